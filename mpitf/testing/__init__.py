"""Helpers for tests: run a command under mpiexec with a deadline and collect every rank's output.

Multi-rank tests start ``mpiexec -n N python ...`` in a subprocess, so a hang becomes a
failed test (the deadline kills the whole process group) instead of a stalled CI run.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from mpitf.runtime.launch import is_openmpi, mpiexec_command

# Hydra's -prepend-rank "[R] line"; Open MPI's --output tag "[J,R]<stdout>: line"
_RANK_PREFIX = re.compile(r"^\[(?:\d+,)?(\d+)\](?:<std(?:out|err)>:)? ?(.*)$")


@dataclass
class MPIRun:
    """The outcome of one mpiexec run: exit code, output, seconds taken, per-rank lines."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool = False
    ranks: dict = field(default_factory=dict)

    @property
    def output(self):
        """Return stdout and stderr together."""
        return self.stdout + self.stderr

    def lines(self, rank):
        """Return the lines rank ``rank`` printed (needs ``tag_output=True``)."""
        return self.ranks.get(rank, [])


def run_mpi(n, argv, timeout=60, env=None, cwd=None, tag_output=False, python=True,
            mpiexec=None):
    """Run ``argv`` (a Python script and its args when ``python``) on ``n`` ranks with a deadline.

    Returns an :class:`MPIRun`; on timeout the whole process group is killed and
    ``timed_out`` is set, so callers can assert on it instead of hanging. ``mpiexec``: the
    launcher (None: :func:`~mpitf.runtime.launch.find_mpiexec`'s), e.g. Open MPI's.
    """
    argv = [sys.executable, *argv] if python else list(argv)
    cmd = mpiexec_command(n, argv, mpiexec=mpiexec, tag_output=tag_output)
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    if env:
        full_env.update(env)
    session_dir = open_mpi_session_dir(mpiexec, full_env)
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, cwd=cwd,
        start_new_session=True, stdin=subprocess.DEVNULL,
    )
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_group(proc)
        out, err = proc.communicate()
    finally:
        if session_dir:
            shutil.rmtree(session_dir, ignore_errors=True)
    result = MPIRun(proc.returncode, out, err, time.monotonic() - start, timed_out)
    if tag_output:
        for line in (out + err).splitlines():
            m = _RANK_PREFIX.match(line)
            if m:
                result.ranks.setdefault(int(m.group(1)), []).append(m.group(2))
    return result


def open_mpi_session_dir(mpiexec, env):
    """Give an Open MPI launch a ``TMPDIR`` of its own in ``env``; return it (None: Hydra).

    PRRTE names its session directories by pid (``$TMPDIR/ompi.PID``, ``prted.PID``), and a
    killed launch leaves its own behind: once pids wrap, a later launch with that pid finds
    the directory taken and ends at once ("The PMIx server's listener thread failed to
    start"). The caller removes the directory when the launch has ended.
    """
    if mpiexec is None or not is_openmpi(mpiexec):
        return None
    env["TMPDIR"] = tempfile.mkdtemp(prefix="mpitf-ompi-")
    return env["TMPDIR"]


def signal_when(n, argv, log, marker, wait=60, sig=signal.SIGTERM, cwd=None):
    """Run a Python ``argv`` on ``n`` ranks into ``log``; signal mpiexec once ``marker`` shows.

    Hydra's mpiexec forwards ``sig`` to every rank. Returns the exit code (None when the
    marker never showed within ``wait`` s) and the log's text; the group is killed after.
    """
    cmd = mpiexec_command(n, [sys.executable, *map(str, argv)])
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"),
                                start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        end = time.monotonic() + wait
        while marker not in log.read_text() and time.monotonic() < end and proc.poll() is None:
            time.sleep(0.01)
        if marker not in log.read_text():
            return None, log.read_text()
        os.kill(proc.pid, sig)
        code = proc.wait(timeout=30)
    finally:
        kill_group(proc)
    return code, log.read_text()


def kill_group(proc, sig=signal.SIGKILL):
    """Send ``sig`` to the process group of ``proc`` (mpiexec and every rank it started).

    Hydra's proxies (mpiexec's children, in a group of their own) exit once mpiexec is gone,
    without removing the topology file each keeps open (``/tmp/hydra_hwloc_xmlfile_*``):
    a SIGKILL removes those files too.
    """
    files = hydra_topology_files(proc.pid) if sig == signal.SIGKILL else ()
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    remove_files(files)


def remove_files(paths):
    """Remove ``paths``, those that are still there."""
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass  # its proxy had removed it


def children(pid):
    """Return the pids of the children of process ``pid`` (none once it is gone)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def hydra_topology_files(parent):
    """Return the Hydra topology files that the children of process ``parent`` hold open.

    A run that ends by a rank's death or a stop can leave them behind its proxies: read them
    while the run trains, remove them (:func:`remove_files`) once mpiexec has exited.
    """
    files = set()
    for pid in children(parent):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if os.path.basename(target).startswith("hydra_hwloc_xmlfile_"):
                    files.add(target)
        except OSError:
            continue  # gone meanwhile
    return files
