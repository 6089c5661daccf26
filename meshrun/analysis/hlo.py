"""Collectives in compiled HLO: op, bytes, and the mesh axes they run over.

`jax.jit(f).lower(*args).compile().as_text()` lists every collective after SPMD partitioning.
Replica groups hold partition ids (positions in `mesh.devices.flat`); the axes whose coordinate
varies inside a group are the axes the collective runs over. XLA combines collectives into tuples
(`(f32[..], f32[..]) all-reduce(`): each tuple counts once, its bytes are the sum of its parts.

A collective inside a while loop appears once in the text but runs once per iteration:
`multiplicity` gives each computation's runs per execution from the loops' known trip counts, and
every `Collective` carries it as `per_step`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from meshrun.parallel.sharding import DP_AXES, REPLICA

OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "ragged-all-to-all")
_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_LINE = re.compile(
    r"=\s*(?P<shape>\(.*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>" + "|".join(OPS) + r")(?:-start)?\("
)  # tuple shapes may hold /*index=5*/
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_WHILE = re.compile(r"\bwhile\(.*?condition=%?(?P<cond>[\w.\-]+), body=%?(?P<body>[\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_ENTRY = re.compile(r"^ENTRY\s+%?([\w.\-]+)", re.M)


@dataclass(frozen=True)
class Collective:
    op: str
    bytes: int  # result bytes on one device (tuple parts summed)
    axes: tuple[str, ...]  # mesh axes the collective spans ( () if unknown / trivial )
    parts: int  # number of arrays (tuple size)
    in_loop: bool  # inside a while-loop body computation
    per_step: int = 1  # runs per execution of the module (`multiplicity` of its computation)
    dtypes: tuple[str, ...] = ()  # element type of each part, e.g. ('bf16', 'f32')
    dims: tuple[tuple[int, ...], ...] = ()  # shape of each part
    promoted: bool = False  # a 16-bit reduction XLA:CPU widened to f32 (its reducer is `*_promoted`)
    name: str = ""  # the HLO instruction's name (e.g. 'all-reduce.6', 'ppermute.3'): profiler events carry it

    @property
    def wire_bytes(self) -> int:
        """Bytes as the program asks for them: where XLA:CPU widened a 16-bit all-reduce /
        reduce-scatter to f32 (`promoted`), its non-scalar f32 parts count 2 bytes an element, as
        backends with native 16-bit collectives (GPUs) move them. Scalars stay f32: the only scalar
        reductions in meshrun's step (loss, token counts) are f32 and XLA combines them into the
        same tuple."""
        if not self.promoted:
            return self.bytes
        half = sum(int(np.prod(d)) * 2 for t, d in zip(self.dtypes, self.dims, strict=True) if t == "f32" and d)
        return self.bytes - half


def shape_bytes(shape: str) -> tuple[int, int]:
    total, n = 0, 0
    for dt, dims in _ARRAY.findall(shape):
        if dt not in _DTYPE_BYTES:
            continue
        size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += size * _DTYPE_BYTES[dt]
        n += 1
    return total, n


def _shape_parts(shape: str) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]:
    parts = [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(shape)]
    parts = [p for p in parts if p[0] in _DTYPE_BYTES]
    return tuple(p[0] for p in parts), tuple(p[1] for p in parts)


def data_parallel(colls: list[Collective]) -> list[Collective]:
    """The step's data-parallel reductions and gathers (its gradient "buckets"): all-reduce,
    reduce-scatter and all-gather over a data-parallel axis ('data', 'expert', HSDP's 'replica'), without those made
    of scalars only (loss, token counts: at most 8 bytes a part). Expert all-to-alls are not DP."""
    ops = ("all-reduce", "reduce-scatter", "all-gather")
    return [c for c in colls if c.op in ops and set(c.axes) & {REPLICA, *DP_AXES} and c.bytes > 8 * c.parts]


def _iota_groups(text: str) -> list[list[int]] | None:
    # replica_groups=[G,S]<=[d0,d1,...]T(perm)  (iota form)
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", text)
    if not m:
        return None
    g, s = int(m.group(1)), int(m.group(2))
    dims = [int(x) for x in m.group(3).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(4):
        ids = ids.transpose([int(x) for x in m.group(4).split(",")])
    return ids.reshape(g, s).tolist()


def _mesh_groups(text: str) -> list[list[int]] | None:
    # replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([2,2,2]T(1,0,2)) {'axis_0'}
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]((?:, device_ids=[^{]*)?) \{([^}]*)\}", text)
    if not m:
        return None
    pairs = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    names, dims = [p[0] for p in pairs], [int(p[1]) for p in pairs]
    n = int(np.prod(dims))
    dev = np.arange(n)
    iota = re.search(r"\[([0-9,]+)\](?:T\(([0-9,]+)\))?", m.group(2))
    explicit = re.search(r"device_ids=\{([0-9,]+)\}", m.group(2))
    if explicit:
        dev = np.array([int(x) for x in explicit.group(1).split(",")])
    elif iota:
        dev = np.arange(n).reshape([int(x) for x in iota.group(1).split(",")])
        if iota.group(2):
            dev = dev.transpose([int(x) for x in iota.group(2).split(",")])
        dev = dev.reshape(-1)
    listed = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(3))]
    ids = np.moveaxis(dev.reshape(dims), listed, list(range(len(dims) - len(listed), len(dims))))
    size = int(np.prod([dims[k] for k in listed])) if listed else 1
    return ids.reshape(-1, size).tolist()


def _groups(line: str) -> list[list[int]]:
    meshg = _mesh_groups(line)
    if meshg is not None:
        return meshg
    iota = _iota_groups(line)
    if iota is not None:
        return iota
    m = re.search(r"(?:replica_groups|source_target_pairs)=\{((?:\{[0-9,]*\},?)*)\}", line)
    if not m:
        return []
    return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]


def _axes_of(groups: list[list[int]], mesh_shape: dict[str, int] | None) -> tuple[str, ...]:
    if not mesh_shape or not groups:
        return ()
    names, dims = list(mesh_shape), list(mesh_shape.values())
    varying: set[str] = set()
    for g in groups:
        if len(g) < 2:
            continue
        coords = np.array(np.unravel_index(np.array(g), dims)).T
        for k, name in enumerate(names):
            if len(set(coords[:, k])) > 1:
                varying.add(name)
    return tuple(n for n in names if n in varying)


def computations(text: str) -> dict[str, str]:
    """Computation name -> its body (the lines between its header and the closing brace)."""
    comps, name, buf = {}, None, []
    for line in text.splitlines():
        head = re.match(r"(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            name, buf = head.group(1), []
            comps[name] = buf
        elif name is not None:
            buf.append(line)
    return {k: "\n".join(v) for k, v in comps.items()}


def _calls(comps: dict[str, str]) -> dict[str, list[tuple[str, int]]]:
    """Callee -> [(caller, runs of the callee per run of the caller)], one entry per calling line.
    A while loop runs its body n times and its condition n + 1 times (n: the known trip count, 1
    when unknown); every other reference (fusion, call, conditional branch, reduction) counts once."""
    callers: dict[str, list[tuple[str, int]]] = {}
    for name, body in comps.items():
        for line in body.splitlines():
            w = _WHILE.search(line)
            trip = _TRIP.search(line) if w else None
            n = int(trip.group(1)) if trip else 1
            for ref in dict.fromkeys(re.findall(r"%([\w.\-]+)", line)):
                if ref not in comps or ref == name:
                    continue
                k = 1
                if w and ref == w.group("body"):
                    k = n
                elif w and ref == w.group("cond"):
                    k = n + 1
                callers.setdefault(ref, []).append((name, k))
    return callers


def multiplicity(text: str) -> dict[str, int]:
    """How many times each computation runs per execution of the module: the product of the trip
    counts of the while loops around it, summed over its call sites. Conditional branches count as
    taken (each once per run of the conditional); a loop of unknown trip count counts once. The entry
    computation runs once (without an ENTRY line: every computation that nothing calls); computations
    it never reaches run 0 times."""
    return _runs(computations(text), _ENTRY.search(text))


def _runs(comps: dict[str, str], entry: re.Match | None) -> dict[str, int]:
    callers = _calls(comps)
    roots = {entry.group(1)} if entry else {c for c in comps if c not in callers}
    memo: dict[str, int] = {}

    def runs(c: str, seen: frozenset = frozenset()) -> int:
        if c in memo:
            return memo[c]
        if c in seen:
            raise ValueError(f"HLO call graph has a cycle through {c}")
        memo[c] = (1 if c in roots else 0) + sum(k * runs(p, seen | {c}) for p, k in callers.get(c, ()))
        return memo[c]

    return {c: runs(c) for c in comps}


_OP = re.compile(
    r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(?P<shape>\(.*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+(?P<op>[a-z\-]+)\("
)  # one instruction: its result shape and opcode


def op_bytes_per_step(hlo_text: str, ops: tuple[str, ...] = ("copy", "copy-start"), loops_only: bool = False) -> int:
    """Result bytes of the given ops, each times the runs of its computation per step (conditional
    branches count as taken): e.g. how many bytes the compiled program copies per step
    (`loops_only`: inside while loops only)."""
    comps, total = computations(hlo_text), 0
    runs = _runs(comps, _ENTRY.search(hlo_text))
    looped = _in_loop(comps) if loops_only else set(comps)
    for name, body in comps.items():
        if name not in looped:
            continue
        for line in body.splitlines():
            m = _OP.match(line)
            if m and m.group("op") in ops:
                total += runs[name] * shape_bytes(m.group("shape"))[0]
    return total


_NAME = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=")


def opcodes(hlo_text: str) -> dict[str, tuple[str, str]]:
    """Instruction name -> (opcode, name of its first operand or ''), over every computation: what a
    profiler event's `hlo_op` was (e.g. 'conditional.23' -> ('conditional', ...))."""
    out = {}
    for line in hlo_text.splitlines():
        m, n = _OP.match(line), _NAME.match(line)
        if m and n:
            arg = re.match(r"\s*%([\w.\-]+)", line[m.end() :])
            out[n.group(1)] = (m.group("op"), arg.group(1) if arg else "")
    return out


_NAMED = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*[a-z][a-z0-9]*\[([0-9,]*)\]")


def dot_flops_per_step(hlo_text: str) -> int:
    """FLOPs of every `dot` (2 x result elements x contracted size), each times the runs of its
    computation per step: the matmul work a compiled step really does, recomputation included
    (XLA's cost_analysis counts a loop body once, whatever its trip count)."""
    comps, total = computations(hlo_text), 0
    runs = _runs(comps, _ENTRY.search(hlo_text))
    for name, body in comps.items():
        named = (m for m in map(_NAMED.match, body.splitlines()) if m)
        dims = {m.group(1): [int(d) for d in m.group(2).split(",") if d] for m in named}
        for line in body.splitlines():
            m = _OP.match(line)
            if not (m and m.group("op") == "dot" and runs[name]):
                continue
            lhs = re.search(r"\bdot\(%([\w.\-]+)", line).group(1)
            contracted = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", line).group(1)
            k = int(np.prod([dims[lhs][int(i)] for i in contracted.split(",") if i]))
            out = int(np.prod([int(d) for d in _ARRAY.search(m.group("shape")).group(2).split(",") if d]))
            total += runs[name] * 2 * out * k
    return total


def _in_loop(comps: dict[str, str]) -> set[str]:
    """Computations run inside a while loop: loop bodies and everything they call, transitively."""
    todo = [b for body in comps.values() for b in re.findall(r"\bbody=%?([\w.\-]+)", body)]
    seen: set[str] = set()
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        todo.extend(r for r in re.findall(r"%([\w.\-]+)", comps[c]) if r in comps)
    return seen


def collectives(hlo_text: str, mesh_shape: dict[str, int] | None = None) -> list[Collective]:
    """Every collective in compiled HLO text. `mesh_shape`: ordered {axis: size} (dict(mesh.shape))."""
    comps = computations(hlo_text)
    looped = _in_loop(comps)
    runs = _runs(comps, _ENTRY.search(hlo_text))
    out = []
    for name, body in comps.items():
        for line in body.splitlines():
            m = _LINE.search(line)
            if not m:
                continue
            nbytes, parts = shape_bytes(m.group("shape"))
            axes = _axes_of(_groups(line), mesh_shape)
            dts, dims = _shape_parts(m.group("shape"))
            promoted = bool(re.search(r"to_apply=%?[\w.\-]+_promoted\b", line))
            inst = _NAME.match(line)
            c = Collective(m.group("op"), nbytes, axes, parts, name in looped, runs[name], dts, dims, promoted,
                           inst.group(1) if inst else "")  # fmt: skip
            out.append(c)
    return out


TICK_OPS = ("while", "conditional")  # a pipeline phase's loop, or a tick's op conditionals


def overlappable(hlo_text: str, op: str = "reduce-scatter", work: tuple[str, ...] = TICK_OPS) -> list[int]:
    """For each `op` (its async start, if split) in any computation, how many instructions of that
    computation whose opcode is in `work` are neither its operands' producers nor its users
    (transitively): the work a latency-hiding scheduler may run beside it. A reduction after the
    tick loops that depends on every tick gets 0; a final chunk's reduction inside a later tick
    (`pipeline.overlap_grad_reduce`) gets that tick's op conditionals (F, B, W)."""
    out = []
    for body in computations(hlo_text).values():
        deps: dict[str, set[str]] = {}
        kind: dict[str, str] = {}
        for line in body.splitlines():
            m, n = _OP.match(line), _NAME.match(line)
            if not (m and n):
                continue
            kind[n.group(1)] = m.group("op")
            deps[n.group(1)] = {r for r in re.findall(r"%([\w.\-]+)", line[m.end() :]) if r in kind}
        if not any(k in (op, f"{op}-start") for k in kind.values()):
            continue
        users: dict[str, set[str]] = {k: set() for k in deps}
        for k, ds in deps.items():
            for d in ds:
                users[d].add(k)

        def reach(start: str, edges: dict[str, set[str]]) -> set[str]:
            seen, todo = set(), [start]
            while todo:
                for x in edges[todo.pop()]:
                    if x not in seen:
                        seen.add(x)
                        todo.append(x)
            return seen

        for name, k in kind.items():
            if k in (op, f"{op}-start"):
                tied = reach(name, deps) | reach(name, users)
                out.append(sum(1 for x, kx in kind.items() if kx in work and x not in tied and x != name))
    return out
