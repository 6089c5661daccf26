"""Errors the CLI turns into one line on stderr and a documented exit status (no traceback; `--debug`
on any subcommand or `MESHRUN_DEBUG=1` prints it above the line).

| status | class              | meaning                                                              |
|--------|--------------------|----------------------------------------------------------------------|
| 0      |                    | done (also: preempted by SIGTERM after saving)                       |
| 1      | (anything else)    | internal error: a bug in meshrun; `--debug` shows the traceback      |
| 2      | ConfigError        | bad input, found before anything is written (config, flags, run dir) |
| 3      | TrainingError      | the run started but cannot go on (NaN/Inf loss, out of device memory)|
| 4      | DataError          | I/O: a data file, the run dir or metrics could not be read/written   |
| 5      | CheckpointError    | no intact checkpoint to resume from, or one cannot be written        |
| 6      | DistributedError   | jax.distributed failed after the settings were checked, or a peer died|
| 7      | (step watchdog)    | no step finished within train.step_timeout: a hang (runtime/watchdog) |
| 130    |                    | interrupted (Ctrl-C)                                                 |
"""

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_CONFIG = 2
EXIT_TRAINING = 3
EXIT_IO = 4
EXIT_CHECKPOINT = 5
EXIT_DISTRIBUTED = 6
EXIT_HANG = 7  # the step watchdog ended a process that made no progress (not an exception)
EXIT_INTERRUPTED = 130

# How to get matplotlib (pictures: `meshrun plot`, `schedule --png`, `profile`); meshrun is installed
# from its checkout, so the extra is named as a checkout install
MATPLOTLIB_FIX = "pip install matplotlib (from the checkout: pip install -e '.[plot]')"


class MeshrunError(Exception):
    """Base: a failure the CLI reports in one line with `exit_code`."""

    exit_code = EXIT_INTERNAL


class ConfigError(MeshrunError, ValueError):
    """A bad configuration value: the message names the field, the value seen and the fix."""

    exit_code = EXIT_CONFIG

    def __init__(self, field: str, value, fix: str, what: str | None = None):
        self.field, self.value, self.fix, self.what = field, value, fix, what
        what = what or "invalid value"
        super().__init__(f"{field}: {what} (got {value!r}); {fix}")

    def __reduce__(self):  # picklable, so that it crosses process pools (prepare-data workers) intact
        return (type(self), (self.field, self.value, self.fix, self.what))


class TrainingError(MeshrunError, RuntimeError):
    """The run cannot go on (e.g. a NaN/Inf loss); the last good checkpoint is left intact."""

    exit_code = EXIT_TRAINING


class DataError(MeshrunError, RuntimeError):
    """Reading data or writing the run's files failed (permissions, a vanished/truncated file, disk full)."""

    exit_code = EXIT_IO


class CheckpointError(MeshrunError, RuntimeError):
    """No intact checkpoint to resume from (every one failed to restore), or a checkpoint cannot be written."""

    exit_code = EXIT_CHECKPOINT


class DistributedError(MeshrunError, RuntimeError):
    """jax.distributed failed after meshrun's own checks passed (coordinator died, network, ...), or
    another process of the job died mid-run. The CLI then leaves with os._exit: jax's shutdown
    barrier at interpreter exit would wait for the dead process."""

    exit_code = EXIT_DISTRIBUTED
