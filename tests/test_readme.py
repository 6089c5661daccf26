"""The README's Python example runs as written."""

import re
from pathlib import Path


def test_readme_python_example(capsys):
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README has no python example"
    exec(compile(blocks[0], "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "tensor groups: [0,1] [2,3] [4,5] [6,7]" in out
    assert "P('pipe', 'data', 'tensor') (2, 32, 128)" in out
    assert "(2, 32, 128)" in out
