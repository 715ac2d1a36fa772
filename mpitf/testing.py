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
import time
from dataclasses import dataclass, field

_RANK_PREFIX = re.compile(r"^\[(\d+)\] ?(.*)$")


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


def find_mpiexec():
    """Return the mpiexec next to this Python (the MPICH wheel's), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(here):
        return here
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise RuntimeError(
            "no mpiexec found: install an MPI (pip install mpich, or load your site's MPI "
            "module) so that mpiexec is on PATH"
        )
    return found


def mpiexec_command(n, argv, mpiexec=None, tag_output=False):
    """Build the argv that runs ``argv`` on ``n`` ranks."""
    cmd = [mpiexec or find_mpiexec(), "-n", str(n)]
    if tag_output:
        cmd.append("-prepend-rank")
    return cmd + list(argv)


def run_mpi(n, argv, timeout=60, env=None, cwd=None, tag_output=False, python=True):
    """Run ``argv`` (a Python script and its args when ``python``) on ``n`` ranks with a deadline.

    Returns an :class:`MPIRun`; on timeout the whole process group is killed and
    ``timed_out`` is set, so callers can assert on it instead of hanging.
    """
    argv = [sys.executable, *argv] if python else list(argv)
    cmd = mpiexec_command(n, argv, tag_output=tag_output)
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    if env:
        full_env.update(env)
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
    result = MPIRun(proc.returncode, out, err, time.monotonic() - start, timed_out)
    if tag_output:
        for line in (out + err).splitlines():
            m = _RANK_PREFIX.match(line)
            if m:
                result.ranks.setdefault(int(m.group(1)), []).append(m.group(2))
    return result


def kill_group(proc, sig=signal.SIGKILL):
    """Send ``sig`` to the process group of ``proc`` (mpiexec and every rank it started)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
