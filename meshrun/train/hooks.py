"""Loop hooks: a side job of the training loop registered with when it is due, run after each step.

    hooks = Hooks(dog)
    hooks.add(evaluate, every=100, when=lambda i: i.last, phase="eval")
    ...
    hooks.run(info)  # after each step: every hook due at `info.step`, in the order they were added

A hook is due on steps divisible by `every` (0: never by count) or where `when(info)` holds, unless
`unless(info)` holds. `phase` is told to the watchdog before the hook runs, so that a hang in it is
recorded under that name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class StepInfo:
    """What the hooks see of one step; they may add to `metrics` (evaluation, straggler checks)."""

    step: int  # 1-based: the step that just ran
    metrics: dict[str, float]
    dt: float  # seconds in the step call
    host_s: float  # seconds on the host before the call (batch, the previous step's hooks)
    ran: int  # steps run in this call of the loop, this one included
    stop: bool = False  # preemption agreed by all processes: save and leave at this step
    cut: bool = False  # the caller's step limit is reached: leave without saving
    last: bool = False  # the call's last step: the run's end, `stop` or `cut`


class Phases(Protocol):
    def phase(self, name: str, step: int) -> None: ...


@dataclass(frozen=True)
class Hook:
    fn: Callable[[StepInfo], object]
    every: int = 1
    when: Callable[[StepInfo], bool] | None = None
    unless: Callable[[StepInfo], bool] | None = None
    phase: str | None = None

    def due(self, info: StepInfo) -> bool:
        if self.unless is not None and self.unless(info):
            return False
        by_count = self.every > 0 and info.step % self.every == 0
        return by_count or (self.when is not None and self.when(info))


@dataclass
class Hooks:
    """The loop's hooks, in the order they run; `dog` (the watchdog) hears each hook's phase."""

    dog: Phases | None = None
    hooks: list[Hook] = field(default_factory=list)

    def add(
        self,
        fn: Callable[[StepInfo], object],
        every: int = 1,
        *,
        when: Callable[[StepInfo], bool] | None = None,
        unless: Callable[[StepInfo], bool] | None = None,
        phase: str | None = None,
    ) -> None:
        self.hooks.append(Hook(fn, every, when, unless, phase))

    def run(self, info: StepInfo) -> None:
        """Every hook due at `info.step`; a later hook's rule sees what the earlier ones added."""
        for hook in self.hooks:
            if hook.due(info):
                if hook.phase is not None and self.dog is not None:
                    self.dog.phase(hook.phase, info.step)
                hook.fn(info)
