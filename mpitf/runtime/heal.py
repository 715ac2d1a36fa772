"""Heal a job under ULFM (``--heal``): each lost rank is replaced by a spawned process.

The survivors shrink the job's communicator (``Comm.Shrink``, which agrees on who is
gone), spawn one process per lost rank running this process's own command line
(``Comm.Spawn``: the job needs a free slot, which ``mpitf run`` gives by oversubscribing),
merge it in and split the merged communicator so that every rank keeps its number: the
replacement *is* the lost rank, with its task's name, and every rank -> task map, ps rank
and checkpoint reads as before. The survivors re-point the communicators they hold at the
new ones in place (:func:`repoint`), so nothing that holds them needs telling; persistent
requests made on the old ones are stale (:data:`generation`) and made again.

A spawned process learns it is a replacement from ``MPI.Comm.Get_parent()``; its
:class:`~mpitf.runtime.server.Server` joins through :func:`join_as_replacement`. It gets
none of ``mpiexec -x``'s variables, so the library mpi4py must load is named on its
command line (:func:`spawn_command`).
"""

import contextlib
import ctypes
import os
import sys
import threading
import time

from mpi4py import MPI

from . import ulfm
from .exits import EXIT_ERROR

__all__ = ["generation", "healed", "parent", "world_size", "shrink_and_spawn",
           "join_as_replacement", "repoint", "spawn_command", "within_deadline", "NoFreeSlot"]

REPLACES = "MPITF_REPLACES"  # a replacement's environment: the rank it replaces
DEADLINE = "MPITF_HEAL_DEADLINE"  # seconds a heal or a join may take (default 120)
generation = 0  # how many heals this process took part in (or came from)
healed = False  # a rank of this job died and was replaced: leave without MPI_Finalize


class NoFreeSlot(Exception):
    """Spawning a replacement failed (no free slot, most often); the job goes on without."""


def parent():
    """Return the intercommunicator to the survivors if this process replaces a lost rank."""
    comm = MPI.Comm.Get_parent()
    return None if comm == MPI.COMM_NULL else comm


def world_size():
    """Return the job's number of ranks: a replacement's ``COMM_WORLD`` holds it alone."""
    spawned = parent()
    if spawned is None:
        return MPI.COMM_WORLD.Get_size()
    return spawned.Get_remote_size() + spawned.Get_size()


def spawn_command(rank):
    """Return ``(command, args)`` that start this process again, to replace ``rank``.

    The interpreter's own argument list (``sys.orig_argv``: a ``-m`` or a wrapper script
    included) is run through ``env`` with ``MPI4PY_LIBMPI`` set: a spawned process gets
    the launcher daemon's environment, without ``mpiexec -x``'s variables, and mpi4py
    would load another MPI's library. ``MPITF_REPLACES`` names the rank it replaces
    (its own ``COMM_WORLD`` says 0; the rank in its log lines comes from there).
    """
    argv = [sys.executable, *sys.orig_argv[1:]]
    settings = [f"{k}={os.environ[k]}" for k in ("MPI4PY_LIBMPI", "OMPI_MCA_mpi_ft_enable")
                if k in os.environ]
    return "/usr/bin/env", [*settings, f"{REPLACES}={rank}", *argv]


@contextlib.contextmanager
def within_deadline(what, rank):
    """End this process, saying so, if ``what`` has not finished within the heal's deadline.

    A rank lost while a replacement joins leaves the others inside Open MPI's agreement on
    the merged communicator (``NBC_Progress`` retrying a failed peer forever): no MPI call
    returns, so a timer ends the process; every rank's does, and the job ends named, not
    hung. ``$MPITF_HEAL_DEADLINE`` seconds (default 120: a spawned Python's start-up took
    2.5-10 s here).
    """
    seconds = float(os.environ.get(DEADLINE, "120"))

    def expire():
        sys.stderr.write(f"mpitf: error on rank {rank}: {what} did not finish within "
                         f"{seconds:g} s ({DEADLINE}): a rank lost while a replacement "
                         "joined, or a replacement that never started; ending the job\n")
        sys.stderr.flush()
        os._exit(EXIT_ERROR)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def lost_ranks(comm, shrunk):
    """Return the ranks of ``comm`` that are not in ``shrunk`` (the lost ones), sorted."""
    ranks = ulfm.translate(comm.Get_group(), shrunk.Get_group())
    return [r for r, there in enumerate(ranks) if there == MPI.UNDEFINED]


def shrink_and_spawn(comm, known):
    """Survivors: replace ``comm``'s lost ranks; return ``(new comm, lost ranks, seconds)``.

    Collective over the survivors of ``comm``. ``known`` (a picklable dict from the
    lowest survivor: the roles, the token, ...) is handed to each replacement. The new
    communicator has ``comm``'s size and ranks, the replacements at the lost ranks.
    Raises :class:`NoFreeSlot` (on every survivor) when no process could be spawned.
    """
    global generation, healed
    start = time.monotonic()
    shrunk = comm.Shrink()
    shrunk.Set_errhandler(MPI.ERRORS_RETURN)
    lost = lost_ranks(comm, shrunk)
    commands, args = zip(*(spawn_command(rank) for rank in lost))
    info = MPI.Info.Create()
    info.Set("wdir", os.getcwd())
    try:
        inter = shrunk.Spawn_multiple(list(commands), list(args), [1] * len(lost),
                                      [info] * len(lost), root=0)
    except MPI.Exception as exc:
        raise NoFreeSlot(exc.Get_error_string()) from None
    finally:
        info.Free()
    merged = inter.Merge(high=False)
    merged.bcast(dict(known, lost=lost) if merged.Get_rank() == 0 else None, root=0)
    new = merged.Split(0, comm.Get_rank())
    new.Set_errhandler(MPI.ERRORS_RETURN)
    for c in (merged, inter, shrunk):
        c.Free()
    generation += 1
    healed = True
    return new, lost, time.monotonic() - start


def join_as_replacement(spawned):
    """A replacement: merge with the survivors; return ``(comm, what they know)``.

    The new communicator gives this process the rank it replaces (``MPITF_REPLACES``).
    """
    global generation, healed
    merged = spawned.Merge(high=True)
    known = merged.bcast(None, root=0)
    comm = merged.Split(0, int(os.environ[REPLACES]))
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    merged.Free()
    generation += 1
    healed = True
    return comm, known


def repoint(comm, new):
    """Make the mpi4py object ``comm`` stand for the communicator ``new`` (in place).

    Every part of the job holds the Server's communicator objects; re-pointing them
    saves telling each. ``MPI._addressof`` is mpi4py's address of the object's handle
    (meant for C code that writes a communicator, as ``MPI_Comm_dup`` does); the old
    handle is returned, still valid, for what the caller must finish on it.
    """
    old, size = type(comm)(), MPI._sizeof(comm)
    ctypes.memmove(MPI._addressof(old), MPI._addressof(comm), size)
    ctypes.memmove(MPI._addressof(comm), MPI._addressof(new), size)
    return old
