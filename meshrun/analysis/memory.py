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


# ---------------------------------------------------------------- live bytes of the temp allocation

_ALLOC = re.compile(r"^allocation \d+: size (\d+),(.*)$")
_VALUE = re.compile(r"^ value: <\d+ (\S+?)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\)")
_RANGE = re.compile(r"^\s+(\S+):(\d+)-(\d+)$")


def live_temp_peak(buffer_assignment: str, live_range: str) -> dict[str, int]:
    """{extent, peak}: the preallocated temp allocation's size (what `memory_analysis().temp` reports)
    and the most bytes of it that are live at one point of the schedule (the union of the live values'
    [offset, offset + size) ranges), from XLA's `*-buffer-assignment.txt` and `*-live-range.txt` dumps
    of one module. extent - peak are the holes the heap packing left: they depend on the order and
    sizes of everything else in the program, not on what the program must hold."""
    extent, values = _temp_values(buffer_assignment)
    ranges = _live_ranges(live_range)
    if not values or not ranges:
        raise ValueError("no preallocated temp values or live ranges in the dumps (XLA's dump format changed?)")
    missing = [n for n in values if n not in ranges]
    if missing:
        raise ValueError(f"{len(missing)} temp values without a live range in the dump, e.g. {missing[:3]}")
    return {"extent": extent, "peak": _union_peak(values, ranges)}


def _temp_values(buffer_assignment: str) -> tuple[int, dict[str, tuple[int, int]]]:
    """(size of the preallocated temp allocation, {value: (offset, size)} of the values in it) from a
    `*-buffer-assignment.txt` dump."""
    values: dict[str, tuple[int, int]] = {}
    extent, inside = 0, False
    for line in buffer_assignment.splitlines():
        a = _ALLOC.match(line)
        if a:
            inside = "preallocated-temp" in a.group(2)
            extent = int(a.group(1)) if inside else extent
            continue
        v = _VALUE.match(line) if inside else None
        if v:
            name = v.group(1) if "{" in v.group(1) else v.group(1) + "{}"
            values[name] = (int(v.group(3)), int(v.group(2)))
    return extent, values


def _live_ranges(live_range: str) -> dict[str, tuple[int, int]]:
    """{value: (first, last) point of the schedule where it is live} from a `*-live-range.txt` dump."""
    ranges: dict[str, tuple[int, int]] = {}
    section = live_range.partition("BufferLiveRange:")[2]
    for line in section.splitlines():
        r = _RANGE.match(line)
        if r:
            ranges[r.group(1)] = (int(r.group(2)), int(r.group(3)))
        elif line.strip() and not line.startswith(" "):
            break
    return ranges


def _union_peak(values: dict[str, tuple[int, int]], ranges: dict[str, tuple[int, int]]) -> int:
    """The most bytes live at one point: the largest union of the live values' [offset, offset + size)."""
    events = sorted({t for s, e in ranges.values() for t in (s, e)})
    peak = 0
    for t in events:  # the union only changes where a range starts or ends
        live = sorted((o, o + n) for name, (o, n) in values.items() if ranges[name][0] <= t <= ranges[name][1])
        used, end = 0, 0
        for lo, hi in live:
            if hi > end:
                used += hi - max(lo, end)
                end = hi
        peak = max(peak, used)
    return peak
