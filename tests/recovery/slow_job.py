"""jobs/mnist_mlp.py with every worker step slowed down, so a test can hit it mid-run.

Run it exactly like jobs/mnist_mlp.py (same flags). ``MPITF_TEST_STEP_SLEEP`` (seconds,
default 0) is slept by every worker before each step's computation; it changes no value, so
a deterministic run gives the same parameters as an unslowed one. Each worker rank also
writes its pid to ``$MPITF_TEST_PID_DIR/rank<R>-<job>-<task>.pid`` when that is set, so a
test can signal one rank without guessing from the process tree. With
``MPITF_TEST_STDERR_DIR`` set, each rank also copies what it writes to ``sys.stderr`` into
``$MPITF_TEST_STDERR_DIR/rank.<R>`` itself, before the stream: a line written just before the
job is torn down (the lifeline's, naming a dead rank) is then in the file, where the launcher
may end before forwarding it.
"""

import os
import runpy
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STEP_SLEEP = float(os.environ.get("MPITF_TEST_STEP_SLEEP", "0"))
PID_DIR = os.environ.get("MPITF_TEST_PID_DIR")
STDERR_DIR = os.environ.get("MPITF_TEST_STDERR_DIR")


class _Tee:
    """``sys.stderr`` that writes each text to a file first (flushed), then to the stream."""

    def __init__(self, stream, path):
        self.stream, self.copy = stream, open(path, "a")

    def write(self, text):
        self.copy.write(text)
        self.copy.flush()
        return self.stream.write(text)

    def flush(self):
        self.copy.flush()
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _patch():
    from mpitf.runtime import server
    from mpitf.worker import session

    if STEP_SLEEP > 0:
        run = session.TrainingSession.run

        def slow_run(self, batch=None):
            time.sleep(STEP_SLEEP)
            return run(self, batch)

        session.TrainingSession.run = slow_run
    if PID_DIR:
        init = server.Server.__init__

        def init_and_record(self, *args, **kwargs):
            init(self, *args, **kwargs)
            name = f"rank{self.rank}-{self.job_name}-{self.task_index}.pid"
            tmp = os.path.join(PID_DIR, name + ".tmp")
            with open(tmp, "w") as f:
                f.write(f"{os.getpid()}\n")
            os.replace(tmp, os.path.join(PID_DIR, name))

        server.Server.__init__ = init_and_record


if __name__ == "__main__":
    if STDERR_DIR:  # Hydra gives each rank its rank as PMI_RANK
        sys.stderr = _Tee(sys.stderr, os.path.join(STDERR_DIR, f"rank.{os.environ['PMI_RANK']}"))
    _patch()
    sys.argv[0] = str(REPO / "jobs" / "mnist_mlp.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
