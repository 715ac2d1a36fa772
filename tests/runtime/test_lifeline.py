"""The lifeline: a rank that fails or is killed ends the job at once, named; a rank that
finishes normally before the others is not taken for dead. The witness names a killed rank
from outside the ranks, and only one that left no marker while the job ran.

(Killed ranks mid-training are covered in tests/ckpt/test_recovery.py.)
"""

import os

import pytest

from mpitf.testing import run_mpi
from tests.support import REPO

DRIVER = str(REPO / "tests" / "mpi" / "lifeline_driver.py")


@pytest.mark.mpi
def test_uncaught_exception_on_one_rank_ends_the_job_naming_it():
    res = run_mpi(3, [DRIVER, "uncaught"], timeout=15, cwd=str(REPO))
    assert not res.timed_out and res.returncode != 0, res.output
    assert "RuntimeError: boom in user code" in res.output
    assert "rank 2 (/job:worker/task:1 on " in res.output, res.output
    assert "ended on an uncaught exception" in res.output, res.output
    assert "waited it out" not in res.output


@pytest.mark.mpi
def test_ranks_finishing_at_different_times_are_not_reported():
    res = run_mpi(3, [DRIVER, "staggered"], timeout=60, cwd=str(REPO))
    assert res.returncode == 0 and not res.timed_out, res.output
    assert sorted(line for line in res.stdout.splitlines() if line.endswith("done")) == [
        "rank 0 done", "rank 1 done", "rank 2 done"]
    assert "died" not in res.output and "uncaught" not in res.output, res.output


def test_a_lifeline_names_a_peer_gone_without_a_marker_and_marks_its_own_exit(monkeypatch):
    import shutil
    import subprocess
    import sys

    from mpitf.runtime import lifeline

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # watch() installs its hook
    monkeypatch.setattr(lifeline, "_active", None)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    aborted = []
    line = lifeline.Lifeline(0, {1: gone.pid}, f"test-{os.getpid()}", lambda r: f"rank {r}",
                             lambda: aborted.append(True))
    try:
        thread = line.watch()
        assert lifeline.active() is line and sys.excepthook == line._note_uncaught
        thread.join(5)  # the peer was gone before it was watched: nothing to wait for
        assert not thread.is_alive() and not aborted
        assert line.dead_peer_message() == \
            f"rank 1 (pid {gone.pid}) died without finishing (killed?); ending the job"
        seen = []
        line._previous_hook = lambda *exc: seen.append(exc[0])
        sys.excepthook(RuntimeError, RuntimeError("boom"), None)  # nobody caught it
        assert seen == [RuntimeError]
        line.mark_exit()
        assert line.leaving.is_set()
        with open(os.path.join(line.dir, "0.exit")) as f:
            assert f.read() == "failed"
    finally:
        shutil.rmtree(line.dir, ignore_errors=True)


def test_an_error_every_rank_raised_alike_is_one_type_whatever_the_cause():
    import pickle

    from mpitf.errors import CollectiveError, ConfigurationError
    from mpitf.runtime.exits import collective

    err = collective(OSError(2, "No such file or directory", "x.h5"))
    assert isinstance(err, CollectiveError) and isinstance(err, ConfigurationError)
    assert str(err) == "[Errno 2] No such file or directory: 'x.h5'"
    assert collective(err) is err
    assert str(pickle.loads(pickle.dumps(err))) == str(err)


def test_garbage_is_a_settled_directory_whose_ranks_are_all_gone(tmp_path):
    import subprocess

    from mpitf.runtime.lifeline import _collect_garbage

    dead = subprocess.Popen(["true"])
    dead.wait()
    jobs = {"mpitf-dead": dead.pid, "mpitf-live": os.getpid(), "mpitf-starting": None}
    for name, pid in jobs.items():
        (tmp_path / name).mkdir()
        if pid is not None:
            (tmp_path / name / "0.pid").write_text(str(pid))
    for name in ("mpitf-dead", "mpitf-live"):  # made 2 minutes ago
        old = (tmp_path / name).stat().st_mtime - 120
        os.utime(tmp_path / name, (old, old))
    # "mpitf-starting" was just made by a job whose ranks have not written their pids yet
    _collect_garbage(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mpitf-live", "mpitf-starting"]


def _witness_over_sleepers(tmp_path, n=3):
    """Start a witness over ``n`` sleeping processes standing in for ranks."""
    import subprocess

    from mpitf.runtime import witness

    directory = tmp_path / "mpitf-test"
    directory.mkdir()
    ranks = [subprocess.Popen(["sleep", "60"]) for _ in range(n)]
    spec = {r: (p.pid, f"rank {r}", str(directory / f"{r}.exit")) for r, p in enumerate(ranks)}
    return directory, ranks, witness.start(spec, str(directory))


def _wait_for(condition, what, timeout=10):
    import time

    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"no {what} within {timeout} s"  # a deadline
        time.sleep(0.01)


def test_the_witness_names_the_first_rank_gone_without_a_marker_and_no_other(tmp_path, capfd):
    directory, ranks, pid = _witness_over_sleepers(tmp_path)
    (directory / "0.exit").write_text("done")
    ranks[0].kill()  # finished: it left its marker
    ranks[1].kill()  # killed: no marker
    seen = []
    _wait_for(lambda: seen.append(capfd.readouterr().err) or "died" in "".join(seen),
              "line naming rank 1")
    ranks[2].kill()  # what a launcher does to the survivors: not the cause, not named
    _wait_for(lambda: os.waitpid(pid, os.WNOHANG)[0] == pid, "end of the witness")
    seen.append(capfd.readouterr().err)
    for rank in ranks:
        rank.wait()
    assert "".join(seen) == f"mpitf: error: rank 1 (pid {ranks[1].pid}) died without " \
                            f"finishing (killed?); ending the job\n"


@pytest.mark.parametrize("end", ["all marked, directory gone", "one aborted the job"])
def test_the_witness_names_no_rank_when_the_ranks_ended_the_job(tmp_path, capfd, end):
    directory, ranks, pid = _witness_over_sleepers(tmp_path)
    if end == "one aborted the job":
        (directory / "2.exit").write_text("aborted")  # it said why; then the launcher kills
    else:  # as Lifeline.mark_exit leaves it
        directory.rename(tmp_path / "gone")
    for rank in ranks:
        rank.kill()
        rank.wait()
    _wait_for(lambda: os.waitpid(pid, os.WNOHANG)[0] == pid, "end of the witness")
    assert capfd.readouterr().err == ""
