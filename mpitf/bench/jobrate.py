"""The examples/s of a training job, measured the same way in every suite that runs one.

The scaling and modes suites and the cost model's profile runs all launch
``mpitf.jobs.mnist_mlp`` logging every ``LOG_EVERY`` global steps, and take the rate from
the chief's ``RUN_DIR/metrics.jsonl``: the job's examples (global steps x examples per
global step, so in async every worker's pushes count) per second over each interval
between two records past the warm-up, and the median of those intervals. Start-up, the
warm-up steps and the evaluation after training lie outside every interval; the median
keeps a moment when another process took a core from setting the figure, and matches the
profile's statistic (the median over blocks of ``LOG_EVERY`` steps, worker/profile.py).
"""

import json
import os
import statistics

from ..worker.profile import BLOCK_STEPS

LOG_EVERY = BLOCK_STEPS  # global steps between two records: one profile block
WARM_UP_SHARE = 0.2  # of the run's steps, left out at the start (at least one interval);
# on 2 shared cores the MLP's first ~150 steps ran up to 1.6x slower than the rest


def job_env(ranks, base=None):
    """Return the environment of a launched job: its BLAS threads share the cores.

    ``OPENBLAS_NUM_THREADS``/``OMP_NUM_THREADS`` default to cores // ranks (at least 1),
    so a worker's matrix products do not fight the other ranks for cores; a value the user
    set is kept.
    """
    env = dict(os.environ if base is None else base, PYTHONUNBUFFERED="1")
    threads = str(max(1, (os.cpu_count() or 1) // max(1, ranks)))
    for key in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        env.setdefault(key, threads)
    return env


def read_records(path):
    """Return the records of a metrics.jsonl file (an empty list if it has none)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def steady_rate(records, warm_up):
    """Return the job's steady examples/s from the chief's records, with the window it used.

    Intervals between consecutive records whose first step is at least ``warm_up``; the
    examples per global step come from the records themselves (batch x aggregated
    gradients in sync, the batch in async). ``examples_per_sec`` is the median over the
    intervals, ``mean_examples_per_sec`` all the window's examples over all its time.
    """
    timed = [r for r in records if r["step"] >= warm_up]
    if len(timed) < 2:  # a run too short for the warm-up: its whole span (first_step says)
        timed = records
    pairs = [(a, b) for a, b in zip(timed, timed[1:]) if b["time"] > a["time"]
             and b["step"] > a["step"]]
    if not pairs:
        raise ValueError(f"expecting two metrics records past step {warm_up}, "
                         f"got {len(records)} records")
    last = next(r for a, b in reversed(pairs) for r in (b, a) if r["global_steps_per_sec"])
    per_step = last["examples_per_sec"] / last["global_steps_per_sec"]
    rates = [(b["step"] - a["step"]) * per_step / (b["time"] - a["time"]) for a, b in pairs]
    steps = pairs[-1][1]["step"] - pairs[0][0]["step"]
    seconds = pairs[-1][1]["time"] - pairs[0][0]["time"]
    return dict(examples_per_sec=statistics.median(rates),
                mean_examples_per_sec=steps * per_step / seconds, window_steps=steps,
                window_s=seconds, first_step=pairs[0][0]["step"], intervals=len(rates))


def warm_up_steps(steps):
    """Return the global steps left out at the start of a run of ``steps``."""
    return max(LOG_EVERY, int(WARM_UP_SHARE * steps))


def measure(final, run_dir, steps):
    """Return the job's ``final`` dict with its steady rate (see :func:`steady_rate`).

    ``examples_per_sec`` becomes the steady rate; the chief's own figure (its clock from
    its first step to the end of training) stays as ``final_examples_per_sec``.
    """
    rate = steady_rate(read_records(os.path.join(run_dir, "metrics.jsonl")),
                       warm_up_steps(steps))
    out = dict(final, final_examples_per_sec=final["examples_per_sec"])
    out.update(rate)
    return out
