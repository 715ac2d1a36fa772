"""Faults of the checkpoint directory, end to end: real mpiexec runs, real files and mounts.

One owner per directory (a second job refused, a dead owner's lock taken over, a requeued
Slurm job taking over its own), a directory that is a file, read-only or full, a garbage
``latest``, and what pruning keeps. Read-only and full disks are small tmpfs mounts
(root only; skipped elsewhere). Every run is under a deadline.
"""

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpitf.ckpt import lock as L
from mpitf.ckpt.names import LATEST, checkpoint_name, list_checkpoints
from mpitf.ckpt.verify import verify_checkpoint
from mpitf.runtime.exits import EXIT_IO, EXIT_REQUEUE, EXIT_USAGE
from mpitf.runtime.launch import mpiexec_command
from mpitf.testing import kill_group, run_mpi
from tests.support import REPO

pytestmark = pytest.mark.mpi

JOB = str(REPO / "tests" / "recovery" / "slow_job.py")
CHECKPOINT = re.compile(r"^checkpoint (\S+) at step (\d+)$", re.MULTILINE)
RESTORED = re.compile(r"^restored (\S+) at step (\d+)$", re.MULTILINE)
ERRORS = re.compile(r"^mpitf: error on rank \d+: (.*)$", re.MULTILINE)


def args(tmp, root, steps=20, every=10, extra=()):
    return ["--deterministic", "--log-every", "10", "--num-ps", "1", "--steps", str(steps),
            "--run-dir", str(tmp / "run"), "--checkpoint-dir", str(root),
            "--checkpoint-every", str(every), *map(str, extra)]


def job(tmp, root, timeout=60, env=None, **kw):
    run = run_mpi(3, [JOB, *args(tmp, root, **kw)], timeout=timeout, cwd=str(REPO), env=env)
    assert not run.timed_out, f"hung, killed after {timeout} s:\n{run.output}"
    return run


def digests(root):
    """sha256 of every file under ``root``, by relative path (the lock file included)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(root).rglob("*")) if p.is_file()}


def steps_of(root):
    return [c["global_step"] for c in list_checkpoints(str(root))]


def one_error(run):
    found = ERRORS.findall(run.output)
    assert len(found) == 1, run.output
    assert "Traceback" not in run.output, run.output
    return found[0]


@pytest.fixture
def tmp(tmp_path):
    return tmp_path


@pytest.fixture
def tmpfs(tmp_path):
    """Mount a small tmpfs (root only); yield a function that mounts one of a given size."""
    mounted = []

    def mount(size="1m", name="fs"):
        point = tmp_path / name
        point.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()})")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        for _ in range(50):  # the ranks may take a moment to let go of it
            if subprocess.run(["umount", str(point)], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)


def remount_ro(point):
    subprocess.run(["mount", "-o", "remount,ro", str(point)], check=True)


# ------------------------------------------------------------- one owner per directory


@pytest.mark.slow
def test_a_second_job_is_refused_naming_the_first_and_touches_nothing(tmp):
    root = tmp / "ckpt"
    log = tmp / "first.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", MPITF_TEST_STEP_SLEEP="0.02")
    cmd = mpiexec_command(3, [sys.executable, JOB, *args(tmp, root, steps=250,
                                                          extra=["--max-to-keep", "0"])])
    with open(log, "w") as out:
        first = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                 cwd=str(REPO), start_new_session=True,
                                 stdin=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 30
        while not (root / LATEST).exists():
            assert first.poll() is None and time.monotonic() < end, log.read_text()
            time.sleep(0.01)
        owner = json.loads((root / L.LOCK).read_text())
        assert "slow_job" in Path(f"/proc/{owner['pid']}/cmdline").read_text()
        before = digests(root)  # with --max-to-keep 0 the first job only adds to these
        second = job(tmp, root, timeout=10)  # refused at once, while the first runs
        after = digests(root)
        assert first.poll() is None, "the first job ended before the second was refused"
    finally:
        try:
            code = first.wait(60)
        except subprocess.TimeoutExpired:
            kill_group(first)
            raise
    assert second.returncode == EXIT_USAGE, second.output
    message = one_error(second)
    assert f"checkpoint directory {root} is in use by pid {owner['pid']} on " \
           f"{socket.gethostname()}" in message
    assert f"remove {root / L.LOCK}" in message
    # Nothing the first job wrote changed (it moves `latest` on; it only adds the rest).
    assert {k: after[k] for k in before if k != LATEST} == \
        {k: v for k, v in before.items() if k != LATEST}
    assert code == 0, log.read_text()
    assert steps_of(root) == list(range(10, 251, 10))  # --max-to-keep 0 kept all 25
    assert not (root / L.LOCK).exists()  # released when the first job ended


@pytest.mark.slow
def test_the_lock_is_released_on_the_requeue_exit(tmp):
    root = tmp / "ckpt"
    env = dict(os.environ, PYTHONUNBUFFERED="1", MPITF_TEST_STEP_SLEEP="0.02")
    cmd = mpiexec_command(3, [sys.executable, JOB, *args(tmp, root, steps=5000, every=1000)])
    with open(tmp / "out.log", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=str(REPO), start_new_session=True,
                                stdin=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 30
        while not re.search(r"^step 20,", (tmp / "out.log").read_text(), re.M):
            assert proc.poll() is None and time.monotonic() < end, (tmp / "out.log").read_text()
            time.sleep(0.01)
        assert (root / L.LOCK).exists()
        proc.send_signal(signal.SIGTERM)  # Hydra forwards it to every rank
        code = proc.wait(30)
    finally:
        kill_group(proc)
    assert code == EXIT_REQUEUE, (tmp / "out.log").read_text()
    assert not (root / L.LOCK).exists()


def dead_pid():
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_a_dead_jobs_lock_is_taken_over(tmp):
    root = tmp / "ckpt"
    root.mkdir()
    stale = dict(L.whoami(), pid=dead_pid(), start="gone:1")
    (root / L.LOCK).write_text(json.dumps(stale))
    run = job(tmp, root)
    assert run.returncode == 0, run.output
    assert f"taking over the lock of {root}: its owner (pid {stale['pid']} on " in run.output
    assert steps_of(root) == [10, 20]
    assert not (root / L.LOCK).exists()


def test_a_requeued_slurm_job_takes_over_its_own_lock_from_another_host(tmp):
    root = tmp / "ckpt"
    root.mkdir()
    mine = dict(L.whoami(), host="node-before-requeue", pid=4321, slurm_job_id="4242",
                slurm_restart_count=0)
    (root / L.LOCK).write_text(json.dumps(mine))
    run = job(tmp, root, env={"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "1"})
    assert run.returncode == 0, run.output
    assert "this Slurm job's own lock from before its requeue (pid 4321 on " \
           "node-before-requeue (Slurm job 4242)" in run.output
    assert steps_of(root) == [10, 20]


def _lock_file(root, **owner):
    root.mkdir(exist_ok=True)
    (root / L.LOCK).write_text(json.dumps(dict(L.whoami(), **owner)))


def test_which_locks_are_stale(tmp):
    me = L.whoami()
    # This process is alive; a record with its pid but another start is pid reuse.
    _lock_file(tmp / "a", pid=os.getpid(), start="another-boot:7")
    held = L.acquire(str(tmp / "a"), log=lambda m: None)
    assert json.loads((tmp / "a" / L.LOCK).read_text())["start"] == me["start"]
    held.release()
    assert not (tmp / "a" / L.LOCK).exists()
    # A live process of this host with its own start time: refused.
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        _lock_file(tmp / "b", pid=sleeper.pid, start=L._proc_start(sleeper.pid))
        with pytest.raises(L.CheckpointLockedError, match=f"in use by pid {sleeper.pid} on"):
            L.acquire(str(tmp / "b"))
    finally:
        sleeper.kill()
        sleeper.wait()
    # Another host is never guessed stale, nor the same Slurm job on another host unless
    # it was requeued since; an unreadable lock is refused with the way to clear it.
    _lock_file(tmp / "c", host="elsewhere", pid=dead_pid(), slurm_job_id="7")
    with pytest.raises(L.CheckpointLockedError, match=r"pid \d+ on elsewhere \(Slurm job 7\)"):
        L.acquire(str(tmp / "c"))
    (tmp / "d").mkdir()
    (tmp / "d" / L.LOCK).write_bytes(b"\x00\xff")
    with pytest.raises(L.CheckpointLockedError, match="unreadable lock file .*remove"):
        L.acquire(str(tmp / "d"))
    assert (tmp / "d" / L.LOCK).read_bytes() == b"\x00\xff"


# ----------------------------------------------------------------- file-system faults


def test_a_checkpoint_dir_that_is_a_file_ends_every_rank_with_one_line(tmp):
    path = tmp / "not-a-dir"
    path.write_text("my notes\n")
    run = job(tmp, path, timeout=30)
    assert run.returncode == EXIT_USAGE, run.output
    assert one_error(run) == (f"checkpoint directory {path}: is a file, not a directory; "
                              "pass a directory to --checkpoint-dir")
    assert path.read_text() == "my notes\n"
    assert not (tmp / "run" / "metrics.jsonl").exists()  # refused before training


def test_a_read_only_checkpoint_dir_ends_every_rank_with_one_line(tmp, tmpfs):
    root = tmpfs("1m")
    first = job(tmp, root)
    assert first.returncode == 0, first.output
    before = digests(root)
    remount_ro(root)
    run = job(tmp, root, timeout=30)
    assert run.returncode == EXIT_USAGE, run.output
    assert one_error(run) == f"checkpoint directory {root}: read-only file system"
    assert digests(root) == before
    run = job(tmp, root / "sub", timeout=30)
    assert one_error(run) == f"checkpoint directory {root / 'sub'}: read-only file system"


def test_an_unwritable_checkpoint_dir_ends_every_rank_with_one_line(tmp):
    # Root ignores permission bits; an immutable directory (chattr +i) refuses even root.
    root = tmp / "immutable"
    root.mkdir()
    if subprocess.run(["chattr", "+i", str(root)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    try:
        run = job(tmp, root, timeout=30)
    finally:
        subprocess.run(["chattr", "-i", str(root)], check=True)
    assert run.returncode == EXIT_USAGE, run.output
    assert one_error(run) == f"checkpoint directory {root}: not writable (permission denied)"
    assert list(root.iterdir()) == []


def test_a_full_disk_fails_the_save_leaves_the_earlier_ones_and_exits_74(tmp, tmpfs):
    root = tmpfs("160k")  # the lock and two checkpoints of ~55 KiB fit, a third does not
    run = job(tmp, root, steps=100, timeout=15)
    assert run.returncode == EXIT_IO, run.output
    shard = root / checkpoint_name(30) / "shard-00000-of-00001.h5"
    assert one_error(run) == (f"cannot write checkpoint shard {shard}: No space left on "
                              "device; the earlier checkpoints and `latest` are untouched")
    assert (root / LATEST).read_text() == checkpoint_name(20) + "\n"
    assert [c["global_step"] for c in list_checkpoints(str(root)) if c["complete"]] == [10, 20]
    assert all(verify_checkpoint(str(root / checkpoint_name(s))) == [] for s in (10, 20))
    assert not list(root.rglob("*.tmp"))  # the half-written shard is gone, space is free


# --------------------------------------------------------------------- garbage latest


def _garbage(root, kind):
    latest = root / LATEST
    latest.unlink()
    if kind == "binary":
        latest.write_bytes(b"\x89\xfe\x00ckpt\xff")
    elif kind == "directory":
        latest.mkdir()
    else:
        latest.write_text("ckpt-00000990\n")


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two")
    run = job(tmp, tmp / "ckpt")
    assert run.returncode == 0, run.output
    return tmp / "ckpt"


@pytest.mark.parametrize("kind", ["binary", "directory", "missing-name"])
def test_a_garbage_latest_is_skipped_by_restore(tmp, two_checkpoints, kind):
    import shutil

    root = tmp / "ckpt"
    shutil.copytree(two_checkpoints, root)
    _garbage(root, kind)
    run = job(tmp, root, steps=30)
    assert run.returncode == 0 and "Traceback" not in run.output, run.output
    assert RESTORED.findall(run.stdout) == [(str(root / checkpoint_name(20)), "20")]
    why = {"binary": "holds binary bytes", "directory": "is a directory",
           "missing-name": None}[kind]
    if why:
        assert f"ignoring `latest`: {root / LATEST} {why}" in run.output
    else:
        assert "skipping ckpt-00000990: named by `latest` but does not exist" in run.output
    assert (root / LATEST).read_text() == checkpoint_name(30) + "\n"
    if kind == "directory":
        assert (root / "latest.skipped-1").is_dir()  # set aside, not deleted


@pytest.mark.parametrize("kind", ["binary", "directory", "missing-name"])
def test_a_garbage_latest_is_reported_by_ckpt_commands(tmp, two_checkpoints, kind):
    import shutil

    root = tmp / "ckpt"
    shutil.copytree(two_checkpoints, root)
    _garbage(root, kind)
    for action, code in (("verify", 1), ("ls", 0), ("show", 0)):
        r = subprocess.run([sys.executable, "-m", "mpitf.cli.main", "ckpt", action, str(root)],
                           capture_output=True, text=True, timeout=60, cwd=str(REPO))
        assert r.returncode == code and "Traceback" not in r.stderr, (action, r)
        if kind == "missing-name":
            if action == "verify":
                assert "latest: names ckpt-00000990, which does not exist" in r.stdout
        else:
            assert f"latest: ignored: {root / LATEST}" in r.stdout, (action, r.stdout)
        if action == "verify":
            assert "ckpt-00000010: OK" in r.stdout and "ckpt-00000020: OK" in r.stdout
        if action == "show":
            assert "ckpt-00000020: global step 20" in r.stdout
