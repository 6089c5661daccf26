"""Pipeline schedule tables as data: placing per-stage op orders on ticks, dependency checks, buffer
sizes and bubble math, for any schedule (pure Python, no JAX). Which schedules exist is `registry.py`.

Two views of one schedule, both lists of ticks, each a list of `p` per-stage cells:
* per-op timeline (`place`, `place_split`): a cell is one `Task` or None (idle); every op takes one
  tick. The view for charts and bubble math, and what the per-op executor plays as is.
* lockstep (`lockstep(table)`): a cell is a `Step(fwd, bwd)`, at most one forward and one backward
  per stage per tick, as the lockstep executor runs them; a value sent at tick t is usable at t+1.

Virtual stages: chunk c of stage s holds virtual stage k (`vstage`: c*p + s for Megatron's
interleaving, or a V: s and 2p - 1 - s). F(mb, k) needs F(mb, k-1); B(mb, k) needs B(mb, k+1) and
F(mb, k); W(mb, k) needs B(mb, k) (Qi et al. 2023: B is the input gradient, W the weight gradients).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Literal, NamedTuple

# which virtual stage chunk c of stage s holds: Megatron's loop (c*p + s) or a V (s, then 2p-1-s)
ChunkPlacement = Literal["loop", "v"]


@dataclass(frozen=True)
class Task:
    kind: str  # 'F' forward, 'B' backward (input and weight gradients; zb-h1: input only), 'W' weight grads
    mb: int
    chunk: int = 0

    def label(self, v: int = 1) -> str:
        return f"{self.kind}{self.mb}" + (f"c{self.chunk}" if v > 1 else "")


class Step(NamedTuple):
    """One lockstep cell: the forward and the backward a stage runs in one tick (fwd first)."""

    fwd: Task | None
    bwd: Task | None


class BufferSizes(NamedTuple):
    residuals: int  # (mb, chunk) pairs whose F ran and whose B has not finished (= max_in_flight)
    fwd_inbox: int  # received activations held past their arrival tick before their F consumes them
    bwd_inbox: int  # received gradients held past their arrival tick before their B consumes them


class ScheduleError(ValueError):
    """A table that breaks the schedule rules (missing/duplicate op, dependency out of order)."""


# ---------------------------------------------------------------- placing per-stage orders on ticks


class Table(list):
    """A per-op or lockstep timeline (a list of ticks, each a list of `p` cells) and its chunk
    placement: 'loop' (chunk c of stage s is virtual stage c*p + s) or 'v' (two chunks: stage s holds
    virtual stages s and 2p - 1 - s)."""

    placement: ChunkPlacement = "loop"

    def __init__(self, rows=(), placement: ChunkPlacement = "loop"):
        super().__init__(rows)
        self.placement = placement


def vstage(chunk: int, stage: int, p: int, placement: ChunkPlacement = "loop") -> int:
    """The virtual stage chunk `chunk` of `stage` holds."""
    if placement == "v":
        return stage if chunk == 0 else 2 * p - 1 - stage
    return chunk * p + stage


def chunk_of(k: int, p: int, placement: ChunkPlacement = "loop") -> tuple[int, int]:
    """(stage, chunk) of virtual stage k (inverse of `vstage`)."""
    if placement == "v":
        return (k, 0) if k < p else (2 * p - 1 - k, 1)
    return k % p, k // p


def _placement(table) -> str:
    return getattr(table, "placement", "loop")


def _deps(t: Task, s: int, p: int, v: int, placement: ChunkPlacement = "loop") -> list[tuple[str, int, int]]:
    """Keys (kind, mb, virtual stage) of the ops `t` on stage `s` needs."""
    k = vstage(t.chunk, s, p, placement)
    if t.kind == "W":
        return [("B", t.mb, k)]
    if t.kind == "F":
        return [("F", t.mb, k - 1)] if k > 0 else []
    return [("F", t.mb, k)] + ([("B", t.mb, k + 1)] if k < v * p - 1 else [])


def place(orders: list[list[Task]], p: int, v: int, placement: ChunkPlacement = "loop") -> Table:
    """Per-op timeline: each stage runs its order as soon as the inputs exist (one op per tick)."""
    done: dict[tuple[str, int, int], int] = {}
    ptr, table = [0] * p, Table(placement=placement)
    while any(ptr[s] < len(orders[s]) for s in range(p)):
        t, row = len(table), [None] * p
        for s in range(p):
            if ptr[s] < len(orders[s]):
                op = orders[s][ptr[s]]
                if all(done.get(d, t) < t for d in _deps(op, s, p, v, placement)):
                    row[s] = op
        if not any(row):
            raise ScheduleError(f"deadlock at tick {t}: next ops {[o[q] for o, q in zip(orders, ptr) if q < len(o)]}")
        for s, op in enumerate(row):
            if op is not None:
                done[(op.kind, op.mb, vstage(op.chunk, s, p, placement))] = t
                ptr[s] += 1
        table.append(row)
    return table


def place_split(orders: list[list[Task]], p: int, m: int, v: int = 1, *, defer: bool = True, limit: int | None = None,
                placement: ChunkPlacement = "loop") -> Table:  # fmt: skip
    """Per-op timeline with each backward split into B (input gradient) and W (weight gradients):
    each stage runs its order of F and B as soon as inputs exist and a pending W whenever the next
    F/B must wait. `defer` (zero bubble): W's are deferred (B first keeps the critical path short, so
    the cool-down is filled with W's), but a stage never holds more than `limit` (default min(p, m))
    microbatch chunks whose W has not run. `defer=False`: each W runs in the tick right after its B."""
    done: dict[tuple[str, int, int], int] = {}
    ptr, held, pend = [0] * p, [0] * p, [[] for _ in range(p)]  # held: F run, W not yet
    table = Table(placement=placement)
    limit = min(p, m) if limit is None else limit
    while any(ptr[s] < len(orders[s]) or pend[s] for s in range(p)):
        t, row = len(table), [None] * p
        for s in range(p):
            op = orders[s][ptr[s]] if ptr[s] < len(orders[s]) else None
            ready = op is not None and all(done.get(d, t) < t for d in _deps(op, s, p, v, placement))
            if pend[s] and not defer:
                row[s] = pend[s][0]
            elif ready and not (op.kind == "F" and held[s] >= limit and pend[s]):
                row[s] = op
            elif pend[s]:
                row[s] = pend[s][0]
        if not any(row):
            raise ScheduleError(f"split-backward deadlock at tick {t}")
        for s, op in enumerate(row):
            if op is None:
                continue
            done[(op.kind, op.mb, vstage(op.chunk, s, p, placement))] = t
            if op.kind == "W":
                pend[s].pop(0)
                held[s] -= 1
            else:
                ptr[s] += 1
                held[s] += op.kind == "F"
                if op.kind == "B":
                    pend[s].append(Task("W", op.mb, op.chunk))
        table.append(row)
    return table


# ---------------------------------------------------------------- lockstep view


def _stage_orders(table) -> list[list[tuple[int, Task]]]:
    """(tick, task) per stage in execution order; a lockstep cell runs fwd before bwd."""
    p = len(table[0]) if table else 0
    out: list[list[tuple[int, Task]]] = [[] for _ in range(p)]
    for t, row in enumerate(table):
        for s, cell in enumerate(row):
            for op in cell if isinstance(cell, tuple) else (cell,):
                if op is not None:
                    out[s].append((t, op))
    return out


def lockstep(table: list[list[Task | None]]) -> list[list[Step]]:
    """Lockstep view of a per-op timeline: per tick and stage a `Step(fwd, bwd)`.

    Each stage keeps the order of its forwards and of its backwards from `table`, and a backward
    never overtakes a forward that precedes it in `table` (so GPipe keeps its flush); otherwise
    every op runs at the first tick whose inputs exist: F(mb, k) one tick after F(mb, k-1),
    B(mb, k) one tick after B(mb, k+1) and no earlier than F(mb, k) (same tick only in fwd-then-bwd
    order, i.e. at the last virtual stage). 1F1B becomes m + 2(p-1) ticks with stage s holding at
    most 2(p-1-s)+1 microbatches; interleaved becomes v*m + (v+1)*p - 2 ticks.
    """
    p, pl = len(table[0]), _placement(table)
    v = 1 + max(op.chunk for row in table for op in row if op is not None)
    fq: list[list[Task]] = [[] for _ in range(p)]
    bq: list[list[tuple[Task, int]]] = [[] for _ in range(p)]  # (B task, forwards that precede it)
    for s, ops in enumerate(_stage_orders(table)):
        for _, op in ops:
            (fq[s].append(op) if op.kind == "F" else bq[s].append((op, len(fq[s]))))
    done: dict[tuple[str, int, int], int] = {}
    fi, bi, out = [0] * p, [0] * p, Table(placement=pl)
    while any(fi[s] < len(fq[s]) or bi[s] < len(bq[s]) for s in range(p)):
        t = len(out)
        row = [_lockstep_step(fq[s], bq[s], fi[s], bi[s], done, t, s, p, v, pl) for s in range(p)]
        if not any(c.fwd or c.bwd for c in row):
            raise ScheduleError(f"lockstep deadlock at tick {t}")
        for s, c in enumerate(row):
            for op in c:
                if op is not None:
                    done[(op.kind, op.mb, vstage(op.chunk, s, p, pl))] = t
            fi[s] += c.fwd is not None
            bi[s] += c.bwd is not None
        out.append(row)
    return out


def _lockstep_step(fq: list[Task], bq: list[tuple[Task, int]], fi: int, bi: int, done: dict, t: int, s: int, p: int,
                   v: int, pl: str) -> Step:  # fmt: skip
    """Stage s's `Step` at tick t of `lockstep`: its next forward fq[fi] if that forward's inputs are
    done (`done`: op -> its tick) before t, and its next backward bq[bi] if the forwards that precede
    it have run (this tick's included) and its inputs are done before t (or are this tick's forward
    of the same microbatch and chunk)."""
    f = fq[fi] if fi < len(fq) else None
    if f is not None and not all(done.get(d, t) < t for d in _deps(f, s, p, v, pl)):
        f = None
    nf = fi + (f is not None)
    b, need = bq[bi] if bi < len(bq) else (None, 0)
    if b is not None:
        same = f is not None and f.mb == b.mb and f.chunk == b.chunk
        ok = need <= nf and all(done.get(d, t) < t or (same and d[0] == "F") for d in _deps(b, s, p, v, pl))
        b = b if ok else None
    return Step(f, b)


# ---------------------------------------------------------------- checks and buffer sizes


def check(table, p: int, m: int, v: int = 1) -> None:
    """Raise ScheduleError unless every (mb, virtual stage) has exactly one F and one B (and one W
    if the table has any: zb-h1) and all dependencies hold. Accepts per-op and lockstep tables."""
    when: dict[tuple[str, int, int], tuple[int, int]] = {}  # key -> (tick, position within the tick)
    pl = _placement(table)
    for t, row in enumerate(table):
        if len(row) != p:
            raise ScheduleError(f"tick {t} has {len(row)} stages, expected p={p}")
        for s, cell in enumerate(row):
            lock = isinstance(cell, tuple)
            if lock and (len(cell) != 2 or any(o is not None and o.kind != k for o, k in zip(cell, "FB"))):
                raise ScheduleError(f"tick {t} stage {s}: lockstep cell must be (F or None, B or None), got {cell}")
            for pos, op in enumerate(cell if lock else (cell,)):
                if op is None:
                    continue
                if op.kind not in "FBW" or not (0 <= op.mb < m and 0 <= op.chunk < v):
                    raise ScheduleError(f"tick {t} stage {s}: task {op} out of range (m={m}, v={v})")
                key = (op.kind, op.mb, vstage(op.chunk, s, p, pl))
                if key in when:
                    raise ScheduleError(f"{op} on stage {s} appears twice (ticks {when[key][0]} and {t})")
                when[key] = (t, pos)
    kinds = "FBW" if any(key[0] == "W" for key in when) else "FB"
    for mb in range(m):
        for k in range(v * p):
            for kind in kinds:
                if (kind, mb, k) not in when:
                    raise ScheduleError(f"missing {kind} of microbatch {mb} at virtual stage {k}")
    for (kind, mb, k), (t, pos) in when.items():
        s, c = chunk_of(k, p, pl)
        for d in _deps(Task(kind, mb, c), s, p, v, pl):
            dt = when.get(d)
            same_cell_ok = dt is not None and d[2] == k and dt == (t, 0) and pos == 1  # fwd before bwd
            if dt is None or not (dt[0] < t or same_cell_ok):
                raise ScheduleError(f"{kind}{mb} at virtual stage {k} (tick {t}) runs before its input {d} ({dt})")


def _residual_intervals(table, stage: int) -> dict[tuple[int, int], tuple[int, int]]:
    """(mb, chunk) -> (tick of F, tick of its last backward op: B, or W for zb-h1) on one stage."""
    iv: dict[tuple[int, int], list[int]] = {}
    for t, op in _stage_orders(table)[stage]:
        key = (op.mb, op.chunk)
        if op.kind == "F":
            iv[key] = [t, t]
        else:
            iv[key][1] = max(iv[key][1], t)
    return {k: (a, b) for k, (a, b) in iv.items()}


def _max_overlap(intervals) -> int:
    """Most closed intervals [a, b] covering one tick."""
    ev = sorted([(a, 0) for a, _ in intervals] + [(b, 1) for _, b in intervals])  # starts before ends
    cur = best = 0
    for _, end in ev:
        cur += -1 if end else 1
        best = max(best, cur)
    return best


def max_in_flight(table, stage: int) -> int:
    """Most (mb, chunk) pairs on `stage` whose F has run and whose B has not finished, i.e.
    max over ticks t of #{F tick <= t <= last backward tick}: the residual slots a stage needs when
    it writes a slot in F and frees it after B (fwd runs before bwd within a lockstep tick)."""
    return _max_overlap(_residual_intervals(table, stage).values())


def residual_slots(table, stage: int) -> dict[tuple[int, int], int]:
    """A slot in [0, max_in_flight) per (mb, chunk) such that no two live residuals share one."""
    return assign_slots(_residual_intervals(table, stage))


def stash_intervals(table, stage: int) -> dict[tuple[int, int], tuple[int, int]]:
    """(mb, chunk) -> (tick of B, tick of its W) on one stage: how long B's stash waits for W."""
    b = {(op.mb, op.chunk): t for t, op in _stage_orders(table)[stage] if op.kind == "B"}
    return {k: (b[k], t) for t, op in _stage_orders(table)[stage] if op.kind == "W" for k in [(op.mb, op.chunk)]}


def assign_slots(intervals: dict) -> dict:
    """A buffer slot per key of {key: (first tick, last tick)} (closed intervals) such that no two
    keys live at one tick share a slot; uses as many slots as the most intervals covering one tick."""
    free: list[int] = []
    busy: list[tuple[int, int]] = []  # (last tick, slot)
    out, n = {}, 0
    for key, (a, b) in sorted(intervals.items(), key=lambda kv: kv[1]):
        while busy and busy[0][0] < a:
            heapq.heappush(free, heapq.heappop(busy)[1])
        slot = heapq.heappop(free) if free else n
        n = max(n, slot + 1)
        out[key] = slot
        heapq.heappush(busy, (b, slot))
    return out


def inbox_intervals(table, stage: int) -> tuple[dict, dict]:
    """What `stage` receives, per (mb, chunk): (tick it arrives, tick its consumer runs), for the
    activations its F's take and for the gradients its B's take. A value sent at tick t arrives at
    t+1 (per-op and lockstep tables)."""
    p, pl = len(table[0]), _placement(table)
    when: dict[tuple[str, int, int], int] = {}
    for s, ops in enumerate(_stage_orders(table)):
        for t, op in ops:
            when[(op.kind, op.mb, vstage(op.chunk, s, p, pl))] = t
    v = 1 + max(k for _, _, k in when) // p
    fin, bin_ = {}, {}
    for t, op in _stage_orders(table)[stage]:
        k = vstage(op.chunk, stage, p, pl)
        if op.kind == "F" and k > 0:
            fin[(op.mb, op.chunk)] = (when[("F", op.mb, k - 1)] + 1, t)
        elif op.kind == "B" and k < v * p - 1:
            bin_[(op.mb, op.chunk)] = (when[("B", op.mb, k + 1)] + 1, t)
    return fin, bin_


def buffer_sizes(table, stage: int) -> BufferSizes:
    """Fixed buffer sizes for `stage`. Inbox slots count values that arrive (one tick after the
    producer's op) before the tick that consumes them; a value consumed in its arrival tick needs
    none (it is read straight from the ppermute result)."""
    fin, bin_ = inbox_intervals(table, stage)
    held = lambda iv: _max_overlap([(a, b - 1) for a, b in iv.values() if a <= b - 1])
    return BufferSizes(max_in_flight(table, stage), held(fin), held(bin_))


def lockstep_arrays(lock: list[list[Step]]) -> dict[str, list[list[int]]]:
    """Integer arrays [tick][stage] for an executor: f_mb, f_chunk, f_slot, b_mb, b_chunk, b_slot
    (-1 where idle). Slots index each stage's residual buffer (see `residual_slots`)."""
    p = len(lock[0])
    slots = [residual_slots(lock, s) for s in range(p)]
    out: dict[str, list[list[int]]] = {k: [] for k in ("f_mb", "f_chunk", "f_slot", "b_mb", "b_chunk", "b_slot")}
    for row in lock:
        for pre, idx in (("f", 0), ("b", 1)):
            ops = [c[idx] for c in row]
            out[f"{pre}_mb"].append([-1 if o is None else o.mb for o in ops])
            out[f"{pre}_chunk"].append([-1 if o is None else o.chunk for o in ops])
            out[f"{pre}_slot"].append([-1 if o is None else slots[s][(o.mb, o.chunk)] for s, o in enumerate(ops)])
    return out


# ---------------------------------------------------------------- bubble math


def stage_bubbles(table, f: float = 1.0, b: float | None = None, w: float | None = None) -> list[float]:
    """Idle / makespan per stage when each stage runs its ops in table order as soon as their inputs
    are done, with costs f (forward), b (backward, default 2f) and, for tables with W ops (zb-h1),
    b = w = f by default (the same backward work, split in two). Zero communication latency."""
    split = any(op.kind == "W" for ops in _stage_orders(table) for _, op in ops)
    b = (f if split else 2.0 * f) if b is None else b
    cost = {"F": f, "B": b, "W": f if w is None else w}
    p, pl = len(table[0]), _placement(table)
    v = 1 + max(op.chunk for ops in _stage_orders(table) for _, op in ops)
    free, busy, fin = [0.0] * p, [0.0] * p, {}
    for row in table:  # ticks are a topological order, so one pass suffices
        for s, cell in enumerate(row):
            for op in cell if isinstance(cell, tuple) else (cell,):
                if op is None:
                    continue
                start = max([free[s]] + [fin[d] for d in _deps(op, s, p, v, pl)])
                free[s] = fin[(op.kind, op.mb, vstage(op.chunk, s, p, pl))] = start + cost[op.kind]
                busy[s] += cost[op.kind]
    span = max(free)
    return [(span - x) / span for x in busy]


def bubble_fraction(table, f: float = 1.0, b: float | None = None, w: float | None = None) -> float:
    """Mean over stages of idle time / makespan (see `stage_bubbles`)."""
    per = stage_bubbles(table, f, b, w)
    return sum(per) / len(per)


def render(table, v: int = 1) -> str:
    """Text chart: rows = stages, columns = ticks; '.' idle; lockstep cells as 'F3+B1'."""

    def lab(cell) -> str:
        if isinstance(cell, tuple):
            parts = [o.label(v) for o in cell if o is not None]
            return "+".join(parts) if parts else "."
        return "." if cell is None else cell.label(v)

    cells = [[lab(c) for c in row] for row in table]
    wd = max([len(x) for row in cells for x in row] + [len(str(len(table) - 1))])
    p = len(table[0]) if table else 0
    head = "tick    " + " ".join(f"{t:>{wd}}" for t in range(len(table)))
    rows = [f"stage {s:<2}" + " ".join(f"{row[s]:>{wd}}" for row in cells) for s in range(p)]
    return "\n".join([head] + rows)


def grad_final_ticks(table, v: int) -> tuple[int, ...]:
    """Per chunk, the last tick of any stage that adds to its gradient sums (a backward; per-op: B or
    W) in a per-op table, or a lockstep table (`schedules.lockstep`)."""
    last = [-1] * v
    for t, row in enumerate(table):
        for cell in row:
            if cell is None:
                continue
            if hasattr(cell, "bwd"):  # lockstep cell: (fwd, bwd)
                if cell.bwd is not None:
                    last[cell.bwd.chunk] = t
            elif cell.kind != "F":
                last[cell.chunk] = t
    return tuple(last)


def drain(lc: int, n: int) -> tuple[int, int]:
    """(layers per tick, ticks) pipeline.overlap_grad_reduce reduces a final chunk of lc layers in over
    the n ticks after its cut: k = ceil(lc / n) a tick, over ceil(lc / k) ticks (`StageRun.segments`)."""
    k = -(-lc // n)
    return k, -(-lc // k)


def grad_cuts(final: tuple[int, ...], ticks: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """(tick, chunks) where chunks' gradients are final before the last tick (`TickProgram.grad_cuts`)."""
    cuts: dict[int, list[int]] = {}
    for c, t in enumerate(final):
        if 0 <= t < ticks - 1:
            cuts.setdefault(t + 1, []).append(c)
    return tuple((t, tuple(cs)) for t, cs in sorted(cuts.items()))
