"""The Python example of docs/mesh.md (the mesh helpers in your own JAX code) runs as written."""

import re
from pathlib import Path


def test_readme_python_example(capsys):
    text = (Path(__file__).resolve().parents[1] / "docs" / "mesh.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "docs/mesh.md has no python example"
    exec(compile(blocks[0], "docs/mesh.md", "exec"), {})
    out = capsys.readouterr().out
    assert "tensor groups: [0,1] [2,3] [4,5] [6,7]" in out
    assert "P('pipe', 'data', 'tensor') (2, 32, 128)" in out
    assert "(2, 32, 128)" in out
