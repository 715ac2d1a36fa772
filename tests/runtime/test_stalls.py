"""Stall detection that adapts to the step time, orphans when the launcher dies, killed ranks.

The rule is a pure function (tested without MPI); the rest are real mpiexec runs of
jobs/mnist_mlp.py (through tests/recovery/slow_job.py, which records every rank's pid)
with default deadline settings, steps of a few milliseconds, and real signals. The three
SIGSTOP cases wait for the detector (about 20 s and 30 s, the three jobs overlapping); the
others take seconds.
"""

import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from mpitf.cli.flags import add_training_arguments
from mpitf.config import (
    SERVER_FIRST,
    STALL_FACTOR,
    STALL_FLOOR,
    STALL_WARMUP_STEPS,
    JobConfig,
    stall_allowance,
)
from mpitf.runtime.stall import StepClock
from mpitf.testing import children, kill_group, remove_files
from tests.docs.blocks import block
from tests.support import JOB, REPO, Background, names_stopped_rank, process_gone

# ------------------------------------------------------------------- the rule, without MPI


def test_the_adaptive_rule():
    assert (STALL_FLOOR, STALL_FACTOR, STALL_WARMUP_STEPS, SERVER_FIRST) == (30.0, 10.0, 5, 1.5)
    # start-up: the whole deadline (a worker waits 1.5 x it)
    for steps in range(STALL_WARMUP_STEPS):
        assert stall_allowance(0.001, steps, 300.0) == 450.0
    # then max(30 s, 10 x the slowest step), never above the deadline's bound
    assert stall_allowance(0.001, 5, 300.0) == 30.0
    assert stall_allowance(2.9, 1000, 300.0) == 30.0
    assert stall_allowance(4.0, 5, 300.0) == 40.0
    assert stall_allowance(44.0, 5, 300.0) == 440.0
    assert stall_allowance(100.0, 5, 300.0) == 450.0
    assert stall_allowance(0.001, 5, 10.0) == 15.0  # $MPITF_DEADLINE=10 bounds it
    assert stall_allowance(0.001, 5, None) is None  # no deadline: wait forever


def test_step_clock_worker_and_ps():
    worker, ps = StepClock(300.0), StepClock(300.0, names_the_silent=True)
    assert (worker.allowance, ps.start_up) == (450.0, 300.0)
    t = 100.0
    for _ in range(STALL_WARMUP_STEPS + 1):  # the first tick only starts the clock
        assert worker.allowance == 450.0
        t += 0.002
        worker.tick(t)
    assert worker.steps == STALL_WARMUP_STEPS and worker.allowance == 30.0
    worker.tick(t + 7.0)  # one slow step: 10 x 7 s
    assert worker.allowance == pytest.approx(70.0)
    worker.pause()  # a checkpoint: the whole deadline until the next step ends
    assert worker.allowance == 450.0
    worker.tick(t + 100.0)
    worker.tick(t + 100.001)
    assert worker.allowance == pytest.approx(70.0)  # the pause was not a step
    for _ in range(STALL_WARMUP_STEPS):
        ps.step(0.001)
    assert ps.steady == 20.0  # the ps speaks first: 30 / 1.5
    # Warm-up steps are not typical: a ps (every worker's pushes are its steps) once saw
    # 6 s between a worker's first two pushes under load, and then waited 10 x 6 / 1.5 s,
    # longer than the workers' 30 s: they named the ps instead of the ps the silent worker.
    ps = StepClock.for_ps(300.0, True, num_workers=2)
    ps.step(6.2)
    for _ in range(2 * STALL_WARMUP_STEPS - 1):
        assert ps.steady == 300.0
        ps.step(0.003)
    assert (ps.steady, ps.slowest) == (20.0, 0.0)
    ps.step(4.0)  # after the warm-up, the slowest counts
    assert ps.steady == pytest.approx(40.0 / 1.5)


def test_fixed_deadline_does_not_adapt():
    clock = StepClock(10.0, adaptive=False)
    for i in range(50):
        clock.tick(i * 0.001)
    assert clock.allowance == 15.0 and clock.steady == 15.0
    assert StepClock(10.0, adaptive=False, names_the_silent=True).steady == 10.0
    assert StepClock(None).allowance is None


def _parse(*argv):
    import argparse

    parser = argparse.ArgumentParser()
    add_training_arguments(parser)
    return JobConfig.from_args(parser.parse_args([str(a) for a in argv]))


def test_deadline_flag_is_fixed_and_the_environment_bounds(monkeypatch):
    monkeypatch.delenv("MPITF_DEADLINE", raising=False)
    assert (_parse().deadline, _parse().fixed_deadline) == (300.0, False)
    assert (_parse("--deadline", 7).deadline, _parse("--deadline", 7).fixed_deadline) == \
        (7.0, True)
    monkeypatch.setenv("MPITF_DEADLINE", "60")
    assert (_parse().deadline, _parse().fixed_deadline) == (60.0, False)


# ------------------------------------------------------- stopped ranks, default settings


@pytest.fixture
def tmp(tmp_path):
    return tmp_path


# The ps names a stopped worker silent in its push, or stuck receiving its reply,
# whichever the worker was stopped in.
STOPPED_WORKER = r"during (push|reply \(the worker stopped receiving\))"


# (victim, the operation it is named in, seconds the rule takes, mode)
STOPPED_CASES = [
    ("rank2-worker-1", STOPPED_WORKER, 20, "sync"),  # the ps names it: 30 s / 1.5
    ("rank0-ps-0", "during push_pull", 30, "sync"),  # the workers name it
    # async: nobody waits for the stopped worker's gradient, yet the ps still names it
    ("rank2-worker-1", STOPPED_WORKER, 20, "async"),
]


@pytest.mark.slow
@pytest.mark.mpi
def test_a_stopped_rank_is_named_within_40_s_by_default(tmp):
    # No --deadline: the adaptive rule. Each job starts once the one before has its rank
    # stopped: the stopped jobs wait (polling with backoff) for their detectors, 20-30 s, so
    # the three cost about one wait, and no job starts while another trains.
    jobs, stopped, ended = [], [], {}
    try:
        for k, (victim, _, _, mode) in enumerate(STOPPED_CASES):
            (tmp / f"job{k}").mkdir()
            jobs.append(Background(tmp / f"job{k}", steps=100000, step_sleep=0, mode=mode))
            jobs[-1].wait_for_step(50)
            stopped.append((jobs[-1].rank_pid(victim), time.monotonic()))
            os.kill(stopped[-1][0], signal.SIGSTOP)
        # A deadline of 40 s after each stop: a job still running then is given up (killed
        # below), so a detector that never fires fails the test at 40 s, not at a timeout.
        deadlines = [at + 40 for _, at in stopped]
        while any(k not in ended and time.monotonic() < deadlines[k] for k in range(len(jobs))):
            for k, job in enumerate(jobs):
                if k not in ended and job.proc.poll() is not None:
                    ended[k] = time.monotonic()
            time.sleep(0.05)
    finally:
        for pid, _ in stopped:
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        for k, job in enumerate(jobs):
            if k in ended:
                job.finish()
            else:
                job.kill()
    for k, (job, (victim, operation, expected_s, _)) in enumerate(zip(jobs, STOPPED_CASES)):
        out = job.output
        assert k in ended, f"{victim} stopped: the job still ran 40 s later\n{out}"
        seconds = ended[k] - stopped[k][1]
        assert job.proc.returncode != 0, out
        assert expected_s - 1 < seconds, (victim, seconds, out)  # not before the detector's bound
        assert names_stopped_rank(out, victim, operation), out
        print(f"{victim} stopped ({STOPPED_CASES[k][3]}): job ended {seconds:.1f} s later")


# ---------------------------------------------------------- the launcher's proxy dies


@pytest.mark.slow
@pytest.mark.mpi
def test_killing_the_proxy_leaves_no_orphan(tmp):
    job = Background(tmp, steps=100000, step_sleep=0)
    try:
        job.wait_for_step(50)
        pids = [job.rank_pid(name) for name in
                ("rank0-ps-0", "rank1-worker-0", "rank2-worker-1")]
        proxies = set(children(job.proc.pid))
        assert sorted(job.rank_pids_from_proc()) == sorted(pids)
        (proxy,) = proxies
        os.kill(proxy, signal.SIGKILL)
        killed = time.monotonic()
        deadline = killed + 3  # measured: about 0.1 s
        while time.monotonic() < deadline:
            if job.proc.poll() is not None and all(process_gone(p) for p in pids):
                break
            time.sleep(0.01)
        seconds = time.monotonic() - killed
        assert job.proc.poll() is not None, "mpiexec still runs 3 s after its proxy died"
        assert [p for p in pids if not process_gone(p)] == [], "orphaned ranks 3 s later"
        assert job.proc.returncode != 0
        print(f"proxy killed: mpiexec and every rank gone {seconds:.2f} s later")
    finally:
        if job.proc.poll() is None:
            job.kill()
        remove_files(job.hydra_files)  # the killed proxy's
        for p in pids if "pids" in locals() else ():
            if not process_gone(p):
                os.kill(p, signal.SIGKILL)


# ------------------------------ a killed rank named by the launcher line of docs/checkpoints.md


def _readme_launcher_line():
    code = block("docs/checkpoints.md",
                 "mpiexec -disable-auto-cleanup -n 3 python jobs/mnist_mlp.py --steps 1000")
    (line,) = [x for x in code.splitlines() if x.startswith("mpiexec")]
    return shlex.split(line)


@pytest.mark.slow
@pytest.mark.mpi
def test_the_readme_launcher_line_names_a_killed_rank(tmp):
    argv = _readme_launcher_line()
    assert argv[:4] == ["mpiexec", "-disable-auto-cleanup", "-n", "3"], argv
    assert argv[4:6] == ["python", "jobs/mnist_mlp.py"], argv
    from mpitf.runtime.launch import find_mpiexec

    # The page's line as written, but with this checkout's mpiexec and Python, and the
    # job through slow_job.py (the same job, recording pids).
    cmd = [find_mpiexec(), *argv[1:4], sys.executable, JOB, "--steps", "100000",
           "--log-every", "10", "--run-dir", str(tmp / "run")]
    pid_dir = tmp / "pids"
    pid_dir.mkdir()
    log = tmp / "out.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=str(REPO), start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1",
                                         MPITF_TEST_PID_DIR=str(pid_dir)))
        try:
            end = time.monotonic() + 60
            while not re.search(r"^step [1-9]\d+,", log.read_text(), re.M):
                assert proc.poll() is None and time.monotonic() < end, log.read_text()
                time.sleep(0.01)
            pid = int((pid_dir / "rank2-worker-1.pid").read_text())
            os.kill(pid, signal.SIGKILL)
            start = time.monotonic()
            try:
                proc.wait(10)  # the deadline: a job that outlives its rank by 10 s fails
            except subprocess.TimeoutExpired:
                pytest.fail(f"still running 10 s after rank 2 was killed:\n{log.read_text()}")
            seconds = time.monotonic() - start
        finally:
            if proc.poll() is None:
                kill_group(proc)
                proc.wait(30)
    text = log.read_text()
    assert proc.returncode != 0, (seconds, text)
    # Named by the node's witness (mpitf.runtime.witness), which Hydra does not kill.
    assert "rank 2 (/job:worker/task:1 on " in text, text
    assert f"(pid {pid}) died without finishing" in text, text
    print(f"worker killed: named, job ended {seconds:.2f} s later (code {proc.returncode})")
