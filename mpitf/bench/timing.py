"""Timing a call as every micro-benchmark here does: a few untimed calls first, then each timed.

The first calls touch fresh memory, fill caches and compile kernels; timing them would
measure start-up, not the step.
"""

import statistics
import time

WARMUP = 3  # untimed calls before the timed ones


def timed(fn, reps, warmup=WARMUP):
    """Return the seconds each of ``reps`` calls of ``fn()`` took, after ``warmup`` untimed."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def median_ms(fn, reps):
    """Return the median milliseconds of ``fn()`` over ``reps`` timed calls."""
    return statistics.median(timed(fn, reps)) * 1e3


def median_us(times):
    """Return the median of ``times`` (seconds) in microseconds."""
    return statistics.median(times) * 1e6
