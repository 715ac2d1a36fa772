"""Job roles under a real mpiexec (issue 14): a chief task trains, an evaluator evaluates
every checkpoint, a task of another job exits 0, and a cluster that cannot train is one
message and exit 2 on every rank."""

import json
import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mpitf.testing import run_mpi
from tests.support import REPO

pytestmark = pytest.mark.mpi

JOB = str(REPO / "jobs" / "mnist_mlp.py")
CKPT_LINE = re.compile(r"^checkpoint \S+ckpt-(\d+) at step (\d+)", re.MULTILINE)


def run_job(n, data, tmp_path, *args, timeout=90, tag_output=False):
    return run_mpi(n, [JOB, "--data", data, *map(str, args)], timeout=timeout,
                   cwd=str(tmp_path), tag_output=tag_output)


def final(run):
    assert not run.timed_out and run.returncode == 0, run.output
    # (with tag_output, MPICH also tags the newline: "[1] final: {...}[1] ")
    found = re.findall(r"^(?:\[\d+\] )?final: (\{.*\})", run.stdout, re.MULTILINE)
    assert len(found) == 1, run.stdout
    return json.loads(found[0])


def eval_records(run_dir):
    return [json.loads(line)
            for line in (run_dir / "eval" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_chief_task_trains_as_replica_0_and_logs(digits_file, tmp_path):
    spec = "ps|localhost:1,chief|localhost:2,worker|localhost:3"
    run = run_job(3, digits_file, tmp_path, f"--cluster_spec={spec}", "--steps", 300,
                  "--mode", "sync", "--run-dir", tmp_path / "run", "--log-every", 100,
                  tag_output=True, timeout=60)
    summary = final(run)  # not timed out
    # the same band as ps + 2 workers (test_training.test_sync_reaches_95_percent...)
    assert summary["test_accuracy"] >= 0.95 and summary["step"] == 300, summary
    assert summary["workers"] == 2  # the chief and the worker both train
    logged = re.findall(r"^\[(\d+)\] (step \d+),", run.stdout, re.MULTILINE)
    assert logged == [("1", "step 100"), ("1", "step 200"), ("1", "step 300")]  # rank 1
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines()]
    assert [r["step"] for r in records] == [100, 200, 300]


@pytest.mark.slow
@pytest.mark.parametrize("cluster", [
    ["--num-ps", "1", "--evaluator"],
    ["--cluster_spec=evaluator|localhost:1,ps|localhost:2,chief|localhost:3,"
     "worker|localhost:4"],
], ids=["num-ps-flag", "spec"])
def test_the_evaluator_writes_one_line_per_checkpoint(digits_file, tmp_path, cluster):
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    run = run_job(4, digits_file, tmp_path, *cluster, "--steps", 200, "--checkpoint-dir",
                  ckpt, "--checkpoint-every", 50, "--run-dir", run_dir, timeout=60)
    summary = final(run)  # every rank, the evaluator's included, exited 0; not timed out
    committed = [int(step) for _, step in CKPT_LINE.findall(run.stdout)]
    assert committed == [50, 100, 150, 200]
    records = eval_records(run_dir)
    assert [r["step"] for r in records] == committed
    assert [r["checkpoint"] for r in records] == [f"ckpt-{s:08d}" for s in committed]
    for r in records:
        assert 0.8 <= r["accuracy"] <= 1.0 and 0 < r["loss"] < 1, r
        assert r["examples"] == 359
    # the final checkpoint holds the chief's final parameters: the same accuracy
    assert records[-1]["accuracy"] == pytest.approx(summary["test_accuracy"])
    assert records[-1]["accuracy"] > records[0]["accuracy"]
    assert run.stdout.count("evaluator: step") == 4
    assert "evaluated 4 checkpoints" in run.stdout
    # TensorFlow's layout: the evaluator's TensorBoard events in <run_dir>/eval
    events = EventAccumulator(str(run_dir / "eval"), size_guidance={"scalars": 0})
    events.Reload()
    for tag in ("loss", "accuracy"):
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert got == [(r["step"], pytest.approx(r[tag], rel=1e-6)) for r in records]


@pytest.mark.slow
def test_the_evaluator_names_checkpoints_pruned_before_it_read_them(digits_file, tmp_path):
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    run = run_job(3, digits_file, tmp_path, "--num-ps", "1", "--evaluator", "--steps", 100,
                  "--checkpoint-dir", ckpt, "--checkpoint-every", 5, "--max-to-keep", 1,
                  "--run-dir", run_dir, "--log-every", 0)
    final(run)
    committed = [int(step) for _, step in CKPT_LINE.findall(run.stdout)]
    assert committed == list(range(5, 101, 5))
    evaluated = [r["step"] for r in eval_records(run_dir)]
    skipped = [int(s) for s in re.findall(r"skipping the checkpoint at step (\d+)", run.stderr)]
    assert sorted(evaluated + skipped) == committed, run.output  # none is missed silently
    assert evaluated == sorted(evaluated) and evaluated[-1] == 100  # through the final one


def test_a_task_of_another_job_exits_0_while_the_others_train(digits_file, tmp_path):
    spec = "ps|localhost:1,worker|localhost:2;localhost:3,other|localhost:4"
    run = run_job(4, digits_file, tmp_path, f"--cluster_spec={spec}", "--steps", 100,
                  "--run-dir", tmp_path / "run", tag_output=True)
    summary = final(run)
    assert summary["step"] == 100 and summary["workers"] == 2 and summary["test_accuracy"] > 0.8
    assert run.output.count("/job:other/task:0 takes no part in training") == 1
    assert re.search(r"^\[3\] mnist_mlp: /job:other/task:0 takes no part", run.stdout,
                     re.MULTILINE), run.stdout  # rank 3 runs the other job's task


@pytest.mark.parametrize("n, args, message", [
    (2, ["--cluster_spec=local|localhost:1;localhost:2"],
     "training needs a chief or worker task, but the cluster has none (jobs: local (2))"),
    (3, ["--cluster_spec=ps|localhost:1,worker|localhost:2,evaluator|localhost:3"],
     "the cluster has an evaluator task, which evaluates checkpoints, but no checkpoint "
     "directory is set"),
    (3, ["--num-ps", "1", "--evaluator", "--cluster_spec=ps|localhost:1,worker|localhost:2"],
     "--evaluator makes the highest rank of the --num-ps form an evaluator, but "
     "--cluster_spec gives the cluster"),
    (2, ["--num-ps", "1", "--evaluator", "--checkpoint-dir", "ckpt"],
     "--evaluator needs 1 ps, a worker and the evaluator: run with mpiexec -n 3"),
    (4, ["--cluster_spec=ps|localhost:1,chief|localhost:2;localhost:3,worker|localhost:4"],
     "the cluster spec has 2 'chief' tasks: TensorFlow allows at most one chief task"),
], ids=["no-replica", "evaluator-without-checkpoints", "evaluator-flag-with-spec",
        "evaluator-flag-too-few-ranks", "two-chiefs"])
def test_a_cluster_that_cannot_train_is_one_message(digits_file, tmp_path, n, args, message):
    run = run_job(n, digits_file, tmp_path, "--steps", 5, *args, timeout=15)
    assert not run.timed_out, run.output
    assert run.returncode == 2, run.output
    assert run.output.count(message) == 1, run.output
    assert "Traceback" not in run.output and "final:" not in run.stdout


@pytest.mark.slow
def test_a_silent_chief_is_named_by_its_own_job(tmp_path):
    from tests.support import Background, names_stopped_rank, stop_and_wait

    spec = "--cluster_spec=ps|localhost:1,chief|localhost:2,worker|localhost:3"
    job = Background(tmp_path, steps=5000, extra=[spec, "--deadline", "5"])
    # the deadline: a job still running 20 s after the stop fails (stop_and_wait's timeout)
    code, seconds, out = stop_and_wait(job, "rank1-chief-0", after_step=20, timeout=20)
    assert code != 0, out
    assert 4 < seconds, (seconds, out)  # not before the 5 s deadline
    assert names_stopped_rank(out, "rank1-chief-0", "during push"), out
