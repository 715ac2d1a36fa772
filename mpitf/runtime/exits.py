"""Turn an exception on any rank into one clear message and a non-zero exit of every rank.

The MPI runtime often fails to notice that one process raised and exited, and the others
then wait forever for its messages. So an error that only this rank saw ends the whole job
with ``MPI.Abort``; an error every rank saw alike (a bad cluster spec, checked after the
ranks shared their host names) is printed once, by rank 0, and each rank exits on its own.
"""

import argparse
import contextlib
import logging
import os
import sys
import time

from ..errors import CollectiveError, MpitfError

EXIT_ERROR = 1
EXIT_USAGE = 2
# Exit code meaning "a checkpoint was written on a signal: requeue me" (sysexits' EX_TEMPFAIL).
EXIT_REQUEUE = 75
# Exit code of a job ended because a checkpoint could not be written (sysexits' EX_IOERR).
EXIT_IO = 74


def world_rank():
    """Return this process's rank in COMM_WORLD, from the launcher's environment if possible.

    A process spawned to replace a lost rank (``--heal``) is that rank.
    """
    for name in ("MPITF_REPLACES", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


class RankParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are printed by rank 0 only (each rank exits 2)."""

    def error(self, message):
        """Print the usage error once for the whole job and exit with code 2."""
        if world_rank() == 0:
            self.print_usage(sys.stderr)
            sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(EXIT_USAGE)

    def print_help(self, file=None):
        """Print help on rank 0 only."""
        if world_rank() == 0:
            super().print_help(file)


def setup_logging(verbose=False):
    """Log mpitf's notes to stderr, prefixed with the rank; other ranks than 0 only warn.

    One copy of each note is enough; ``verbose`` shows every rank's notes and debug lines.
    """
    level = logging.DEBUG if verbose else logging.INFO if world_rank() == 0 else logging.WARNING
    logging.basicConfig(level=level, format=f"[rank {world_rank()}] %(levelname)s %(message)s",
                        stream=sys.stderr)
    logging.getLogger("mpitf").setLevel(level)


def collective(exc):
    """Return ``exc`` as a :class:`~mpitf.errors.CollectiveError`: every rank raised it alike.

    Rank 0 alone prints it; every rank exits 2.
    """
    return exc if isinstance(exc, CollectiveError) else CollectiveError(exc)


def report(exc):
    """Print one line naming the rank and the error."""
    sys.stderr.write(f"mpitf: error on rank {world_rank()}: {exc}\n")
    sys.stderr.flush()


@contextlib.contextmanager
def abort_on_error():
    """Run the body; on an exception print it and end every rank with a non-zero exit."""
    try:
        yield
    except SystemExit:
        raise
    except KeyboardInterrupt:
        _abort(130)
    except BaseException as exc:  # noqa: BLE001 - every failure must end the whole job
        if isinstance(exc, CollectiveError):
            # Every rank raised this same error from the same shared facts: say it once.
            if world_rank() == 0:
                report(exc)
            sys.exit(EXIT_USAGE)
        from . import lifeline

        watching = lifeline.active()
        dead = watching.dead_peer_message() if watching is not None else None
        if dead is not None:  # the real cause: an MPI error stack would only obscure it
            report(dead)
            _abort(EXIT_ERROR)
        report(exc)
        if not isinstance(exc, MpitfError):
            import traceback

            traceback.print_exc()
        _abort(getattr(exc, "exit_code", EXIT_ERROR))



def end_job(exc, first=True):
    """End every rank on an error a library call found (no abort_on_error around it).

    ``mpitf.torch``'s and ``mpitf.jax``'s ``DistributedOptimizer`` run inside a user's
    script, which may not wrap its body in :func:`abort_on_error`: without this, the rank
    would end on a traceback and its peers would wait for it. One line names the error
    (no traceback: it says what to do), and the job ends with its exit code (2 for a
    configuration error). A rank other than the ``first`` (replica 0), which usually met
    the same error, waits a moment so that the first's line is the only one.
    """
    if not first:
        time.sleep(2.0)
    report(exc)
    _abort(getattr(exc, "exit_code", EXIT_USAGE))


def run_job(main):
    """Run a job's ``main()`` as its process: an error ends every rank; exit with its code."""
    with abort_on_error():
        code = main()
        from . import job_end, lifeline, ulfm

        left_without_finalize = ulfm.survived_a_loss()
        job_end.record(code)
        if left_without_finalize:  # every survivor leaves without MPI_Finalize (see there)
            watching = lifeline.active()
            if watching is not None:
                watching.mark_exit()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code or 0)
    sys.exit(code)


def _abort(code):
    from . import lifeline

    watching = lifeline.active()
    if watching is not None:  # the error above is the cause: peers need not report us
        watching.mark_exit("aborted")
    sys.stderr.flush()
    sys.stdout.flush()
    time.sleep(0.3)  # the launcher drops output still in flight when the job is aborted
    from mpi4py import MPI

    MPI.COMM_WORLD.Abort(code)
    # MPICH's Abort under hydra may return before the launcher kills this process; the
    # script must not go on (``sys.exit(code)`` after the ``with`` would raise NameError).
    os._exit(code)


class CheckpointSignals:
    """Catch SIGTERM and SIGUSR1 so a rank can finish its step, checkpoint and exit.

    Slurm sends SIGUSR1 ahead of the time limit (``--signal=B:USR1@120``, forwarded by the
    batch script) and SIGTERM when the job is cancelled or preempted; either default action
    would kill the rank mid-step.
    """

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self):
        self.received = None

    def install(self):
        """Install the handlers (main thread only); return self."""
        import atexit
        import signal

        for name in self.SIGNALS:
            signal.signal(getattr(signal, name), self._handle)
        # Python puts the default action back when it shuts down, before MPI_Finalize runs,
        # and Hydra (-disable-auto-cleanup) sends SIGUSR1 to ranks still finalizing when a
        # peer exits: ignore it once this rank is on its way out.
        atexit.register(signal.signal, signal.SIGUSR1, signal.SIG_IGN)
        return self

    def _handle(self, signum, frame):
        import signal

        self.received = signal.Signals(signum).name

    @property
    def requested(self):
        """Return True once a checkpoint-and-exit signal has arrived."""
        return self.received is not None
