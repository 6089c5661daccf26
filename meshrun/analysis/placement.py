"""Transfers between memory kinds in a lowered program, and the loops they run in.

XLA:CPU emits no transfers between memory kinds (a `jax.device_put` to another memory space lowers
to nothing there), so a CPU compile cannot show them. Lowered for a GPU instead
(`jit(...).trace(...).lower(lowering_platforms=("cuda",))`, no GPU needed), each transfer is an
`annotate_device_placement` custom call whose `_xla_buffer_placement` says where its result goes
("device" or "pinned_host"), and the entry function's arguments carry `mhlo.memory_kind`. This
module reads both off the StableHLO text: `loops` gives, for every `stablehlo.while`, the
transfers its body runs once per iteration (through the functions it calls, not counting nested
loops), and `argument_kinds` the memory kind of every entry argument.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

_FUNC = re.compile(r"^\s*func\.func\s+(?:public\s+|private\s+)?@([\w.$-]+)")
_CALL = re.compile(r"\bcall @([\w.$-]+)")
_PLACE = re.compile(r'annotate_device_placement.*?_xla_buffer_placement = "(\w+)"')


@dataclass(frozen=True)
class Loop:
    """One `stablehlo.while`: the function it sits in, and the transfers per iteration by
    destination ("device": host -> device, "pinned_host": device -> host)."""

    function: str
    transfers: dict[str, int]
    nested: int  # while loops directly inside its body (their transfers are not counted here)


def _functions(text: str) -> dict[str, list[str]]:
    funcs: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            name = m.group(1)
            funcs[name] = []
        if name is not None:
            funcs[name].append(line)
    return funcs


def _scan(lines: list[str]) -> tuple[Counter, list[str], list[tuple[Counter, list[str], int]]]:
    """(transfers and calls outside any loop, [per top-level loop: transfers, calls, nested loops])."""
    free, free_calls, loops = Counter(), [], []
    stack: list[list] = []  # open loops: [depth at open, transfers, calls, nested]
    depth = 0
    for line in lines:
        target = stack[-1] if stack else None
        for kind in _PLACE.findall(line):
            (target[1] if target else free)[kind] += 1
        (target[2] if target else free_calls).extend(_CALL.findall(line))
        if "stablehlo.while" in line:
            if target:
                target[3] += 1
            stack.append([depth, Counter(), [], 0])
        depth += line.count("{") - line.count("}")
        while stack and depth <= stack[-1][0] and "}" in line:
            d, transfers, calls, nested = stack.pop()
            loops.append((transfers, calls, nested))
    return free, free_calls, loops


def loops(text: str) -> list[Loop]:
    """Every while loop of a lowered (StableHLO) program with the transfers one iteration runs."""
    funcs = _functions(text)
    scanned = {name: _scan(lines) for name, lines in funcs.items()}
    memo: dict[str, Counter] = {}

    def straight(name: str, seen: frozenset = frozenset()) -> Counter:
        """Transfers a call of `name` runs outside loops (its callees' too)."""
        if name in memo:
            return memo[name]
        free, calls, _ = scanned.get(name, (Counter(), [], []))
        total = Counter(free)
        for c in calls:
            if c not in seen:
                total += straight(c, seen | {name})
        memo[name] = total
        return total

    out = []
    for name, (_, _, found) in scanned.items():
        for transfers, calls, nested in found:
            total = Counter(transfers)
            for c in calls:
                total += straight(c)
            out.append(Loop(name, dict(total), nested))
    return out


def argument_kinds(text: str) -> list[str]:
    """mhlo.memory_kind of each argument of the entry function (`main`), in order ("" if none)."""
    head = next((line for line in text.splitlines() if re.search(r"func\.func\s+public\s+@main\(", line)), "")
    args = re.split(r"%arg\d+: ", head.split(") -> ")[0])[1:]
    return [m.group(1) if (m := re.search(r'mhlo\.memory_kind = "(\w+)"', a)) else "" for a in args]
