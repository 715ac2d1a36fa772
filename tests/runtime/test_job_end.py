"""mpitf run ends a launcher that outlived every rank (PRRTE's hang after a healed job).

The launcher here is a stand-in that starts the ranks as Open MPI would name them and
then stays, as prterun did; the ranks are real processes running mpitf's ``run_job``.
"""

import os
import subprocess
import sys
import textwrap

from mpitf.runtime import job_end

LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, time
    n, stay, argv = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
    ranks = [subprocess.Popen(argv, env=dict(os.environ, OMPI_COMM_WORLD_RANK=str(r)))
             for r in range(n)]
    codes = [rank.wait() for rank in ranks]
    time.sleep(stay)  # the launcher that misses its job's end
    sys.exit(9)
""")
JOB = "from mpitf.runtime import exits; exits.run_job(lambda: {code})"


def _launch(tmp_path, started, ranks, stay, code=0):
    """Start the stand-in launcher with ``started`` ranks of ``JOB`` exiting ``code``."""
    records = tmp_path / "records"
    records.mkdir()
    env = dict(os.environ, **{job_end.FOLDER: str(records)})
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(started), str(stay), sys.executable, "-c",
         JOB.format(code=code)], env=env)
    return launcher, str(records)


def test_a_launcher_that_outlives_every_rank_is_ended_with_the_ranks_code(tmp_path):
    launcher, records = _launch(tmp_path, 2, ranks=2, stay=600, code=3)
    try:
        assert job_end.wait(launcher, 2, records, grace=0.5) == 3
        assert launcher.returncode is not None and launcher.returncode != 9
        assert job_end.ended(records, 2) == [3, 3]
    finally:
        launcher.kill()
        launcher.wait()


def test_a_launcher_is_not_ended_while_a_rank_never_recorded_its_end(tmp_path):
    # rank 2 never ran (a rank killed and not replaced): the launcher's own code comes back
    launcher, records = _launch(tmp_path, 2, ranks=3, stay=3)
    try:
        assert job_end.wait(launcher, 3, records, grace=0) == 9
        assert job_end.ended(records, 3) is None and job_end.ended(records, 2) == [0, 0]
    finally:
        launcher.kill()
        launcher.wait()


def test_a_record_names_the_rank_a_replacement_replaces(tmp_path, monkeypatch):
    monkeypatch.setenv(job_end.FOLDER, str(tmp_path))
    monkeypatch.setenv("MPITF_REPLACES", "5")
    job_end.record(None)
    assert (tmp_path / "rank5").read_text().split() == ["0", str(os.getpid())]
    assert job_end.ended(str(tmp_path), 1) is None  # rank 0 has not recorded
