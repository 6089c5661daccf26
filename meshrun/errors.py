"""Errors that the CLI turns into exit status 2 with a one-line message (no traceback)."""


class ConfigError(ValueError):
    """A bad configuration value: the message names the field, the value seen and the fix."""

    def __init__(self, field: str, value, fix: str, what: str | None = None):
        self.field, self.value, self.fix = field, value, fix
        what = what or "invalid value"
        super().__init__(f"{field}: {what} (got {value!r}); {fix}")
