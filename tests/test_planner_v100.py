"""The ZeRO-Offload and ZeRO-Infinity papers' single-node V100 figures against the planner's host and
NVMe tiers (docs/planning.md, "V100: the offload papers"): one DGX-2 is 16 V100 32GB, 1.5 TB of host
memory, 8 x 3.84 TB NVMe (NVIDIA's DGX-2 datasheet). GPT-shaped models (`calibrate.gpt_config`), seq
1024. Pure Python, no JAX.
"""

import pytest

from meshrun.errors import ConfigError
from meshrun.planner import search
from meshrun.planner.calibrate import gpt_config
from meshrun.planner.hardware import parse_cluster

DGX2 = "v100-32g:{}x16,host=1.5TB,nvme=8x3.84TB"
ONE_V100 = "v100-32g:1x1,host=1.5TB,nvme=8x3.84TB"


def _best(model, cluster: str, batch: int):
    return search.search(model, parse_cluster(cluster), batch, 1024, top=1)[0]


def _fits(result) -> bool:
    """No memory rule broken (an offload proposal is a note, not a violation of the layout)."""
    return not [v for v in result.violations if v.startswith("memory") or result.hard]


def test_one_v100_fits_1_4b_without_offload_and_not_13b():
    """ZeRO-Offload's baseline: 1.4B is the largest PyTorch trains on one V100 without running out of
    memory; the planner fits a 1.3B on the device alone. Its 13B on one GPU keeps the fp16 params on
    the device and streams gradients to the CPU; meshrun's parameter tier needs ZeRO-3 over 2+ data
    ranks, so the planner finds no layout for 13B on one V100 (said so in docs/planning.md)."""
    small = _best(gpt_config(16, 2048, 24, seq=1024), ONE_V100, 8)
    assert not small.layout.offload_params and small.layout.offload_optimizer == "none" and _fits(small)
    with pytest.raises(ConfigError, match="fits on no layout"):
        _best(gpt_config(40, 5120, 40, seq=1024), ONE_V100, 8)


def test_one_dgx2_fits_a_65b_only_with_the_host_tier():
    """ZeRO-Offload with model parallelism: over 70B on one DGX-2. The planner's best layout for a
    65B (80 layers of 8192) there keeps the parameters and the optimizer state in host memory: the
    search proposes offload only when no layout fits without it."""
    best = _best(gpt_config(64, 8192, 80, seq=1024), DGX2.format(1), 16)
    assert best.layout.offload_params and best.layout.offload_optimizer == "host" and _fits(best)


@pytest.mark.slow
def test_a_trillion_needs_nvme_and_two_dgx2_nodes():
    """ZeRO-Infinity fine-tunes 1T on one DGX-2 with the parameters on NVMe too. meshrun's parameter
    tier is host memory: on one DGX-2 1T needs 2 TB of it (no layout), on two the parameters rest in
    host memory and the optimizer state and gradient on NVMe."""
    one_t = gpt_config(160, 25600, 128, seq=1024)
    with pytest.raises(ConfigError, match="host memory"):
        _best(one_t, DGX2.format(1), 16)
    best = _best(one_t, DGX2.format(2), 32)
    assert best.layout.offload_params and best.layout.offload_optimizer == "nvme" and _fits(best)
