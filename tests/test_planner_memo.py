"""The search's kept results (`step_model._state_bytes`, `timing._dp_comm`) are keyed on the layout
fields those functions read: every layout of a search, and its variants in every field the search or
`--evaluate` changes, gets what the uncached function computes for it."""

import dataclasses
import itertools

from meshrun.config import load_config
from meshrun.planner import search, step_model, timing
from meshrun.planner.hardware import parse_cluster
from meshrun.planner.layout import precision_of

VARIANTS = {  # the values a field takes beside the candidate's own
    "executor": ("lockstep", "per_op"),
    "overlap_grad_reduce": (False, True),
    "tp_comm_overlap": (False, True),
    "remat": ("none", "selective", "full"),
    "sequence_parallel": (False, True),
    "zero": (0, 1, 2, 3),
    "zero3_gather": ("auto", "layer", "step"),
    "zero2_reduce": ("auto", "microbatch", "step"),
    "offload_params": (False, True),
    "offload_optimizer": ("none", "host", "nvme"),
    "micro_batch_size": (1, 2),
    "grad_reduce_dtype": ("float32", "bfloat16"),
    "state_dtype": ("float32", "bfloat16"),
}


def _layouts(model, cluster):
    fields = {f.name for f in dataclasses.fields(search.Layout)}
    for lay in itertools.islice(search.candidates(model, cluster, 64, 2048), 0, None, 7):
        yield lay
        for name, values in VARIANTS.items():
            if name in fields:
                for v in values:
                    yield dataclasses.replace(lay, **{name: v})


def test_kept_results_equal_the_uncached_functions():
    model = load_config("configs/tiny_moe_cpu.yaml").model
    model = dataclasses.replace(model, n_layers=8, param_dtype="bfloat16")
    cluster = parse_cluster("h100-80g:2x8")
    layouts = list(_layouts(model, cluster))
    assert len(layouts) > 200
    for frac in (1.0, 0.5):
        kept = [step_model._state_bytes(model, lay, frac) for lay in layouts]  # fills the memo first
        for lay, got in zip(layouts, kept, strict=True):
            assert got == step_model._state_bytes_of(model, lay, frac), lay
    for fw in ("meshrun", "megatron"):
        kept = [timing._dp_comm(model, lay, cluster, precision_of(model, layout=lay), fw) for lay in layouts]
        for lay, got in zip(layouts, kept, strict=True):
            assert got == timing._dp_comm_of(model, lay, cluster, precision_of(model, layout=lay), fw), lay
