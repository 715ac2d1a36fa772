"""User-level failure mitigation (ULFM): whether this job can outlive a rank, and who died.

Open MPI started with ``mpiexec --with-ft ulfm`` keeps the other ranks running when one
dies; an operation that involves the dead rank (a receive from ``ANY_SOURCE`` included)
returns ``MPI_ERR_PROC_FAILED`` instead of ending the job, and ``Comm.Ack_failed`` /
``Comm.Get_failed`` say who is gone. MPICH's Hydra, and Open MPI without the option, end
every rank instead: there ``enabled()`` is False and nothing here is used.
"""

import os

from mpi4py import MPI

__all__ = ["enabled", "is_failure", "failed_ranks", "count_failed", "watch", "survived_a_loss"]

# The communicator a Server watches under ULFM (set once, by the main thread).
_watched = None


def enabled():
    """Return True when this rank runs under Open MPI with ULFM turned on (``--with-ft ulfm``).

    ``prterun --with-ft ulfm`` sets ``OMPI_MCA_mpi_ft_enable=1`` for every rank it starts;
    the library must be Open MPI's (mpi4py may have loaded another one).
    """
    if os.environ.get("OMPI_MCA_mpi_ft_enable", "0").lower() not in ("1", "true", "yes"):
        return False
    return hasattr(MPI.Comm, "Ack_failed") and "Open MPI" in MPI.Get_library_version()


def _failure_classes():
    names = ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED", "ERR_IN_STATUS")
    return {getattr(MPI, n) for n in names if hasattr(MPI, n)}


def is_failure(exc):
    """Return True if ``exc`` is an MPI error caused by a failed process (under ULFM).

    ``ERR_IN_STATUS`` counts: a wait over several requests reports a failed peer that way.
    """
    if not isinstance(exc, MPI.Exception):
        return False
    try:
        return exc.Get_error_class() in _failure_classes()
    except MPI.Exception:
        return False


def failed_ranks(comm):
    """Acknowledge the failures ``comm`` has seen and return the failed ranks (of ``comm``).

    After the acknowledgement a receive from ``ANY_SOURCE`` works again until another
    rank fails.
    """
    comm.Ack_failed()
    ranks = translate(comm.Get_failed(), comm.Get_group())
    return sorted(r for r in ranks if r != MPI.UNDEFINED)


def translate(group, other):
    """Return each rank of ``group`` as a rank of ``other`` (``MPI.UNDEFINED``: not in it).

    Frees both groups.
    """
    try:
        return MPI.Group.Translate_ranks(group, list(range(group.Get_size())), other)
    finally:
        group.Free()
        other.Free()


def count_failed(comm):
    """Return how many of ``comm``'s ranks this rank knows to have failed (not collective)."""
    group = comm.Get_failed()
    try:
        return group.Get_size()
    finally:
        group.Free()


def watch(comm):
    """Remember ``comm`` (the Server's): at the end, :func:`survived_a_loss` asks over it."""
    global _watched
    _watched = comm


def survived_a_loss():
    """Return True, alike on every surviving rank, if a rank of the job died (collective).

    Open MPI's ``MPI_Finalize`` waits in a fence that, once a rank has died, now and then
    never ends (seen in about 1 run in 10 here); the survivors of a loss therefore leave
    without it. Whether a rank died is agreed on (``Comm.Agree``, which completes despite
    failures), so that either every survivor finalizes or none does: one finalizing alone
    would wait for the others forever. False without ULFM or a watched communicator.
    A job that healed (``--heal``) had a rank die too, though its communicator is whole:
    its survivors leave without, but a replacement finalizes, as its launcher counts an
    exit without ``MPI_Finalize`` from a spawned process as the job's failure.
    """
    from . import heal

    if _watched is None:
        return False
    if heal.healed:  # every rank took part in the heal, the replacements too
        try:  # still a meeting point: a worker that left first would be a loss to the ps
            _watched.Agree(1)  # still waiting for its DONE, not a finished worker
        except MPI.Exception as exc:
            if not is_failure(exc):
                raise
        return heal.parent() is None
    try:
        failed = _watched.Get_failed()
        knows = failed.Get_size() > 0
        failed.Free()
        return _watched.Agree(0 if knows else 1) == 0
    except MPI.Exception as exc:
        if is_failure(exc):
            return True
        raise
