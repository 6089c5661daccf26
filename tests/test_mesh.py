import json
import subprocess
import sys
import warnings

import jax
import pytest

from meshrun import ConfigError, MeshConfig, build_mesh, describe, describe_dict
from meshrun.cli.main import main
from meshrun.runtime.mesh import axis_groups, host_of


def _hosts_of(groups, host_map):
    return [{host_map[str(d)] for d in g} for g in groups]


def test_default_order_and_fill():
    mesh = build_mesh(MeshConfig(pipe=2, tensor=2))
    assert mesh.axis_names == ("pipe", "data", "expert", "context", "tensor")
    assert dict(mesh.shape) == {"pipe": 2, "data": 2, "expert": 1, "context": 1, "tensor": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    # innermost axis = neighbouring devices
    assert axis_groups(mesh, "tensor") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert axis_groups(mesh, "pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_fill_other_axis_and_custom_order():
    mesh = build_mesh(MeshConfig(data=2, tensor=-1, order=("tensor", "data", "pipe", "expert")))
    assert mesh.shape["tensor"] == 4
    assert axis_groups(mesh, "data") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert axis_groups(mesh, "tensor") == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_keyword_overrides():
    assert build_mesh(pipe=4).shape["data"] == 2


def test_host_placement_tensor_inside_pipe_across():
    mesh = build_mesh(MeshConfig(pipe=2, data=2, tensor=2, hosts=2))
    d = describe_dict(mesh)
    assert d["hosts"] == 2
    assert all(len(h) == 1 for h in _hosts_of(d["groups"]["tensor"], d["host_of"]))
    assert all(len(h) == 2 for h in _hosts_of(d["groups"]["pipe"], d["host_of"]))
    assert host_of(mesh) == {i: i // 4 for i in range(8)}
    text = describe(mesh)
    assert "tensor groups: [0,1] [2,3] [4,5] [6,7]" in text and "2 host(s)" in text


def test_cross_host_tensor_error_and_allow():
    with pytest.raises(ConfigError, match="spans 2 hosts") as e:
        build_mesh(MeshConfig(tensor=8, hosts=2))
    assert "allow_cross_host_tensor" in str(e.value)
    with pytest.warns(UserWarning, match="inter-node"):
        build_mesh(MeshConfig(tensor=8, hosts=2, allow_cross_host_tensor=True))


def test_expert_across_hosts_warns():
    with pytest.warns(UserWarning, match="expert group spans"):
        build_mesh(MeshConfig(expert=4, hosts=4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_mesh(MeshConfig(expert=4, hosts=2))


@pytest.mark.parametrize(
    "cfg, match",
    [
        (dict(data=3, tensor=2, pipe=1), "product of axes is 6 but there are 8"),
        (dict(data=-1, tensor=3), "not divisible by 3"),
        (dict(hosts=3), "split evenly into 3 hosts"),
    ],
)
def test_bad_mesh(cfg, match):
    with pytest.raises(ConfigError, match=match):
        build_mesh(MeshConfig(**cfg))


def test_cli_json_keys(capsys):
    rc = main(["mesh", "--devices", "8", "--hosts", "2", "mesh.pipe=2", "mesh.data=2", "mesh.tensor=2", "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert set(d) == {"axes", "shape", "hosts", "racks", "device_ids", "host_of", "rack_of", "groups", "warnings"}
    assert d["axes"] == ["pipe", "data", "expert", "context", "tensor"] and d["hosts"] == 2
    assert d["device_ids"] == [[[[[0, 1]]], [[[2, 3]]]], [[[[4, 5]]], [[[6, 7]]]]]
    assert all(len(h) == 1 for h in _hosts_of(d["groups"]["tensor"], d["host_of"]))
    assert all(len(h) == 2 for h in _hosts_of(d["groups"]["pipe"], d["host_of"]))
    assert d["warnings"] == []


def test_cli_cross_host_tensor(capsys):
    assert main(["mesh", "--devices", "8", "--hosts", "2", "mesh.tensor=8", "--json"]) == 2
    err = capsys.readouterr().err
    assert "spans 2 hosts" in err and "mesh.allow_cross_host_tensor=true" in err
    rc = main(
        ["mesh", "--devices", "8", "--hosts", "2", "mesh.tensor=8", "mesh.allow_cross_host_tensor=true", "--json"]
    )
    assert rc == 0
    assert "inter-node" in json.loads(capsys.readouterr().out)["warnings"][0]


@pytest.mark.parametrize(
    "args, words",
    [
        (["mesh.tensor=3"], "product"),
        (["mesh.data=-1", "mesh.pipe=-1"], "two axes are -1"),
        (["mesh.tensor=0"], "mesh.tensor"),
        (["mesh.tensor=-3"], "mesh.tensor"),
        (["mesh.tensr=2"], "did you mean 'tensor'"),
        (["mesh.tensor=two"], "not an integer"),
        (["--hosts", "3"], "split evenly into 3 hosts"),
    ],
)
def test_cli_bad_input_exit_2(capsys, args, words):
    assert main(["mesh", "--devices", "8", *args]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_cli_subprocess_fresh_process_sets_devices():
    """`--devices` works in a fresh process (before jax is imported) and errors carry no traceback."""
    env = {"PATH": "", "JAX_PLATFORMS": "cpu"}
    ok = subprocess.run(
        [sys.executable, "-m", "meshrun.cli.main", "mesh", "--devices", "4", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["shape"]["data"] == 4
    bad = subprocess.run(
        [sys.executable, "-m", "meshrun.cli.main", "mesh", "--devices", "4", "mesh.tensr=2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "tensor" in bad.stderr
