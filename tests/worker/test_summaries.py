"""TensorBoard events: written by every training job, read back with TensorBoard's own reader.

The jobs run a few dozen steps with --log-every 10 and --summary-every 15; the events are
read with ``EventAccumulator`` (the reader behind ``tensorboard --logdir``) and compared
number by number with metrics.jsonl, the model's variable sizes and the learning-rate
schedule.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mpitf.models import build_model
from mpitf.ps.optimizers import make_optimizer
from mpitf.ps.schedules import ExponentialDecay
from mpitf.runtime.backend import numpy_backend
from mpitf.testing import run_mpi
from mpitf.worker.hooks import Hook, LoggingHook
from mpitf.worker.summaries import EventWriter, histogram_stats
from mpitf.worker.towers import LocalSession, Towers
from tests.support import REPO

SCALARS = {"loss", "learning_rate", "examples_per_sec", "global_step/sec", "staleness/max",
           "staleness/max_lead", "dropped/stale", "dropped/nonfinite"}
STEPS, LOG_EVERY, SUMMARY_EVERY = 40, 10, 15


def read_events(run_dir):
    """Return TensorBoard's view of ``run_dir``: every scalar and histogram kept."""
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    return events


def scalars(events, tag):
    return {e.step: e.value for e in events.Scalars(tag)}


def variable_sizes(hidden=128):
    model = build_model("mlp", 64, 10, hidden=(hidden,))  # the digits set: 8x8 pixels
    return {name: int(np.prod(shape)) for name, shape, _ in model.variables()}


def check_run_dir(run_dir, steps=STEPS, lr=None):
    """Assert the events of a finished job against metrics.jsonl and the model."""
    assert len(list(Path(run_dir).glob("events.out.tfevents.*"))) == 1  # the chief's alone
    events = read_events(run_dir)
    tags = events.Tags()
    assert set(tags["scalars"]) == SCALARS
    records = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").open())}
    logged = sorted({*range(LOG_EVERY, steps + 1, LOG_EVERY), steps})
    assert sorted(records) == logged
    for tag, key in (("loss", "loss"), ("learning_rate", "learning_rate"),
                     ("examples_per_sec", "examples_per_sec"),
                     ("global_step/sec", "global_steps_per_sec"),
                     ("dropped/stale", "stale_dropped"),
                     ("dropped/nonfinite", "nonfinite_skipped")):
        got = scalars(events, tag)
        assert sorted(got) == logged, tag
        for step, value in got.items():  # events hold float32
            assert value == np.float32(records[step][key]), (tag, step)
    if lr is not None:
        for step, value in scalars(events, "learning_rate").items():
            assert value == np.float32(lr(step - 1)), step  # the rate of the step's update
    sizes = variable_sizes()
    assert set(tags["histograms"]) == {f"{kind}/{name}" for name in sizes
                                       for kind in ("gradients", "variables")}
    for name, size in sizes.items():
        for kind in ("gradients", "variables"):
            histograms = events.Histograms(f"{kind}/{name}")
            assert [h.step for h in histograms] == \
                list(range(SUMMARY_EVERY, steps + 1, SUMMARY_EVERY))
            for h in histograms:
                value = h.histogram_value
                assert value.num == size and sum(value.bucket) == size
                assert value.min <= value.max == value.bucket_limit[-1]
    return events, records


# -- the writer --------------------------------------------------------------------------

def test_histogram_counts_every_value_in_equal_buckets():
    values = np.arange(60, dtype=np.float32).reshape(6, 10)
    h = histogram_stats(values)
    assert (h["min"], h["max"], h["num"]) == (0.0, 59.0, 60)
    assert h["bucket_counts"] == [2] * 30
    assert h["bucket_limits"][0] == pytest.approx(59 / 30) and h["bucket_limits"][-1] == 59
    assert h["sum"] == 1770 and h["sum_squares"] == float((values.astype(np.float64) ** 2).sum())
    same = histogram_stats(np.full(7, 2.5, np.float32))
    assert (same["bucket_counts"], same["bucket_limits"]) == ([7], [2.5])
    bad = histogram_stats(np.array([1, np.inf, np.nan, 3], np.float32))
    assert bad["num"] == 4 and sum(bad["bucket_counts"]) == 2  # NaN/Inf in no bucket
    assert (bad["min"], bad["max"]) == (1.0, 3.0)


def test_event_writer_creates_nothing_until_written_and_appends_a_file_per_run(tmp_path):
    run_dir = tmp_path / "run"
    writer = EventWriter(run_dir)
    writer.flush()
    writer.close()
    assert not run_dir.exists()
    weights = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    with EventWriter(run_dir) as writer:
        writer.scalars(1, {"loss": 2.5, "learning_rate": 0.1})
        writer.histograms(1, {"variables/w": weights})
    writer = EventWriter(run_dir)  # a resumed run: a file of its own beside the first
    writer.scalars(2, {"loss": 1.5})
    writer.close()
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 2
    events = read_events(run_dir)
    assert scalars(events, "loss") == {1: 2.5, 2: 1.5}
    assert scalars(events, "learning_rate") == {1: np.float32(0.1)}
    h, = events.Histograms("variables/w")
    assert (h.step, h.histogram_value.num, h.histogram_value.min) == (1, 12, -1.0)


# -- towers without a ps: the local session ----------------------------------------------

class _Batches:
    def __init__(self, rng, n=8):
        self.batch_size = n
        self.rng = rng
        self.seen = []

    def next_batch(self):
        batch = (self.rng.standard_normal((self.batch_size, 6)).astype(np.float32),
                 self.rng.integers(0, 3, self.batch_size))
        self.seen.append(batch)
        return batch


class _Grab(Hook):
    """Keep, after every step, what a summary hook would read: parameters and gradients."""

    def __init__(self):
        self.after = []

    def after_run(self, session, loss):
        self.after.append((session.global_step,
                           {k: v.copy() for k, v in session.params.items()},
                           {k: v.copy() for k, v in session.grads.items()}))


def test_local_towers_keep_the_gradient_on_summary_steps():
    from mpitf.config import TrainingConfig

    model = build_model("mlp", 6, 3, hidden=(5,))
    towers = Towers(model, [numpy_backend(), numpy_backend()])
    grab, data = _Grab(), _Batches(np.random.default_rng(0))
    config = TrainingConfig(last_step=4, summary_every=2, log_every=0)
    sess = LocalSession(towers, make_optimizer("sgd", 0.5), data, config, hooks=[grab])
    before = {k: v.copy() for k, v in towers.params.items()}
    while not sess.should_stop():
        sess.run()
    sess.close()
    assert [g[0] for g in grab.after] == [1, 2, 3, 4]
    for (step, params, grads), batch in zip(grab.after, data.seen):
        want = {k: np.zeros_like(v) for k, v in before.items()}
        model.loss_and_grads(before, batch, want)
        for name in want:
            np.testing.assert_allclose(params[name], before[name] - np.float32(0.5) * want[name],
                                       rtol=1e-5, atol=1e-6)
            if step % 2 == 0:  # a summary step: the gradient is still there to be read
                np.testing.assert_allclose(grads[name], want[name], rtol=1e-5, atol=1e-7)
        before = params


def test_the_metrics_hook_is_made_only_when_it_has_something_to_do():
    from mpitf.config import TrainingConfig

    assert LoggingHook.from_config(TrainingConfig(log_every=0, summary_every=0)) is None
    assert LoggingHook.from_config(TrainingConfig(log_every=0, run_dir=None)) is None
    hook = LoggingHook.from_config(TrainingConfig(log_every=0, summary_every=5, run_dir="r"))
    assert (hook.every, hook.summary_every) == (0, 5)
    assert LoggingHook.from_config(TrainingConfig(log_every=3)).summary_every == 0  # no dir


# -- the jobs ----------------------------------------------------------------------------

def job_flags(run_dir, steps=STEPS):
    return ["--steps", str(steps), "--log-every", str(LOG_EVERY), "--summary-every",
            str(SUMMARY_EVERY), "--run-dir", str(run_dir)]


@pytest.mark.mpi
def test_mnist_mlp_writes_scalars_and_histograms(digits_file, tmp_path):
    run_dir = tmp_path / "run"
    run = run_mpi(3, ["jobs/mnist_mlp.py", "--data", digits_file, "--num-ps", "1",
                      "--lr-decay", "0.5", "--lr-decay-steps", "10", *job_flags(run_dir)],
                  timeout=90, cwd=str(REPO))
    assert not run.timed_out and run.returncode == 0, run.output[-3000:]
    events, records = check_run_dir(run_dir, lr=ExponentialDecay(0.3, 10, 0.5))
    for step, value in scalars(events, "examples_per_sec").items():  # 2 workers x 32, sync
        assert value == pytest.approx(64 * scalars(events, "global_step/sec")[step], rel=1e-6)
    assert set(scalars(events, "staleness/max").values()) == {0.0}


@pytest.mark.mpi
def test_in_graph_writes_events(digits_file, tmp_path):
    run_dir = tmp_path / "run"
    run = run_mpi(3, ["jobs/in_graph.py", "--data", digits_file, "--num-ps", "1",
                      *job_flags(run_dir)], timeout=90, cwd=str(REPO))
    assert not run.timed_out and run.returncode == 0, run.output[-3000:]
    check_run_dir(run_dir, lr=lambda step: 0.3)


def test_towers_without_a_ps_write_events(digits_file, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "jobs/towers.py", "--devices", "cpu:0,cpu:1",
                           "--data", digits_file, *job_flags(run_dir, steps=35)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 35, loss = " in proc.stdout
    check_run_dir(run_dir, steps=35)


@pytest.mark.mpi
def test_towers_through_a_ps_write_events(digits_file, tmp_path):
    run_dir = tmp_path / "run"
    run = run_mpi(2, ["jobs/towers.py", "--devices", "cpu:0,cpu:1", "--data", digits_file,
                      "--num-ps", "1", *job_flags(run_dir)], timeout=90, cwd=str(REPO))
    assert not run.timed_out and run.returncode == 0, run.output[-3000:]
    check_run_dir(run_dir)


@pytest.mark.mpi
def test_a_resumed_run_adds_a_file_and_tensorboard_reads_both(digits_file, tmp_path):
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    for steps in (20, STEPS):
        run = run_mpi(3, ["jobs/mnist_mlp.py", "--data", digits_file, "--num-ps", "1",
                          "--checkpoint-dir", str(ckpt), *job_flags(run_dir, steps)],
                      timeout=90, cwd=str(REPO))
        assert not run.timed_out and run.returncode == 0, run.output[-3000:]
    assert "restored" in run.stdout
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 2
    events = read_events(run_dir)
    assert sorted(scalars(events, "loss")) == [10, 20, 30, 40]
    assert [h.step for h in events.Histograms("variables/hidden1/weights")] == [15, 30]
