"""Notice at once when a rank on this node dies, and say which one.

MPI launchers end the whole job when one rank is killed, but their message names a pid,
often not the dead one. Each rank therefore watches the processes of the other ranks on
its node (a pidfd per peer, so the kernel wakes the watcher the instant one exits). A rank
that finishes or fails on purpose first leaves a marker file; a peer that vanishes without
one was killed, and the lowest surviving rank of the node names it and ends the job.
Ranks on other nodes are covered by the deadlines on every wait.

Each rank also watches its parent, the launcher's proxy (``hydra_pmi_proxy``, ``orted``,
``slurmstepd``): when it dies, nobody can forward this rank's output or end the job, so
the rank says so and exits instead of training on as an orphan.
"""

import os
import select
import shutil
import sys
import tempfile
import threading
import time

_state = {"dir": None, "rank": None, "local": (), "peers": {}, "describe": str}


def _marker(rank):
    return os.path.join(_state["dir"], f"{rank}.exit")


def mark_exit(reason=None):
    """Record why this rank is leaving: "done", "aborted" (it said why) or "failed".

    A rank that leaves through an exception nobody caught is marked "failed": its peers
    would otherwise wait for it until a deadline, so they end the job instead.
    """
    if _state["dir"] is None:
        return
    reason = reason or ("failed" if _state.get("uncaught") else "done")
    _state["leaving"] = True  # from now on this rank reports no peer
    try:
        with open(_marker(_state["rank"]), "w") as f:
            f.write(reason)
        # Every rank of the node has marked its exit, so no watcher reports any more.
        if all(os.path.exists(_marker(r)) for r in _state["local"]):
            shutil.rmtree(_state["dir"], ignore_errors=True)
    except OSError:
        pass


def watch(rank, peers, token, describe, abort, parent=None):
    """Start watching the same-node ``peers`` ({rank: pid}); report a killed one.

    ``describe(rank)`` names a rank for the message; ``abort()`` ends the job. When the
    process ``parent`` (the launcher's proxy, ``os.getppid()``) ends, this rank exits.
    """
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    if rank == min([rank, *peers]):
        _collect_garbage(base)
    _state.update(dir=os.path.join(base, f"mpitf-{token}"), rank=rank,
                  local=tuple(sorted([rank, *peers])), peers=dict(peers), describe=describe)
    os.makedirs(_state["dir"], exist_ok=True)
    with open(os.path.join(_state["dir"], f"{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    parent_fd = _open_parent(parent)
    if not peers and parent_fd is None:
        return None
    thread = threading.Thread(target=_run, args=(rank, dict(peers), describe, abort,
                                                 parent_fd),
                              name="mpitf-lifeline", daemon=True)
    thread.start()
    return thread


def dead_peer_message():
    """Return a message naming a same-node peer that died without finishing, or None.

    An MPI call that fails because its peer vanished reports an error stack; this names
    the rank instead.
    """
    for r, pid in sorted(_state["peers"].items()):
        if not _alive(pid) and _read_marker(r) is None:
            return _dead(r, pid)
    return None


def _read_marker(r):
    """Return the exit reason rank ``r`` recorded, or None if it left none (killed)."""
    try:
        with open(_marker(r)) as f:
            return f.read().strip() or "done"
    except (OSError, TypeError):
        return None


def _note_uncaught(exc_type, exc, tb):
    _state["uncaught"] = True
    _previous_excepthook(exc_type, exc, tb)


_previous_excepthook = sys.excepthook
sys.excepthook = _note_uncaught


def _dead(r, pid):
    return (f"{_state['describe'](r)} (pid {pid}) died without finishing (killed?); "
            f"ending the job")


def _open_parent(parent):
    """Return a pidfd on ``parent`` (None: no parent to watch, or no pidfds)."""
    if not parent or parent == 1 or not hasattr(os, "pidfd_open"):
        return None
    try:
        fd = os.pidfd_open(parent)
    except OSError:
        return None
    if os.getppid() != parent:  # it died before the pidfd was opened
        _orphaned(parent)
    return fd


def _orphaned(parent):
    """Say that the launcher's proxy is gone and end this rank (no one else can now)."""
    from .exits import EXIT_ERROR

    mark_exit("aborted")  # the same-node peers lose the same parent: none need report us
    try:
        sys.stderr.write(f"mpitf: error on {_state['describe'](_state['rank'])} (pid "
                         f"{os.getpid()}): its launcher process (pid {parent}) died; "
                         f"ending this rank\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass  # the proxy held the other end of stderr
    os._exit(EXIT_ERROR)


def _run(rank, peers, describe, abort, parent_fd=None):
    gone = set()
    fds = {}
    parent = os.getppid()
    if hasattr(os, "pidfd_open"):
        for r, pid in peers.items():
            try:
                fds[os.pidfd_open(pid)] = r
            except OSError:
                gone.add(r)
    if parent_fd is not None:
        fds[parent_fd] = None
    while len(gone) < len(peers) or parent_fd is not None:
        if fds:
            poller = select.poll()
            for fd in fds:
                poller.register(fd, select.POLLIN)
            ready = [fds.pop(fd) for fd, _ in poller.poll(1000)]
            if None in ready:
                _orphaned(parent)
        else:  # no pidfd: look every half second
            time.sleep(0.5)
            ready = [r for r, pid in peers.items() if r not in gone and not _alive(pid)]
        # A rank that failed may linger in MPI_Finalize, waiting for the others: its marker
        # says so before its process ends.
        ready += [r for r in peers if r not in gone and r not in ready
                  and _read_marker(r) == "failed"]
        for r in ready:
            gone.add(r)
            if _state.get("leaving"):
                return
            why = _read_marker(r)
            if why in ("done", "aborted"):
                continue
            survivors = [x for x in (rank, *peers) if x not in gone]
            if survivors and min(survivors) == rank:
                message = _dead(r, peers[r]) if why is None else (
                    f"{_state['describe'](r)} ended on an uncaught exception (see its "
                    f"traceback above); ending the job")
                sys.stderr.write(f"mpitf: error on rank {rank}: {message}\n")
                sys.stderr.flush()
                time.sleep(0.3)  # let the launcher forward the message before the abort
            else:
                time.sleep(2.0)  # let the lowest survivor say it before the job ends
            abort()
            return


def _collect_garbage(base):
    """Remove the marker directories of jobs on this node whose ranks are all gone."""
    for name in os.listdir(base):
        path = os.path.join(base, name)
        if not name.startswith("mpitf-") or not os.path.isdir(path):
            continue
        pids = []
        for entry in os.listdir(path):
            if entry.endswith(".pid"):
                try:
                    with open(os.path.join(path, entry)) as f:
                        pids.append(int(f.read() or 0))
                except (OSError, ValueError):
                    pass
        if not any(pid > 0 and _alive(pid) for pid in pids):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid):
    """Return True if ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
