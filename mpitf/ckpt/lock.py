"""One owner per checkpoint directory: ``ROOT/.mpitf-lock``, held for the job's lifetime.

The chief creates the lock file with ``O_CREAT | O_EXCL`` (atomic on local file systems,
NFSv3+, Lustre and GPFS), writes who it is (host, pid, process start, Slurm job id), and
keeps it open with ``flock`` held where the file system honours it. A second job finds the
file and is refused with the owner's name. A lock whose owner is gone is taken over: on
the same host when its pid is dead or now belongs to another process (the start time
differs); on any host when it is this Slurm job's own lock from before a requeue. A lock
held from another host is never guessed stale: the message says how to clear it.
``docs/checkpoint-format.md`` ("One owner per directory") says what this relies on.
"""

import atexit
import contextlib
import errno
import fcntl
import json
import os
import socket
import time

from ..errors import CheckpointError

LOCK = ".mpitf-lock"
_held = {}  # realpath of the lock file -> Lock, for this process


class CheckpointLockedError(CheckpointError):
    """Another live job owns the checkpoint directory."""


def _proc_start(pid):
    """Return an id of process ``pid``'s start (boot id and start tick), or None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            tick = f.read().rsplit(")", 1)[1].split()[19]
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()}:{tick}"
    except (OSError, IndexError):
        return None


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                return False  # exited, not yet reaped
    except (OSError, IndexError):
        pass  # no /proc (or the pid is gone): ask kill()
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def whoami():
    """Return this process's owner record: host, pid, start, Slurm job, time."""
    slurm = os.environ.get("SLURM_JOB_ID")
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _proc_start(os.getpid()),
            "slurm_job_id": slurm, "slurm_restart_count":
                int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) if slurm else None,
            "time": time.time()}


def describe(owner):
    """Return the owner record as a phrase: ``pid 123 on node7 (Slurm job 42) since ...``."""
    text = f"pid {owner.get('pid')} on {owner.get('host')}"
    if owner.get("slurm_job_id"):
        text += f" (Slurm job {owner['slurm_job_id']})"
    when = owner.get("time")
    if isinstance(when, (int, float)):
        text += time.strftime(" since %Y-%m-%d %H:%M:%S UTC", time.gmtime(when))
    return text


def stale_reason(owner, me, flock_free=False):
    """Return why the lock of ``owner`` may be taken over by ``me``, or None if it may not.

    ``flock_free``: the lock file's flock was just granted to ``me``.
    """
    same_job = owner.get("slurm_job_id") and owner.get("slurm_job_id") == me["slurm_job_id"]
    if same_job and (owner.get("slurm_restart_count") or 0) < (me["slurm_restart_count"] or 0):
        return f"it is this Slurm job's own lock from before its requeue ({describe(owner)})"
    if owner.get("host") != me["host"]:
        return None
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return None
    if pid == me["pid"] and owner.get("start") == me["start"]:
        return None  # this very process: _held answers before we get here
    if not _alive(pid):
        return f"its owner ({describe(owner)}) is gone"
    if flock_free and owner.get("flock"):
        return f"its owner ({describe(owner)}) no longer holds it (it is exiting)"
    start = _proc_start(pid)
    if owner.get("start") and start and start != owner["start"]:
        return f"pid {pid} is now another process than its owner ({describe(owner)})"
    return None


class Lock:
    """A held checkpoint-directory lock; :meth:`release` removes the file (also at exit)."""

    def __init__(self, path, fd, owner):
        self.path, self.fd, self.owner = path, fd, owner

    def release(self):
        """Remove the lock file if it is still ours, and close it."""
        if self.fd is None:
            return
        try:
            if _owner_at(self.path) == self.owner:
                os.remove(self.path)
        except OSError:
            pass  # already gone or the directory went away: nothing left to release
        os.close(self.fd)
        self.fd = None
        _held.pop(self.path, None)


def _owner_at(path):
    """Return the owner record in the lock file at ``path`` (None if unreadable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return _owner(fd)
    finally:
        os.close(fd)


def _flock(fd):
    """Try an exclusive flock: True (got it), False (held elsewhere), None (unsupported)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:  # ENOLCK, ENOSYS, EOPNOTSUPP...: this file system has no flock
        return None


def _fs_error(root, e):
    cause = e.strerror or str(e)
    if e.errno == errno.EROFS:
        cause = "read-only file system"
    elif e.errno in (errno.EACCES, errno.EPERM):
        cause = "not writable (permission denied)"
    elif e.errno == errno.ENOTDIR:
        cause = "a part of the path is a file, not a directory"
    return CheckpointError(f"checkpoint directory {root}: {cause}")


def prepare_root(root):
    """Create ``root`` if needed; raise one-line CheckpointError if it cannot hold checkpoints."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"checkpoint directory {root}: is a file, not a directory; "
                              "pass a directory to --checkpoint-dir")
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise _fs_error(root, e) from None


def acquire(root, log=print):
    """Take the lock of checkpoint directory ``root`` for this process; return the Lock.

    Creates ``root`` if needed. Idempotent within a process. Raises CheckpointLockedError
    naming the owner if a live job holds it, and CheckpointError (one line: path and cause)
    if the directory cannot be written.
    """
    prepare_root(root)
    path = os.path.realpath(os.path.join(root, LOCK))
    if path in _held:
        return _held[path]
    me = whoami()
    for _ in range(5):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            _take_over(root, path, me, log)  # raises unless the lock is gone or stale
            continue
        except OSError as e:
            raise _fs_error(root, e) from None
        me["flock"] = _flock(fd) is True
        try:
            os.write(fd, (json.dumps(me) + "\n").encode())
            os.fsync(fd)
        except OSError as e:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.remove(path)
            raise _fs_error(root, e) from None
        lock = Lock(path, fd, json.loads(json.dumps(me)))
        _held[path] = lock
        atexit.register(lock.release)
        return lock
    raise CheckpointLockedError(f"checkpoint directory {root}: its lock {path} keeps changing "
                                "owner; another job is starting on it")


def _take_over(root, path, me, log):
    """Remove a stale lock file so the caller can create its own; raise if it is not stale."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return  # its owner just released it
    except OSError as e:
        raise _fs_error(root, e) from None
    try:
        owner = _owner(fd)
        if owner is None:  # being written this instant, or garbage: look once more
            time.sleep(0.2)
            owner = _owner(fd)
        got = _flock(fd)
        # A job killed a moment ago may still be exiting: give its flock a second to go.
        end = time.monotonic() + 1.0
        while got is False and owner and owner.get("host") == me["host"] \
                and time.monotonic() < end:
            time.sleep(0.05)
            got = _flock(fd)
        how = f"if that job has ended, remove {path} and start again"
        if got is False:
            raise CheckpointLockedError(
                f"checkpoint directory {root} is in use by "
                f"{describe(owner) if owner else 'another job'}; {how}")
        if owner is None:
            raise CheckpointLockedError(f"checkpoint directory {root}: unreadable lock file "
                                        f"{path}; {how}")
        why = stale_reason(owner, me, flock_free=got is True)
        if why is None:
            raise CheckpointLockedError(f"checkpoint directory {root} is in use by "
                                        f"{describe(owner)}; {how}")
        try:  # still the file we judged (not one a racing job just created)?
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return
        if same:
            os.remove(path)
            log(f"taking over the lock of {root}: {why}")
    finally:
        os.close(fd)


def _owner(fd):
    os.lseek(fd, 0, os.SEEK_SET)
    data = os.read(fd, 65536)
    try:
        owner = json.loads(data.decode())
    except (ValueError, UnicodeDecodeError):
        return None
    return owner if isinstance(owner, dict) else None
