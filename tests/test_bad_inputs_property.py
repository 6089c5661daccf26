"""Property: whatever configs and overrides a user types, the config loader and the pre-run checks
answer with a ConfigError naming the field (the CLI: exit 2, one line, no traceback) or accept them;
never an internal error, and nothing is written.

Generated: `section.key=value` overrides over every RunConfig field (plus misspelt keys and malformed
override syntax) with values from the edges (0, -1, huge integers, nan/inf, strings, lists, YAML
syntax), and whole YAML documents (duplicate keys, wrong nesting). Bounded example counts, no deadline
(the first examples import jax), a few seconds in all.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshrun.cli.main import main
from meshrun.config import RunConfig, load_config
from meshrun.errors import ConfigError

SECTIONS = {f.name: f.type for f in dataclasses.fields(RunConfig)}
FIELDS = sorted(f"{s}.{f.name}" for s in SECTIONS for f in dataclasses.fields(getattr(RunConfig(), s).__class__))
EDGE = ["0", "-1", "1", "2", "3", "8", "2147483648", "1e21", str(10**30), "-3", "3.0", "2.5"]
EDGE += ["nan", "inf", "-inf", ".nan", "1e400", "true", "yes", "", "[1, 2]", "{a: 1}", "'x", "abc", "~", "0x10"]
VALUES = st.one_of(
    st.sampled_from(EDGE),
    st.integers(-(10**25), 10**25).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(alphabet="ab01.-_[]{}:,=' ", max_size=6),
)
KEYS = st.one_of(
    st.sampled_from(FIELDS),
    st.sampled_from(FIELDS).map(lambda k: k[:-1]),  # misspelt
    st.sampled_from(["", "=", "mesh..data", ".mesh", "mesh.", "train", "nosuch.key", "mesh.data.x", "a b.c"]),
)
OVERRIDES = st.lists(st.tuples(KEYS, VALUES).map(lambda kv: f"{kv[0]}={kv[1]}"), min_size=1, max_size=4)


def _names_a_field(field: str, overrides: list[str]) -> bool:
    """The error names a config field (or section), or the override the user typed."""
    keys = [o.split("=", 1)[0] for o in overrides]
    typed = set(overrides) | {".".join(k.split(".")[: i + 1]) for k in keys for i in range(k.count(".") + 1)}
    if str(field) in typed:
        return True
    parts = [p.strip() for p in str(field).split(",")]
    return all(p in FIELDS or p in SECTIONS or p == "config" or p in typed for p in parts)


FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _checked(overrides: list[str], tmp_path) -> None:
    """load_config + the checks `meshrun train` runs before it writes anything (the local
    checkpoint tier's directory included)."""
    from meshrun.checkpoint.local import check_local_dir
    from meshrun.runtime.mesh import build_mesh
    from meshrun.train.plan import build_plan

    cfg = load_config(None, [*overrides, f"train.run_dir={tmp_path / 'run'}"])
    mesh = build_mesh(cfg.mesh)
    build_plan(cfg, mesh)
    check_local_dir(cfg.checkpoint, 0)


@FAST
@given(overrides=OVERRIDES)
def test_overrides_never_cause_an_internal_error(overrides, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("prop")
    try:
        _checked(overrides, tmp_path)
    except ConfigError as e:
        assert _names_a_field(e.field, overrides), e
        assert str(e).startswith(f"{e.field}:")
    assert not any(tmp_path.iterdir())  # nothing written


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(overrides=OVERRIDES)
def test_mesh_command_answers_with_exit_0_or_2(overrides, capsys):
    mesh_overrides = [o for o in overrides if o.startswith("mesh.")] or overrides
    rc = main(["mesh", *mesh_overrides])
    err = capsys.readouterr().err
    assert rc in (0, 2), err
    if rc == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in err and "internal error" not in err, err


DOCS = st.dictionaries(
    st.sampled_from([*SECTIONS, "trian", "mesh.data"]),
    st.one_of(
        st.dictionaries(st.sampled_from([f.split(".", 1)[1] for f in FIELDS] + ["x"]), VALUES, max_size=3),
        VALUES,
    ),
    max_size=3,
)


@FAST
@given(doc=DOCS, dup=st.booleans())
def test_yaml_files_never_cause_an_internal_error(doc, dup, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("yaml")
    lines = []
    for section, body in doc.items():
        if isinstance(body, dict):
            lines.append(f"{section}:")
            lines += [f"  {k}: {v}" for k, v in body.items()]
            if dup and body:
                k, v = next(iter(body.items()))
                lines.append(f"  {k}: {v}")  # the same key twice: refused, never "the last wins"
        else:
            lines.append(f"{section}: {body}")
    path = tmp_path / "c.yaml"
    path.write_text("\n".join(lines) + "\n")
    before = sorted(tmp_path.iterdir())
    try:
        cfg = load_config(path, [f"train.run_dir={tmp_path / 'run'}"])
    except ConfigError as e:
        assert e.field and str(e).startswith(f"{e.field}:"), e
    else:
        assert not (dup and any(isinstance(b, dict) and b for b in doc.values())), cfg
    assert sorted(tmp_path.iterdir()) == before


@pytest.mark.parametrize(
    "override, field",
    [
        ("=3", "=3"),
        ("mesh..data=2", "mesh..data"),
        ("optimizer.lr=nan", "optimizer.lr"),
        ("optimizer.lr=inf", "optimizer.lr"),
        ("optimizer.warmup_steps=-3", "optimizer.warmup_steps"),
        ("model.head_dim=15", "model.head_dim"),
        (f"model.d_model={10**30}", "model.d_model"),
        ("mesh.data=100000000", "mesh.data"),
        ("optimizer.beta2=1.5", "optimizer.beta2"),
        ("checkpoint.local_every=-2", "checkpoint.local_every"),
        ("checkpoint.local_every=5", "checkpoint.local_dir"),
        ("checkpoint.local_keep=0", "checkpoint.local_keep"),
    ],
)
def test_examples_from_the_issue_are_config_errors(override, field):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert e.value.field == field


def test_duplicate_yaml_key_and_directory_config(tmp_path):
    (tmp_path / "c.yaml").write_text("train:\n  steps: 3\n  steps: 5\n")
    with pytest.raises(ConfigError, match="duplicate key on line 3"):
        load_config(tmp_path / "c.yaml")
    with pytest.raises(ConfigError, match="a directory"):
        load_config(tmp_path)


LOCAL_DIRS = st.one_of(
    st.sampled_from(["", " ", "{process}", "FILE", "FILE/x", "NOPE/a/b", "TMP/{process}/x", "TMP/ok", "TMP"]),
    st.text(alphabet="ab{}/._- ", max_size=8).map(lambda t: f"TMP/{t}"),
)


@FAST
@given(every=VALUES, keep=VALUES, local=LOCAL_DIRS)
def test_local_tier_settings_are_accepted_or_name_their_field(every, keep, local, tmp_path_factory):
    """checkpoint.local_every / local_keep / local_dir: accepted, or a ConfigError naming one of them;
    the directory checks create nothing (a file, a missing parent, a relative or odd name)."""
    tmp_path = tmp_path_factory.mktemp("local")
    (tmp_path / "FILE").write_text("x")
    local = local.replace("TMP", str(tmp_path)).replace("FILE", str(tmp_path / "FILE"))
    local = local.replace("NOPE", str(tmp_path / "nope"))
    before = sorted(tmp_path.rglob("*"))
    over = [f"checkpoint.local_every={every}", f"checkpoint.local_keep={keep}", f"checkpoint.local_dir={local}"]
    try:
        _checked(over, tmp_path)
    except ConfigError as e:
        assert _names_a_field(e.field, over), e
        assert str(e).startswith(f"{e.field}:") and "\n" not in str(e)
    assert sorted(tmp_path.rglob("*")) == before  # nothing written
