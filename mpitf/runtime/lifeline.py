"""Notice at once when a rank on this node dies, and say which one.

MPI launchers end the whole job when one rank is killed, but their message names a pid,
often not the dead one. Each rank therefore watches the processes of the other ranks on
its node (a pidfd per peer, so the kernel wakes the watcher the instant one exits). A rank
that finishes or fails on purpose first leaves a marker file; a peer that vanishes without
one was killed, and the job ends. The line naming it comes from the node's witness
(:mod:`mpitf.runtime.witness`), a process that the lowest rank starts and the launcher
does not kill: Hydra's proxy SIGKILLs the survivors the moment it reaps a killed rank,
often before their watchers run. Without a witness the lowest surviving rank names it.
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

from . import witness

__all__ = ["Lifeline", "active"]

# The lifeline that watch() started in this process (a Server's), for the exit paths of
# runtime.exits, which run where no Server is at hand. Set by the main thread only.
_active = None


def active():
    """Return the lifeline watching in this process (None: no Server has started one)."""
    return _active


class Lifeline:
    """One rank's watch over its same-node peers and its launcher's proxy.

    A :class:`~mpitf.runtime.server.Server` builds it and calls :meth:`watch`. What the
    constructor sets is read, never written, by the watcher thread; the two things that
    change later cross threads explicitly: ``leaving`` (an Event the exit path sets, so the
    watcher reports no peer any more) and whether an exception went uncaught (written by
    the hook on the main thread, read by :meth:`mark_exit` on the same thread at exit).

    Args:
        rank: this rank.
        peers: ``{rank: pid}`` of the other ranks on this node.
        token: a job-wide token naming the marker directory.
        describe: ``describe(rank)`` names a rank for a message.
        abort: ends the job (``COMM_WORLD.Abort``).
        parent: the launcher's proxy (``os.getppid()``); when it ends, this rank exits.
        survivable: ranks whose death the job outlives (training replicas under ULFM: the
            ps acknowledges the loss and goes on, see :mod:`mpitf.runtime.ulfm`); a killed
            one is left to MPI instead of ending the job. With any (the set grows as the
            job runs), or with no parent, the node gets no :mod:`~mpitf.runtime.witness`.
    """

    def __init__(self, rank, peers, token, describe, abort, parent=None, survivable=()):
        self.rank = rank
        self.peers = dict(peers)
        self.local = tuple(sorted([rank, *self.peers]))
        self.describe = describe
        self.abort = abort
        self.parent = parent
        self.survivable = frozenset(survivable)
        self.base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self.dir = os.path.join(self.base, f"mpitf-{token}")
        self.leaving = threading.Event()
        self.uncaught = False
        self._previous_hook = None

    def watch(self):
        """Start watching; return the watcher thread (None: no peer and no parent to watch).

        Installs the ``sys.excepthook`` that marks an uncaught exception, so this rank's
        exit says "failed" and its peers end the job instead of waiting for it.
        """
        global _active
        if self.rank == self.local[0]:
            _collect_garbage(self.base)
        os.makedirs(self.dir, exist_ok=True)
        with open(os.path.join(self.dir, f"{self.rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
        self._previous_hook = sys.excepthook
        sys.excepthook = self._note_uncaught
        _active = self
        parent_fd = self._open_parent()
        if not self.peers and parent_fd is None:
            return None
        if self.parent and not self.survivable and self.rank == self.local[0]:
            self._start_witness()
        thread = threading.Thread(target=self._run, args=(parent_fd,), name="mpitf-lifeline",
                                  daemon=True)
        thread.start()
        return thread

    def mark_exit(self, reason=None):
        """Record why this rank is leaving: "done", "aborted" (it said why) or "failed".

        A rank that leaves through an exception nobody caught is marked "failed": its peers
        would otherwise wait for it until a deadline, so they end the job instead.
        """
        reason = reason or ("failed" if self.uncaught else "done")
        self.leaving.set()  # from now on this rank reports no peer
        try:
            with open(self._marker(self.rank), "w") as f:
                f.write(reason)
            # Every rank of the node has marked its exit, so no watcher reports any more:
            # the directory goes at once (a rename), so the witness never reads it half gone.
            if all(os.path.exists(self._marker(r)) for r in self.local):
                os.rename(self.dir, f"{self.dir}.done")
                shutil.rmtree(f"{self.dir}.done", ignore_errors=True)
        except OSError:
            pass

    def dead_peer_message(self):
        """Return a message naming a same-node peer that died without finishing, or None.

        An MPI call that fails because its peer vanished reports an error stack; this names
        the rank instead.
        """
        for r, pid in sorted(self.peers.items()):
            if r in self.survivable:  # its death is no error: what failed after it is
                continue
            if not process_alive(pid) and self._read_marker(r) is None:
                return self._dead(r, pid)
        return None

    def _note_uncaught(self, exc_type, exc, tb):
        self.uncaught = True
        self._previous_hook(exc_type, exc, tb)

    def _marker(self, rank):
        return os.path.join(self.dir, f"{rank}.exit")

    def _read_marker(self, r):
        """Return the exit reason rank ``r`` recorded, or None if it left none (killed)."""
        try:
            with open(self._marker(r)) as f:
                return f.read().strip() or "done"
        except OSError:
            return None

    def _dead(self, r, pid):
        return witness.dead_message(self.describe(r), pid)

    def _start_witness(self):
        """Start this node's witness and leave its pid beside the markers."""
        pids = {**self.peers, self.rank: os.getpid()}
        ranks = {r: (pids[r], self.describe(r), self._marker(r)) for r in self.local}
        pid = witness.start(ranks, self.dir)
        if pid is not None:
            with open(os.path.join(self.dir, "witness.pid"), "w") as f:
                f.write(str(pid))

    def _witness_runs(self):
        """Return True if this node's witness runs: it names a killed rank, not this rank."""
        try:
            with open(os.path.join(self.dir, "witness.pid")) as f:
                return process_alive(int(f.read()))
        except (OSError, ValueError):
            return False

    def _open_parent(self):
        """Return a pidfd on the parent (None: no parent to watch, or no pidfds)."""
        parent = self.parent
        if not parent or parent == 1 or not hasattr(os, "pidfd_open"):
            return None
        try:
            fd = os.pidfd_open(parent)
        except OSError:
            return None
        if os.getppid() != parent:  # it died before the pidfd was opened
            self._orphaned()
        return fd

    def _orphaned(self):
        """Say that the launcher's proxy is gone and end this rank (no one else can now)."""
        from .exits import EXIT_ERROR

        self.mark_exit("aborted")  # the same-node peers lose the same parent: none report us
        try:
            sys.stderr.write(f"mpitf: error on {self.describe(self.rank)} (pid "
                             f"{os.getpid()}): its launcher process (pid {self.parent}) died; "
                             f"ending this rank\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass  # the proxy held the other end of stderr
        os._exit(EXIT_ERROR)

    def _run(self, parent_fd=None):
        """The watcher thread: wait for a peer or the parent to end, and act on it."""
        peers, gone, fds = self.peers, set(), {}
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
                    self._orphaned()
            else:  # no pidfd: look every half second
                time.sleep(0.5)
                ready = [r for r, pid in peers.items()
                         if r not in gone and not process_alive(pid)]
            # A rank that failed may linger in MPI_Finalize, waiting for the others: its
            # marker says so before its process ends.
            ready += [r for r in peers if r not in gone and r not in ready
                      and self._read_marker(r) == "failed"]
            for r in ready:
                gone.add(r)
                if self.leaving.is_set():
                    return
                if self._report(r, gone):
                    return

    def _report(self, r, gone):
        """Act on peer ``r`` gone: end the job unless it finished; return True if ended."""
        why = self._read_marker(r)
        if why in ("done", "aborted") or (why is None and r in self.survivable):
            return False
        survivors = [x for x in self.local if x not in gone]
        if why is None and self._witness_runs():
            time.sleep(0.3)  # the witness names it: let the launcher forward its line
        elif survivors and min(survivors) == self.rank:
            message = self._dead(r, self.peers[r]) if why is None else (
                f"{self.describe(r)} ended on an uncaught exception (see its traceback "
                f"above); ending the job")
            sys.stderr.write(f"mpitf: error on rank {self.rank}: {message}\n")
            sys.stderr.flush()
            time.sleep(0.3)  # let the launcher forward the message before the abort
        else:
            time.sleep(2.0)  # let the lowest survivor say it before the job ends
        self.abort()
        return True


def _collect_garbage(base, settle=60.0):
    """Remove the marker directories of jobs on this node whose ranks are all gone.

    A directory younger than ``settle`` seconds is left alone: another job starting at the
    same moment may have made it and not yet written its ranks' pid files.
    """
    now = time.time()
    for name in os.listdir(base):
        path = os.path.join(base, name)
        if not name.startswith("mpitf-") or not os.path.isdir(path):
            continue
        try:
            if now - os.stat(path).st_mtime < settle:
                continue
        except OSError:
            continue
        pids = []
        for entry in os.listdir(path):
            if entry.endswith(".pid"):
                try:
                    with open(os.path.join(path, entry)) as f:
                        pids.append(int(f.read() or 0))
                except (OSError, ValueError):
                    pass
        if not any(pid > 0 and process_alive(pid) for pid in pids):
            shutil.rmtree(path, ignore_errors=True)


_PF_EXITING = 0x4  # the kernel's flag, in /proc/PID/stat's ninth field, for a task in exit


def process_alive(pid):
    """Return True if ``pid`` runs (a zombie, dead but not yet reaped, does not).

    Nor does a process that is exiting: a killed rank's memory is gone (an MPI copy from
    it fails) a moment before it is a zombie, and a peer whose copy failed must find it
    dead to name it.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0] not in ("Z", "X") and not int(fields[6]) & _PF_EXITING
    except (OSError, IndexError, ValueError):
        pass
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
