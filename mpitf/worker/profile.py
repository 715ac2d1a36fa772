"""``--profile-steps N``: time N steps on the chief and write the figures the planner needs.

After a warm-up (N // 4 steps, at least ``WARM_UP``) the chief's compute (forward +
backward, the batch read, and with buckets the pushes that leave during backward) and
push+pull wait are timed for N steps from the session's timeline spans; the steady
figures (the median over blocks of ``BLOCK_STEPS`` steps of each block's mean: what mpitf
bench's examples/s measures too) and the plain means go to ``RUN_DIR/profile.json``:
``model_bytes``, ``bytes_per_ps``, ``compute_s`` per step and per example, ``push_pull_s``,
``step_s`` and ``overhead_s`` (the rest of a step: checks, hooks). ``mpitf bench --plan
--model-bytes B --compute-ms C`` takes ``model_bytes`` and ``compute_s`` (scaled to the
batch a worker will run). ``model_bytes`` counts the dense variables (embedding tables
travel by rows). The timeline records only while profiling unless --timeline.
"""

import datetime
import json
import logging
import os
import socket
import statistics
import time

from .hooks import Hook

WARM_UP = 3  # steps left out at least: first touches, lazy imports, the first pull
BLOCK_STEPS = 10  # steps per block: the figures are medians over blocks of their means


def steady_mean(values, block=BLOCK_STEPS):
    """Return the median over consecutive blocks of ``block`` values of each block's mean.

    A step another process delayed weighs on one block, not on the figure, as a plain
    mean would let it; a short tail of fewer than ``block`` values joins the last block.
    """
    if not values:
        return 0.0
    starts = range(0, max(1, len(values) - block + 1), block)
    blocks = [values[i:i + block] for i in starts]
    blocks[-1] = values[starts[-1]:]
    return statistics.median(statistics.fmean(b) for b in blocks)

_log = logging.getLogger("mpitf")


class ProfileHook(Hook):
    """Time ``steps`` steps after the warm-up; write ``path`` (JSON) once, on the chief.

    The warm-up is ``steps // 4`` steps (at least ``WARM_UP``): on shared cores a job's
    first hundred or so steps ran up to 1.6x slower than its steady state.
    """

    def __init__(self, steps, path):
        self.steps = steps
        self.warm_up = max(WARM_UP, steps // 4)
        self.path = path
        self.ticks = []
        self.written = False

    @classmethod
    def from_config(cls, config):
        """The hook ``--profile-steps`` asks for (``RUN_DIR/profile.json``), or None."""
        if config.profile_steps:
            return cls(config.profile_steps, os.path.join(config.run_dir or ".", "profile.json"))
        return None

    def begin(self, session):
        """Turn the session's timeline on for the profiled steps."""
        self.was_enabled = session.timeline.enabled
        self.mark = len(session.timeline.events)
        session.timeline.enabled = True
        self.ticks = [time.perf_counter()]

    def after_run(self, session, loss):
        """Note the step's end; write the profile once enough steps ran."""
        if self.written:
            return
        self.ticks.append(time.perf_counter())
        if len(self.ticks) > self.warm_up + self.steps:
            self.write(session)

    def end(self, session):
        """Write what was profiled if the run ended first (saying so)."""
        if not self.written and len(self.ticks) > self.warm_up + 1:
            _log.warning("--profile-steps %d: the run ended after %d profiled steps; "
                         "writing those", self.steps, len(self.ticks) - 1 - self.warm_up)
            self.write(session)

    def figures(self, session):
        """Return the profile as a dict (seconds; steady figures and plain means)."""
        events = session.timeline.events[self.mark:]
        spans = {k: [e["dur"] * 1e-6 for e in events if e["name"] == k][self.warm_up:]
                 for k in ("compute", "push_pull")}
        spans["step"] = [b - a for a, b in zip(self.ticks, self.ticks[1:])][self.warm_up:]
        mean = {k: statistics.fmean(v) if v else 0.0 for k, v in spans.items()}
        steady = {k: steady_mean(v) for k, v in spans.items()}
        step, batch = steady["step"], session.batch_size
        per_ps = session.placement.bytes_per_ps()
        return dict(
            model_bytes=sum(per_ps), bytes_per_ps=per_ps, num_ps=len(per_ps),
            workers=session.num_workers, batch_size=batch, mode=session.mode,
            bucket_bytes=session.config.bucket_bytes, layerwise=session.layerwise,
            compute_s=steady["compute"], compute_s_per_example=steady["compute"] / batch,
            push_pull_s=steady["push_pull"], step_s=step,
            overhead_s=max(0.0, step - steady["compute"] - steady["push_pull"]),
            examples_per_sec_per_worker=batch / step if step > 0 else 0.0,
            compute_s_mean=mean["compute"], push_pull_s_mean=mean["push_pull"],
            step_s_mean=mean["step"], steps=len(spans["step"]), warm_up=self.warm_up,
            block_steps=BLOCK_STEPS,
            statistic=f"median over blocks of {BLOCK_STEPS} steps of the block's mean "
                      "(the plain means alongside, *_mean)",
            device=str(session.server.device), hostname=socket.gethostname(),
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            plan_flags=f"--model-bytes {sum(per_ps)} --compute-ms {steady['compute'] * 1e3:.4g}")

    def write(self, session):
        """Write the profile, then stop recording spans nobody asked for."""
        self.written = True
        out = self.figures(session)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "w") as f:
            json.dump(out, f, indent=1)
        print(f"profile: {out['steps']} steps, model {out['model_bytes']} bytes, compute "
              f"{out['compute_s'] * 1e3:.3f} ms, push+pull {out['push_pull_s'] * 1e3:.3f} ms,"
              f" step {out['step_s'] * 1e3:.3f} ms; wrote {self.path}", flush=True)
        if not self.was_enabled:
            session.timeline.enabled = False
            del session.timeline.events[self.mark:]
