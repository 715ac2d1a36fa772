"""Name a rank of this node that a signal killed, from a process the launcher does not kill.

Hydra's proxy SIGKILLs every rank of its node as soon as it reaps one that a signal
killed, with ``-disable-auto-cleanup`` or without (``proxy/pmip.c``, MPICH 5.0), so the
survivors' lifelines (:mod:`mpitf.runtime.lifeline`) often die before they can say which
rank it was. The lowest rank of each node therefore starts this witness in a process group
of its own, out of reach of the proxy's ``killpg``. It holds that rank's stderr, which the
proxy forwards until every holder has closed it, and it exits once every rank of the node
has. It runs as a script (``python -I -S witness.py``): it imports nothing from mpitf.
"""

import json
import os
import select
import subprocess
import sys

__all__ = ["dead_message", "start"]


def dead_message(name, pid):
    """Return the line that names a rank gone without leaving a marker."""
    return f"{name} (pid {pid}) died without finishing (killed?); ending the job"


def start(ranks, directory):
    """Start the witness of this node's ``ranks``; return its pid (None: it could not start).

    Args:
        ranks: ``{rank: (pid, name, marker)}``, every rank of this node; ``marker`` is the
            file a rank writes when it leaves on purpose (see ``Lifeline.mark_exit``).
        directory: the markers' directory; the ranks rename it away once all have left.
    """
    if not _pidfds():
        return None
    spec = json.dumps({"ranks": {str(r): list(v) for r, v in ranks.items()},
                       "directory": directory})
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), spec],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                start_new_session=True)
    except OSError:
        return None
    return proc.pid


def _pidfds():
    """Return True if this kernel gives pidfds (Linux 5.3 and later)."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return True


def _reason(marker):
    try:
        with open(marker) as f:
            return f.read().strip() or "done"
    except OSError:
        return None


def _unexplained(ranks, r, directory):
    """Return True if rank ``r`` left no marker while no rank of the node ended the job."""
    reasons = {x: _reason(marker) for x, (_, _, marker) in ranks.items()}
    if reasons[r] is not None or {"aborted", "failed"} & set(reasons.values()):
        return False
    return os.path.isdir(directory)  # gone: every rank had marked its exit


def watch(ranks, directory):
    """Wait until every rank has gone; name the first that left no marker while the job ran."""
    fds, gone = {}, []
    for r, (pid, _, _) in ranks.items():
        try:
            fds[os.pidfd_open(pid)] = r
        except ProcessLookupError:  # already gone
            gone.append(r)
        except OSError:  # out of descriptors: leave the naming to the lifelines
            return
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    named = False
    while True:
        for r in gone:
            if not named and _unexplained(ranks, r, directory):
                named = True
                pid, name, _ = ranks[r]
                try:
                    sys.stderr.write(f"mpitf: error: {dead_message(name, pid)}\n")
                    sys.stderr.flush()
                except (OSError, ValueError):
                    pass  # the launcher's proxy is gone too
        if not fds:
            return
        gone = []
        for fd, _ in poller.poll():
            poller.unregister(fd)
            os.close(fd)
            gone.append(fds.pop(fd))


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    watch({int(r): tuple(v) for r, v in spec["ranks"].items()}, spec["directory"])
