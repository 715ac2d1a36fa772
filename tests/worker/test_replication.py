"""In-graph replication and towers: equality with between-graph training, accuracy, averaging."""

import json
import subprocess
import sys

import numpy as np
import pytest

from mpitf.errors import ConfigurationError
from mpitf.models import MLP
from mpitf.runtime.backend import numpy_backend
from mpitf.testing import run_mpi
from mpitf.worker.towers import Towers, parse_devices
from tests.support import REPO

STEPS = 200


def _final(output):
    line = next(x for x in output.splitlines() if x.startswith("final: "))
    return json.loads(line[len("final: "):])


@pytest.fixture(scope="module")
def in_graph_vs_between(tmp_path_factory):
    """Run both jobs, deterministic sync, same seeds and steps; return their outputs."""
    out = tmp_path_factory.mktemp("replication")
    runs = {}
    for name, script in (("in_graph", "jobs/in_graph.py"), ("between", "jobs/mnist_mlp.py")):
        path = out / f"{name}.npz"
        run = run_mpi(4, [script, "--num-ps", "1", "--steps", str(STEPS), "--deterministic",
                          "--seed", "3", "--export", str(path), "--run-dir", ""],
                      timeout=90, cwd=str(REPO))
        assert not run.timed_out and run.returncode == 0, run.output[-3000:]
        runs[name] = (run, path)
    return runs


@pytest.mark.mpi
def test_in_graph_equals_between_graph_bit_for_bit(in_graph_vs_between):
    (_, a), (_, b) = in_graph_vs_between["in_graph"], in_graph_vs_between["between"]
    ours, theirs = np.load(a), np.load(b)
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype
        assert ours[name].tobytes() == theirs[name].tobytes(), name


@pytest.mark.mpi
def test_in_graph_reaches_accuracy_and_logs(in_graph_vs_between):
    run, _ = in_graph_vs_between["in_graph"]
    assert f"step {STEPS}, loss = " in run.stdout
    final = _final(run.stdout)
    assert final["step"] == STEPS and final["replication"] == "in-graph"
    assert final["test_accuracy"] >= 0.93, final


def test_towers_job_reaches_accuracy(tmp_path):
    proc = subprocess.run(
        [sys.executable, "jobs/towers.py", "--devices", "cpu:0,cpu:1", "--steps", "200",
         "--run-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 200, loss = " in proc.stdout
    final = _final(proc.stdout)
    assert final["towers"] == 2 and final["test_accuracy"] >= 0.95, final


def _batch(rng, n=24, d=12, k=5):
    return rng.standard_normal((n, d)).astype(np.float32), rng.integers(0, k, n)


@pytest.mark.parametrize("num_towers", [1, 2, 3])
def test_towers_average_equals_full_batch_gradient(num_towers):
    rng = np.random.default_rng(0)
    model = MLP(input_dim=12, hidden=(16,), num_classes=5)
    params = model.init(rng)
    batch = _batch(rng)
    want = {n: np.zeros(s, t) for n, s, t in model.variables()}
    want_loss = model.loss_and_grads(params, batch, want)
    towers = Towers(model, [numpy_backend() for _ in range(num_towers)])
    got = {n: np.full(s, np.nan, t) for n, s, t in model.variables()}
    loss = towers.loss_and_grads(params, batch, got)  # host dicts: the copy-in/out path
    assert loss == pytest.approx(want_loss, rel=1e-5)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7)
    # Tower 0's own views (the local trainer's path) give the same average.
    for name, value in params.items():
        towers.params[name][...] = value
    towers.loss_and_grads(towers.params, batch, towers.grads)
    for name in want:
        np.testing.assert_allclose(towers.grads[name], want[name], rtol=1e-5, atol=1e-7)


def test_towers_apply_locally_is_sgd():
    from mpitf.ps.optimizers import make_optimizer

    rng = np.random.default_rng(1)
    model = MLP(input_dim=12, hidden=(8,), num_classes=5)
    towers = Towers(model, [numpy_backend(), numpy_backend()])
    for name, value in model.init(rng).items():
        towers.params[name][...] = value
    before = towers.towers[0].params_flat.copy()
    towers.loss_and_grads(towers.params, _batch(rng), towers.grads)
    grads = towers.towers[0].grads_flat.copy()  # apply may consume the gradient buffer
    towers.apply_locally(make_optimizer("sgd", 0.5), 0)
    np.testing.assert_allclose(towers.towers[0].params_flat, before - np.float32(0.5) * grads,
                               rtol=1e-6)


def test_towers_refuse_uneven_batch():
    model = MLP(input_dim=12, hidden=(8,), num_classes=5)
    towers = Towers(model, [numpy_backend(), numpy_backend()])
    with pytest.raises(ConfigurationError, match="equal tower chunks"):
        towers.loss_and_grads(towers.params, _batch(np.random.default_rng(2), n=5),
                              towers.grads)


def test_parse_devices():
    assert parse_devices("cpu:0, CPU:1") == [("cpu", 0), ("cpu", 1)]
    assert parse_devices("gpu:1") == [("gpu", 1)]
    for bad in ("tpu:0", "cpu", "cpu:x", "cpu:0,cpu:0"):
        with pytest.raises(ConfigurationError):
            parse_devices(bad)


def test_in_graph_batches_stack_the_between_graph_batches():
    from mpitf.data.datasets import default_data_path, ensure_digits
    from mpitf.data.sharded import ShardedDataset
    from mpitf.worker.replication import InGraphBatches

    path = default_data_path()
    ensure_digits(path)
    batches = InGraphBatches(path, 3, 8, seed=5)
    shards = [ShardedDataset(path, "train", i, 3, 8, 5, prefetch=0) for i in range(3)]
    try:
        for _ in range(70):  # past an epoch of every shard (59 batches of 8 per shard)
            x, y = batches.next_batch()
            for i, shard in enumerate(shards):
                xi, yi = shard.next_batch()
                np.testing.assert_array_equal(x[8 * i:8 * (i + 1)], xi)
                np.testing.assert_array_equal(y[8 * i:8 * (i + 1)], yi)
        state = batches.state()
        resumed = InGraphBatches(path, 3, 8, seed=5)
        resumed.restore(state)
        np.testing.assert_array_equal(resumed.next_batch()[0], batches.next_batch()[0])
        resumed.close()
    finally:
        batches.close()
        for shard in shards:
            shard.close()
