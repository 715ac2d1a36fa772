"""A lost worker under Open MPI's ULFM (``mpiexec --with-ft ulfm``): the job goes on.

A worker is SIGKILLed mid-run (a real kill, once the chief has logged a step); the ps
acknowledges the failure and trains on with the survivors, the loss is named in the log
with its cost, and the final accuracy stays within 0.02 of an uninterrupted run. The same
kill under MPICH ends the job (tests/ckpt/test_recovery.py::test_sigkill_of_a_rank_ends_the_job).
"""

import json
import os
import re
import signal

import pytest

from tests.support import FINAL, Background, final_summary, openmpi_mpiexec, run_job

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

STEPS = 400
LOST = re.compile(r"lost rank 2 \(/job:worker/task:1 on \S+\) at step (\d+): (.*); "
                  r"1 of 2 workers go on")


@pytest.fixture
def tmp(tmp_path):
    return tmp_path


@pytest.mark.parametrize("mode,cost", [
    ("async", "its future pushes are lost (async mode waits for no one)"),
    ("sync", "sync steps now aggregate 1 gradient (replicas_to_aggregate was 2)"),
])
def test_a_killed_worker_is_survived_and_named_with_its_cost(tmp, mode, cost):
    mpiexec = openmpi_mpiexec()
    whole = run_job(tmp, mode=mode, steps=STEPS, mpiexec=mpiexec, run_dir="whole",
                    deterministic=False, timeout=120)
    assert whole.returncode == 0, whole.output
    expected = final_summary(whole)["test_accuracy"]

    job = Background(tmp, mode=mode, steps=STEPS, mpiexec=mpiexec, step_sleep=0.005,
                     deterministic=False)
    job.wait_for_step(100)
    os.kill(job.rank_pid("rank2-worker-1"), signal.SIGKILL)
    code, _ = job.finish(timeout=120)
    out = job.output
    assert code == 0, out
    lost = LOST.search(out)
    assert lost, out
    assert int(lost.group(1)) >= 100 and lost.group(2) == cost, out
    summary = json.loads(FINAL.findall(out)[-1])
    assert summary["step"] == STEPS, out
    assert abs(summary["test_accuracy"] - expected) <= 0.02, (summary, expected)
