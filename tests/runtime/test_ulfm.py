"""A lost worker under Open MPI's ULFM (``mpiexec --with-ft ulfm``): the job goes on.

A worker is SIGKILLed mid-run (a real kill, once the chief has logged a step); the ps
acknowledges the failure and trains on with the survivors, the loss is named in the log
with its cost, and the final accuracy stays within 0.02 of an uninterrupted run. The same
kill under MPICH ends the job (tests/ckpt/test_recovery.py::test_sigkill_of_a_rank_ends_the_job).
"""

import json
import os
import re
import shlex
import signal
import subprocess
import sys

import pytest

from mpitf.testing import run_mpi
from tests.support import (
    FINAL,
    OPENMPI_PREFIX,
    REPO,
    Background,
    cli_verify,
    final_summary,
    latest_step,
    openmpi_mpiexec,
    run_job,
)

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

STEPS, KILL_AT = 600, 300  # killed mid-run
# a decaying rate settles the last steps: uninterrupted async runs then end within 0.006 of
# each other (0.017 with a constant rate, measured over 5 runs each)
DECAY = ["--lr-decay", "0.5", "--lr-decay-steps", "150"]
ASYNC = "its future pushes are lost (async mode waits for no one)"
SYNC = "sync steps now aggregate 1 gradient (replicas_to_aggregate was 2)"
CHIEF = "; the chief's duties (logging, checkpoints, the summary) go to rank 2 (/job:worker/task:1)"


@pytest.fixture
def tmp(tmp_path):
    return tmp_path


_WHOLE = {}  # mode -> the test accuracy of an uninterrupted run


def whole_run_accuracy(tmp_path_factory, mode, mpiexec):
    """Run the job uninterrupted once per mode, with a checkpoint; return its accuracy.

    It is also this mode's and the checkpoint's test under Open MPI.
    """
    if mode not in _WHOLE:
        tmp = tmp_path_factory.mktemp(f"whole-{mode}")
        whole = run_job(tmp, mode=mode, steps=STEPS, mpiexec=mpiexec, deterministic=False,
                        ckpt=tmp / "ckpt", extra=DECAY, timeout=120)
        assert whole.returncode == 0, whole.output
        assert latest_step(tmp / "ckpt") >= STEPS, whole.output  # async: a push may land late
        assert cli_verify(tmp / "ckpt").returncode == 0, whole.output
        _WHOLE[mode] = final_summary(whole)["test_accuracy"]
    return _WHOLE[mode]


@pytest.mark.parametrize("mode,victim,cost", [
    ("async", "rank2-worker-1", ASYNC),
    ("sync", "rank2-worker-1", SYNC),
    # the chief: rank 2 takes over its duties, its checkpoints among them
    ("async", "rank1-worker-0", ASYNC + CHIEF),
    ("sync", "rank1-worker-0", SYNC + CHIEF),
])
def test_a_killed_worker_is_survived_and_named_with_its_cost(tmp, tmp_path_factory, mode,
                                                             victim, cost):
    mpiexec = openmpi_mpiexec()
    expected = whole_run_accuracy(tmp_path_factory, mode, mpiexec)
    chief = cost.endswith(CHIEF)
    # Cuts at steps 120, 240, 360, ...: the chief dies between two (in a cut it ends the
    # job, named: docs/reliability.md), the kill at 300 lands 60 steps from each.
    job = Background(tmp, mode=mode, steps=STEPS, mpiexec=mpiexec, step_sleep=0.005,
                     deterministic=False, ckpt=tmp / "ckpt" if chief else None,
                     extra=DECAY + (["--checkpoint-every", "120"] if chief else []))
    job.wait_for_step(KILL_AT)
    os.kill(job.rank_pid(victim), signal.SIGKILL)
    code, _ = job.finish(timeout=120)
    out = job.output
    assert code == 0, out
    rank, _, task = victim.split("-")
    lost = re.search(rf"lost rank {rank[4:]} \(/job:worker/task:{task} on \S+\) at step "
                     rf"(\d+): (.*); 1 of 2 workers go on", out)
    assert lost, out
    assert int(lost.group(1)) >= KILL_AT and lost.group(2) == cost, out
    if chief:
        assert re.search(r"^step \d+: the chief was lost; /job:worker/task:1 takes over its "
                         r"duties$", out, re.MULTILINE), out
        after = out[out.index("takes over its duties"):]  # the successor's checkpoints
        assert re.search(r"^checkpoint \S+ at step \d+$", after, re.MULTILINE), out
        assert latest_step(tmp / "ckpt") >= STEPS, out
        assert cli_verify(tmp / "ckpt").returncode == 0, out
    summary = json.loads(FINAL.findall(out)[-1])  # the chief's, or its successor's
    assert summary["step"] == STEPS, out
    assert abs(summary["test_accuracy"] - expected) <= 0.02, (summary, expected)


def test_the_launch_line_under_open_mpi_and_the_library_mpi4py_loads(tmp):
    """`mpitf run` with Open MPI's mpiexec asks for ULFM; its ranks load Open MPI's libmpi
    (MPI4PY_LIBMPI, beside the launcher), not the MPICH wheel's in the venv."""
    mpiexec = openmpi_mpiexec()
    line = subprocess.run([sys.executable, "-m", "mpitf.cli.main", "run", "--dry-run",
                           "--mpiexec", mpiexec, "-n", "3", "hello"], capture_output=True,
                          text=True, timeout=60, cwd=str(REPO))
    assert line.returncode == 0, line.stderr
    argv = shlex.split(line.stdout)
    assert argv[:4] == [mpiexec, "--oversubscribe", "--with-ft", "ulfm"], argv
    assert argv[4:6] == ["-x", f"MPI4PY_LIBMPI={OPENMPI_PREFIX.resolve()}/lib/libmpi.so.40"]
    # a replacement (--heal) is a job of its own: recoverable too, or its loss ends them all
    assert argv[6:9] == ["--prtemca", "state_base_recoverable", "1"], argv
    run = run_mpi(2, ["-c", "import os; from mpi4py import MPI; print(MPI.COMM_WORLD.rank, "
                      "MPI.Get_library_version().split(',')[0], os.environ.get("
                      "'OMPI_MCA_mpi_ft_enable'))"], mpiexec=mpiexec, timeout=60)
    assert not run.timed_out and run.returncode == 0, run.output
    assert sorted(run.stdout.splitlines()) == [f"{r} Open MPI v5.0.11 1" for r in range(2)]


def test_open_mpi_across_hosts_fills_each_host_s_slots():
    """With --oversubscribe, PRRTE 3.0's default mapping put all of ``--host n1:2,n2:2 -n 4``
    on n1; ``--map-by slot`` fills each host's slots (placed on the box: test_ulfm_node.py)."""
    mpiexec = openmpi_mpiexec()
    line = subprocess.run([sys.executable, "-m", "mpitf.cli.main", "run", "--dry-run",
                           "--mpiexec", mpiexec, "-n", "4", "--hosts", "n1:2,n2:2", "hello"],
                          capture_output=True, text=True, timeout=60, cwd=str(REPO))
    assert line.returncode == 0, line.stderr
    argv = shlex.split(line.stdout)
    at = argv.index("--map-by")
    assert argv[at:at + 4] == ["--map-by", "slot", "--host", "n1:2,n2:2"], argv


def test_a_killed_worker_ends_a_deterministic_job_under_ulfm_too(tmp):
    job = Background(tmp, mode="sync", steps=5000, mpiexec=openmpi_mpiexec(), step_sleep=0.005)
    job.wait_for_step(10)
    pid = job.rank_pid("rank2-worker-1")
    os.kill(pid, signal.SIGKILL)
    code, _ = job.finish(timeout=60)
    out = job.output
    assert code != 0, out
    assert re.search(r"mpitf: error on rank 0: a worker died at step \d+: deterministic sync "
                     r"needs every worker's gradient in every step, so the job ends \(rank 2, "
                     r"/job:worker/task:1, on \S+, during training\)", out), out
