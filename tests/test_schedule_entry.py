"""A schedule added from outside meshrun's files, as docs/pipeline.md "Your own schedule" says: one
`Schedule` entry registered here (an eager 1F1B, one more warm-up forward per stage, on the per-op
executor) and nothing else edited. Config validation, the executor (parity with one device),
`meshrun schedule` and `meshrun plan` (--evaluate and the search) all take it from the registry."""

import json

import pytest
from test_pipeline import RTOL, assert_tree_close, toy_compiled, toy_ref

from meshrun.cli.main import main
from meshrun.config import load_config
from meshrun.errors import ConfigError
from meshrun.pipeline import registry
from meshrun.pipeline import schedules as S
from meshrun.pipeline.schedules import Task
from meshrun.planner import search
from meshrun.runtime.mesh import build_mesh
from meshrun.train.plan import build_plan

NAME = "1f1b-eager"


def _eager_orders(p: int, m: int, v: int) -> list[list[Task]]:
    """1F1B with p - s warm-up forwards on stage s (1F1B runs p - 1 - s): one more in flight."""
    orders = []
    for s in range(p):
        w = min(p - s, m)
        o = [Task("F", i) for i in range(w)]
        for i in range(m - w):
            o += [Task("F", w + i), Task("B", i)]
        orders.append(o + [Task("B", i) for i in range(m - w, m)])
    return orders


EAGER = registry.Schedule(
    NAME, "eager 1F1B", _eager_orders, ("per_op",), m_at_least_p=True,
    slots=lambda p, m, v, ex: min(m, p + 1), stash=lambda p, m: 1,
    idle=lambda p, m, v, ex: 2 * (p - 1) / 3,  # as 1F1B per-op: the extra forward fills no bubble
    held=lambda p, m, v, stage: float(min(p - stage + 1, m)), searched=True,
)  # fmt: skip


@pytest.fixture
def eager(monkeypatch):
    monkeypatch.setitem(registry.SCHEDULES, NAME, EAGER)
    return EAGER


def test_unregistered_name_is_refused():
    with pytest.raises(ConfigError, match=r"pipeline\.schedule: unknown schedule \(got .1f1b-eager.\)"):
        registry.get(NAME)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (8, 16)])
def test_closed_forms_match_the_table(eager, p, m):
    table = eager.table(p, m)
    assert max(S.max_in_flight(table, s) for s in range(p)) == eager.slots(p, m, 1, "per_op")
    assert S.bubble_fraction(table, 1.0, 1.0, 1.0) == pytest.approx(eager.bubble(p, m))


def test_config_validation_reads_the_entry(eager):
    cfg = load_config("configs/tiny_cpu.yaml", [f"pipeline.schedule={NAME}"])  # data 2, pipe 2, tensor 2, m 4
    plan = build_plan(cfg, build_mesh(cfg.mesh))
    assert plan.program.executor == "per_op" and plan.program.slots == 3
    bad = load_config("configs/tiny_cpu.yaml", [f"pipeline.schedule={NAME}", "pipeline.microbatches=1"])
    with pytest.raises(ConfigError, match=r"pipeline\.microbatches.*eager 1F1B needs m >= p"):
        build_plan(bad, build_mesh(bad.mesh))
    with pytest.raises(ConfigError, match=r"pipeline\.executor.*per_op executor only"):
        registry.check_config(
            load_config("configs/tiny_cpu.yaml", [f"pipeline.schedule={NAME}", "pipeline.executor=lockstep"]).pipeline
        )


def test_executor_plays_it_as_one_device(eager):
    pl, compiled, args = toy_compiled((2, 2, 1, 2), NAME, 4, 1, b=8)
    assert pl.program.slots == 3  # stage 0 holds p + 1 = 3 microbatches (1F1B: 2)
    loss, grads, aux = compiled(*args)
    ref_loss, ref_grads, ref_aux = toy_ref(8)
    assert float(loss) == pytest.approx(ref_loss, rel=RTOL)
    assert float(aux["sq"]) == pytest.approx(float(ref_aux["sq"]), rel=RTOL)
    assert_tree_close(grads, ref_grads)


def test_meshrun_schedule_shows_it(eager, capsys):
    assert main(["schedule", "--pipe", "4", "--microbatches", "8", "--schedule", NAME, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["schedule"] == NAME and got["max_in_flight"] == [5, 4, 3, 2]
    assert got["bubble_fraction"] == pytest.approx(eager.bubble(4, 8))


PLAN = ["plan", "--model", "gpt3-175b", "--cluster", "a100-80g:16x8", "--global-batch", "64", "--json"]


def _evaluate(capsys, schedule):
    assert main([*PLAN, "--evaluate", f"pipe=8,tensor=8,schedule={schedule},executor=per_op"]) == 0
    return json.loads(capsys.readouterr().out)["configs"][0]


def test_meshrun_plan_costs_and_searches_it(eager, capsys):
    mine, one = _evaluate(capsys, NAME), _evaluate(capsys, "1f1b")
    assert mine["schedule"] == NAME and mine["violations"] == []
    assert mine["bubble_fraction"] == one["bubble_fraction"] == pytest.approx(eager.bubble(8, 32), abs=1e-4)
    # held: one more microbatch's activations on every stage than 1F1B
    assert mine["memory_parts_gb"]["activations"] > one["memory_parts_gb"]["activations"]
    assert (NAME, 1) in set(search._schedules(8, 32, 96))
