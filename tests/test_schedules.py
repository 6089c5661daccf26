"""Pipeline schedule tables (pure Python): structure, dependencies, lockstep view, buffers, bubble math, CLI."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from meshrun.errors import ConfigError
from meshrun.pipeline import registry as R
from meshrun.pipeline import schedules as S
from meshrun.pipeline.schedules import ScheduleError, Step, Task


def build(name: str, p: int, m: int, v: int = 1):
    """The timeline a schedule's default executor plays (whole backwards on the lockstep executor)."""
    return R.get(name).table(p, m, v)


def per_op_table(name: str, p: int, m: int, v: int = 1):
    return R.get(name).table(p, m, v, "per_op")


def closed_form(name: str, p: int, m: int, v: int = 1) -> float:
    return R.get(name).bubble(p, m, v)


CASES = (
    [("gpipe", p, m, 1) for p in (1, 2, 3, 4, 6) for m in (1, 2, 3, 5, 8, 13)]
    + [("1f1b", p, m, 1) for p in (1, 2, 3, 4, 6) for m in (p, p + 1, 2 * p, 4 * p + 3)]
    + [("interleaved", p, m, v) for p in (1, 2, 3, 4) for m in (p, 2 * p, 4 * p) for v in (1, 2, 3, 4)]
)


def _where(table, p):
    """(kind, mb, virtual stage) -> tick, for per-op or lockstep tables."""
    out = {}
    for t, row in enumerate(table):
        for s, cell in enumerate(row):
            for op in cell if isinstance(cell, tuple) else (cell,):
                if op is not None:
                    out[(op.kind, op.mb, op.chunk * p + s)] = t
    return out


# ------------------------------------------------------------------ structure and validation


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_every_builder_passes_check_in_both_views(name, p, m, v):
    table = build(name, p, m, v)
    assert all(len(row) == p for row in table)
    S.check(table, p, m, v)
    lock = S.lockstep(table)
    assert all(isinstance(c, Step) for row in lock for c in row)
    S.check(lock, p, m, v)
    ops = [op for row in table for op in row if op is not None]
    assert len(ops) == 2 * m * v * p  # one F and one B per (mb, virtual stage)
    assert sum(op is not None for row in lock for c in row for op in c) == 2 * m * v * p


@pytest.mark.parametrize("p,m", [(1, 1), (2, 3), (4, 8), (5, 7)])
def test_per_op_tick_counts_gpipe_and_1f1b(p, m):
    # With unit-cost ops, GPipe and 1F1B both end after 2(m+p-1) ticks.
    assert len(build("gpipe", p, m)) == 2 * (m + p - 1)
    assert len(build("1f1b", p, m)) == 2 * (m + p - 1)


def test_1f1b_table_matches_known_chart():
    t = build("1f1b", 2, 3)
    rows = [" ".join("." if c is None else c.label() for c in col) for col in zip(*t)]
    assert rows == ["F0 F1 . B0 F2 B1 . B2", ". F0 B0 F1 B1 F2 B2 ."]


def test_interleaved_chunk_placement_and_order():
    p, m, v = 2, 4, 2
    t = build("interleaved", p, m, v)
    stage0_fwd = [op for op in (row[0] for row in t) if op is not None and op.kind == "F"]
    # Megatron order: groups of p microbatches, all chunks of a group before the next group.
    assert [(o.mb, o.chunk) for o in stage0_fwd] == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    stage0_bwd = [op for op in (row[0] for row in t) if op is not None and op.kind == "B"]
    assert [(o.mb, o.chunk) for o in stage0_bwd] == [(0, 1), (1, 1), (0, 0), (1, 0), (2, 1), (3, 1), (2, 0), (3, 0)]
    when = _where(t, p)
    # virtual stage k = c*p + s: stage 0 chunk 1 (k=2) consumes stage 1 chunk 0 (k=1)
    assert when[("F", 0, 2)] > when[("F", 0, 1)] > when[("F", 0, 0)]


def _replace(table, tick, stage, new):
    out = [list(row) for row in table]
    out[tick][stage] = new
    return out


def test_check_rejects_corrupted_tables():
    p, m = 3, 4
    good = build("1f1b", p, m)
    S.check(good, p, m)
    when = _where(good, p)
    # 1. a missing op
    t0 = when[("B", 2, 1)]
    with pytest.raises(ScheduleError, match="missing B of microbatch 2 at virtual stage 1"):
        S.check(_replace(good, t0, 1, None), p, m)
    # 2. a duplicated op (F1 on stage 0 also placed in an idle slot later)
    idle = next(t for t, row in enumerate(good) if row[0] is None and t > when[("F", 1, 0)])
    with pytest.raises(ScheduleError, match="twice"):
        S.check(_replace(good, idle, 0, Task("F", 1)), p, m)
    # 3. dependency broken: swap two ticks of the last stage so B0 runs before F0
    tf, tb = when[("F", 0, 2)], when[("B", 0, 2)]
    bad = _replace(_replace(good, tf, 2, good[tb][2]), tb, 2, good[tf][2])
    with pytest.raises(ScheduleError, match="runs before its input"):
        S.check(bad, p, m)
    # 4. B on stage 0 in the same tick as B on stage 1 (needs an earlier tick)
    tb1, tb0 = when[("B", 3, 1)], when[("B", 3, 0)]
    bad = _replace(_replace(good, tb0, 0, None), tb1, 0, Task("B", 3))
    assert good[tb1][0] is None  # the slot we used was idle, so only the dependency is wrong
    with pytest.raises(ScheduleError, match="runs before its input"):
        S.check(bad, p, m)
    # 5. out of range microbatch / chunk, wrong width
    with pytest.raises(ScheduleError, match="out of range"):
        S.check(_replace(good, idle, 0, Task("F", m)), p, m)
    with pytest.raises(ScheduleError, match="out of range"):
        S.check(_replace(good, idle, 0, Task("F", 0, chunk=1)), p, m)
    with pytest.raises(ScheduleError, match="stages"):
        S.check([row[:2] for row in good], p, m)


def test_check_rejects_corrupted_lockstep_tables():
    p, m = 3, 5
    lock = S.lockstep(build("1f1b", p, m))
    S.check(lock, p, m)
    when = _where(lock, p)
    # same-tick F then B is allowed only in that order inside one cell: flip the last stage's cell
    t = when[("F", 2, 2)]
    assert when[("B", 2, 2)] == t
    flipped = _replace(lock, t, 2, Step(lock[t][2].bwd, lock[t][2].fwd))
    with pytest.raises(ScheduleError, match="lockstep cell"):
        S.check(flipped, p, m)
    # move the last stage's B0 one tick before its F0
    t0 = when[("F", 0, 2)]
    assert lock[t0 - 1][2] == Step(None, None)
    bad = _replace(_replace(lock, t0, 2, Step(lock[t0][2].fwd, None)), t0 - 1, 2, Step(None, Task("B", 0)))
    with pytest.raises(ScheduleError, match="runs before its input"):
        S.check(bad, p, m)
    # F of stage 1 in the same tick as F of stage 0 (activation arrives only the next tick)
    t1 = when[("F", 0, 1)]
    assert lock[t1 - 1][1] == Step(None, None) and when[("F", 0, 0)] == t1 - 1
    bad = _replace(_replace(lock, t1, 1, Step(None, lock[t1][1].bwd)), t1 - 1, 1, Step(Task("F", 0), None))
    with pytest.raises(ScheduleError, match="runs before its input"):
        S.check(bad, p, m)


# ------------------------------------------------------------------ lockstep view


@pytest.mark.parametrize("p, m", [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 4, 8, 9, 64) if m >= p])
def test_lockstep_1f1b_exact_ticks_and_in_flight_bound(p, m):
    lock = S.lockstep(build("1f1b", p, m))
    assert len(lock) == m + 2 * (p - 1)
    when = _where(lock, p)
    for mb in range(m):
        for s in range(p):
            assert when[("F", mb, s)] == mb + s
            assert when[("B", mb, s)] == mb + 2 * (p - 1) - s  # last stage: same tick as its F
    for s in range(p):
        # Bound 2(p-1-s)+1 does not depend on m (only caps it when m is smaller).
        assert S.max_in_flight(lock, s) == min(m, 2 * (p - 1 - s) + 1)
        assert S.buffer_sizes(lock, s) == (min(m, 2 * (p - 1 - s) + 1), 0, 0)


@pytest.mark.parametrize("p,m", [(2, 2), (3, 6), (4, 8), (4, 40)])
def test_per_op_in_flight_gpipe_vs_1f1b(p, m):
    for s in range(p):
        assert S.max_in_flight(build("gpipe", p, m), s) == m  # grows with m
        assert S.max_in_flight(build("1f1b", p, m), s) == p - s  # PipeDream-flush bound
        assert S.max_in_flight(S.lockstep(build("gpipe", p, m)), s) == m


@pytest.mark.parametrize("p,v", [(2, 2), (2, 3), (3, 2), (4, 2), (4, 4)])
@pytest.mark.parametrize("k", [2, 3, 8])
def test_lockstep_interleaved_ticks_and_buffers(p, v, k):
    m = k * p
    lock = S.lockstep(build("interleaved", p, m, v))
    assert len(lock) == v * m + (v + 1) * p - 2
    for s in range(p):
        bound = 2 * (p - 1 - s) + 1 + (v - 1) * p
        assert S.buffer_sizes(lock, s) == (bound, 0, 0)  # independent of m; no inbox needed


def test_per_op_interleaved_needs_inbox_slots():
    t = build("interleaved", 4, 8, 2)
    sizes = [S.buffer_sizes(t, s) for s in range(4)]
    assert [b.residuals for b in sizes] == [S.max_in_flight(t, s) for s in range(4)]
    assert max(b.fwd_inbox for b in sizes) >= 1 and max(b.bwd_inbox for b in sizes) >= 1


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 4, 11, 1), ("interleaved", 3, 9, 3), ("gpipe", 3, 5, 1)])
def test_residual_slots_and_arrays(name, p, m, v):
    lock = S.lockstep(build(name, p, m, v))
    arr = S.lockstep_arrays(lock)
    assert set(arr) == {"f_mb", "f_chunk", "f_slot", "b_mb", "b_chunk", "b_slot"}
    assert all(len(a) == len(lock) and all(len(r) == p for r in a) for a in arr.values())
    for s in range(p):
        n = S.max_in_flight(lock, s)
        slots = S.residual_slots(lock, s)
        assert sorted(set(slots.values())) == list(range(n))
        live: dict[int, tuple[int, int]] = {}  # slot -> (mb, chunk), replayed tick by tick, fwd first
        for t, row in enumerate(lock):
            f, b = row[s]
            if f is not None:
                assert arr["f_slot"][t][s] not in live
                live[arr["f_slot"][t][s]] = (f.mb, f.chunk)
                assert (arr["f_mb"][t][s], arr["f_chunk"][t][s]) == (f.mb, f.chunk)
            else:
                assert arr["f_mb"][t][s] == arr["f_slot"][t][s] == -1
            if b is not None:
                assert live.pop(arr["b_slot"][t][s]) == (b.mb, b.chunk)
            else:
                assert arr["b_mb"][t][s] == arr["b_slot"][t][s] == -1
        assert not live


# ------------------------------------------------------------------ bubble math


BUBBLE_CASES = (
    [("gpipe", p, m, 1) for p, m in [(1, 4), (2, 1), (2, 4), (4, 4), (4, 16), (8, 32), (5, 7)]]
    + [("1f1b", p, m, 1) for p, m in [(1, 4), (2, 2), (2, 5), (4, 4), (4, 16), (8, 32), (5, 7)]]
    + [("interleaved", p, m, v) for p, m, v in [(2, 2, 2), (2, 4, 3), (4, 4, 2), (4, 8, 2), (4, 16, 4), (3, 9, 3)]]
)


@pytest.mark.parametrize("name,p,m,v", BUBBLE_CASES)
@pytest.mark.parametrize("b_over_f", [1.0, 2.0])
def test_bubble_from_table_matches_closed_form(name, p, m, v, b_over_f):
    table = build(name, p, m, v)
    closed = closed_form(name, p, m, v)
    for f in (1.0, 0.25):
        per = S.stage_bubbles(table, f=f, b=b_over_f * f)
        assert per == pytest.approx([closed] * p, rel=1e-12, abs=1e-15)
        assert S.bubble_fraction(table, f=f, b=b_over_f * f) == pytest.approx(closed, rel=1e-12, abs=1e-15)
    assert S.bubble_fraction(table) == pytest.approx(closed, rel=1e-12, abs=1e-15)  # default b = 2f


def test_bubble_depends_on_table_order():
    # GPipe p=2 m=2 but the last stage runs B1 before B0: stage 0's B0 waits for the last op of
    # stage 1. Hand timeline with f=1, b=2: stage 1 B1 [3,5] B0 [5,7]; stage 0 B0 [7,9] B1 [9,11].
    F, B = (lambda i: Task("F", i)), (lambda i: Task("B", i))
    bad = [[F(0), None], [F(1), F(0)], [None, F(1)], [None, B(1)], [None, B(0)], [B(0), None], [B(1), None]]
    t = build("gpipe", 2, 2)
    assert len(t) == 6 and t[3] == [None, B(0)]
    S.check(bad, 2, 2)
    assert S.stage_bubbles(bad, f=1.0, b=2.0) == pytest.approx([5 / 11, 5 / 11], rel=1e-12)
    assert S.bubble_fraction(t, f=1.0, b=2.0) == pytest.approx(1 / 3, rel=1e-12)


def test_bubble_counted_from_hand_drawn_timelines():
    # Time units with F = 1 and B = 2 ('.' idle), each op started as soon as its inputs and its stage
    # are free, drawn by hand in the stage orders of the text charts above.
    one_f_one_b = [  # p=2, m=3: stage 0 runs F0 F1 B0 F2 B1 B2, stage 1 F0 B0 F1 B1 F2 B2
        "F0 F1 .  .  B0 B0 F2 B1 B1 .  B2 B2",
        ".  F0 B0 B0 F1 B1 B1 F2 B2 B2 .  .",
    ]
    gpipe = [  # p=2, m=2: every forward, then every backward
        "F0 F1 .  .  .  B0 B0 B1 B1",
        ".  F0 F1 B0 B0 B1 B1 .  .",
    ]
    for chart, table, (name, p, m) in ((one_f_one_b, build("1f1b", 2, 3), ("1f1b", 2, 3)),
                                       (gpipe, build("gpipe", 2, 2), ("gpipe", 2, 2))):  # fmt: skip
        units = [row.split() for row in chart]
        span = max(len(u) for u in units)
        idle = [(span - sum(c != "." for c in u)) / span for u in units]
        assert S.stage_bubbles(table, f=1.0, b=2.0) == pytest.approx(idle, rel=1e-12)
        assert closed_form(name, p, m) == pytest.approx(idle[0], rel=1e-12)


@pytest.mark.parametrize(
    "name,p,m,v,published",
    [
        ("gpipe", 4, 8, 1, 0.2727),  # GPipe (Huang et al. 2019): (K-1)/(M+K-1) = 3/11
        ("1f1b", 4, 8, 1, 0.2727),  # PipeDream-flush keeps GPipe's bubble, not its memory
        ("gpipe", 24, 8, 1, 0.7419),  # 23/31: few micro-batches on a deep pipeline idle it ~74%
        # Megatron (Narayanan et al. 2021): bubble / ideal time = (p-1)/(v m) = 3/16 -> 3/19 of the step
        ("interleaved", 4, 8, 2, 0.1579),
    ],
)
def test_bubble_of_the_table_equals_published_values(name, p, m, v, published):
    assert S.bubble_fraction(build(name, p, m, v), f=1.0, b=2.0) == pytest.approx(published, abs=5e-5)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "call,field",
    [
        (lambda: build("1f1b", 4, 3), "pipeline.microbatches"),
        (lambda: build("interleaved", 4, 6, 2), "pipeline.microbatches"),
        (lambda: build("interleaved", 2, 4, 0), "pipeline.virtual"),
        (lambda: build("1f1b", 2, 4, 2), "pipeline.virtual"),
        (lambda: build("pipedream", 2, 4), "pipeline.schedule"),
        (lambda: build("gpipe", 0, 4), "mesh.pipe"),
        (lambda: build("gpipe", 2, 0), "pipeline.microbatches"),
        (lambda: closed_form("zb", 2, 4), "pipeline.schedule"),
    ],
)
def test_bad_arguments_raise_config_error(call, field):
    with pytest.raises(ConfigError) as e:
        call()
    assert e.value.field == field
    assert "got" in str(e.value) and "use" in str(e.value)


def test_task_is_frozen_and_labels():
    t = Task("F", 3, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.mb = 4
    assert (t.label(), t.label(2), Task("B", 3).label()) == ("F3", "F3c1", "B3")


# ------------------------------------------------------------------ CLI


def _main():
    from meshrun.cli.main import main

    return main


def test_cli_json_per_op(capsys):
    main = _main()
    assert main(["schedule", "--pipe", "4", "--microbatches", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ticks"] == 22 == len(out["table"])
    assert out["bubble_fraction"] == pytest.approx(3 / 11, rel=1e-12)
    assert out["table"][0] == ["F0", None, None, None]
    assert out["table"][4] == [None, None, None, "B0"]
    cells = [c for row in out["table"] for c in row if c is not None]
    assert len(cells) == 2 * 8 * 4 and all(isinstance(c, str) for c in cells)


def test_cli_json_interleaved_and_lockstep(capsys):
    main = _main()
    argv = ["schedule", "--pipe", "2", "--microbatches", "4", "--schedule", "interleaved", "--virtual", "2"]
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bubble_fraction"] == pytest.approx(1 / 9, rel=1e-12)
    assert out["table"][0] == ["F0c0", None] and out["table"][2][0] == "F0c1"
    assert main(argv + ["--json", "--lockstep"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ticks"] == 2 * 4 + 3 * 2 - 2
    assert out["table"][3][1] == ["F0c1", "B0c1"]  # last virtual stage: F then B in one tick
    assert out["bubble_fraction"] == pytest.approx(1 / 9, rel=1e-12)


def test_cli_text_chart(capsys):
    main = _main()
    assert main(["schedule", "--pipe", "2", "--microbatches", "3"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    stage_rows = [ln.split()[2:] for ln in lines if ln.startswith("stage ")]
    assert stage_rows == [
        ["F0", "F1", ".", "B0", "F2", "B1", ".", "B2"],
        [".", "F0", "B0", "F1", "B1", "F2", "B2", "."],
    ]
    assert "bubble fraction (backward = 2 x forward): 0.2500" in out


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--pipe", "4", "--microbatches", "2"], "pipeline.microbatches"),
        (["--pipe", "4", "--microbatches", "6", "--schedule", "interleaved", "--virtual", "2"], "m % p == 0"),
        (["--pipe", "0", "--microbatches", "2", "--schedule", "gpipe"], "mesh.pipe"),
        (["--pipe", "2", "--microbatches", "4", "--virtual", "2"], "pipeline.virtual"),
    ],
)
def test_cli_bad_input_exit_2(capsys, argv, needle):
    main = _main()
    assert main(["schedule", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_cli_png_without_matplotlib(capsys, monkeypatch, tmp_path):
    main = _main()
    for mod in [k for k in sys.modules if k == "matplotlib" or k.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    assert main(["schedule", "--pipe", "2", "--microbatches", "2", "--png", str(tmp_path / "s.png")]) == 2
    err = capsys.readouterr().err
    assert "--png: matplotlib is not installed" in err and "pip install -e '.[plot]'" in err


def test_cli_png_with_matplotlib(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    main = _main()
    path = tmp_path / "s.png"
    argv = ["schedule", "--pipe", "2", "--microbatches", "4", "--schedule", "interleaved", "--virtual", "2"]
    assert main(argv + ["--png", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ zero bubble (ZB-H1)


@pytest.mark.parametrize("p,m", [(p, k * p) for p in (1, 2, 3, 4, 8) for k in (1, 2, 4)] + [(4, 5), (3, 7)])
def test_zb_h1_table_bubble_third_of_1f1b_at_the_same_memory(p, m):
    """ZB-H1 (Qi et al. 2023): B (input grad) and W (weight grad) split; W's fill the cool-down.
    With F = B = W its table bubble is (p-1)/(3m+p-1): (p-1)(F+B-W) idle per stage, against 1F1B's
    (p-1)(F+B+W); no stage holds more microbatches between F and W than 1F1B's peak, min(p, m)."""
    table = build("zb-h1", p, m)
    S.check(table, p, m)
    assert sum(op is not None for row in table for op in row) == 3 * m * p
    assert len(table) == 3 * m + p - 1
    closed = (p - 1) / (3 * m + p - 1)
    assert S.stage_bubbles(table) == pytest.approx([closed] * p, rel=1e-12, abs=1e-15)
    assert closed_form("zb-h1", p, m) == pytest.approx(closed)
    one = S.bubble_fraction(build("1f1b", p, m))
    if p > 1:  # a third of 1F1B's as m grows: (p-1)/(3m+p-1) against (p-1)/(m+p-1)
        assert S.bubble_fraction(table) < (0.4 if m >= 4 * p else 0.5) * one
    peak_1f1b = max(S.max_in_flight(build("1f1b", p, m), s) for s in range(p))
    assert max(S.max_in_flight(table, s) for s in range(p)) == peak_1f1b == min(p, m)


def test_zb_h1_check_catches_a_w_before_its_b_and_a_missing_w():
    table = build("zb-h1", 2, 2)
    ws = [(t, s) for t, row in enumerate(table) for s, op in enumerate(row) if op is not None and op.kind == "W"]
    t, s = ws[0]
    broken = [list(row) for row in table]
    broken[t][s] = None
    with pytest.raises(ScheduleError, match="missing W"):
        S.check(broken, 2, 2)
    early = [list(row) for row in table]
    early[0][s], early[t][s] = early[t][s], early[0][s]
    with pytest.raises(ScheduleError, match="runs before its input"):
        S.check(early, 2, 2)


def test_cli_draws_zb_h1_with_both_bubbles(capsys):
    main = _main()
    assert main(["schedule", "--pipe", "4", "--microbatches", "8", "--schedule", "zb-h1"]) == 0
    out = capsys.readouterr().out
    assert "W7" in out and "bubble fraction (F = B = W): 0.1111" in out and "order with whole backwards" in out
    assert "0.2727" in out


def test_cli_draws_per_op_1f1b_and_refuses_other_schedules(capsys):
    """`meshrun schedule --per-op`: 1F1B as the per-op executor plays it (each B followed by its W),
    bubble 2(p-1)/(3m+2(p-1)); GPipe and interleaved have no per-op timeline (exit 2, field named)."""
    main = _main()
    assert main(["schedule", "--pipe", "4", "--microbatches", "8", "--per-op", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["per_op"] and out["ticks"] == 3 * 8 + 2 * 3 and out["max_in_flight"] == [4, 3, 2, 1]
    assert out["bubble_fraction"] == pytest.approx(out["bubble_closed_form"]) == pytest.approx(6 / 30)
    assert out["table"][7][0] == "B0" and out["table"][8][0] == "W0"
    assert main(["schedule", "--pipe", "4", "--microbatches", "8", "--schedule", "gpipe", "--per-op"]) == 2
    assert "--per-op" in capsys.readouterr().err


@pytest.mark.parametrize("schedule", ["zb-h1", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (4, 4), (4, 8), (4, 16)])
def test_per_op_program_delivers_every_value(p, m, schedule):
    """Play the per-op executor's index tables (zb-h1, 1F1B split) in Python: sends arrive one tick
    later into the inbox slot the table names, every F / B reads its own microbatch's input from its
    inbox slot, B and W find their microbatch's residuals (and dy) in the slot F (B) wrote, W finds
    its B's stash in the stash slot B wrote, and no slot is overwritten while its value is still needed."""
    from meshrun.config import PipelineConfig
    from meshrun.pipeline.program import tick_program

    prog = tick_program(PipelineConfig(schedule=schedule, microbatches=m, executor="per_op"), p)
    assert prog.per_op and prog.slots == p and prog.ticks == len(per_op_table(schedule, p, m))
    assert prog.stash_slots == (p if schedule == "zb-h1" else 1)
    tb = prog.tables
    fbox = [dict() for _ in range(p)]
    gbox = [dict() for _ in range(p)]
    res = [dict() for _ in range(p)]
    dyb = [dict() for _ in range(p)]
    stash = [dict() for _ in range(p)]
    sent_f, sent_b = [None] * p, [None] * p  # what each stage sent last tick
    done = set()
    send_ticks = {t for _, t0, t1, sf, sb in prog.phases if sf or sb for t in range(t0, t1)}
    for t in range(prog.ticks):
        for s in range(p):
            arr_f = sent_f[s - 1] if s > 0 else None
            arr_b = sent_b[s + 1] if s < p - 1 else None
            if tb["f_put"][t, s] >= 0:
                assert arr_f is not None and (t - 1) in send_ticks
                fbox[s][int(tb["f_put"][t, s])] = arr_f
            else:
                assert arr_f is None
            if tb["g_put"][t, s] >= 0:
                assert arr_b is not None
                gbox[s][int(tb["g_put"][t, s])] = arr_b
            else:
                assert arr_b is None
        sent_f, sent_b = [None] * p, [None] * p
        for s in range(p):
            kind, mb, slot = (int(tb[k][t, s]) for k in ("kind", "mb", "slot"))
            if kind <= 0:
                continue
            if kind == 1:  # F
                if s > 0:
                    assert fbox[s].pop(int(tb["f_get"][t, s])) == mb
                res[s][slot] = mb
                if s == p - 1:
                    dyb[s][slot] = mb
                else:
                    sent_f[s] = mb
            elif kind == 2:  # B
                assert res[s][slot] == mb
                if s < p - 1:
                    assert gbox[s].pop(int(tb["g_get"][t, s])) == mb
                    dyb[s][slot] = mb
                assert dyb[s][slot] == mb
                if s > 0:
                    sent_b[s] = mb
                st = int(tb["stash"][t, s])
                assert 0 <= st < prog.stash_slots and st not in stash[s]
                stash[s][st] = mb
            else:  # W: frees the slots
                assert res[s].pop(slot) == mb and dyb[s].pop(slot) == mb
                assert stash[s].pop(int(tb["stash"][t, s])) == mb
            done.add((kind, mb, s))
    assert len(done) == 3 * m * p and not any(res) and not any(fbox) and not any(gbox) and not any(stash)
    assert prog.bubble == pytest.approx(S.bubble_fraction(per_op_table(schedule, p, m), 1.0, 1.0, 1.0))


@pytest.mark.parametrize("p, m", [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 4, 8, 9, 16, 64) if m >= p])
def test_split_1f1b_holds_p_minus_s_with_one_op_ticks(p, m):
    """1F1B on the per-op executor (`pipeline.executor=per_op`): Megatron's order of F and B per stage,
    each B followed by its W in the next tick; stage s holds at most min(m, p - s) microbatches (p on
    stage 0, not the lockstep table's min(m, 2p - 1)) and one B's stash, in 3m + 2(p - 1) ticks of
    one op: bubble 2(p - 1) / (3m + 2(p - 1)) with F = B = W."""
    from meshrun.config import PipelineConfig
    from meshrun.pipeline.program import tick_program

    table, fused = per_op_table("1f1b", p, m), build("1f1b", p, m)
    S.check(table, p, m)
    assert len(table) == 3 * m + 2 * (p - 1)
    for s in range(p):
        ops = [op for _, op in S._stage_orders(table)[s]]
        assert [op for op in ops if op.kind != "W"] == [op for _, op in S._stage_orders(fused)[s]]
        for i, op in enumerate(ops):
            assert (op.kind == "B") == (i + 1 < len(ops) and ops[i + 1] == S.Task("W", op.mb))
        ticks = {(op.kind, op.mb): t for t, op in S._stage_orders(table)[s]}
        assert all(ticks[("W", mb)] == ticks[("B", mb)] + 1 for mb in range(m))
        assert S.max_in_flight(table, s) == min(m, p - s)
    assert S.bubble_fraction(table, 1.0, 1.0, 1.0) == pytest.approx(2 * (p - 1) / (3 * m + 2 * (p - 1)))
    prog = tick_program(PipelineConfig(schedule="1f1b", microbatches=m, executor="per_op"), p)
    assert prog.executor == "per_op" and prog.per_op and prog.ticks == len(table) and prog.stash_slots == 1
    assert prog.stage_slots() == tuple(min(m, p - s) for s in range(p))
    lock = tick_program(PipelineConfig(schedule="1f1b", microbatches=m, executor="lockstep"), p)
    assert lock.executor == "lockstep" and not lock.per_op and lock.slots == min(m, 2 * p - 1)
    assert lock.bubble == pytest.approx(closed_form("1f1b", p, m))


def test_executor_option_errors_name_the_fix():
    """The schedule's registry entry says which executors play it (checked by the step plan, and by
    `tick_program`: meshrun.config sits below the pipeline package)."""
    from meshrun.config import PipelineConfig
    from meshrun.pipeline.program import tick_program

    with pytest.raises(ConfigError, match="per_op or auto") as e:
        R.check_config(PipelineConfig(schedule="zb-h1", microbatches=4, executor="lockstep"))
    assert e.value.field == "pipeline.executor"
    with pytest.raises(ConfigError, match="lockstep or auto") as e:
        tick_program(PipelineConfig(schedule="interleaved", microbatches=4, virtual=2, executor="per_op"), 2)
    assert e.value.field == "pipeline.executor"
    with pytest.raises(ConfigError, match="did you mean 'zb-h1'") as e:
        R.check_config(PipelineConfig(schedule="zb-h2"))
    assert e.value.field == "pipeline.schedule"
    with pytest.raises(ConfigError, match="use one of"):
        PipelineConfig(executor="async")


@pytest.mark.parametrize("schedule", ["zb-h1", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (3, 5), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_per_op_static_sends_cover_every_tick(p, m, schedule):
    """The per-op program's static sends (`TickProgram.sends`): each phase repeats a period of u
    ticks; the permutes of a tick's position in its period carry every value the tick's ops send
    (F's activation to s + 1, B's input gradient to s - 1), and in each permute no stage sends or
    receives twice (a collective-permute's pairs). Phases tile the ticks, each at least two periods
    long unless it is the whole program."""
    from meshrun.config import PipelineConfig
    from meshrun.pipeline.program import tick_program

    prog = tick_program(PipelineConfig(schedule=schedule, microbatches=m, executor="per_op"), p)
    table = per_op_table(schedule, p, m)
    assert len(prog.sends) == len(prog.phases)
    assert [t0 for _, t0, _, _, _ in prog.phases] == [0] + [t1 for _, _, t1, _, _ in prog.phases[:-1]]
    assert prog.phases[-1][2] == prog.ticks == len(table)
    n = 0
    for (_, t0, t1, sf, sb), period in zip(prog.phases, prog.sends, strict=True):
        u = len(period)
        assert (t1 - t0) % u == 0 and ((t1 - t0) // u >= 2 or (t0, t1) == (0, prog.ticks))
        for perms in period:
            for pairs in perms:
                assert len({a for a, _ in pairs}) == len({b for _, b in pairs}) == len(pairs)
                assert all(abs(a - b) == 1 for a, b in pairs)
        pairs = {pr for perms in period for pairs in perms for pr in pairs}
        assert sf == any(b > a for a, b in pairs) and sb == any(b < a for a, b in pairs)
        for t in range(t0, t1):
            need = {(s, s + 1) for s, op in enumerate(table[t]) if op is not None and op.kind == "F" and s < p - 1}
            need |= {(s, s - 1) for s, op in enumerate(table[t]) if op is not None and op.kind == "B" and s > 0}
            have = [set(pairs) for pairs in period[(t - t0) % u]]
            assert need <= set().union(*have), (t, need, have)
            n += len(have)
    assert prog.permute_counts() == (n, n)


@pytest.mark.parametrize("schedule, expected", [("1f1b", 28), ("zb-h1", 37)])
def test_per_op_sends_one_permute_per_sending_tick(schedule, expected):
    """p = 4, m = 8: per-op 1F1B sends in 28 collective-permutes per step (one per tick that sends;
    there were 49, two per tick, before the sends were made static), zb-h1 in 37 (at least 33: its
    ticks where a stage receives an activation and a gradient at once need two)."""
    from meshrun.config import PipelineConfig
    from meshrun.pipeline.program import _permutes, _tick_sends, tick_program

    p, m = 4, 8
    prog = tick_program(PipelineConfig(schedule=schedule, microbatches=m, executor="per_op"), p)
    # the fewest any program could make: each tick's own sends, in one permute unless a stage receives twice
    fewest = sum(len(_permutes(*_tick_sends(row, p))) for row in per_op_table(schedule, p, m))
    assert prog.permute_counts()[0] == expected
    assert fewest == (28 if schedule == "1f1b" else 33)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_zb_v_table_is_a_v_holding_p_microbatches(p):
    """ZB-V: stage s holds virtual stages s and 2p - 1 - s (the V), so stage 0 embeds and runs the
    head and stage p - 1 feeds its own second chunk; at most 2p chunks of half a stage (p
    microbatches' worth) in flight on any stage; its bubble from the table equals the entry's closed
    form and is below zb-h1's at the same p and m."""
    sched = R.get("zb-v")
    for m in (p, p + 1, 2 * p - 2, 2 * p, 4 * p):
        m = max(m, p)
        t = sched.table(p, m)
        S.check(t, p, m, 2)
        assert t.placement == "v" and [S.chunk_of(k, p, "v") for k in (0, p - 1, p, 2 * p - 1)] == [
            (0, 0), (p - 1, 0), (p - 1, 1), (0, 1)]  # fmt: skip
        tip = [(tick, op) for tick, op in S._stage_orders(t)[p - 1] if op.mb == 0 and op.kind == "F"]
        assert [op.chunk for _, op in tip] == [0, 1] and tip[1][0] == tip[0][0] + 1  # the tip feeds itself
        in_flight = [S.max_in_flight(t, s) for s in range(p)]
        assert max(in_flight) <= 2 * p == sched.slots(p, m, 2, "per_op")
        stash = max(1 + max(S.assign_slots(S.stash_intervals(t, s)).values()) for s in range(p))
        assert stash == sched.stash(p, m)
        assert S.bubble_fraction(t, 1.0, 1.0, 1.0) == pytest.approx(sched.bubble(p, m))
        if p > 1:
            assert sched.bubble(p, m) < closed_form("zb-h1", p, m)
    with pytest.raises(ConfigError, match="virtual=1 or 2") as e:
        sched.table(p, 2 * p, 3)
    assert e.value.field == "pipeline.virtual"


def test_cli_png_draws_the_v(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    main = _main()
    out = tmp_path / "v.png"
    assert main(["schedule", "--pipe", "4", "--microbatches", "8", "--schedule", "zb-v", "--png", str(out)]) == 0
    text = capsys.readouterr().out
    assert (
        out.stat().st_size > 0 and "F0c1" in text and "max in-flight microbatch chunks per stage: [8, 8, 8, 8]" in text
    )
