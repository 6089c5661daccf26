"""Every file in configs/ loads and validates; run configs build their train step on CPU."""

from pathlib import Path

import pytest

from meshrun.config import RunConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
ALL = sorted((ROOT / "configs").rglob("*.yaml"))
RUN_CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))

# Shrinks a GPU template to something that compiles on 8 CPU devices while keeping its structure
# (its schedule, ZeRO stage, MoE routing, remat policy, dtypes).
TINY = [
    "model.vocab=256",
    "model.d_model=32",
    "model.n_heads=4",
    "model.head_dim=8",
    "model.d_ff=64",
    "model.max_seq_len=16",
    "train.seq_len=16",
    "model.attention_impl=xla",
    "data.kind=synthetic",
]


def tiny_mesh(cfg: RunConfig) -> list[str]:
    pipe = 2 if cfg.mesh.pipe > 1 else 1
    expert = 2 if cfg.mesh.expert > 1 else 1
    tensor = 2 if cfg.mesh.tensor > 1 else 1
    data = 8 // (pipe * expert * tensor)
    v = cfg.pipeline.virtual
    m = 2 * pipe if pipe > 1 else 2
    layers = pipe * v * cfg.model.moe_every * (2 if pipe == 1 else 1)
    kv = 4 if cfg.model.n_kv_heads == cfg.model.n_heads else 2
    experts = [f"model.n_experts={2 * expert}"] if cfg.model.n_experts else []
    return [
        f"mesh.pipe={pipe}",
        f"mesh.expert={expert}",
        f"mesh.tensor={tensor}",
        f"mesh.data={data}",
        f"pipeline.microbatches={m}",
        f"train.global_batch={m * data * expert}",
        f"model.n_layers={layers}",
        f"model.n_kv_heads={kv}",
        *experts,
    ]


@pytest.mark.parametrize("path", ALL, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_config_loads(path):
    cfg = load_config(path)
    assert cfg.model.n_layers >= 1


# mixtral_h100.yaml's and moe_1t_h100.yaml's MoE routing also runs, smaller, in tiny_moe_cpu.yaml and
# tiny_deepseek_cpu.yaml: their one step is slow-only
SLOW_STEPS = ("mixtral_h100.yaml", "moe_1t_h100.yaml")
STEP_CONFIGS = [pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW_STEPS else p for p in RUN_CONFIGS]


@pytest.mark.parametrize("path", STEP_CONFIGS, ids=lambda p: p.name)
def test_run_config_runs_one_step_on_cpu(path, tmp_path):
    import jax

    from meshrun.data.datasets import global_batch_arrays, make_dataset
    from meshrun.parallel.sharding import DP_AXES
    from meshrun.runtime.mesh import build_mesh
    from meshrun.train.step import make_train_step

    base = load_config(path)
    over = [*TINY, *tiny_mesh(base)] if "cpu" not in path.name else ["train.steps=1"]
    if base.offload.optimizer == "nvme":  # the template's NVMe path -> a local scratch directory
        (tmp_path / "nvme").mkdir()
        over.append(f"offload.dir={tmp_path / 'nvme'}")
    cfg = load_config(path, [*over, f"train.run_dir={tmp_path}"])
    mesh = build_mesh(cfg.mesh)
    train_step = make_train_step(cfg, mesh)
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch)
    tokens, labels = global_batch_arrays(ds, 0, mesh, jax.sharding.PartitionSpec(DP_AXES))
    state, metrics = train_step.step(train_step.init(), tokens, labels)
    assert int(state.step) == 1
    assert 0 < float(metrics["loss"]) < 20
    if base.offload.optimizer == "nvme":  # the optimizer state went through the tier's file
        assert train_step.tier is not None and any((tmp_path / "nvme").iterdir())
