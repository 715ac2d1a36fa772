"""jobs/mnist_mlp.py with every worker step slowed down, so a test can hit it mid-run.

Run it exactly like jobs/mnist_mlp.py (same flags), or like another job of jobs/ named by
``MPITF_TEST_JOB`` (``ctr.py``: its flags). ``MPITF_TEST_STEP_SLEEP`` (seconds,
default 0) is slept by every worker before each step's computation; it changes no value, so
a deterministic run gives the same parameters as an unslowed one. Each worker rank also
writes its pid to ``$MPITF_TEST_PID_DIR/rank<R>-<job>-<task>.pid`` when that is set, so a
test can signal one rank without guessing from the process tree.

``MPITF_TEST_KILL=rank2@300,rank0@500`` makes rank R SIGKILL itself once its step reaches
N (a worker before its step's compute, a ps once it has applied and answered step N): a
rank of the launch at its first step at or past the first N, however late it started (in
async mode a launch's workers take their first step together, so the chief is not past N
before worker 1's first step, and so do the workers after a heal with a replacement's
first); a replacement spawned for
rank R (``--heal``, ``MPITF_REPLACES`` set) at step 310 only at an N past that, so it lives
on past ``rank2@300`` and dies at ``rank2@500``. The kill lands at a step, not at a time;
a ps's at the first such step at which every worker has pushed since the last pause or
heal: a worker's replacement still starting when a ps dies is a fault of its own (async,
under load, the chief can run 70 steps while it starts), not one a test of losses one
after another meant. Async waits for no worker, so there, with ``MPITF_TEST_KILL_DIR``
set (a folder a rank dying at N marks first), every other worker that has pushed waits at
a worker's kill step N until MPI reports it gone: under load the chief ran 250 steps
before it heard of worker 1's loss at step 150, and healed it only at the last.
``MPITF_TEST_JOIN=die`` makes every replacement SIGKILL itself before it joins.
"""

import os
import runpy
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STEP_SLEEP = float(os.environ.get("MPITF_TEST_STEP_SLEEP", "0"))
PID_DIR = os.environ.get("MPITF_TEST_PID_DIR")
KILL_DIR = os.environ.get("MPITF_TEST_KILL_DIR")
WAIT_FOR_KILL = 60.0  # seconds a worker waits at a kill's step for the rank's mark
KILLS = {}  # rank -> the steps it dies at
for entry in filter(None, os.environ.get("MPITF_TEST_KILL", "").split(",")):
    who, _, at = entry.partition("@")
    KILLS.setdefault(int(who.removeprefix("rank")), []).append(int(at))


if "MPITF_REPLACES" in os.environ and os.environ.get("MPITF_TEST_JOIN") == "die":
    os.kill(os.getpid(), signal.SIGKILL)  # a replacement that dies before it joins


def _started(step):
    """Return the step a kill must come after: ``step`` for a replacement, else none (-1)."""
    return step if "MPITF_REPLACES" in os.environ else -1


def _die_at(rank, first, step):
    """SIGKILL this process if ``step`` reached one of ``rank``'s kill steps after ``first``."""
    due = [at for at in KILLS.get(rank, ()) if first < at <= step]
    if due:
        for at in due if KILL_DIR else ():
            Path(KILL_DIR, f"rank{rank}@{at}").touch()
        os.kill(os.getpid(), signal.SIGKILL)


def _wait_for_kills(session, step):
    """Async: at another worker's kill step, wait until MPI reports it gone (once per kill).

    A kill counts as seen once one worker saw the rank fail, or a heal replaced it (then
    the rank is alive again). At most WAIT_FOR_KILL seconds each; then the step goes on,
    and the test's assertions say what came instead.
    """
    server = session.server
    for rank, steps in KILLS.items():
        if rank == server.rank or server.roles[rank][0] != "worker":
            continue  # a ps's kill waits for every worker's push: waiting there would stall
        for at in steps:
            seen = Path(KILL_DIR, f"rank{rank}@{at}.seen")
            if at > step or seen.exists():
                continue
            give_up = time.monotonic() + WAIT_FOR_KILL
            while not seen.exists() and rank not in _failed(server.comm) and \
                    time.monotonic() < give_up:
                time.sleep(0.01)
            seen.touch()


def _failed(comm):
    """Return the ranks of ``comm`` this rank knows to have failed (no acknowledgement)."""
    from mpi4py import MPI

    from mpitf.runtime import ulfm
    from mpitf.wire.protocol import TAG_PROGRESS

    try:
        comm.Iprobe(MPI.ANY_SOURCE, TAG_PROGRESS)  # lets MPI hear of a failure
    except MPI.Exception:
        pass  # it has: a failure not acknowledged yet
    return set(ulfm.translate(comm.Get_failed(), comm.Get_group()))


def _seen_at_heal(lost):
    """Count the kills of the ``lost`` ranks that landed as seen: a heal replaced them."""
    for rank in lost:
        for at in KILLS.get(rank, ()):
            if Path(KILL_DIR, f"rank{rank}@{at}").exists():
                Path(KILL_DIR, f"rank{rank}@{at}.seen").touch()


def _start_together(session):
    """Async, the workers take a step together at the start and after a heal.

    Async waits for no worker: under load the chief ran all 400 steps of a heal test before
    worker 1's first, and 172 while a replacement started, so a ps kill that needs every
    worker's push since the heal never came. So a launch's workers meet before their first
    step, and after a heal the survivors meet at their next step a replacement at its
    first (a heal at a survivor's last step would leave the replacement waiting: the tests'
    kills come well before). Sync needs nothing: a step waits for every worker's push.
    """
    if session.mode == "async":
        session.server.replica_comm.Barrier()


def _patch():
    from mpitf.runtime import server
    from mpitf.worker import session

    if STEP_SLEEP > 0 or KILLS:
        run = session.TrainingSession.run

        def slow_run(self, batch=None):
            if KILLS:
                if "_first_step" not in self.__dict__ or self.server.__dict__.pop("_healed",
                                                                                  False):
                    _start_together(self)
                elif KILL_DIR and self.mode == "async":  # it has pushed
                    _wait_for_kills(self, self.global_step)
                first = self.__dict__.setdefault("_first_step", _started(self.global_step))
                _die_at(self.server.rank, first, self.global_step)
            time.sleep(STEP_SLEEP)
            return run(self, batch)

        session.TrainingSession.run = slow_run
    if KILLS:
        from mpitf.ps import service

        apply_and_reply = service.Service.apply_and_reply

        def apply_and_maybe_die(self, grad, workers, bucket=0, steps=1, **kwargs):
            apply_and_reply(self, grad, workers, bucket, steps, **kwargs)
            first = self.__dict__.setdefault("_first_step",
                                             _started(self.state.global_step - steps))
            if all(last is not None for last in self.state.last_push):  # all train now
                _die_at(self.server.rank, first, self.state.global_step)

        service.Service.apply_and_reply = apply_and_maybe_die
    if KILLS and KILL_DIR:
        heal = server.Server.heal

        def heal_and_mark(self, facts=None):
            healed = heal(self, facts)
            _seen_at_heal(healed["lost"])
            self._healed = True  # a worker's next step meets a replacement's first
            return healed

        server.Server.heal = heal_and_mark
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
    sys.argv[0] = str(REPO / "jobs" / os.environ.get("MPITF_TEST_JOB", "mnist_mlp.py"))
    runpy.run_path(sys.argv[0], run_name="__main__")
