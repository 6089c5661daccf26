"""Device and host bytes of a compiled step, per memory space.

`compiled.memory_analysis()` has device fields (argument, output, temp, alias) and host_* fields.
Where the backend fills the host_* fields (GPU, TPU) they are used as they are. XLA:CPU leaves them
at 0 and counts host-resident arguments and outputs in the device fields (measured, jax 0.10.2), so
there the host share is read off the entry computation layout: an entry parameter or result placed
in pinned host memory has memory space 5 in its layout (`f32[8,64]{1,0:S(5)}`), and
`input_output_alias` says which host results reuse a donated host argument's buffer.

What XLA:CPU cannot show: JAX lowers a `device_put` to another memory kind INSIDE a jitted function
to nothing on CPU (the transfer custom call is emitted for GPU and TPU only), so an offloading remat
policy compiles on CPU exactly as its non-offloading twin, and host temp bytes stay 0.
"""

from __future__ import annotations

import re

from meshrun.analysis.hlo import shape_bytes

_ARRAY_LAYOUT = re.compile(r"[a-z][a-z0-9]*\[[0-9,]*\](?:\{[^}]*\})?")
_ALIAS = re.compile(r"\{(\d+)\}:\s*\((\d+),")
HOST_SPACE = ":S(5)"  # XLA's memory space 5: host memory


def _entry_layout(text: str) -> tuple[list[tuple[int, bool]], list[tuple[int, bool]]]:
    """([(bytes, on host)] of the entry parameters, the same of the results) on one device."""
    start = text.find("entry_computation_layout={")
    if start < 0:
        return [], []
    i = depth = start + len("entry_computation_layout=")
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            break
    body = text[i + 1 : j]
    args, _, results = body.partition(")->")
    one = lambda s: [(shape_bytes(a)[0], HOST_SPACE in a) for a in _ARRAY_LAYOUT.findall(s)]
    return one(args), one(results)


def host_layout_bytes(text: str) -> dict[str, int]:
    """Host argument / output / alias bytes on one device, from the compiled HLO text."""
    args, results = _entry_layout(text)
    head = text[: text.find("\n")]
    alias = 0
    m = re.search(r"input_output_alias=\{(.*?)\s\}", head)
    for out, arg in _ALIAS.findall(m.group(1) if m else ""):
        o, a = int(out), int(arg)
        if o < len(results) and a < len(args) and results[o][1] and args[a][1]:
            alias += results[o][0]
    return {
        "argument": sum(b for b, h in args if h),
        "output": sum(b for b, h in results if h),
        "alias": alias,
    }


def memory_spaces(compiled) -> dict[str, int]:
    """{device, host, device_argument, host_argument, temp, host_temp}: bytes per device of one
    compiled step; device/host = argument + output + temp - alias in that memory space."""
    ma = compiled.memory_analysis()
    f = lambda name: int(getattr(ma, name, 0) or 0)
    arg, out, temp, alias = (f(f"{k}_size_in_bytes") for k in ("argument", "output", "temp", "alias"))
    host = {k: f(f"host_{k}_size_in_bytes") for k in ("argument", "output", "temp", "alias")}
    if not any(host.values()):  # XLA:CPU: host buffers are counted in the device fields
        host = host_layout_bytes(compiled.as_text()) | {"temp": 0}
        arg, out, alias = arg - host["argument"], out - host["output"], alias - host["alias"]
    return {
        "device": arg + out + temp - alias,
        "host": host["argument"] + host["output"] + host["temp"] - host["alias"],
        "device_argument": arg,
        "host_argument": host["argument"],
        "temp": temp,
        "host_temp": host["temp"],
    }
