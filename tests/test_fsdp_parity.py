"""ZeRO-3 per layer and ZeRO-2 per microbatch beside other features: the same numbers as one device
(losses and params after 3 steps, fp32, rtol 1e-5) with context parallelism (ring; also beside a
pipeline), muon (also through 1F1B and an uneven pipeline), an uneven pipeline and the host tier
(offload.optimizer=host). fp8 with both: tests/test_fp8.py; bf16 params: tests/test_zero3_layer.py.
"""

import pytest
from test_train import _cfg, assert_same, reference, run_steps

LAYER = ["train.zero=3", "train.zero3_gather=layer"]
MB = ["train.zero=2", "train.zero2_reduce=microbatch"]
DP4_TP2 = ["mesh.pipe=1", "mesh.data=4", "mesh.tensor=2", "pipeline.microbatches=2"]
CP = ["mesh.pipe=1", "mesh.data=2", "mesh.tensor=2", "mesh.context=2", "model.context_parallel=ring"]
CP_PIPE = ["mesh.pipe=2", "mesh.data=1", "mesh.tensor=2", "mesh.context=2", "model.context_parallel=ring"]
MUON = ["optimizer.name=muon"]
HOST = ["offload.optimizer=host"]
UNEVEN = ["pipeline.layers_per_stage=[3,1]"]  # data2 x pipe2 x tensor2, 1F1B, 3 + 1 layers

# id -> (the layout and feature, what the one-device reference shares)
CASES = {
    "context2-zero3-layer": ([*CP, *LAYER], []),
    "context2-zero2-microbatch": ([*CP, *MB], []),
    "muon-zero3-layer": ([*DP4_TP2, *MUON, *LAYER], MUON),
    "muon-zero2-microbatch": ([*DP4_TP2, *MUON, *MB], MUON),
    "host-tier-zero3-layer": ([*DP4_TP2, *HOST, *LAYER], []),
    "host-tier-zero2-microbatch": ([*DP4_TP2, *HOST, *MB], []),
    "context2-pipe2-zero3-layer": ([*CP_PIPE, *LAYER], []),
    "context2-pipe2-zero2-microbatch": ([*CP_PIPE, *MB], []),
    "uneven-pipe-zero3-layer": ([*UNEVEN, *LAYER], []),
    "uneven-pipe-zero2-microbatch": ([*UNEVEN, *MB], []),
    "muon-1f1b-zero3-layer": ([*MUON, *LAYER], MUON),
    "muon-uneven-pipe-zero3-layer": ([*MUON, *UNEVEN, *LAYER], MUON),
    "muon-uneven-pipe-zero2-microbatch": ([*MUON, *UNEVEN, *MB], MUON),
}
FAST = {"context2-zero3-layer"}  # the representative case of the default suite


@pytest.mark.parametrize(
    "over,ref",
    [pytest.param(*CASES[k], id=k, marks=() if k in FAST else pytest.mark.slow) for k in CASES],
)
def test_matches_one_device(over, ref):
    got = run_steps(_cfg("tiny_cpu.yaml", over))
    assert_same(got, reference("tiny_cpu.yaml", ref))
