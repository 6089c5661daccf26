"""The executor's static program: the schedule's lockstep table as per-tick index arrays, grouped
into phases of same-kind ticks (pure Python + numpy, no JAX: `meshrun explain` and the tests read it).

Per-op executor: one op (F, B = input gradient, W = weight gradient) per stage per tick; values that
arrive before their consumer runs wait in inbox slots. For 1F1B that is Megatron's order with each
backward split into B and W: p - s microbatches in flight on stage s. Its ticks are grouped into
phases that repeat a period of a few ticks with static sends (`_send_phases`), one
collective-permute both ways where it can.

Lockstep executor: each stage runs at most one forward and one backward per tick
(`schedules.lockstep`); ticks are grouped into maximal runs of one kind ('F', 'B', 'FB'), one
`lax.scan` each. A phase sends activations (gradients) iff some tick of it feeds a forward
(backward) on the next tick.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from meshrun.config import PipelineConfig
from meshrun.errors import ConfigError
from meshrun.pipeline import registry, schedules
from meshrun.pipeline.registry import Executor
from meshrun.pipeline.schedules import ChunkPlacement


def _phases(lock, v: int, cuts: frozenset[int] = frozenset()) -> list[tuple[str, int, int, bool, bool]]:
    """Maximal runs of ticks of one kind: 'F' (forwards only), 'B' (backwards only), 'FB' (both),
    each with whether its ticks send activations / gradients (some tick of the run has a consumer
    next tick). One scan per run keeps the tick body specialised (a warm-up tick costs a forward
    only) while the HLO holds few copies of the stage (compile time). A run also ends at each tick
    of `cuts` (`grad_cuts`: a chunk's gradients are final there)."""
    p = len(lock[0])
    kinds, sf, sb = [], [], []
    for t, row in enumerate(lock):
        f, b = any(c.fwd for c in row), any(c.bwd for c in row)
        kinds.append("FB" if f and b else "F" if f else "B")
        nxt = lock[t + 1] if t + 1 < len(lock) else []
        sf.append(any(c.fwd is not None and c.fwd.chunk * p + s > 0 for s, c in enumerate(nxt)))
        sb.append(any(c.bwd is not None and c.bwd.chunk * p + s < v * p - 1 for s, c in enumerate(nxt)))
    out, t0 = [], 0
    for t in range(1, len(kinds) + 1):
        if t == len(kinds) or kinds[t] != kinds[t0] or t in cuts:
            out.append((kinds[t0], t0, t, any(sf[t0:t]), any(sb[t0:t])))
            t0 = t
    return out


@dataclass(frozen=True)
class TickProgram:
    """Everything static about one pipelined step, read off the schedule's table (built once, by
    `tick_program`): per-tick task tables, phases of same-kind ticks, residual slots, the bubble."""

    schedule: str
    p: int
    m: int
    v: int
    ticks: int
    slots: int  # residual buffer slots (max in-flight (mb, chunk) pairs on any stage)
    fused_head: bool  # every last-virtual-stage backward runs in its forward's tick
    phases: tuple[tuple[str, int, int, bool, bool], ...]  # (kind, first tick, end tick, send fwd, send bwd)
    tables: Mapping[str, np.ndarray]  # [ticks, p] int32: f_mb f_chunk f_slot b_mb b_chunk b_slot
    # per_op (zb-h1): tables are kind (0 idle, 1 F, 2 B, 3 W) mb slot f_put f_get g_put g_get; the
    # inboxes hold received activations / gradients from their arrival tick to their consumer's
    per_op: bool = False
    inbox: tuple[int, int] = (0, 0)  # (activation, gradient) inbox slots, trash slot not counted
    executor: Executor = "lockstep"  # 'lockstep' (F and B per tick) or 'per_op' (one op per stage per tick)
    stash_slots: int = 0  # per_op: B's stash slots (B to W), trash slot not counted
    # per_op: per phase, one period of u ticks (its scan body runs u ticks; u divides the phase's
    # length), each tick's collective-permutes as their (source, target) stage pairs (mostly one)
    sends: tuple[tuple[tuple[tuple[tuple[int, int], ...], ...], ...], ...] = ()
    # the timeline's idle fraction per stage (F = 1, B = 2; per-op: F = B = W = 1)
    stage_bubbles: tuple[float, ...] = ()
    # which virtual stage chunk c of stage s holds (`schedules.vstage`); per-op 'v': one inbox for
    # both kinds (a stage may receive two activations at once), f_put / g_put / s_put the slot of what
    # arrives from the stage below / above / itself (the V's tip, no permute), f_get / g_get what F / B read
    placement: ChunkPlacement = "loop"
    head_slots: int = 0  # per_op: the head's dy slots on the last virtual stage (its F to its B)
    # pipeline.overlap_grad_reduce: (tick, chunks) pairs, ascending: at that tick (a phase boundary)
    # the chunks' gradient sums are final on every stage, so their data-parallel reduction may run
    # beside the ticks after it; the chunks not listed are reduced after the loop
    grad_cuts: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def stage_slots(self) -> tuple[int, ...]:
        """Residual slots each stage's schedule needs (the buffer has `slots`, the max, on every
        stage): lockstep 1F1B min(m, 2(p-1-s)+1), per-op 1F1B and zb-h1 min(m, p-s) on stage s."""
        slot = self.tables["slot" if self.per_op else "f_slot"]
        return tuple(1 + int(slot[:, s].max()) for s in range(self.p))

    @property
    def bubble(self) -> float:
        """Mean idle fraction of the timeline this program plays (`stage_bubbles`)."""
        return sum(self.stage_bubbles) / len(self.stage_bubbles)

    def permutes(self) -> tuple[int, int]:
        """(forward, backward) activation transfers over 'pipe' per step: one per tick of a phase that
        sends. With p = 2 a tick that sends both ways does it in one collective-permute. Per-op: the
        compiled collective-permutes that carry activations / gradients (one may carry both)."""
        if self.per_op:
            perms = [pr for (_, t0, t1, _, _), per in zip(self.phases, self.sends, strict=True)
                     for _ in range((t1 - t0) // len(per)) for tick in per for pr in tick]  # fmt: skip
            return sum(any(b > a for a, b in pr) for pr in perms), sum(any(b < a for a, b in pr) for pr in perms)
        f = sum(t1 - t0 for _, t0, t1, sf, _ in self.phases if sf)
        b = sum(t1 - t0 for _, t0, t1, _, sb in self.phases if sb)
        return f, b

    def permute_counts(self) -> tuple[int, int]:
        """(collective-permute ops, activation-sized payloads they carry) per step, as compiled: with
        p = 2 a tick that sends both ways is one swap (v = 1: each stage sends one of the two;
        interleaved: both, stacked). Per-op: each stage sends its op's one output, so a tick's sends
        both ways are one collective-permute unless a stage receives from both neighbours (`sends`)."""
        if self.per_op:
            n = sum((t1 - t0) // len(per) * sum(map(len, per))
                    for (_, t0, t1, _, _), per in zip(self.phases, self.sends, strict=True))  # fmt: skip
            return n, n
        f, b = self.permutes()
        both = sum(t1 - t0 for _, t0, t1, sf, sb in self.phases if sf and sb) if self.p == 2 else 0
        return f + b - both, f + b - (both if self.v == 1 else 0)


def _check_overlap(pcfg: PipelineConfig, cuts, v: int, p: int) -> None:
    if pcfg.overlap_grad_reduce and not cuts:
        raise ConfigError(
            "pipeline.overlap_grad_reduce",
            True,
            "use a schedule with 2+ chunks per stage (zb-v, or interleaved with virtual >= 2), or set it false",
            f"{pcfg.schedule} on {p} stages with {v} chunk{'s' if v > 1 else ''} per stage finishes every "
            "gradient in its last tick: nothing to overlap",
        )


def tick_program(pcfg: PipelineConfig, p: int) -> TickProgram:
    """The program of `pcfg`'s schedule on p stages (its registry entry's checks first)."""
    sched = registry.check_config(pcfg)
    executor = sched.executor(pcfg.executor)
    v = sched.chunks_of(pcfg.virtual)
    table = sched.table(p, pcfg.microbatches, pcfg.virtual, executor)  # checks p, m, virtual
    bubbles = tuple(schedules.stage_bubbles(table))
    if executor == "per_op":
        return _per_op_program(pcfg, p, table, bubbles)
    lock = schedules.lockstep(table)
    cuts = schedules.grad_cuts(schedules.grad_final_ticks(lock, v), len(lock)) if pcfg.overlap_grad_reduce else ()
    _check_overlap(pcfg, cuts, v, p)
    arrs = {k: np.asarray(a, np.int32) for k, a in schedules.lockstep_arrays(lock).items()}
    slots = max(schedules.max_in_flight(lock, s) for s in range(p))
    last = p - 1
    fused = all(
        row[last].bwd is None
        or row[last].bwd.chunk != v - 1
        or (row[last].fwd is not None and (row[last].fwd.mb, row[last].fwd.chunk) == (row[last].bwd.mb, v - 1))
        for row in lock
    )
    phases = tuple(_phases(lock, v, frozenset(t for t, _ in cuts)))
    return TickProgram(pcfg.schedule, p, pcfg.microbatches, v, len(lock), slots, fused, phases, arrs,
                       stage_bubbles=bubbles, grad_cuts=cuts)  # fmt: skip


KINDS = {"F": 1, "B": 2, "W": 3}  # per-op kind codes; 0 = idle


def _per_op_program(pcfg: PipelineConfig, p: int, table, bubbles: tuple[float, ...]) -> TickProgram:
    """The per-op timeline as index arrays. A value sent at tick t arrives at t+1; it goes into an
    inbox slot then (-1: nothing arrives, the trash slot) and its consumer reads that slot when it
    runs, so a consumer may run later than the arrival. Residual slots live from F to W."""
    m = pcfg.microbatches
    ticks = len(table)
    placement = getattr(table, "placement", "loop")
    v = 1 + max(op.chunk for row in table for op in row if op is not None)
    keys = ("kind", "mb", "chunk", "slot", "stash", "head", "f_put", "f_get", "g_put", "g_get", "s_put")
    arrs = {k: np.full((ticks, p), -1, np.int32) for k in keys}
    slots, stash_slots, head_slots, inbox = 0, 0, 0, [0, 0]
    for s in range(p):
        n_res, n_stash, n_head = _fill_stage_ops(table, s, p, v, placement, arrs)
        slots, stash_slots, head_slots = max(slots, n_res), max(stash_slots, n_stash), max(head_slots, n_head)
        if placement == "v":
            inbox[0] = max(inbox[0], _one_inbox(table, s, p, arrs))
            continue
        inbox = [max(n, k) for n, k in zip(inbox, _fill_stage_inboxes(table, s, arrs), strict=True)]
    cuts = schedules.grad_cuts(schedules.grad_final_ticks(table, v), ticks) if pcfg.overlap_grad_reduce else ()
    _check_overlap(pcfg, cuts, v, p)
    period = MAX_PERIOD if placement == "loop" else 2 * MAX_PERIOD
    phases, sends = _send_phases(table, p, period, frozenset(t for t, _ in cuts))
    return TickProgram(pcfg.schedule, p, m, v, ticks, slots, False, phases, arrs, True, tuple(inbox), "per_op",
                       stash_slots, sends, bubbles, placement, head_slots, cuts)  # fmt: skip


def _fill_stage_ops(table, s: int, p: int, v: int, placement: str, arrs: dict) -> tuple[int, int, int]:
    """Stage s's column of the op arrays: each op's kind, microbatch and chunk and the residual, stash
    and head slots it uses. Returns the residual, stash and head slots the stage needs."""
    res = schedules.residual_slots(table, s)
    st = schedules.assign_slots(schedules.stash_intervals(table, s))  # B's stash lives from B to W
    hd = schedules.assign_slots(_head_intervals(table, s, p, v, placement))  # the head's dy: F to B
    for t, row in enumerate(table):
        op = row[s]
        if op is not None:
            key = (op.mb, op.chunk)
            arrs["kind"][t, s], arrs["mb"][t, s], arrs["chunk"][t, s] = KINDS[op.kind], op.mb, op.chunk
            arrs["slot"][t, s] = res[key]
            if op.kind != "F":
                arrs["stash"][t, s] = st[key]
            if key in hd and op.kind != "W":
                arrs["head"][t, s] = hd[key]
    return 1 + max(res.values()), 1 + max(st.values()), 1 + max(hd.values(), default=-1)


def _fill_stage_inboxes(table, s: int, arrs: dict) -> tuple[int, int]:
    """Stage s's inbox slots (a loop placement's): activations from stage s-1's F (f_put, f_get) and
    gradients from stage s+1's B (g_put, g_get). Returns the activation and gradient slots it needs."""
    need = [0, 0]
    for i, (pre, iv) in enumerate(zip("fg", schedules.inbox_intervals(table, s), strict=True)):
        if not iv:
            continue
        box = schedules.assign_slots(iv)
        need[i] = 1 + max(box.values())
        for key, (a, b) in iv.items():
            arrs[f"{pre}_put"][a, s] = arrs[f"{pre}_get"][b, s] = box[key]
    return need[0], need[1]


def _head_intervals(table, s: int, p: int, v: int, placement: str) -> dict:
    """(mb, chunk) -> (tick of F, tick of B) of stage s's ops on the last virtual stage: how long the
    head's output gradient, made by F, waits for B."""
    f, out = {}, {}
    for t, row in enumerate(table):
        op = row[s]
        if op is None or schedules.vstage(op.chunk, s, p, placement) != v * p - 1:
            continue
        if op.kind == "F":
            f[(op.mb, op.chunk)] = t
        elif op.kind == "B":
            out[(op.mb, op.chunk)] = (f[(op.mb, op.chunk)], t)
    return out


def _one_inbox(table, s: int, p: int, arrs) -> int:
    """One inbox for what stage `s` receives of both kinds (a V: activations and gradients arrive from
    either neighbour, and from the stage itself at the V's tip): f_get / g_get the slot F / B read,
    f_put / g_put / s_put the slot of what arrives from below / above / itself. Returns its slots."""
    pl = table.placement
    fin, bin_ = schedules.inbox_intervals(table, s)
    iv = {("f", *k): a for k, a in fin.items()} | {("g", *k): a for k, a in bin_.items()}
    if not iv:
        return 0
    box = schedules.assign_slots(iv)
    for (pre, mb, c), (a, b) in iv.items():
        k = schedules.vstage(c, s, p, pl)
        src, _ = schedules.chunk_of(k - 1 if pre == "f" else k + 1, p, pl)
        col = "f" if src < s else "g" if src > s else "s"
        assert arrs[f"{col}_put"][a, s] < 0, "two values arrive from one side in one tick"
        arrs[f"{col}_put"][a, s] = arrs[f"{pre}_get"][b, s] = box[(pre, mb, c)]
    return 1 + max(box.values())


MAX_PERIOD = 3  # longest period of ticks a per-op phase's scan body runs (1F1B's and zb-h1's steady state: 3)
TICK_COPY_COST = 2  # collective-permutes per step a compiled copy of the tick must save to be made


def _tick_sends(row, p: int, v: int = 1, placement: str = "loop") -> tuple[frozenset, frozenset]:
    """The sends of one per-op tick as (source, target) stage pairs, (up, down): F's output to the
    stage of the next virtual stage, B's to the previous one's (each stage runs one op, so it sends at
    most one value). Up: to a higher stage (1F1B: the activations); down: to a lower stage (1F1B: the
    gradients). A V's tip feeds its own other chunk without a permute (`s_put`)."""
    up, down = set(), set()
    for s, op in enumerate(row):
        if op is None or op.kind == "W":
            continue
        k = schedules.vstage(op.chunk, s, p, placement) + (1 if op.kind == "F" else -1)
        if 0 <= k < v * p:
            d, _ = schedules.chunk_of(k, p, placement)
            if d != s:
                (up if d > s else down).add((s, d))
    return frozenset(up), frozenset(down)


def _permutes(f: frozenset, b: frozenset) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The collective-permutes that make the sends `f` and `b`: none, one (no stage sends or receives
    twice), else two (activations, then gradients)."""
    pairs = f | b
    if not pairs:
        return ()
    if len({a for a, _ in pairs}) == len({t for _, t in pairs}) == len(pairs):
        return (tuple(sorted(pairs)),)
    return tuple(tuple(sorted(x)) for x in (f, b) if x)


def _send_phases(table, p: int, max_period: int = MAX_PERIOD, cuts: frozenset[int] = frozenset()):
    """Phases of the per-op program (one `lax.scan` each) and their sends. A collective costs one
    rendezvous of every device whatever it carries, so a tick makes its sends in as few
    collective-permutes as it can: one (each stage sends its op's one output) unless some stage
    receives an activation and a gradient at once. A permute's pairs are static, so a phase repeats
    one period of u ticks (its scan body runs the u ticks, each with its own permutes; the steady
    state of 1F1B and zb-h1 has period 3), each position's permutes covering the sends of all its
    ticks (an extra pair carries what its receiver drops into the trash slot). The phases minimise
    the permutes per step plus TICK_COPY_COST per compiled tick (dynamic programming over the phase
    ends); each runs two periods or more (XLA inlines a one-trip loop, and there it copied the
    residual buffers into each op's cond). Returns (phases, sends): ('FBW', t0, t1, sends
    activations, sends gradients) and per phase its u ticks' permutes (`TickProgram.sends`). 1F1B at
    p = 4, m = 8: 28 permutes per step in 5 compiled ticks (one per tick that sends; two per tick
    before, 49); zb-h1: 37 in 6 (44 before; at least 33). No phase spans a tick of `cuts` (a phase
    ends there: `TickProgram.grad_cuts`); a phase between two bounds may then run one period."""
    v = 1 + max(op.chunk for row in table for op in row if op is not None)
    need = [_tick_sends(row, p, v, getattr(table, "placement", "loop")) for row in table]
    bits = {pr: 1 << i for i, pr in enumerate(sorted(set().union(*(f | b for f, b in need))))}
    mask = [(sum(bits[x] for x in f), sum(bits[x] for x in b)) for f, b in need]
    pairs_of = lambda m: frozenset(pr for pr, bit in bits.items() if m & bit)
    cost = functools.cache(lambda f, b: len(_permutes(pairs_of(f), pairs_of(b))))  # f, b as bit masks
    spans = _cheapest_spans(mask, cost, max_period, cuts)
    phases, sends = [], []
    for t0, t1, u in spans:
        pat = [(frozenset(), frozenset())] * u
        for t in range(t0, t1):
            j = (t - t0) % u
            pat[j] = (pat[j][0] | need[t][0], pat[j][1] | need[t][1])
        per = tuple(_permutes(f, b) for f, b in pat)
        pairs = [pr for tick in per for perm in tick for pr in perm]
        phases.append(("FBW", t0, t1, any(b > a for a, b in pairs), any(b < a for a, b in pairs)))
        sends.append(per)
    return tuple(phases), tuple(sends)


def _cheapest_spans(mask, cost, max_period: int, cuts: frozenset[int]) -> list[tuple[int, int, int]]:
    """`_send_phases`' dynamic programme: the (t0, t1, u) spans, in tick order, that split the ticks
    [0, len(mask)) at the least permutes per step plus TICK_COPY_COST per compiled tick. mask[t] is tick
    t's sends as (activation, gradient) bit masks; cost(f, b) the permutes one tick of those masks takes."""
    ticks = len(mask)
    best: list = [(0, None)] + [(float("inf"), None)] * ticks  # (cost, (t0, u)) of the best split of [0, t)
    bounds = {0, ticks} | set(cuts)
    for t0 in range(ticks):
        for u in range(1, min(max_period, ticks - t0) + 1):
            pat, per_period = [(0, 0)] * u, 0  # each position's sends (masks); permutes per period
            for t in range(t0, ticks):
                if t > t0 and t in cuts:
                    break
                j = (t - t0) % u
                f, b = pat[j][0] | mask[t][0], pat[j][1] | mask[t][1]
                if (f, b) != pat[j]:
                    per_period += cost(f, b) - cost(*pat[j])
                    pat[j] = (f, b)
                if j == u - 1 and (t + 1 - t0 > u or (t0 in bounds and t + 1 in bounds)):  # two periods or more
                    c = best[t0][0] + (t + 1 - t0) // u * per_period + TICK_COPY_COST * u
                    if c < best[t + 1][0]:
                        best[t + 1] = (c, (t0, u))
    spans, t = [], ticks
    while t:
        t0, u = best[t][1]
        spans.append((t0, t, u))
        t = t0
    return spans[::-1]
