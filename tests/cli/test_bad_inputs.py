"""Bad inputs under mpiexec: one message from rank 0, exit 2 on every rank, before training.

Flags that contradict each other, cluster flags given empty, a TF_CONFIG task that is not
the rank's, output paths that cannot be written and data that does not fit (labels out of
range or not integers, a test split of another width): each ends the job at start-up with
one message and nothing written. Images stored as (N, H, W) train: the models take flat rows.
"""

import json
import shutil

import h5py
import numpy as np
import pytest

from mpitf.testing import run_mpi
from tests.support import REPO

pytestmark = pytest.mark.mpi

JOB = str(REPO / "jobs" / "mnist_mlp.py")


@pytest.fixture
def data(digits_file):
    return digits_file


def variant(data, path, change):
    """Copy the digits file to ``path`` and let ``change(f)`` rewrite it; return the path."""
    shutil.copy(data, path)
    with h5py.File(path, "r+") as f:
        change(f)
    return str(path)


def replace(f, name, value):
    del f[name]
    f[name] = value


def refused(run, message, tmp_path):
    """Assert the job ended at start-up with ``message`` once, exit 2, nothing written.

    Its run had a deadline of 30 s (``timeout=30``): a refusal that hangs is killed there.
    """
    assert not run.timed_out, run.output
    assert run.returncode == 2, run.output
    assert run.output.count(message) == 1, run.output  # rank 0 alone says it
    assert f"mpitf: error on rank 0: {message}" in run.stderr, run.output
    assert "Traceback" not in run.output
    assert "final:" not in run.stdout and "step " not in run.stdout
    assert not (tmp_path / "runs").exists() and not (tmp_path / "ckpt").exists()


def job(n, data, tmp_path, *flags, env=None):
    return run_mpi(n, [JOB, "--data", data, "--num-ps", "1", "--steps", "5",
                       "--checkpoint-dir", str(tmp_path / "ckpt"), *flags], timeout=30,
                   cwd=str(tmp_path), env=env)


@pytest.mark.parametrize("flags, message", [
    (["--mode", "async", "--deterministic"],
     "deterministic (--deterministic) needs mode 'sync', got 'async'"),
    (["--mode", "ssp", "--deterministic"],
     "deterministic (--deterministic) needs mode 'sync', got 'ssp'"),
    (["--local-steps", "4"],
     "local_steps (--local-steps) needs mode 'local', got 'sync': give --mode local or drop "
     "--local-steps"),
    (["--mode", "local", "--local-steps", "0"],
     "local_steps (--local-steps) must be >= 1, got 0"),
    (["--replicas-to-aggregate", "0"],
     "replicas_to_aggregate (leave it out for every worker) must be >= 1, got 0"),
    (["--skip-nonfinite", "--max-nonfinite-skips", "0"],
     "max_nonfinite_skips (--max-nonfinite-skips) must be >= 1, got 0"),
    (["--cluster_spec", ""], "empty cluster spec ''"),
    (["--worker_hosts", ""], "--worker_hosts is empty: mpitf needs at least one worker"),
])
def test_contradicting_or_empty_flags_are_refused(data, tmp_path, flags, message):
    refused(job(3, data, tmp_path, *flags), message, tmp_path)


def test_a_tf_config_task_that_is_not_the_ranks_role_is_refused(data, tmp_path):
    hosts = ["localhost:1", "localhost:2", "localhost:3"]
    tf_config = json.dumps({"cluster": {"ps": hosts[:1], "worker": hosts[1:]},
                            "task": {"type": "worker", "index": 0}})
    run = run_mpi(3, [JOB, "--data", data, "--steps", "5"], timeout=30, cwd=str(tmp_path),
                  env={"TF_CONFIG": tf_config})
    # rank 0 runs the ps; the other worker disagrees too
    refused(run, 'TF_CONFIG task {"type": "worker", "index": 0} but MPI rank 0 runs '
                 "/job:ps/task:0", tmp_path)
    assert "(and 1 more rank disagrees)" in run.stderr


def test_a_cluster_without_ps_is_refused(data, tmp_path):
    refused(job(2, data, tmp_path, "--num-ps", "0"),
            "mnist_mlp trains through ps tasks but the cluster has none", tmp_path)


@pytest.mark.parametrize("flag", ["--run-dir", "--timeline"])
def test_an_unwritable_run_dir_or_timeline_is_refused_before_training(data, tmp_path, flag):
    (tmp_path / "afile").write_text("")
    run = job(3, data, tmp_path, flag, "afile/out")
    refused(run, f"{flag} afile/out: {tmp_path / 'afile'} is not a directory", tmp_path)


def test_a_batch_larger_than_a_shard_is_refused(data, tmp_path):
    run = job(3, data, tmp_path, "--batch-size", "5000")
    refused(run, f"data file {data}: the smallest of 2 shards (workers) of x_train holds 719 "
                 "samples, fewer than batch_size=5000", tmp_path)


@pytest.mark.parametrize("export, cause", [
    ("missing/params.npz", "directory {tmp}/missing does not exist"),
    ("adir", "{tmp}/adir.npz is a directory"),
    ("afile/params", "directory {tmp}/afile does not exist"),
])
def test_an_unwritable_export_is_refused_before_training(data, tmp_path, export, cause):
    (tmp_path / "adir.npz").mkdir()
    (tmp_path / "afile").write_text("")
    run = job(3, data, tmp_path, "--export", export)
    refused(run, f"--export {export}: {cause.format(tmp=tmp_path)}", tmp_path)


@pytest.mark.parametrize("change, message", [
    (lambda f: f["y_train"].__setitem__(7, -1),
     "y_train[7] = -1 is outside the classes [0, 10) (num_classes=10)"),
    (lambda f: f["y_test"].__setitem__(3, 10),
     "y_test[3] = 10 is outside the classes [0, 10) (num_classes=10)"),
    (lambda f: replace(f, "y_train", f["y_train"][...].astype(np.float32) + 0.5),
     "y_train must hold integer class labels, got dtype float32"),
    (lambda f: replace(f, "x_test", f["x_test"][:, :60]),
     "samples of x_test have shape (60,) but those of x_train (64,)"),
    (lambda f: f.attrs.__setitem__("image_shape", (7, 7, 1)),
     "attribute image_shape (7, 7, 1) does not hold one sample of x_train, of shape (64,)"),
])
def test_data_that_does_not_fit_is_refused_before_the_first_step(data, tmp_path, change,
                                                                   message):
    path = variant(data, tmp_path / "bad.h5", change)
    refused(job(3, path, tmp_path), f"data file {path}: {message}", tmp_path)


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_images_stored_as_n_h_w_train_as_flat_rows(data, tmp_path, model):
    def as_images(f):
        del f.attrs["image_shape"]
        for split in ("train", "test"):
            replace(f, f"x_{split}", f[f"x_{split}"][...].reshape(-1, 8, 8))
    path = variant(data, tmp_path / "images.h5", as_images)
    run = run_mpi(3, [JOB, "--data", path, "--num-ps", "1", "--steps", "30", "--model", model,
                      "--run-dir", "r"], timeout=60, cwd=str(tmp_path))
    assert run.returncode == 0, run.output
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["step"] == 30 and summary["test_accuracy"] > 0.3, summary
