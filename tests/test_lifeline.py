"""The lifeline: a rank that fails or is killed ends the job at once, named; a rank that
finishes normally before the others is not taken for dead.

(Killed ranks mid-training are covered in test_recovery.py.)
"""

from pathlib import Path

from mpitf.testing import run_mpi

REPO = Path(__file__).resolve().parent.parent
DRIVER = str(REPO / "tests" / "mpi" / "lifeline_driver.py")


def test_uncaught_exception_on_one_rank_ends_the_job_naming_it():
    res = run_mpi(3, [DRIVER, "uncaught"], timeout=60, cwd=str(REPO))
    assert not res.timed_out and res.returncode != 0, res.output
    assert res.seconds < 15, res.output
    assert "RuntimeError: boom in user code" in res.output
    assert "rank 2 (/job:worker/task:1 on " in res.output, res.output
    assert "ended on an uncaught exception" in res.output, res.output
    assert "waited it out" not in res.output


def test_ranks_finishing_at_different_times_are_not_reported():
    res = run_mpi(3, [DRIVER, "staggered"], timeout=60, cwd=str(REPO))
    assert res.returncode == 0 and not res.timed_out, res.output
    assert sorted(line for line in res.stdout.splitlines() if line.endswith("done")) == [
        "rank 0 done", "rank 1 done", "rank 2 done"]
    assert "died" not in res.output and "uncaught" not in res.output, res.output
