"""Failure and recovery end to end: real mpiexec runs, real signals and kills, real HDF5 files.

jobs/mnist_mlp.py runs through tests/recovery/slow_job.py, which can slow every worker step
(MPITF_TEST_STEP_SLEEP; values are unchanged) so that a kill or a signal lands mid-run, and
records each rank's pid; tests/support.py runs it. Every run is under a deadline; a hung
run's process group is killed.
About 90 s on a 2-core machine, a third of it the two deadline tests.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest

from mpitf.ckpt.names import checkpoint_name, read_manifest, shard_name
from mpitf.ckpt.verify import find_restorable, verify_checkpoint
from mpitf.runtime.exits import EXIT_REQUEUE
from mpitf.testing import run_mpi
from tests.support import (
    CHECKPOINT,
    JOB,
    REPO,
    RESTORED,
    Background,
    assert_bitwise_equal,
    cli_verify,
    final_summary,
    job_args,
    latest_step,
    load_npz,
    names_stopped_rank,
    run_job,
    stop_and_wait,
    tree_digests,
)

pytestmark = [pytest.mark.mpi, pytest.mark.slow]  # kills, signals, resumes: 5 to 40 s each


@pytest.fixture
def tmp(tmp_path):
    return tmp_path


# -------------------------------------------------------- 1. kill, resume, same bits


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_sigkill_then_resume_gives_the_same_bits(tmp, optimizer):
    extra = ["--checkpoint-every", "10", "--optimizer", optimizer]
    if optimizer == "adam":
        extra += ["--lr", "0.01"]
    ref = run_job(tmp, ckpt=tmp / "ref-ckpt", steps=60,
                  extra=[*extra, "--export", tmp / "ref.npz"])
    assert ref.returncode == 0, ref.output

    root = tmp / "ckpt"
    job = Background(tmp, ckpt=root, steps=60, step_sleep=0.03, run_dir="killed",
                     extra=[*extra, "--log-every", "1", "--export", tmp / "dead.npz"])
    job.wait_until(lambda: (latest_step(root) or 0) > 20, 30, "a checkpoint beyond step 20")
    job.wait_for_step(latest_step(root) + 2)  # two steps past the checkpoint: not a checkpoint step
    code = job.kill_and_finish()
    assert code != 0 and not (tmp / "dead.npz").exists()
    saved = latest_step(root)
    assert saved is not None and saved % 10 == 0 and 20 < saved < 60, job.output
    # The kill came after the chief had logged steps past the checkpoint: work was lost.
    logged = [json.loads(line)["step"]
              for line in (tmp / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert max(logged) > saved, (saved, logged[-5:])

    resumed = run_job(tmp, ckpt=root, steps=60, extra=[*extra, "--export", tmp / "out.npz"])
    assert resumed.returncode == 0, resumed.output
    (path, step), = RESTORED.findall(resumed.stdout)
    assert int(step) == saved and int(step) % 10 == 0 and int(step) < 60
    assert Path(path).name == checkpoint_name(saved)
    assert final_summary(resumed)["step"] == 60
    assert_bitwise_equal(load_npz(tmp / "out.npz"), load_npz(tmp / "ref.npz"))


def test_sigkill_then_resume_with_buckets_gives_the_one_frame_bits(tmp):
    # The reference trains in one frame per ps; the killed and the resumed run in buckets
    # (64 bytes: each of the model's variables its own), cut and restored between steps.
    extra = ["--checkpoint-every", "10", "--optimizer", "adam", "--lr", "0.01"]
    ref = run_job(tmp, ckpt=tmp / "ref-ckpt", steps=40,
                  extra=[*extra, "--export", tmp / "ref.npz"])
    assert ref.returncode == 0, ref.output
    root, buckets = tmp / "ckpt", ["--bucket-bytes", "64"]
    job = Background(tmp, ckpt=root, steps=40, step_sleep=0.03, run_dir="killed",
                     extra=[*extra, *buckets, "--log-every", "1"])
    job.wait_until(lambda: (latest_step(root) or 0) >= 20, 30, "a checkpoint at step 20")
    job.kill_and_finish()
    saved = latest_step(root)
    assert saved is not None and 20 <= saved < 40, job.output
    resumed = run_job(tmp, ckpt=root, steps=40,
                      extra=[*extra, *buckets, "--export", tmp / "out.npz"])
    assert resumed.returncode == 0, resumed.output
    (_, step), = RESTORED.findall(resumed.stdout)
    assert int(step) == saved
    assert final_summary(resumed)["step"] == 40
    assert_bitwise_equal(load_npz(tmp / "out.npz"), load_npz(tmp / "ref.npz"))


# ------------------------------------------------------- 2. a damaged newest checkpoint


def _truncate(shard):
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    return "truncated"


def _flip_dataset_bytes(shard):
    with h5py.File(shard, "r") as f:
        names = []
        f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
        name = sorted(n for n in names if n.startswith("params/"))[0]
        offset = f[name].id.get_offset()
        assert offset is not None  # contiguous storage, as the format says
    with open(shard, "r+b") as f:
        f.seek(offset + 16)
        data = bytearray(f.read(8))
        f.seek(offset + 16)
        f.write(bytes(b ^ 0xFF for b in data))
    return name


@pytest.mark.parametrize("damage", [_truncate, _flip_dataset_bytes],
                         ids=["truncated", "flipped"])
def test_damaged_newest_checkpoint_is_skipped(tmp, damage):
    root = tmp / "ckpt"
    first = run_job(tmp, ckpt=root, steps=30, extra=["--checkpoint-every", "10"])
    assert first.returncode == 0, first.output
    assert [int(s) for _, s in CHECKPOINT.findall(first.stdout)] == [10, 20, 30]
    names = [checkpoint_name(s) for s in (10, 20, 30)]
    assert latest_step(root) == 30
    before = {n: tree_digests(root / n) for n in names[:2]}

    shard = root / names[2] / shard_name(0, 1)
    what = damage(shard)
    bad = cli_verify(root / names[2])
    assert bad.returncode != 0 and "OK" not in bad.stdout, bad.stdout
    assert shard_name(0, 1) in bad.stdout
    if what != "truncated":
        assert f"checksum mismatch in {what}" in bad.stdout
    assert cli_verify(root).returncode != 0
    for n in names[:2]:
        good = cli_verify(root / n)
        assert good.returncode == 0 and good.stdout.strip() == f"{n}: OK", good.stdout

    resumed = run_job(tmp, ckpt=root, steps=40, extra=["--checkpoint-every", "10"])
    assert resumed.returncode == 0, resumed.output
    skip = re.search(rf"skipping {names[2]}: (.*); using {names[1]}", resumed.stderr)
    assert skip, resumed.output
    assert shard_name(0, 1) in skip.group(1)
    (path, step), = RESTORED.findall(resumed.stdout)
    assert Path(path).name == names[1] and int(step) == 20
    assert [int(s) for _, s in CHECKPOINT.findall(resumed.stdout)] == [30, 40]
    assert final_summary(resumed)["step"] == 40
    # The older checkpoints were not touched; the damaged one was replaced by a good save.
    for n in names[:2]:
        assert tree_digests(root / n) == before[n], n
    assert latest_step(root) == 40
    everything = cli_verify(root)
    assert everything.returncode == 0, everything.stdout
    assert everything.stdout.count(": OK") == 4, everything.stdout


# ---------------------------------------------------------------------- 3. resharding


def test_checkpoint_restores_under_another_number_of_ps(tmp):
    root = tmp / "ckpt"
    one = run_job(tmp, ckpt=root, steps=30,
                  extra=["--checkpoint-every", "30", "--export", tmp / "a.npz"])
    assert one.returncode == 0, one.output
    assert latest_step(root) == 30
    assert read_manifest(root / checkpoint_name(30))["layout"]["num_ps"] == 1

    # Two ps, already at the last step: restore, write nothing, export the same values.
    two = run_job(tmp, n=4, ckpt=root, num_ps=2, steps=30, extra=["--export", tmp / "b.npz"])
    assert two.returncode == 0, two.output
    (_, step), = RESTORED.findall(two.stdout)
    assert int(step) == 30 and final_summary(two)["step"] == 30
    assert not CHECKPOINT.findall(two.stdout), "the checkpoint at step 30 was rewritten"
    assert_bitwise_equal(load_npz(tmp / "b.npz"), load_npz(tmp / "a.npz"))

    # Two ps, ten more steps: training goes on from the resharded state.
    more = run_job(tmp, n=4, ckpt=root, num_ps=2, steps=40)
    assert more.returncode == 0, more.output
    (_, step), = RESTORED.findall(more.stdout)
    assert int(step) == 30
    summary = final_summary(more)
    assert summary["step"] == 40 and summary["ps"] == 2
    assert summary["test_accuracy"] > 0.8, summary
    manifest = read_manifest(root / checkpoint_name(40))
    assert manifest["layout"]["num_ps"] == 2 and len(manifest["shards"]) == 2
    assert verify_checkpoint(root / checkpoint_name(40)) == []


# ---------------------------------------------------------- 4. SIGUSR1 / SIGTERM mid-run


@pytest.mark.parametrize("signame", ["SIGUSR1", "SIGTERM"])
@pytest.mark.parametrize("target", ["ranks", "mpiexec"])
def test_signal_checkpoints_and_exits_with_requeue_code(tmp, signame, target):
    root = tmp / "ckpt"
    job = Background(tmp, ckpt=root, steps=5000)
    job.wait_for_step(20)
    sig = getattr(signal, signame)
    if target == "ranks":
        pids = job.rank_pids_from_proc()
        assert len(pids) == 3, pids
        for pid in pids:
            os.kill(pid, sig)
    else:
        # Hydra's mpiexec forwards SIGUSR1 and SIGTERM to every rank.
        os.kill(job.proc.pid, sig)
    code, seconds = job.finish(timeout=30)
    out = job.output
    assert code == EXIT_REQUEUE, out
    (path, step), = CHECKPOINT.findall(out)
    step = int(step)
    assert step >= 20 and Path(path).name == checkpoint_name(step)
    assert (f"{signame}: checkpointed at step {step}; exiting with code {EXIT_REQUEUE}"
            in out), out
    assert latest_step(root) == step and verify_checkpoint(path) == []
    assert "final:" not in out

    resumed = run_job(tmp, ckpt=root, steps=step + 10)
    assert resumed.returncode == 0, resumed.output
    (_, restored), = RESTORED.findall(resumed.stdout)
    assert int(restored) == step
    assert final_summary(resumed)["step"] == step + 10


# ----------------------------------------------------- 5. a dead or a silent rank mid-run


@pytest.mark.parametrize("victim", ["rank2-worker-1", "rank0-ps-0"])
def test_sigkill_of_a_rank_ends_the_job(tmp, victim):
    rank, job_name, task = victim.split("-")
    expected = f"{rank.replace('rank', 'rank ')} (/job:{job_name}/task:{task} on "
    job = Background(tmp, steps=5000, extra=["--deadline", "10"])
    job.wait_for_step(20)
    pid = job.rank_pid(victim)
    os.kill(pid, signal.SIGKILL)
    code, _ = job.finish(timeout=30)  # the deadline: still running 30 s later fails
    out = job.output
    assert code != 0, out
    # The node's witness names the dead rank, its task and pid (mpitf.runtime.witness: a
    # process that Hydra's proxy does not kill when it kills the survivors), or a survivor
    # whose MPI call failed on the dead peer first does; Hydra's own block names some pid.
    assert expected in out and f"(pid {pid}) died without finishing" in out, out


@pytest.mark.parametrize("victim,operation,deadline_s", [
    ("rank2-worker-1", "during push", 6),
    ("rank0-ps-0", "during push_pull", 9),  # workers wait 1.5 x the deadline on a ps
])
def test_a_stopped_rank_is_named_when_the_deadline_ends_the_job(tmp, victim, operation,
                                                                deadline_s):
    job = Background(tmp, steps=5000, extra=["--deadline", "6"])
    # the deadline: a job still running 30 s after the stop fails (stop_and_wait's timeout)
    code, seconds, out = stop_and_wait(job, victim, after_step=20, timeout=30)
    assert code != 0, out
    assert deadline_s - 1 < seconds, (seconds, out)  # not before the deadline
    assert names_stopped_rank(out, victim, operation), out


# ----------------------------------------------- 6. killed at any instant, even mid-save


def test_kills_at_random_instants_leave_latest_whole(tmp):
    root = tmp / "ckpt"
    rng = random.Random(1234)
    for i in range(5):
        before = latest_step(root)
        job = Background(tmp, ckpt=root, steps=100000, step_sleep=0,
                         extra=["--checkpoint-every", "1", "--max-to-keep", "3"])
        # Every step saves, so most of a step's time is spent writing a checkpoint.
        job.wait_until(lambda before=before: latest_step(root) not in (None, before), 30,
                       "a new checkpoint")
        # A random instant on purpose (the one sleep that lands a signal): the point is a
        # kill anywhere in a step, mid-save included, which no log line marks; seeded.
        time.sleep(rng.uniform(0.0, 0.3))
        job.kill_and_finish()
        out = job.output
        m = RESTORED.search(out)
        if i:
            assert m and int(m.group(2)) == before, out  # each run resumed where the last one left
        latest = latest_step(root)
        assert latest is not None and latest > (before or 0), out
        assert verify_checkpoint(root / checkpoint_name(latest)) == []
        found = find_restorable(str(root), log=lambda m: None)
        assert found is not None
        path, manifest = found
        assert Path(path).name == checkpoint_name(latest) and verify_checkpoint(path) == []
        assert manifest["global_step"] == latest
    assert cli_verify(root).returncode == 0


# ---------------------------------------------- 7. the timer trigger and `mpitf ckpt verify`


def test_checkpoint_every_t_seconds(tmp):
    root = tmp / "timed"
    run = run_mpi(3, [JOB, *job_args(
        tmp, ckpt=root, steps=60, extra=["--checkpoint-secs", "0.25"])], timeout=60,
        cwd=str(REPO), env={"MPITF_TEST_STEP_SLEEP": "0.02"})
    assert run.returncode == 0 and not run.timed_out, run.output
    steps = [int(s) for _, s in CHECKPOINT.findall(run.stdout)]
    # 60 steps of at least 20 ms each take over a second: several timed cuts, then the end.
    assert len(steps) >= 3 and steps == sorted(steps) and steps[-1] == 60, run.output
    verify = subprocess.run([sys.executable, "-m", "mpitf.cli.main", "ckpt", "verify", str(root)],
                            capture_output=True, text=True, timeout=60, cwd=str(REPO))
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_checkpoint_of_other_shapes_is_refused_naming_the_variable(tmp):
    root = tmp / "shapes"
    first = run_job(tmp, ckpt=root, steps=20)
    assert first.returncode == 0, first.output
    before = {p.name: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    other = run_job(tmp, ckpt=root, steps=40, extra=["--hidden", "64"], timeout=15)
    assert other.returncode != 0, other.output
    assert "variable 'hidden1/weights' has shape (64, 64) in the model but (64, 128)" in \
        other.output, other.output
    # The checkpoint it refused is untouched and still verifies. The aborted job leaves
    # its lock file (MPI_Abort runs no exit handlers); the next job takes it over.
    after = {p.name: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    assert {k: v for k, v in after.items() if k != ".mpitf-lock"} == before
    verify = subprocess.run([sys.executable, "-m", "mpitf.cli.main", "ckpt", "verify", str(root)],
                            capture_output=True, text=True, timeout=60, cwd=str(REPO))
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_local_sgd_stopped_at_an_average_resumes_to_the_uninterrupted_bits(tmp):
    # Local SGD (K = 4): the workers' optimizer steps between averages are their own, the
    # cut holds the ps's average. A run stopped at step 20 (an average: its final cut) and
    # resumed to 40 averages at the same steps as one run of 40, so it ends on its bits
    # (plain SGD: no optimizer slots to start afresh on the workers).
    extra = ["--local-steps", "4", "--checkpoint-every", "10"]
    ref = run_job(tmp, ckpt=tmp / "ref-ckpt", steps=40, mode="local",
                  extra=[*extra, "--export", tmp / "ref.npz"])
    assert ref.returncode == 0, ref.output
    assert [int(s) for _, s in CHECKPOINT.findall(ref.stdout)] == [12, 20, 32, 40]  # averages
    root = tmp / "ckpt"
    first = run_job(tmp, ckpt=root, steps=20, mode="local", extra=extra)
    assert first.returncode == 0 and latest_step(root) == 20, first.output
    resumed = run_job(tmp, ckpt=root, steps=40, mode="local",
                      extra=[*extra, "--export", tmp / "out.npz"])
    assert resumed.returncode == 0, resumed.output
    (_, step), = RESTORED.findall(resumed.stdout)
    assert int(step) == 20 and final_summary(resumed)["step"] == 40
    assert final_summary(resumed)["mode"] == "local"
    assert_bitwise_equal(load_npz(tmp / "out.npz"), load_npz(tmp / "ref.npz"))
