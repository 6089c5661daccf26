"""The pipeline schedules, one `Schedule` entry each: the one module that names a schedule (plain
Python, no JAX: the planner and `meshrun schedule` read it too).

An entry declares everything the rest of meshrun asks about its schedule: the per-stage op orders
(its table builder: `schedules.place` / `place_split` turn them into timelines), its rules on virtual
chunks, microbatches and stages (`check`: ConfigErrors naming the field), the executors that play it
(the first is `pipeline.executor=auto`'s), the residual slots and B stashes per stage and the idle
microbatches of its timeline (closed forms the planner uses, checked against the tables in the
tests; the executor and the start-up block read the table itself), where its chunks sit
(`schedules.vstage`) and whether the planner's search tries it. `check_config` is the config's check
of `pipeline.schedule` / `pipeline.executor` (meshrun.config sits below this package: the step plan calls it).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from meshrun.config import PipelineConfig
from meshrun.errors import ConfigError
from meshrun.pipeline.schedules import ChunkPlacement, Table, Task, place, place_split

Executor = Literal["lockstep", "per_op"]  # one forward and one backward per stage per tick, or one op


@dataclass(frozen=True)
class Schedule:
    """One pipeline schedule. p stages, m microbatches, v virtual chunks per stage."""

    name: str  # pipeline.schedule
    title: str  # in messages
    # (p, m, v) -> each stage's ops in order: F and B (the per-op executor splits each B into B and
    # W), or F, B and W (played as they are, per-op only)
    orders: Callable[[int, int, int], list[list[Task]]]
    executors: tuple[Executor, ...]  # executors that play it; the first is pipeline.executor=auto's
    # per-op executor: W's deferred into the bubbles (zero bubble) or each right after its B
    defer_w: bool = False
    chunks: int | None = 1  # virtual chunks per stage; None: pipeline.virtual (>= 1)
    placement: ChunkPlacement = "loop"  # chunk c of stage s: 'loop' virtual stage c*p + s, 'v' s then 2p-1-s
    m_at_least_p: bool = False  # microbatches >= stages
    m_multiple_of_p: bool = False  # microbatches % stages == 0
    # Closed forms (tests/test_schedules.py, test_planner.py check them against the tables):
    # residual slots (max over stages of the microbatch chunks from F to their last backward op),
    # per executor: (p, m, v, executor) -> int
    slots: Callable[[int, int, int, str], int] = lambda p, m, v, ex: m * v
    stash: Callable[[int, int], int] = lambda p, m: 0  # per-op: B's stash slots (from B to W)
    # the timeline's idle time per stage in microbatches of F + B + W (bubble = idle / (m + idle))
    idle: Callable[[int, int, int, str], float] = lambda p, m, v, ex: (p - 1) / v
    # microbatches' worth of a stage's layers stage `stage` holds at its peak (Megatron's accounting,
    # `planner.cost`): (p, m, v, stage) -> float
    held: Callable[[int, int, int, int], float] = lambda p, m, v, stage: float(min(p - stage, m))
    # (p >= 2, m, v, executor) -> (ticks of the timeline the executor plays, per chunk the last tick that
    # adds to its gradient sums: `schedules.grad_final_ticks`), or None to read them off the table
    grad_final: Callable[[int, int, int, str], tuple[int, tuple[int, ...]]] | None = None
    lockstep_fb: bool = True  # a lockstep tick runs a forward and a backward (1F1B's steady state)
    searched: bool = False  # the planner's search tries it
    megatron: bool = False  # Megatron-LM runs it (`meshrun plan --framework megatron` tries it)

    def chunks_of(self, virtual: int) -> int:
        """Virtual chunks per stage with `pipeline.virtual` = virtual."""
        return virtual if self.chunks is None else self.chunks

    def executor(self, executor: str) -> Executor:
        """`executor` ('auto', 'lockstep', 'per_op') resolved for this schedule: auto (or one that does
        not play it) is its first."""
        return executor if executor in self.executors else self.executors[0]

    def check(self, p: int, m: int, v: int) -> None:
        """ConfigError unless this schedule runs p stages, m microbatches and `pipeline.virtual` = v
        (a schedule with its own chunk count takes 1, the default, or that count)."""
        if not isinstance(p, int) or p < 1:
            raise ConfigError("mesh.pipe", p, "use a positive number of pipeline stages")
        if not isinstance(m, int) or m < 1:
            raise ConfigError("pipeline.microbatches", m, "use a positive number of microbatches")
        if not isinstance(v, int) or v < 1:
            raise ConfigError("pipeline.virtual", v, "use a positive number of virtual chunks per stage")
        if self.chunks is not None and v not in (1, self.chunks):
            free = "/".join(s.name for s in SCHEDULES.values() if s.chunks is None)
            why = f"{self.name} has {self.chunks} chunk{'s' if self.chunks > 1 else ''} per stage"
            n = f"virtual={self.chunks}" if self.chunks == 1 else f"virtual=1 or {self.chunks}"
            raise ConfigError("pipeline.virtual", v, f"use schedule={free}, or {n}", why)
        if self.m_at_least_p and m < p:
            fix = f"use at least pipe={p} microbatches (>= {4 * p} recommended)"
            raise ConfigError("pipeline.microbatches", m, fix, f"{self.title} needs m >= p")
        if self.m_multiple_of_p and m % p:
            fix = f"use a multiple of pipe={p}, e.g. {max(p, m - m % p)} or {m + p - m % p}"
            raise ConfigError("pipeline.microbatches", m, fix, f"{self.title} needs m % p == 0")

    def table(self, p: int, m: int, v: int = 1, executor: str = "auto") -> Table:
        """The per-op timeline `executor` plays (arguments checked): per-op, each backward split into
        B and W; lockstep, whole backwards (its lockstep view: `schedules.lockstep`)."""
        self.check(p, m, v)
        return self.timeline(p, m, self.chunks_of(v), self.executor(executor))

    def timeline(self, p: int, m: int, v: int, executor: str) -> Table:
        """`table` without the checks (and with whole backwards on request, for comparison)."""
        orders = self.orders(p, m, v)
        if any(t.kind == "W" for o in orders for t in o):
            return place(orders, p, v, self.placement)
        if executor == "per_op":
            return place_split(orders, p, m, v, defer=self.defer_w, placement=self.placement)
        return place(orders, p, v, self.placement)

    def bubble(self, p: int, m: int, v: int = 1, executor: str = "auto") -> float:
        """Idle fraction of its timeline in closed form (F = 1, B = 2; per-op F = B = W = 1)."""
        idle = self.idle(p, m, v, self.executor(executor))
        return idle / (m + idle)


# ---------------------------------------------------------------- per-stage op orders


def _gpipe_orders(p: int, m: int, v: int) -> list[list[Task]]:
    return [[Task("F", i) for i in range(m)] + [Task("B", i) for i in range(m)] for _ in range(p)]


def _1f1b_orders(p: int, m: int, v: int) -> list[list[Task]]:
    orders = []
    for s in range(p):
        w = min(p - 1 - s, m)  # warm-up forwards (PipeDream-flush / Megatron non-interleaved)
        o = [Task("F", i) for i in range(w)]
        for i in range(m - w):
            o += [Task("F", w + i), Task("B", i)]
        orders.append(o + [Task("B", i) for i in range(m - w, m)])
    return orders


def _interleaved_orders(p: int, m: int, v: int) -> list[list[Task]]:
    # Megatron-LM interleaved 1F1B (Narayanan et al. 2021): microbatches go in groups of p; within a
    # group each chunk runs all p microbatches before the next chunk; backward visits chunks in reverse.
    n = v * m

    def task(kind: str, j: int) -> Task:
        c = (j // p) % v
        return Task(kind, (j // (p * v)) * p + j % p, c if kind == "F" else v - 1 - c)

    orders = []
    for s in range(p):
        w = min(2 * (p - 1 - s) + (v - 1) * p, n)
        o = [task("F", j) for j in range(w)]
        for j in range(n - w):
            o += [task("F", w + j), task("B", j)]
        orders.append(o + [task("B", j) for j in range(n - w, n)])
    return orders


def _interleaved_held(p: int, m: int, v: int, stage: int) -> float:
    # Korthikanti et al. 2022, 4.2.3: the first stage holds p (1 + (p-1)/(p v)) microbatches' worth
    n = float(min(p - stage, m))
    return n * (1.0 + (p - 1) / (p * v)) if stage == 0 and v > 1 else n


def _interleaved_final(p: int, m: int, v: int, ex: str) -> tuple[int, tuple[int, ...]]:
    # lockstep: v m + (v + 1) p - 2 ticks (`schedules.lockstep`); chunk c's last backward p c ticks before the end
    ticks = v * m + (v + 1) * p - 2
    return ticks, tuple(ticks - 1 - c * p for c in range(v))


def _zbv_final(p: int, m: int, v: int, ex: str) -> tuple[int, tuple[int, ...]]:
    # 6m + p - 1 one-op ticks (+ 2p - 2 - m when m < 2p - 2); chunk 1's last W p - 1 ticks before chunk 0's
    ticks = 6 * m + p - 1 + max(0, 2 * p - 2 - m)
    return ticks, (ticks - 1, ticks - p)


def _zbv_orders(p: int, m: int, v: int) -> list[list[Task]]:
    # ZB-V (Qi et al. 2024; torchtitan's ScheduleZBVZeroBubble): stage r holds chunk 0 (virtual stage
    # r) and chunk 1 (2p-1-r). Warm-up: 2(p-r)-1 chunk-0 forwards, r pairs (F1, F0), then p-r rounds of
    # F1 B1 W1; steady state F0 B0 W0 F1 B1 W1; cool-down: r pairs (B0, B1), p-r rounds of B0 W0, the
    # deferred W's last. At most 2p chunks (p microbatches' worth of the stage's layers) in flight.
    return [_zbv_stage_order(p, m, r) for r in range(p)]


def _zbv_stage_order(p: int, m: int, r: int) -> list[Task]:
    """Stage r's ops in ZB-V's order (`_zbv_orders`)."""
    o, n = [], {"F0": 0, "F1": 0, "B0": 0, "B1": 0, "W0": 0, "W1": 0}

    def op(kind: str, c: int) -> None:
        o.append(Task(kind, n[f"{kind}{c}"], c))
        n[f"{kind}{c}"] += 1

    for _ in range(min(2 * (p - r) - 1, m)):
        op("F", 0)
    for _ in range(r):
        for c in (1, 0):
            if n[f"F{c}"] < m:
                op("F", c)
    for _ in range(p - r):
        if n["F1"] < m:
            op("F", 1)
        op("B", 1)
        op("W", 1)
    while n["F1"] < n["F0"] or n["F0"] < m:
        if n["F0"] < m:
            op("F", 0)
        op("B", 0)
        op("W", 0)
        op("F", 1)
        op("B", 1)
        op("W", 1)
    for _ in range(r):
        op("B", 0)
        op("B", 1)
    for _ in range(p - r):
        op("B", 0)
        op("W", 0)
    for c in (1, 0):
        while n[f"W{c}"] < n[f"B{c}"]:
            op("W", c)
    return o


# ---------------------------------------------------------------- the registry

SCHEDULES: dict[str, Schedule] = {
    s.name: s
    for s in (
        Schedule(
            "gpipe", "GPipe", _gpipe_orders, ("lockstep",),
            slots=lambda p, m, v, ex: m, held=lambda p, m, v, stage: float(m), lockstep_fb=False,
        ),
        Schedule(
            "1f1b", "1F1B", _1f1b_orders, ("lockstep", "per_op"), m_at_least_p=True,
            # lockstep runs forwards ahead: 2(p-1-s)+1 on stage s; per-op (Megatron's order, each W in
            # the tick after its B): p - s, one B stash; its bubble is 2(p-1) one-op ticks of 3m + 2(p-1)
            slots=lambda p, m, v, ex: min(m, p) if ex == "per_op" else min(m, 2 * p - 1),
            stash=lambda p, m: 1,
            idle=lambda p, m, v, ex: 2 * (p - 1) / 3 if ex == "per_op" else float(p - 1),
            searched=True, megatron=True,
        ),
        Schedule(
            "interleaved", "interleaved 1F1B", _interleaved_orders, ("lockstep",), chunks=None,
            m_multiple_of_p=True,
            slots=lambda p, m, v, ex: min(m * v, (v + 1) * p - 1) if v > 1 else min(m, 2 * p - 1),
            held=_interleaved_held, grad_final=_interleaved_final, searched=True, megatron=True,
        ),
        Schedule(
            # Qi et al. 2023: 1F1B's order with W's deferred into the bubbles, at most min(p, m)
            # microbatches from F to W on a stage (1F1B's peak); bubble (p-1)(F+B-W) with F = B = W
            "zb-h1", "ZB-H1", _1f1b_orders, ("per_op",), defer_w=True, m_at_least_p=True,
            slots=lambda p, m, v, ex: min(m, p), stash=lambda p, m: min(m, p),
            idle=lambda p, m, v, ex: (p - 1) / 3,
            held=lambda p, m, v, stage: 2.0 * min(p, m),  # residuals + the stash after B (~ one more set)
        ),
        Schedule(
            # two chunks per stage in a V, its backward split into B and W: 2p chunks (p microbatches'
            # worth) in flight, 2p - 1 B stashes; 6m + p - 1 one-op ticks when m >= 2p - 2
            "zb-v", "ZB-V", _zbv_orders, ("per_op",), chunks=2, placement="v", m_at_least_p=True,
            slots=lambda p, m, v, ex: 2 * p, stash=lambda p, m: 2 * p - 1,
            idle=lambda p, m, v, ex: (p - 1 + max(0, 2 * p - 2 - m)) / 6,
            held=lambda p, m, v, stage: p + (2 * p - 1) / 2,  # residuals + stashes, in stage-layer units
            grad_final=_zbv_final, searched=True,
        ),
    )
}  # fmt: skip


def names() -> tuple[str, ...]:
    return tuple(SCHEDULES)


def get(name: str, field: str = "pipeline.schedule") -> Schedule:
    """The entry of `name`; ConfigError (on `field`) naming the close match or the choices."""
    if name not in SCHEDULES:
        close = difflib.get_close_matches(str(name), list(SCHEDULES), n=1, cutoff=0.5)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ConfigError(field, name, f"{hint}use one of {list(SCHEDULES)}", "unknown schedule")
    return SCHEDULES[name]


def default_name(virtual: int) -> str:
    """The schedule a planner layout with `virtual` chunks per stage runs unless one is given: the
    first searched one whose chunk rule takes it."""
    return next(s.name for s in SCHEDULES.values() if s.searched and s.chunks in (None, virtual))


def check_config(pcfg: PipelineConfig) -> Schedule:
    """The config's own check of `pipeline.schedule` and `pipeline.executor` (any mesh); the rules on
    stages and microbatches wait for the mesh (`Schedule.check`)."""
    sched = get(pcfg.schedule)
    if pcfg.executor != "auto" and pcfg.executor not in sched.executors:
        other = [n for n, s in SCHEDULES.items() if pcfg.executor in s.executors]
        fix = f"use {' or '.join(sched.executors)} or auto (or pipeline.schedule={'/'.join(other)})"
        why = f"{sched.name} runs on the {'/'.join(sched.executors)} executor only"
        raise ConfigError("pipeline.executor", pcfg.executor, fix, why)
    return sched


def executor_of(pcfg: PipelineConfig) -> Executor:
    """'lockstep' or 'per_op': `pipeline.executor` with 'auto' resolved by the schedule's entry."""
    return check_config(pcfg).executor(pcfg.executor)


def chunks_of(pcfg: PipelineConfig) -> int:
    """Virtual chunks per stage of a config's schedule."""
    return get(pcfg.schedule).chunks_of(pcfg.virtual)
