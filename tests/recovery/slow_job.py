"""jobs/mnist_mlp.py with every worker step slowed down, so a test can hit it mid-run.

Run it exactly like jobs/mnist_mlp.py (same flags). ``MPITF_TEST_STEP_SLEEP`` (seconds,
default 0) is slept by every worker before each step's computation; it changes no value, so
a deterministic run gives the same parameters as an unslowed one. Each worker rank also
writes its pid to ``$MPITF_TEST_PID_DIR/rank<R>-<job>-<task>.pid`` when that is set, so a
test can signal one rank without guessing from the process tree.
"""

import os
import runpy
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STEP_SLEEP = float(os.environ.get("MPITF_TEST_STEP_SLEEP", "0"))
PID_DIR = os.environ.get("MPITF_TEST_PID_DIR")


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
    _patch()
    sys.argv[0] = str(REPO / "jobs" / "mnist_mlp.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
