"""A bad flag value under mpiexec: one message from rank 0, exit 2 on every rank, at once.

The job builds its configuration right after parsing, on every rank, so nothing starts:
no run directory, no checkpoint, no training.
"""


import pytest

from mpitf.testing import run_mpi
from tests.support import REPO

pytestmark = pytest.mark.mpi

JOB = str(REPO / "jobs" / "mnist_mlp.py")


@pytest.fixture
def data(digits_file):
    return digits_file


@pytest.mark.parametrize("flags, message", [
    (["--batch-size", "0"], "batch_size must be >= 1, got 0"),
    (["--lr", "-1"], "learning rate (--lr) must be > 0.0, got -1.0"),
    (["--deadline", "0"], "deadline must be > 0.0, got 0.0"),
    (["--mode", "ssp", "--staleness", "-1"], "staleness must be >= 0, got -1"),
    (["--checkpoint-every", "0"], "save_checkpoint_steps (--checkpoint-every) must be >= 1"),
    (["--summary-every", "-1"], "summary_every (--summary-every) must be >= 0, got -1"),
    (["--bucket-bytes", "-1"],
     "bucket_bytes (--bucket-bytes; 0 for one frame per ps) must be >= 0, got -1"),
    (["--ps-threads", "0"], "ps_threads (--ps-threads) must be >= 1, got 0"),
    (["--ps-threads", "5000"], "ps_threads (--ps-threads) must be at most 1024, got 5000"),
    (["--wire-dtype", "bfloat16", "--moving-average-decay", "0.9"],
     "wire_dtype bfloat16 (--wire-dtype) does not support moving_average_decay"),
    (["--full-checkpoint-every", "3"], "full_checkpoint_every (--full-checkpoint-every) "
     "takes deltas between the checkpoints --checkpoint-every or --checkpoint-secs takes"),
    (["--full-checkpoint-every", "3", "--checkpoint-every", "2"],
     "full_checkpoint_every (--full-checkpoint-every) does not support a model without "
     "embedding tables"),
])
def test_a_bad_flag_ends_every_rank_with_one_message(data, tmp_path, flags, message):
    ckpt = tmp_path / "ckpt"
    run = run_mpi(3, [JOB, "--data", data, "--num-ps", "1", "--steps", "5",
                      "--checkpoint-dir", str(ckpt), *flags], timeout=30, cwd=str(tmp_path))
    assert not run.timed_out, run.output  # at start-up, not after any deadline
    assert run.returncode == 2, run.output
    assert run.output.count(message) == 1, run.output  # rank 0 alone says it
    assert f"mpitf: error on rank 0: {message}" in run.stderr, run.output
    assert "Traceback" not in run.output
    assert "final:" not in run.stdout and "step " not in run.stdout
    assert not (tmp_path / "runs").exists() and not ckpt.exists()


@pytest.mark.parametrize("variable", ["MPITF_DEADLINE", "MPITF_SPIN_MS"])
def test_a_bad_number_in_the_environment_is_one_message(data, tmp_path, variable):
    run = run_mpi(3, [JOB, "--data", data, "--num-ps", "1", "--steps", "5"], timeout=60,
                  cwd=str(tmp_path), env={variable: "soon"})
    assert not run.timed_out, run.output
    assert run.returncode == 2, run.output
    assert run.output.count(f"{variable}='soon' is not a number") == 1, run.output
    assert "Traceback" not in run.output
    assert not (tmp_path / "runs").exists()
