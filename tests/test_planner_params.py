"""The planner's `offload.params` (ZeRO-3 parameters in host memory, fetched layer by layer):
its element counts, the host-link traffic table of docs/offload.md, the tier bytes and time of one
layout by hand, the rule that it is proposed only when the optimizer state's tiers do not fit, and
that it proposes only what meshrun's runtime accepts (`config.offload_params_refusals`, pinned
both ways by replacing that one function). Planner only, except the test that checks its shard
bytes against the runtime's shardings (jax, nothing compiled)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml

from meshrun import config
from meshrun.analysis.flops import layer_params, param_counts
from meshrun.cli.main import main
from meshrun.cli.plan import load_model
from meshrun.errors import ConfigError
from meshrun.planner import offload, param_offload, search, tiers
from meshrun.planner.cost import Layout
from meshrun.planner.hardware import GB, TB, parse_cluster

ROOT = Path(__file__).resolve().parents[1]
H100 = parse_cluster("h100-80g:1x8")
LINK = 64 * GB * 0.8  # H100's PCIe 5.0 x16, one direction, at the planner's 80%


def model(name: str, **kw):
    return dataclasses.replace(load_model(name)[0], **kw)


def run_cli(argv, capsys):
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


# ----------------------------------------------------------------------------- elements and the traffic table


@pytest.mark.parametrize(
    "name,lay",
    [
        ("llama-70b", Layout(tensor=4, data=2, zero=3)),
        ("llama-70b", Layout(tensor=2, pipe=2, data=2, microbatches=4, zero=3)),
        ("mixtral-8x7b", Layout(tensor=2, data=2, expert=2, microbatches=2, zero=3)),
    ],
)
def test_elements_are_the_zero3_shard(name, lay):
    """The layers' and the non-layer shards add up to the optimizer's ZeRO-3 shard of meshrun's step
    model; one unit gathered is a layer's params over tensor (and expert) parallelism."""
    m = model(name)
    r = search.evaluate(m, lay, parse_cluster(f"h100-80g:1x{lay.n_devices}"), lay.global_batch, 1024)
    el = param_offload.elements(m, lay, max(r.time["split"]))
    assert el.shard == pytest.approx(r.memory["opt_elems"], rel=1e-12)
    h, t, e = m.d_model, lay.tensor, lay.expert
    if not m.is_moe:
        assert el.unit == pytest.approx((layer_params(m) - 2 * h) / t + 2 * h)
    emb = param_counts(m)["embedding"] + param_counts(m)["head"]
    assert el.edge == emb / t + h and el.edges == pytest.approx(emb / t / (lay.data * e) + h)
    assert el.units == m.n_units / lay.pipe


def _doc_table() -> dict[str, tuple[str, str]]:
    """docs/offload.md's host-link traffic table: {phase: (host -> device, device -> host)}."""
    text = (ROOT / "docs/offload.md").read_text()
    start = text.index("**Host-link traffic per step and device**")
    rows = {}
    for line in text[start:].splitlines()[3:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] != "phase" and not set(cells[0]) <= {"-"}:
            rows[cells[0]] = (cells[1], cells[2])
    return rows


def _eval(cell: str, n: float, b: float, m: int) -> float:
    """A cell of the table as a number: comments in words dropped, `·` a product."""
    expr = re.sub(r"\((?:the|Adam)[^)]*\)", "", cell).replace("·", "*").strip()
    return eval(expr, {"N": n, "b": b, "m": m}) if expr else 0.0  # noqa: S307 (our own docs)


@pytest.mark.parametrize("m,b", [(1, 2), (1, 4), (4, 2), (8, 4)])
def test_link_bytes_follow_the_docs_table(m, b):
    """`param_offload.link_bytes` is docs/offload.md's table row by row (m = 1: no sums row; the
    gradient is float32 either way); the host tier adds its state both ways."""
    n = 1000.0
    rows = _doc_table()
    assert list(rows) == ["forward", "backward", "gradient sums (m > 1 only)", "update: the norm, then the update",
                          "update with `offload_optimizer=host`"]  # fmt: skip
    h2d = d2h = 0.0
    for phase in list(rows)[:4]:
        if phase.startswith("gradient sums") and m == 1:
            continue
        h2d += _eval(rows[phase][0], n, b, m)
        d2h += _eval(rows[phase][1], n, b, m)
    assert param_offload.link_bytes(n, b, m) == pytest.approx((h2d, d2h), rel=0, abs=0)
    host = rows["update with `offload_optimizer=host`"]
    assert "8·N" in host[0] and "12·N with a float32 master" in host[0] and host[1] == "+ the same"
    assert param_offload.link_bytes(n, b, m, 12.0) == pytest.approx((h2d + 12 * n, d2h + 12 * n), rel=0, abs=0)
    # the table by hand, m = 4, bf16: forward 8000 + backward 8000 + sums 4 x 8000 + update 10000 in;
    # backward 16000 + zeros 4000 + sums 16000 + update 2000 out
    assert param_offload.link_bytes(1000, 2, 4) == (58_000, 38_000)
    assert param_offload.link_bytes(1000, 2, 1) == (2_000 + 2_000 + 10_000, 4_000 + 4_000 + 2_000)


def test_link_bytes_with_the_gradient_on_nvme():
    """offload.grads=nvme (one micro-batch): the forward and backward fetches, the gradient out
    once (no zeros; the norm's squared sums come from the backward, so no read for it), then the
    update's gradient and params in and the new params out."""
    assert param_offload.link_bytes(1000, 2, 1, grads="nvme") == (2_000 + 2_000 + 4_000 + 2_000, 4_000 + 2_000)
    host = param_offload.link_bytes(1000, 2, 1)
    assert host[0] - 4_000 == param_offload.link_bytes(1000, 2, 1, grads="nvme")[0]  # the norm's read
    assert host[1] - 4_000 == param_offload.link_bytes(1000, 2, 1, grads="nvme")[1]  # the zeros


# ----------------------------------------------------------------------------- one layout by hand


def test_tier_bytes_and_time_by_hand():
    """llama-70b with float32 params, TP 4, DP 2, ZeRO-3, 8 micro-batches on one DGX H100: every
    tier's device, host, NVMe and host-link bytes, and the time added to the step."""
    m = model("llama-70b", param_dtype="float32")
    lay = Layout(tensor=4, data=2, microbatches=8, zero=3, remat="full", sequence_parallel=True)
    r = search.evaluate(m, lay, H100, 16, 4096)
    el = param_offload.elements(m, lay, m.n_layers)
    n_l, n_e, n = el.layers, el.edges, el.shard
    h, t = m.d_model, 4
    assert el.unit == (layer_params(m) - 2 * h) / t + 2 * h
    counts = param_counts(m)
    assert n_l == pytest.approx((counts["layers"] - 2 * h * 80) / t / 2 + 2 * h * 80)
    state = 8 * n  # float32 params: Adam's m and v
    assert r.memory["opt_state"] == pytest.approx(state)
    for tier in tiers.TIERS:
        pt = offload.params_of(r, m, H100, tier)
        assert pt.parts["params"] == pytest.approx(4 * (2 * el.unit + el.edge))  # two units + the non-layer params
        u = n_l / 80
        assert pt.parts["grads"] == pytest.approx(4 * el.unit + (4 + 4) * u + (4 + 4) * el.edge)
        assert pt.parts["optimizer"] == pytest.approx(state if tier == "none" else 0.0)
        rest = sum(r.memory[k] for k in ("activations", "logits", "overheads"))
        assert pt.backward == pytest.approx(pt.parts["params"] + pt.parts["grads"] + pt.parts["optimizer"] + rest)
        host_state = state if tier == "host" else 0.0
        # forward 8 N 4, backward 8 N 4 in and out, sums 8 (4 + 4) N in and (4 + 8 x 4) N out, update 12 N in, 4 N out
        h2d = 8 * 4 * n_l * 2 + 8 * 8 * n_l + 12 * n_l + 4 * n_e + host_state  # the non-layer params: once
        d2h = 8 * 4 * n_l + (4 + 32) * n_l + 4 * n_l + 4 * n_e + host_state
        if tier == "nvme":
            assert pt.state.nvme == pt.nvme and pt.nvme >= state
            h2d, d2h = h2d + pt.nvme, d2h + pt.nvme
        assert (pt.h2d, pt.d2h) == pytest.approx((h2d, d2h))
        assert pt.link_s == pytest.approx((h2d + d2h) / LINK)
        assert pt.host == pytest.approx(4 * n + 4 * n_l + host_state + (256 * 2**20 / 8 if tier == "nvme" else 0))
        assert pt.dp_s == pytest.approx(1.5 * 8 * r.time["dp_sync"])
        if tier == "nvme":  # the drives: 8 GPUs' files on 8 drives at 70% of 6.4 / 3.8 GB/s, beyond the link
            node = 8 * pt.nvme
            assert pt.disk_s == pytest.approx(node / (8 * 0.7 * 6.4 * GB) + node / (8 * 0.7 * 3.8 * GB))
            assert pt.exposed_s == pytest.approx(pt.link_s + max(0.0, pt.disk_s - 2 * pt.nvme / LINK))
        else:
            assert pt.exposed_s == pt.link_s
    # the state on the device: 69 GB; host memory per node: params + float32 sums, 0.55 TB
    none = offload.params_of(r, m, H100, "none")
    assert none.device < H100.usable_memory < r.memory["total"]
    assert 8 * none.host == pytest.approx(8 * (4 * n + 4 * n_l)) and 8 * none.host < 0.6 * TB


def test_proposed_only_when_the_state_tiers_do_not_fit():
    """llama-70b with float32 params on one DGX H100: neither the host nor the NVMe tier of the state
    fits (the parameters and gradients stay), so the search proposes offload.params, with the
    state on the device (the nearest tier that fits), each saying why; GPT-3 175B at 16K on 8 DGX
    A100 fits with the host tier alone, so no proposal offloads parameters."""
    m = model("llama-70b", param_dtype="float32")
    rs = search.search(m, H100, 16, 4096, top=3)
    assert rs and all(r.layout.offload_params and r.layout.offload_optimizer == "none" for r in rs)
    for r in rs:
        why = next(v for v in r.violations if v.startswith("offload parameters"))
        assert "host offload alone does not fit" in why and "nvme offload alone does not fit" in why
        assert "not overlapped with compute" in why and r.memory["total"] <= H100.usable_memory
        assert r.time["host_transfer"] > 0 and r.layout.zero == 3
    gpt3 = search.search(model("gpt3-175b"), parse_cluster("a100-80g:8x8"), 16, 16384, top=3, max_context=1)
    assert gpt3 and not any(r.layout.offload_params for r in gpt3)


# ----------------------------------------------------------------------------- the runtime's rules decide

# one node with 3 TB of host memory: a DGX H100's 2 TB (1.8 usable) cannot hold the 405B's bf16 params
# and their float32 gradient (2.42 TB per node; test_405b_on_a_dgx_h100_needs_more_host_memory)
ARGV_405B = ["--model", "llama-405b", "--cluster", "h100-80g:1x8,host=3TB", "--global-batch", "16", "--seq-len",
             "4096"]  # fmt: skip


def refuse(*args, **kw):
    """A stand-in for `config.offload_params_refusals` that refuses everything."""
    return [("is refused by this test", "accept it")]


def check_405b(rc: int, out: str, err: str, refused: list[str]) -> None:
    """The 405B on one node: exit 2 naming the combination that would fit and each rule that refuses
    it when `refused`, else a ZeRO-3 layout with the parameters in host memory and its step time."""
    if refused:
        assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert ("with the parameters in host memory (offload.params) and the optimizer state on NVMe it "
                "would fit") in err  # fmt: skip
        assert ("but meshrun does not run offload.params with offload.optimizer=nvme and "
                "model.param_dtype=bfloat16: " + "; ".join(f"it {w}" for w in refused)) in err  # fmt: skip
        assert "with the state in host memory: host memory" in err  # why not the host tier
        return
    assert rc == 0 and err == ""
    why = next(line for line in out.splitlines() if "offload parameters to host memory" in line)
    assert "offload.params=true offload.optimizer=nvme" in why and "on NVMe" in why
    row = out.splitlines()[3].split()
    assert row[9] == "3" and float(row[13]) > 0  # ZeRO-3, a step time


def test_405b_follows_the_runtimes_acceptance(capsys, monkeypatch):
    """The 405B on one node fits only with the parameters in host memory and the state on NVMe. The
    planner's answer follows `config.offload_params_refusals` alone: refused, it exits 2 naming what
    refuses it; accepted, the same command answers with a layout and its step time. Pinned both ways
    by replacing that one function, and checked against what it says today."""
    today = [w for w, _ in config.offload_params_refusals(3, "nvme", fp8="none", pipe=1)]  # its layout: pipe 1
    check_405b(*run_cli([*ARGV_405B, "--top", "1"], capsys), today)
    monkeypatch.setattr(config, "offload_params_refusals", refuse)
    check_405b(*run_cli([*ARGV_405B, "--top", "1"], capsys), ["is refused by this test"])
    monkeypatch.setattr(config, "offload_params_refusals", lambda *a, **k: [])
    check_405b(*run_cli([*ARGV_405B, "--top", "1"], capsys), [])


def _refuse_grads(*args, **kw):
    """`config.offload_params_refusals` as today, and offload.grads=nvme refused as well."""
    out = ORIGINAL_REFUSALS(*args, **kw)
    grads = kw.get("offload_grads", "host")
    return out + [("is refused with the gradient on NVMe by this test", "accept it")] * (grads == "nvme")


ORIGINAL_REFUSALS = config.offload_params_refusals
ARGV_DGX = ["--model", "llama-405b", "--cluster", "h100-80g:1x8", "--global-batch", "16", "--seq-len", "4096"]


def test_405b_on_a_dgx_h100_puts_the_gradient_on_nvme(capsys, monkeypatch):
    """On a DGX H100 (2 TB of host memory) the params in host memory with their float32 gradient need
    2.42 TB per node; with the gradient on NVMe too (one micro-batch) the 405B fits: a ZeRO-3 layout
    with 0.81 TB of host memory per node and a step time. Refused (the same function replaced), the
    planner exits 2 naming the host memory the gradient would need."""
    rc, out, err = run_cli([*ARGV_DGX, "--top", "1"], capsys)
    assert rc == 0 and err == ""
    why = next(line for line in out.splitlines() if "offload parameters to host memory" in line)
    assert "offload.optimizer=nvme offload.grads=nvme pipeline.microbatches=1" in why
    assert "(0.81 of 2.00 TB per node)" in why and "the layers' float32 gradient" in why
    assert "with the state on NVMe (the gradient in host memory): host memory 2419 GB per node > 1800 GB" in why
    row = out.splitlines()[3].split()
    assert row[7] == "1" and row[9] == "3" and float(row[13]) > 0  # one micro-batch, ZeRO-3, a step time
    monkeypatch.setattr(config, "offload_params_refusals", _refuse_grads)
    rc, out, err = run_cli(ARGV_DGX, capsys)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "and the optimizer state on NVMe (the gradient too) it would fit" in err
    assert "it is refused with the gradient on NVMe by this test" in err and "host memory 2419 GB per node" in err


def test_a_refused_combination_is_never_proposed(monkeypatch):
    """The float32 llama-70b on one node is proposed offload.params today; when the runtime's
    rules refuse it, the search proposes nothing and says what refuses it."""
    m = model("llama-70b", param_dtype="float32")
    assert search.search(m, H100, 16, 4096, top=1)[0].layout.offload_params
    monkeypatch.setattr(config, "offload_params_refusals", refuse)
    with pytest.raises(ConfigError) as e:
        search.search(m, H100, 16, 4096, top=1)
    assert "would fit" in str(e.value) and "it is refused by this test" in str(e.value)


def test_the_planners_rules_are_the_runtimes():
    """What the planner is told is refused is what the run's config raises."""
    for tier in tiers.TIERS:
        refused = config.offload_params_refusals(3, tier)
        if not refused:
            config.RunConfig(
                train=config.TrainConfig(zero=3), offload=config.OffloadConfig(optimizer=tier, dir="x", params=True)
            )
            continue
        with pytest.raises(ConfigError, match=re.escape(refused[0][0])):
            config.RunConfig(
                train=config.TrainConfig(zero=3), offload=config.OffloadConfig(optimizer=tier, dir="x", params=True)
            )
    muon = Layout(zero=3, optimizer="muon")
    assert any("layer by layer" in w for w in param_offload.refusals(model("llama-7b"), muon, "none"))
    f32 = model("llama-7b", param_dtype="float32")
    assert param_offload.refusals(f32, Layout(zero=1), "none") == ["needs ZeRO-3's sharded parameters (train.zero=1)"]
    # --evaluate of both levers is refused, not costed (the step's plan raises on it)
    off = Layout(pipe=2, data=4, zero=3, schedule="zb-v", virtual=2, microbatches=8)
    assert any("overlap_grad_reduce" in w for w in param_offload.refusals(
        f32, dataclasses.replace(off, overlap_grad_reduce=True), "none"))  # fmt: skip
    assert not param_offload.refusals(f32, off, "none")


# ----------------------------------------------------------------------------- --evaluate


def test_evaluate_shows_the_tier_bytes_and_host_link_time(tmp_path, capsys, monkeypatch):
    """`--evaluate ...,offload_params=true,offload_optimizer=host` prints the tier's host bytes and
    host-link time; the JSON carries the host memory; a refused combination is a violation."""
    raw = yaml.safe_load((ROOT / "configs/models/llama-70b.yaml").read_text())
    raw["model"]["param_dtype"] = "float32"
    path = tmp_path / "llama-70b-fp32.yaml"
    path.write_text(yaml.safe_dump(raw))
    ev = "tensor=4,data=2,zero=3,microbatches=8,offload_params=true,offload_optimizer=host"
    argv = ["--model", str(path), "--cluster", "h100-80g:1x8", "--global-batch", "16", "--seq-len", "4096"]
    rc, out, _ = run_cli([*argv, "--evaluate", ev], capsys)
    m = model(str(path))
    lay = Layout(tensor=4, data=2, microbatches=8, zero=3, remat=m.remat, sequence_parallel=m.sequence_parallel)
    pt = offload.params_of(search.evaluate(m, lay, H100, 16, 4096), m, H100, "host")
    why = next(line for line in out.splitlines() if "offload parameters" in line)
    assert rc == 0 and f"{pt.host / GB:.1f} GB/device in host memory" in why
    assert f"host link {pt.h2d / GB:.1f} GB in + {pt.d2h / GB:.1f} GB out per step (+{pt.link_s:.3g} s" in why
    assert "meshrun refuses" not in out
    rc, out, _ = run_cli([*argv, "--evaluate", ev, "--json"], capsys)
    c = json.loads(out)["configs"][0]
    assert c["offload_params"] is True and c["host_memory_gb"] == round(pt.host / GB, 3)
    monkeypatch.setattr(config, "offload_params_refusals", refuse)
    rc, out, _ = run_cli([*argv, "--evaluate", ev], capsys)
    assert "offload.params is refused by this test (meshrun refuses it)" in out and why in out


# ----------------------------------------------------------------------------- against the runtime


@pytest.mark.parametrize(
    "over",
    [
        ["mesh.pipe=1", "mesh.data=4", "mesh.tensor=2", "pipeline.microbatches=4"],
        ["mesh.pipe=1", "mesh.data=8", "mesh.tensor=1", "pipeline.microbatches=1"],
        [],  # tiny_cpu: data 2 x pipe 2 x tensor 2
    ],
)
def test_planner_shard_is_the_runtimes_host_params(over):
    """The tiny model on 8 CPU devices with offload.params: the bytes of one device's parameter
    shards that rest in pinned host memory (the step's own shardings, nothing compiled) equal the
    planner's N·b for the layers and for the embedding, head and final norm."""
    import jax
    import numpy as np

    from meshrun.config import load_config
    from meshrun.planner.layout import layout_of
    from meshrun.runtime.mesh import build_mesh
    from meshrun.train.step import make_train_step

    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", [*over, "train.zero=3", "offload.params=true"])
    mesh = build_mesh(cfg.mesh, devices=jax.devices()[:8])
    ts = make_train_step(cfg, mesh)
    host = {"layers": 0, "other": 0}
    params, shardings = ts.abstract_run.params, ts.state_shardings.params
    for key in params:
        for a, s in zip(jax.tree.leaves(params[key]), jax.tree.leaves(shardings[key]), strict=True):
            assert s.memory_kind == "pinned_host"
            host["layers" if key == "layers" else "other"] += int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize
    lay = layout_of(cfg, dict(mesh.shape))
    el = param_offload.elements(cfg.model, lay, cfg.model.n_layers / lay.pipe)
    assert (4 * el.layers, 4 * el.edges) == (host["layers"], host["other"])


@pytest.mark.parametrize(
    "over",
    [
        ["mesh.pipe=1", "mesh.data=8", "mesh.tensor=1", "pipeline.microbatches=1"],
        ["mesh.pipe=1", "mesh.data=4", "mesh.tensor=2", "pipeline.microbatches=1"],
    ],
)
def test_planner_gradient_bytes_are_the_runtimes(over, tmp_path):
    """The tiny model on 8 CPU devices with offload.grads=nvme, one step: the gradient bytes the
    runtime writes to the file per device (the sink's count) are the planner's NVMe gradient (4·N of the
    layers); the planner's host memory is the params' pinned shard (the runtime's shardings) plus the
    chunk budget, the gradient's 4·N less than with the gradient in host memory; the runtime's tier
    holds no more than that budget; its file holds the gradient beside the state."""
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from meshrun.config import load_config
    from meshrun.data.datasets import global_batch_arrays, make_dataset
    from meshrun.parallel.sharding import DP_AXES
    from meshrun.planner.layout import layout_of
    from meshrun.runtime.mesh import build_mesh
    from meshrun.train.step import make_train_step

    budget = 2.0
    nvme = ["offload.optimizer=nvme", f"offload.dir={tmp_path}", f"offload.budget_mb={budget}"]
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", [*over, "train.zero=3", "offload.params=true", *nvme,
                                                       "offload.grads=nvme"])  # fmt: skip
    mesh = build_mesh(cfg.mesh, devices=jax.devices()[:8])
    ts = make_train_step(cfg, mesh)
    t = cfg.train
    ds = make_dataset(cfg.data, vocab=cfg.model.vocab, seq_len=t.seq_len, global_batch=t.global_batch)
    ts.step(ts.init(), *global_batch_arrays(ds, 0, mesh, P(DP_AXES)))
    tier = ts.tier
    params = sum(int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize
                 for a, s in zip(jax.tree.leaves(ts.abstract_run.params), jax.tree.leaves(ts.state_shardings.params),
                                 strict=True))  # fmt: skip
    lay = layout_of(cfg, dict(mesh.shape))
    el = param_offload.elements(cfg.model, lay, cfg.model.n_layers)
    r = search.evaluate(cfg.model, lay, H100, t.global_batch, t.seq_len)
    mem = dict(r.memory, layers=max(r.time["split"]))
    pts = {g: param_offload.param_tier(mem, cfg.model, lay, H100, "nvme", r.time["dp_sync"], budget, grads=g)
           for g in ("host", "nvme")}  # fmt: skip
    assert tier.sink.bytes_written / len(tier.layout.local) == pts["nvme"].grad_nvme == 4 * el.layers
    assert pts["nvme"].host == pytest.approx(params + budget * 2**20 / 8)
    assert pts["host"].host - pts["nvme"].host == pytest.approx(4 * el.layers)
    assert tier.bytes_per_device()["host"] <= budget * 2**20 / 8 and tier.file.peak_resident <= budget * 2**20
    per_device = tier.sink.bytes_written / len(tier.layout.local)
    assert tier.bytes_per_device()["nvme"] >= per_device + tier.file.state_bytes / 8
    assert pts["nvme"].nvme == pytest.approx(pts["host"].nvme + 4 * el.layers)
