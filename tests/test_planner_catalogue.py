"""The GPU catalogue (meshrun/planner/hardware.py): every entry loads with sane datasheet figures and
its node storage, jax device kinds map to it, and `meshrun plan --cluster GPU:8x1` plans on it."""

import pytest

from meshrun.planner.hardware import GB, GPUS, NODES, gpu_of_kind, parse_cluster

DATASHEET = ("v100-32g", "a100-40g", "a100-80g", "h100-80g", "h200", "gh200", "gh200-144g", "b200")


def run_cli(argv, capsys):
    from meshrun.cli.main import main

    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("name", sorted(GPUS))
def test_each_entry_loads(name):
    gpu = GPUS[name]
    assert gpu.name == name and name in NODES
    assert gpu.peak_flops > 0 and gpu.memory_bytes > 0 and gpu.hbm_bw > 0 and gpu.nic_bw > 0 and gpu.sms >= 1
    assert gpu.fp8_flops == 0 or gpu.fp8_flops == pytest.approx(2 * gpu.peak_flops, rel=1e-3)  # Hopper, Blackwell
    st = parse_cluster(f"{name}:2x8").storage
    assert st.host_bytes > 0 and st.nvme_drives >= 1 and st.host_mem_bw > 0


def test_datasheet_figures():
    assert set(DATASHEET) <= set(GPUS)
    v100, b200 = GPUS["v100-32g"], GPUS["b200"]
    assert v100.peak_flops == 125e12 and v100.fp8_flops == 0 and v100.memory_bytes == 32 * GB  # fp16 peak, no fp8
    assert b200.peak_flops == 2250e12 and b200.fp8_flops == 4500e12 and b200.hbm_bw == 8000 * GB
    assert GPUS["gh200-144g"].memory_bytes == 144 * GB and GPUS["gh200"].memory_bytes == 96 * GB
    assert GPUS["gh200"].pcie_bw == 450 * GB  # NVLink-C2C to the Grace host, each way
    assert NODES["gh200-144g"].host_bytes == 480 * GB
    assert GPUS["h200"].memory_bytes == 141 * GB and GPUS["a100-40g"].memory_bytes == 40 * GB


@pytest.mark.parametrize(
    "kind,name",
    [("Tesla V100-SXM2-32GB", "v100-32g"), ("NVIDIA B200", "b200"), ("NVIDIA GH200 144G HBM3e", "gh200-144g"),
     ("NVIDIA GH200 480GB", "gh200"), ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-40GB", "a100-40g")],
)  # fmt: skip
def test_device_kinds_map_to_entries(kind, name):
    assert gpu_of_kind(kind) == name


@pytest.mark.parametrize("name", DATASHEET)
def test_plan_runs_on_each_gpu(name, capsys):
    rc, out, err = run_cli(["--model", "llama-7b", "--cluster", f"{name}:8x1", "--global-batch", "64",
                            "--seq-len", "2048", "--top", "1"], capsys)  # fmt: skip
    assert rc == 0, err
    assert f"{name}:8x1 = 8 x {name}" in out


def test_fp8_refused_on_v100(capsys):
    rc, out, err = run_cli(["--model", "llama-7b", "--cluster", "v100-32g:1x8", "--global-batch", "64",
                            "--fp8", "tensorwise"], capsys)  # fmt: skip
    assert rc == 2 and "v100-32g has no fp8 GEMMs" in err
