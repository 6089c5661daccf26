"""1F1B on the per-op executor (`pipeline.executor=per_op`, Megatron's p-slot timeline with each
backward split into B and W) trains like one device: 3 optimizer steps' losses and updated params on
data2·pipe2·tensor2 (m = 4) and pipe4·tensor2 (m = 8, slow), against the one-device reference of
tests/test_train.py (same tolerances)."""

import pytest
from test_train import _cfg, assert_same, reference, run_steps

from meshrun.runtime.mesh import build_mesh
from meshrun.train.plan import build_plan


@pytest.mark.parametrize(
    "over",
    [
        ["pipeline.executor=per_op", "pipeline.microbatches=4"],  # tiny_cpu.yaml: data 2, pipe 2, tensor 2
        pytest.param(
            ["pipeline.executor=per_op", "pipeline.microbatches=8", "mesh.data=1", "mesh.pipe=4"],
            marks=pytest.mark.slow,
        ),
    ],
)
def test_per_op_1f1b_train_steps_match_one_device(over):
    cfg = _cfg("tiny_cpu.yaml", over)
    assert cfg.mesh.pipe * cfg.mesh.data * cfg.mesh.tensor == 8
    program = build_plan(cfg, build_mesh(cfg.mesh)).program  # what the train step runs
    assert program.executor == "per_op" and program.slots == cfg.mesh.pipe
    assert_same(run_steps(cfg), reference("tiny_cpu.yaml"))
