"""slurm/train.sbatch on a real single-node Slurm: checkpoint on SIGUSR1, requeue, resume;
and srun's ranks running the tasks TensorFlow's SlurmClusterResolver gives them.

The session fixture starts Slurm with tests/slurm/start-slurm.sh (root and Debian's packages).
Where this machine cannot run it, the tests skip; with MPITF_TEST_SLURM=1 they fail instead.
About 20 s in all, most of it Slurm's delay before a requeued job starts again.
"""

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import REPO

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SBATCH_SCRIPT = REPO / "slurm" / "train.sbatch"
# The job under test: the real training job (tests/slurm/fake_job.py, a stand-in with the
# same contract and slow steps, works too: JOB_ARGS = ["--steps", "60"], FINAL_STEP = 60).
# Its steps take about a millisecond: the USR1 lands while its tasks are stopped (see
# usr1_after_step), so it cannot finish first.
JOB_SCRIPT = REPO / "jobs" / "mnist_mlp.py"
JOB_ARGS = ["--num-ps", "1", "--steps", "2000", "--log-every", "500"]
FINAL_STEP = 2000
LONG_JOB_ARGS = ["--num-ps", "1", "--steps", "2000000", "--log-every", "1000"]
TF_TASKS = REPO / "tests" / "slurm" / "tf_tasks.py"
START = REPO / "tests" / "slurm" / "start-slurm.sh"
STOP = REPO / "tests" / "slurm" / "stop-slurm.sh"
SLURM_ROOT = os.environ.get("SLURM_TEST_ROOT", "/tmp/mpitf-slurm")
EXIT_CANNOT = 3  # start-slurm.sh: this machine cannot run Slurm (not root, no apt, no packages)
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


def _unavailable(reason):
    if os.environ.get("MPITF_TEST_SLURM") == "1":
        pytest.fail(f"MPITF_TEST_SLURM=1 but Slurm cannot run here: {reason}")
    pytest.skip(f"cannot run Slurm here: {reason}")


def _slurmctld_alive():
    try:
        pid = Path(SLURM_ROOT, "run", "slurmctld.pid").read_text().strip()
        return Path("/proc", pid, "comm").read_text().strip() == "slurmctld"
    except OSError:
        return False


@pytest.fixture(scope="session")
def slurm_env():
    """Start the local Slurm; give the environment for its clients; stop it if a test started it.

    Several pytest sessions (the suite's two xdist workers among them) may share this Slurm:
    each holds a shared lock on a file while it uses it, one at a time starts (or finds) the
    daemons under a second lock, and the last one out stops them, if a test session (not a
    person) started them. MPITF_SLURM_KEEP=1 leaves them running.
    """
    if sys.platform != "linux" or not hasattr(os, "geteuid") or os.geteuid() != 0:
        _unavailable("needs root on Linux")
    if shutil.which("apt-get") is None and shutil.which("slurmctld") is None:
        _unavailable("no apt-get to install Slurm and no Slurm installed")
    os.makedirs(SLURM_ROOT, exist_ok=True)
    marker = Path(SLURM_ROOT, "started-by-pytest")
    env = dict(os.environ, SLURM_TEST_ROOT=SLURM_ROOT)
    with open(Path(SLURM_ROOT, "pytest.lock"), "w") as using, \
            open(Path(SLURM_ROOT, "pytest-turn.lock"), "w") as turn:
        fcntl.flock(using, fcntl.LOCK_SH)  # held while this session uses Slurm
        with _locked(turn):  # one session at a time starts or stops it
            started_here = not _slurmctld_alive()
            try:
                res = subprocess.run(["bash", str(START)], env=env, capture_output=True,
                                     text=True, timeout=300)
            except subprocess.TimeoutExpired:
                pytest.fail("start-slurm.sh did not finish in 300 s")
        if res.returncode == EXIT_CANNOT:
            _unavailable(res.stderr.strip())
        assert res.returncode == 0, f"start-slurm.sh failed:\n{res.stdout}\n{res.stderr}"
        if started_here:
            marker.touch()
        env["SLURM_CONF"] = str(Path(SLURM_ROOT, "etc", "slurm.conf"))
        yield env
        if os.environ.get("MPITF_SLURM_KEEP") == "1" or not marker.exists():
            return
        with _locked(turn):
            try:
                fcntl.flock(using, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                # another session still uses it and stops it: leave before our turn ends,
                # so that the last session out finds itself alone
                fcntl.flock(using, fcntl.LOCK_UN)
                return
            subprocess.run(["bash", str(STOP)], env=env, capture_output=True, timeout=120)
            marker.unlink(missing_ok=True)


@contextlib.contextmanager
def _locked(file):
    fcntl.flock(file, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(file, fcntl.LOCK_UN)


def _job_env(slurm_env, tmp_path):
    return dict(slurm_env, MPITF_PYTHON=sys.executable, MPITF_CKPT_ROOT=str(tmp_path / "ckpt"))


def _submit(env, tmp_path, *args):
    # --time=10: train.sbatch's own USR1 (--signal=B:USR1@120) must not come during a test.
    # With --time=3 it came 60 s after submission, into a resumed run slowed by a loaded
    # machine, and requeued the job a second time.
    cmd = ["sbatch", "--parsable", "-n", "2", "--time=10", f"--chdir={tmp_path}",
           str(SBATCH_SCRIPT), str(JOB_SCRIPT), *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, f"sbatch failed: {res.stderr}"
    jobid = res.stdout.strip().split(";")[0]
    return jobid, tmp_path / f"mpitf-{jobid}.out"


def _job_info(env, jobid, client=()):
    """Return ``scontrol show job``'s fields; ``client``: a prefix (a box's head namespace)."""
    res = subprocess.run([*client, "scontrol", "show", "job", "-o", jobid], env=env,
                         capture_output=True, text=True, timeout=30)
    return dict(re.findall(r"(\w+)=(\S*)", res.stdout))


def _read(out):
    return out.read_text(errors="replace") if out.exists() else ""


def _steps(text):
    return [int(n) for n in re.findall(r"^step (\d+)\b", text, re.M)]


def _wait_for(what, cond, deadline_s, out, poll_s=0.5):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(poll_s)
    pytest.fail(f"timed out after {deadline_s} s waiting for {what}; log so far:\n{_read(out)}")


def _job_pids(env, jobid):
    """Return the pids Slurm still runs for ``jobid`` on this node: its batch shell, its steps."""
    res = subprocess.run(["scontrol", "listpids", jobid], env=env, capture_output=True,
                         text=True, timeout=30)
    return [f[0] for f in map(str.split, res.stdout.splitlines()) if f and f[0].isdigit()]


def _tasks(jobid):
    """Return the pids of ``jobid``'s tasks (``python JOB_SCRIPT ...``), on any node here.

    The pids are this (the root) PID namespace's, which also sees a box's nodes; srun, whose
    arguments hold the script too, is not one.
    """
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if argv[1:2] == [str(JOB_SCRIPT).encode()] and (
                    f"SLURM_JOB_ID={jobid}".encode()
                    in (proc / "environ").read_bytes().split(b"\0")):
                pids.append(int(proc.name))
        except (OSError, ValueError):
            continue  # not a process, or gone
    return pids


def _stat_state(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _pending(pid, signum):
    """Whether ``signum`` waits, undelivered, for process ``pid`` (a stopped one keeps it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    masks = re.findall(r"^(?:ShdPnd|SigPnd):\s*([0-9a-f]+)$", status, re.M)
    return any(int(mask, 16) >> (signum - 1) & 1 for mask in masks)


def usr1_after_step(scancel, jobid, ntasks, step, out):
    """Send the batch shell USR1 as the time limit would, once the job has logged ``step``.

    The job's tasks are SIGSTOPped as soon as the step shows (the log is read every 10 ms;
    the job still has many steps to go), USR1 goes to the batch shell (``scancel(argv)``
    runs scancel, in a box's head namespace if need be), which forwards it to srun and srun
    to the tasks; once USR1 is pending in every task, they go on. So a job of millisecond
    steps does not finish between the step the test saw and the signal.
    """
    def found():
        if "srun exited" in _read(out):
            pytest.fail(f"the job ended before its {ntasks} tasks were found:\n{_read(out)}")
        return len(pids := _tasks(jobid)) == ntasks and pids

    tasks = _wait_for(f"the job's {ntasks} tasks", found, 120, out, 0.05)
    try:
        _wait_for(f"step {step}", lambda: max(_steps(_read(out)), default=0) >= step, 120, out,
                  0.01)
        for pid in tasks:
            os.kill(pid, signal.SIGSTOP)
        _wait_for("its tasks to stop", lambda: all(_stat_state(p) == "T" for p in tasks), 30, out)
        assert scancel(["scancel", "--signal=USR1", "--batch", jobid]).returncode == 0
        _wait_for("USR1 to reach every task",
                  lambda: all(_pending(p, signal.SIGUSR1) for p in tasks), 60, out)
    finally:
        for pid in tasks:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def _wait_terminal(env, jobid, deadline_s, out, client=()):
    return _wait_for(f"job {jobid} to end",
                     lambda: (i := _job_info(env, jobid, client)).get("JobState") in TERMINAL
                     and i, deadline_s, out)


@pytest.fixture
def submitted(slurm_env, tmp_path):
    """Yield a submit function; cancel whatever it submitted when the test ends."""
    env, jobs = _job_env(slurm_env, tmp_path), []

    def submit(*args):
        jobid, out = _submit(env, tmp_path, *args)
        jobs.append(jobid)
        return env, jobid, out

    yield submit
    for jobid in jobs:
        subprocess.run(["scancel", jobid], env=env, capture_output=True, timeout=30)


def test_usr1_checkpoints_requeues_and_resumes(submitted, tmp_path):
    env, jobid, out = submitted(*JOB_ARGS)
    # What --signal=B:USR1@120 does before the time limit, now: USR1 to the batch shell only.
    usr1_after_step(lambda argv: subprocess.run(argv, env=env, timeout=30), jobid, 2, 500, out)
    info = _wait_terminal(env, jobid, 150, out)
    log = _read(out)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, log)
    assert info["Restarts"] == "1", log

    ckpt_dir = tmp_path / "ckpt" / jobid
    assert ckpt_dir.is_dir() and any(ckpt_dir.iterdir()), f"no checkpoint in {ckpt_dir}"
    assert re.search(r"srun exited with 75 after SIGUSR1: .*requeueing job", log), log
    runs = re.split(r"^.*\] start: job \d+ ", log, flags=re.M)[1:]
    assert len(runs) == 2, log
    assert runs[0].startswith("SLURM_RESTART_COUNT=unset"), log
    assert runs[1].startswith("SLURM_RESTART_COUNT=1 "), log
    first, second = _steps(runs[0]), _steps(runs[1])
    assert first and second, log
    # Resumed from the checkpoint, not from 0: the second run starts after the first one's steps.
    assert second[0] > max(first) >= 500, log
    final = json.loads(re.search(r"^final: (.*)$", runs[1], re.M).group(1))
    assert final["step"] == FINAL_STEP, log
    assert final.get("restart_count", 1) == 1, log
    assert "srun exited with 0: training finished" in log, log


def test_scancel_does_not_requeue(submitted):
    env, jobid, out = submitted(*LONG_JOB_ARGS)
    _wait_for("1000 steps", lambda: max(_steps(_read(out)), default=0) >= 1000, 120, out)
    subprocess.run(["scancel", jobid], env=env, check=True, timeout=30)
    info = _wait_terminal(env, jobid, 60, out)
    # The batch shell logs its decision just after the job turns CANCELLED: give it a moment.
    log = _wait_for("the batch shell's decision", lambda: re.search(
        r"srun exited with \d+.*NOT requeueing|job failed", _read(out)) and _read(out), 20, out)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", (info, log)
    assert "requeueing job" not in log, log
    assert len(re.findall(r"\] start: job ", log)) == 1, log
    assert "final:" not in log, log
    # Nothing brings it back: still cancelled, not requeued, once its batch shell (the one
    # that could requeue it) has exited.
    _wait_for("the job's batch shell to exit", lambda: not _job_pids(env, jobid), 30, out)
    info = _job_info(env, jobid)
    assert info.get("JobState", "CANCELLED") == "CANCELLED" and info.get("Restarts", "0") == "0"


def test_srun_runs_tensorflows_task_for_slurm_task_r_on_mpi_rank_r(slurm_env, tmp_path):
    # Under srun the jobs' cluster comes from SlurmClusterResolver: each address is a Slurm
    # node name and a port, mpitf.cluster.roles pins the task there, and since srun makes
    # SLURM_PROCID the MPI rank, rank r runs the task TensorFlow gives Slurm task r.
    # -O: 3 tasks, 2 CPUs.
    cmd = ["srun", "-O", "-n", "3", "--time=2", sys.executable, str(TF_TASKS), "--num-ps", "1"]
    res = subprocess.run(cmd, env=dict(slurm_env, PYTHONPATH=str(REPO)), cwd=tmp_path,
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = sorted((json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")),
                  key=lambda row: row["rank"])
    assert [r["rank"] for r in rows] == [r["procid"] for r in rows] == [0, 1, 2], res.stdout
    assert [r["role"] for r in rows] == [r["tf"] for r in rows] == [
        ["ps", 0], ["worker", 0], ["worker", 1]], res.stdout
    node = rows[0]["host"].split(".")[0]  # the test Slurm's NodeName is `hostname -s`
    assert [r["address"] for r in rows] == [f"{node}:8888", f"{node}:8889", f"{node}:8890"]
