"""--skip-nonfinite under mpiexec: skips are counted, bounded, and signals still act.

A sample holding NaN makes a few gradients non-finite: they are skipped and counted in the
log, metrics.jsonl and the summary. A huge learning rate makes the parameters Inf: every
gradient is skipped, and the job ends at --max-nonfinite-skips naming the variable, or, on
SIGTERM with a checkpoint directory, checkpoints and exits 75 within seconds.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from mpitf.ckpt.names import LATEST
from mpitf.runtime.exits import EXIT_ERROR, EXIT_REQUEUE
from mpitf.runtime.launch import mpiexec_command
from mpitf.testing import kill_group, run_mpi
from tests.support import REPO

pytestmark = pytest.mark.mpi

JOB = str(REPO / "jobs" / "mnist_mlp.py")
DIVERGE = ["--lr", "1e30", "--skip-nonfinite"]


@pytest.fixture
def data(digits_file):
    return digits_file


def test_isolated_skips_are_counted_in_the_log_metrics_and_summary(data, tmp_path):
    path = str(tmp_path / "nan.h5")
    shutil.copy(data, path)
    with h5py.File(path, "r+") as f:
        f["x_train"][5, 0] = np.nan  # one sample: a skip in each epoch that serves it
    run = run_mpi(2, [JOB, "--data", path, "--num-ps", "1", "--steps", "150",
                      "--log-every", "10", "--skip-nonfinite", "--run-dir", "r"], timeout=60,
                  cwd=str(tmp_path))
    assert run.returncode == 0, run.output
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    metrics = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").open()]
    lines = re.findall(r"^step \d+: skipped a gradient holding NaN or Inf in 'hidden1/weights'"
                       r" \(1 in a row, (\d+) in all", run.stdout, re.M)
    skipped = summary["nonfinite_skipped"]
    assert skipped >= 2 and summary["step"] == 150, summary
    assert [int(n) for n in lines] == list(range(1, skipped + 1))
    assert metrics[-1]["step"] == 150 and metrics[-1]["nonfinite_skipped"] == skipped
    assert f"; {skipped} non-finite skipped)" in run.stdout


def test_a_diverged_job_ends_at_the_bound_naming_the_variable(data, tmp_path):
    run = run_mpi(3, [JOB, "--data", data, "--num-ps", "1", "--steps", "300", *DIVERGE,
                      "--max-nonfinite-skips", "50"], timeout=20, cwd=str(tmp_path))
    assert not run.timed_out, run.output
    assert run.returncode == EXIT_ERROR, run.output
    assert ("the gradient of variable 'hidden1/weights' held NaN or Inf 50 steps in a row"
            in run.stderr), run.output
    assert "lower the learning rate, or raise max_nonfinite_skips" in run.stderr
    assert "final:" not in run.stdout


@pytest.mark.parametrize("ckpt", [True, False])
def test_sigterm_while_skipping_is_acted_on(data, tmp_path, ckpt):
    root = tmp_path / "ckpt"
    log = tmp_path / "out.log"
    argv = [sys.executable, "-W", "ignore", JOB, "--data", data, "--num-ps", "1",
            "--steps", "300", *DIVERGE, "--max-nonfinite-skips", "100000000",
            "--log-every", "100", *(["--checkpoint-dir", str(root)] if ckpt else [])]
    with log.open("w") as out:
        proc = subprocess.Popen(mpiexec_command(3, argv), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=str(tmp_path),
                                env=dict(os.environ, PYTHONUNBUFFERED="1"),
                                start_new_session=True)
    try:
        end = time.monotonic() + 30
        while "(200 in a row" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < end, log.read_text()
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGTERM)  # Hydra's mpiexec forwards it to every rank
        try:
            code = proc.wait(timeout=10)  # the deadline: acted on within 10 s
        except subprocess.TimeoutExpired:
            pytest.fail("still running 10 s after SIGTERM:\n" + log.read_text())
    finally:
        kill_group(proc)
    out = log.read_text()
    if ckpt:
        assert code == EXIT_REQUEUE, out
        assert f"SIGTERM: checkpointed at step 1; exiting with code {EXIT_REQUEUE}" in out
        assert (root / LATEST).read_text().strip() == "ckpt-00000001"
        assert "final:" not in out
    else:  # nothing to save: training stops at once, and the chief still reports
        assert code == 128 + signal.SIGTERM, out
        assert '"nonfinite_skipped": ' in out
