"""Session hooks: what runs around every step (stop at a step, metrics, checkpoint timing).

A hook sees the session before the first step, after every step and at the end; the
session itself decides nothing about logging or when to save.
"""

import json
import os
import sys
import time

from .summaries import EventWriter


class Hook:
    """Base of session hooks; override what you need."""

    def begin(self, session):
        """Run once the session has its starting parameters."""

    def after_run(self, session, loss):
        """Run after every step with its loss."""

    def after_skip(self, session, variable):
        """Run after a gradient holding NaN/Inf in ``variable`` was dropped (skip_nonfinite)."""

    def end(self, session):
        """Run once when the session closes."""


class StopAtStepHook(Hook):
    """Ask the session to stop once the global step reaches ``last_step``."""

    def __init__(self, last_step):
        self.last_step = last_step

    def begin(self, session):
        """Stop at once if the restored step is already there."""
        if session.global_step >= self.last_step:
            session.request_stop()

    def after_run(self, session, loss):
        """Stop when the global step has reached the last step."""
        if session.global_step >= self.last_step:
            session.request_stop()


class LoggingHook(Hook):
    """On the chief, the per-step metrics: log lines, ``metrics.jsonl`` and TensorBoard events.

    Every ``every`` global steps (and at the last) it prints ``step N, loss = L (E
    examples/sec; S sec/batch)``, appends the step's record to ``RUN_DIR/metrics.jsonl``
    and writes the same numbers as TensorBoard scalars into ``RUN_DIR`` (tags in
    ``SCALAR_TAGS``); every ``summary_every`` global steps it writes histograms of the
    gradients (``gradients/<var>``: the last gradient this worker computed) and of the
    variables (``variables/<var>``: the parameters just pulled), read from the session's
    buffers in place. A progress bar shows when stderr is a terminal. Gradients dropped for
    NaN/Inf are counted (``nonfinite_skipped``); while skipping, a line says so at the first
    skip in a row and every ``every`` skips after it, since the step does not move.
    """

    # metrics.jsonl key -> TensorBoard tag (TensorFlow's names where it has them)
    SCALAR_TAGS = {"loss": "loss", "learning_rate": "learning_rate",
                   "examples_per_sec": "examples_per_sec",
                   "global_steps_per_sec": "global_step/sec",
                   "max_staleness": "staleness/max", "max_lead": "staleness/max_lead",
                   "stale_dropped": "dropped/stale", "nonfinite_skipped": "dropped/nonfinite"}

    def __init__(self, every=20, run_dir=None, last_step=None, stream=sys.stdout,
                 summary_every=0):
        self.every = every
        self.run_dir = run_dir
        self.summary_every = summary_every if run_dir else 0
        self.last_step = last_step
        self.stream = stream
        self.metrics = None
        self.events = EventWriter(run_dir) if run_dir else None
        if self.events is not None and (every or self.summary_every):
            self.events.load()

    @classmethod
    def from_config(cls, config, stream=None):
        """Return the hook a :class:`~mpitf.config.TrainingConfig` asks for, or None.

        ``stream``: where the progress lines go (default: stdout).
        """
        if config.log_every or (config.summary_every and config.run_dir):
            return cls(config.log_every, config.run_dir, config.last_step,
                       stream=stream or sys.stdout, summary_every=config.summary_every)
        return None

    def begin(self, session):
        """Open the metrics file and start the clocks."""
        if self.run_dir and self.every:
            os.makedirs(self.run_dir, exist_ok=True)
            self.metrics = open(os.path.join(self.run_dir, "metrics.jsonl"), "a")
        if self.events is not None and (self.every or self.summary_every):
            self.events.open()  # before the first step: not a stall inside the loop
        self._mark(session)
        self.last_logged = None
        self.last_histograms = session.global_step

    def _mark(self, session):
        self.t0, self.step0 = time.monotonic(), session.global_step
        self.batches0 = session.steps_run

    def after_run(self, session, loss):
        """Log when the global step crosses a multiple of ``every``; histograms likewise."""
        step = session.global_step
        n = self.summary_every
        if n and step // n > self.last_histograms // n:
            arrays = {f"gradients/{k}": v for k, v in session.grads.items()}
            arrays.update((f"variables/{k}", v) for k, v in session.params.items())
            self.events.histograms(step, arrays)
            self.last_histograms = step
        if not self.every:
            return
        if step // self.every == (self.last_logged or self.step0) // self.every and \
                not session.should_stop():
            self._progress(session)
            return
        self._log(session, step, loss)

    def _log(self, session, step, loss):
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        batches = session.steps_run - self.batches0
        examples = (step - self.step0) * session.examples_per_global_step
        reply = session.last_reply
        record = dict(step=step, time=time.time(), loss=float(loss),
                      learning_rate=session.optimizer.learning_rate(max(step - 1, 0)),
                      examples_per_sec=examples / elapsed,
                      global_steps_per_sec=(step - self.step0) / elapsed,
                      sec_per_batch=elapsed / max(batches, 1),
                      stale_dropped=reply.dropped, max_staleness=reply.max_staleness,
                      max_lead=reply.max_lead, nonfinite_skipped=session.nonfinite_skipped)
        if sys.stderr.isatty():
            sys.stderr.write("\r\033[K")
        skipped = f"; {session.nonfinite_skipped} non-finite skipped" \
            if session.nonfinite_skipped else ""
        _say(self.stream, f"step {step}, loss = {loss:.2f} ({record['examples_per_sec']:.1f} "
                          f"examples/sec; {record['sec_per_batch']:.3f} sec/batch{skipped})")
        if self.metrics:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
        if self.events:
            self.events.scalars(step, {t: record[k] for k, t in self.SCALAR_TAGS.items()})
        self.last_logged = step
        self._mark(session)

    def after_skip(self, session, variable):
        """Say that the chief dropped a gradient, at the first skip in a row and every few."""
        n = session.skips_in_a_row
        if self.every and (n == 1 or n % self.every == 0):
            _say(self.stream, f"step {session.global_step}: skipped a gradient holding NaN "
                              f"or Inf in {variable!r} ({n} in a row, "
                              f"{session.nonfinite_skipped} in all; the job ends at "
                              f"{session.config.max_nonfinite_skips} in a row)")

    def _progress(self, session):
        if self.last_step and sys.stderr.isatty():
            done = min(1.0, session.global_step / self.last_step)
            bar = "#" * int(30 * done)
            sys.stderr.write(f"\r[{bar:<30}] {session.global_step}/{self.last_step}")
            sys.stderr.flush()

    def end(self, session):
        """Close the metrics and event files."""
        if self.metrics:
            self.metrics.close()
        if self.events:
            self.events.close()


class CheckpointSaverHook(Hook):
    """On the chief, cut a checkpoint every ``save_steps`` global steps or ``save_secs``."""

    def __init__(self, save_steps=None, save_secs=None):
        self.save_steps = save_steps
        self.save_secs = save_secs

    @classmethod
    def from_config(cls, config):
        """The hook a checkpoint directory with a step or time trigger asks for, or None."""
        if config.checkpoint_dir and (config.save_checkpoint_steps or config.save_checkpoint_secs):
            return cls(config.save_checkpoint_steps, config.save_checkpoint_secs)
        return None

    def begin(self, session):
        """Start counting from the restored step."""
        self.last_step = session.global_step
        self.last_time = time.monotonic()

    def due(self, session):
        """Return True when the next step should carry a checkpoint request.

        A cut requested with a step lands after that step (at ``global_step + 1`` in sync
        mode), so ``save_steps`` N asks for it one step early: checkpoints fall on the
        multiples of N, also after a restore or a signal cut at another step.
        """
        n = self.save_steps
        if n and (session.global_step + 1) // n > self.last_step // n:
            return True
        return bool(self.save_secs and time.monotonic() - self.last_time >= self.save_secs)

    def saved(self, session):
        """Restart the counters after a checkpoint."""
        self.last_step = session.global_step
        self.last_time = time.monotonic()


def _say(stream, line):
    """Write ``line`` and its newline in one write, so no other rank's line runs into it.

    print() makes two writes; under mpiexec another rank's line written between them was
    glued to this one, and a loop's own line was lost to a parser.
    """
    stream.write(line + "\n")
    stream.flush()
