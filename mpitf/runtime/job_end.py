"""How ``mpitf run`` learns that its job ended when the launcher does not say so.

Open MPI's launcher (PRRTE's ``prterun``) now and then stays alive after every rank of a
job that healed has ended: the survivors leave without ``MPI_Finalize`` (see
:func:`mpitf.runtime.ulfm.survived_a_loss`) and PRRTE misses the job's end (seen here
twice: in a whole-suite run, and once in 13 loaded runs of the heal tests;
openpmix/prrte#1839 is an open report of such a hang). Under
Slurm that would hold the allocation until its time limit. So each rank of a local run
records its exit code and pid in ``mpitf run``'s folder (:func:`record`, the rank that a
replacement replaces under its number), and ``mpitf run`` (:func:`wait`) ends a launcher
that outlives every one of its ranks by :data:`GRACE` seconds, returning the ranks' code.
A rank killed and not replaced records nothing, so a launcher is never ended early.
"""

import os
import subprocess
import sys
import time

from .lifeline import process_alive

FOLDER = "MPITF_EXIT_RECORDS"  # the environment variable naming mpitf run's folder
GRACE = 20.0  # seconds a launcher may outlive its last rank before mpitf run ends it


def record(code):
    """Record this rank's exit ``code`` (and pid) for ``mpitf run``, if it asked."""
    folder = os.environ.get(FOLDER)
    if not folder:
        return
    from .exits import world_rank

    path = os.path.join(folder, f"rank{world_rank()}")
    try:
        with open(f"{path}.{os.getpid()}", "w") as f:
            f.write(f"{int(code or 0)} {os.getpid()}\n")
        os.replace(f"{path}.{os.getpid()}", path)  # a replacement's record overwrites
    except OSError:
        pass  # without it, mpitf run waits for the launcher as it would anyway


def ended(folder, ranks):
    """Return every rank's recorded exit code once all ``ranks`` recorded and left, else None."""
    codes = []
    for rank in range(ranks):
        try:
            with open(os.path.join(folder, f"rank{rank}")) as f:
                code, pid = map(int, f.read().split())
        except (OSError, ValueError):
            return None
        if process_alive(pid):
            return None
        codes.append(code)
    return codes


def wait(launcher, ranks, folder, grace=GRACE):
    """Wait for ``launcher`` (a Popen) to end; end it if it outlives all ``ranks`` by ``grace`` s.

    Returns the launcher's exit code, or, when mpitf run had to end it, the first non-zero
    code the ranks recorded (0 if none).
    """
    since = None
    while True:
        try:
            return launcher.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        codes = ended(folder, ranks)
        if codes is None:
            since = None
            continue
        since = since or time.monotonic()
        if time.monotonic() - since < grace:
            continue
        sys.stderr.write(f"mpitf: every rank ended (exit codes {codes}), but the launcher did "
                         f"not return within {grace:g} s; ending it\n")
        launcher.terminate()
        try:
            launcher.wait(timeout=10)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()
        return next((code for code in codes if code), 0)
