"""Time the steps and keep how long a wait on a silent peer may last (the stall allowance).

A :class:`StepClock` is fed step times and holds ``allowance``, the seconds the next wait
may take: with a fixed deadline, always the deadline; adaptive, the whole deadline during
start-up and after a pause (a checkpoint), then the rule of
:func:`mpitf.config.stall_allowance` over the slowest step since the warm-up steps (those
compile, fault pages in and wait for peers to join: a ps once measured 6 s between a
worker's first two pushes under load and then waited 50 s, longer than the workers). It is
updated only when the slowest step grows, so the per-step cost is a subtraction and a
comparison.
"""

from ..config import SERVER_FIRST, STALL_WARMUP_STEPS, stall_allowance


class StepClock:
    """Step times seen so far and the allowance they give one rank's waits.

    Args:
        deadline: the fixed value, or the upper bound when adaptive (None: wait forever).
        adaptive: adapt to the step time (the default of the jobs) or keep ``deadline``.
        names_the_silent: True for the rank that waits on workers (a ps): it waits
            ``1 / SERVER_FIRST`` of a worker's allowance, so it speaks first.
        warmup: the first steps, not counted in the slowest (a ps counts every worker's
            pushes: STALL_WARMUP_STEPS per worker).
    """

    __slots__ = ("deadline", "adaptive", "scale", "steps", "slowest", "allowance", "steady",
                 "warmup", "_last")

    def __init__(self, deadline, adaptive=True, names_the_silent=False,
                 warmup=STALL_WARMUP_STEPS):
        self.deadline = deadline
        self.warmup = warmup
        self.adaptive = adaptive and deadline is not None
        self.scale = 1.0 / SERVER_FIRST if names_the_silent else 1.0
        self.steps = 0
        self.slowest = 0.0
        self.steady = self._rule()  # the allowance once steps have run (not at start-up)
        self.allowance = self.start_up
        self._last = None

    @classmethod
    def for_ps(cls, deadline, adaptive, num_workers):
        """Return a ps's clock: every worker's pushes are its steps, and it speaks first."""
        return cls(deadline, adaptive, names_the_silent=True,
                   warmup=STALL_WARMUP_STEPS * num_workers)

    @property
    def start_up(self):
        """Return the allowance of start-up and checkpoints: the whole deadline."""
        if self.deadline is None:
            return None
        return self.deadline * SERVER_FIRST * self.scale

    def _rule(self):
        if not self.adaptive:
            return self.start_up
        seen = STALL_WARMUP_STEPS if self.steps >= self.warmup else 0  # the rule's units
        return stall_allowance(self.slowest, seen, self.deadline) * self.scale

    def step(self, seconds):
        """Count one step of ``seconds``; return the allowance now."""
        self.steps += 1
        if self.steps <= self.warmup:  # not typical: left out of the slowest
            if self.steps == self.warmup:
                self.steady = self._rule()
        elif seconds > self.slowest:
            self.slowest = seconds
            self.steady = self._rule()
        return self.steady

    def tick(self, now):
        """Mark the end of a step at ``now`` (time.monotonic); the first mark only starts."""
        if self._last is not None:
            self.allowance = self.step(now - self._last)
        self._last = now

    def pause(self):
        """A checkpoint (or other pause) begins: the whole deadline until the next tick."""
        self._last = None
        self.allowance = self.start_up
