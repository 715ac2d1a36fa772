"""TensorFlow's classic distributed programs (tests/tutorials/) run on mpitf as written.

Each program is started the way its tutorial starts it: one process per task with its
own ``--job_name``/``--task_index`` (an MPMD ``mpiexec`` line, ps first), or one process
for the towers. The tests read the lines the tutorials print and check their numbers.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mpitf.testing import run_mpi
from tests.support import REPO

PROGRAMS = REPO / "tests" / "tutorials"
STEP_LINE = re.compile(r"^[\d.]+: Worker (\d+): training step (\d+) done \(global step: (\d+)\)$",
                       re.M)
XENT_LINE = re.compile(r"^After (\d+) training step\(s\), validation cross entropy = (\S+)$", re.M)
ACCURACY_LINE = re.compile(r"^validation accuracy = (\S+) \((\d+) examples", re.M)
# mpiexec merges every rank's stdout into one stream, and an unbuffered print writes its
# text and its newline apart: the launcher makes each process write whole lines, then
# runs the program unchanged as __main__.
WHOLE_LINES = ("import runpy, sys; sys.stdout.reconfigure(line_buffering=True, "
               "write_through=False); sys.argv = sys.argv[1:]; "
               "runpy.run_path(sys.argv[0], run_name='__main__')")


def _env(tmp_path):
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "TMPDIR": str(tmp_path)}


def _mpmd(program, tasks, common, tmp_path, timeout=60):
    """Run ``program`` once per ``(job, task)`` in ``tasks``, one MPMD mpiexec, ps first."""
    argv = []
    for job, task in tasks:
        argv += [":", "-n", "1"] if argv else []
        argv += [sys.executable, "-c", WHOLE_LINES, str(PROGRAMS / program), f"--job_name={job}",
                 f"--task_index={task}", *common]
    return run_mpi(1, argv, timeout=timeout, env=_env(tmp_path), cwd=str(tmp_path),
                   python=False)


def _ok(run):
    assert not run.timed_out, run.output[-3000:]
    assert run.returncode == 0, run.output[-3000:]


def _steps(output):
    """Return {worker: [(local step, global step), ...]} from the workers' step lines."""
    steps = {}
    for worker, local, global_step in STEP_LINE.findall(output):
        steps.setdefault(int(worker), []).append((int(local), int(global_step)))
    return steps


REPLICA_TASKS = [("ps", 0), ("worker", 0), ("worker", 1)]


def _replica(tmp_path, digits_file, *flags, steps=30):
    common = ["--num_gpus=0", f"--data_dir={Path(digits_file).parent}",
              f"--train_steps={steps}", *flags]
    return _mpmd("mnist_replica.py", REPLICA_TASKS, common, tmp_path)


def _validation(output, steps):
    """Return the (cross entropy sums, accuracies) the workers print after training."""
    sums = [float(x) for n, x in XENT_LINE.findall(output) if int(n) == steps]
    accuracies = [(float(a), int(n)) for a, n in ACCURACY_LINE.findall(output)]
    assert len(sums) == 2 and len(accuracies) == 2, output[-3000:]
    return sums, accuracies


@pytest.mark.slow
@pytest.mark.mpi
def test_mnist_replica_sync_replicas_step_once_per_aggregated_step(tmp_path, digits_file):
    steps = 30
    run = _replica(tmp_path, digits_file, "--sync_replicas", steps=steps)
    _ok(run)
    out = run.stdout
    assert "job name = ps" in out and out.count("job name = worker") == 2
    assert "Worker 0: Initializing session..." in out
    assert "Worker 1: Waiting for session to be initialized..." in out
    assert out.count("Session initialization complete.") == 2
    # Both replicas feed every update: each worker's k-th step ends at global step k.
    want = [(k, k) for k in range(1, steps + 1)]
    assert _steps(out) == {0: want, 1: want}
    sums, accuracies = _validation(out, steps)
    assert sums[0] == sums[1]  # both workers evaluate the same (final) parameters
    (accuracy, examples), _ = accuracies
    assert examples == 359 and accuracy >= 0.9, accuracies
    assert 0.0 < sums[0] / examples < 0.45, sums  # mean validation cross entropy
    # The Supervisor's logdir: the chief's checkpoint of the last step (save_model_secs).
    assert "ckpt-00000030 at step 30" in out


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("flags", [("--sync_replicas", "--replicas_to_aggregate=1"), ()],
                         ids=["sync_one_of_two", "async"])
def test_mnist_replica_one_gradient_per_update(tmp_path, digits_file, flags):
    steps = 20
    run = _replica(tmp_path, digits_file, *flags, steps=steps)
    _ok(run)
    per_worker = _steps(run.stdout)
    assert sorted(per_worker) == [0, 1]
    for lines in per_worker.values():
        assert [k for k, _ in lines] == list(range(1, len(lines) + 1))
        globals_seen = [g for _, g in lines]
        assert globals_seen == sorted(set(globals_seen)), lines  # every step an update
        assert globals_seen[-1] >= steps
    # Every update applied one gradient; a worker's step that came too late was dropped.
    assert sum(len(v) for v in per_worker.values()) >= steps
    assert max(v[-1][1] for v in per_worker.values()) <= steps + 1
    sums, accuracies = _validation(run.stdout, steps)
    assert all(a >= 0.6 for a, _ in accuracies), accuracies
    assert all(s / 359 < 1.5 for s in sums), sums


@pytest.mark.mpi
def test_mnist_replica_role_that_is_not_the_ranks_is_named(tmp_path, digits_file):
    tasks = [("worker", 0), ("ps", 0), ("worker", 1)]  # the policy puts the ps on rank 0
    common = ["--num_gpus=0", f"--data_dir={Path(digits_file).parent}", "--train_steps=5"]
    run = _mpmd("mnist_replica.py", tasks, common, tmp_path, timeout=20)
    assert not run.timed_out and run.returncode == 2, run.output[-3000:]
    message = "Server(job_name='worker', task_index=0) on MPI rank 0, which runs /job:ps/task:0"
    assert run.stderr.count(message) == 1, run.stderr[-3000:]  # said once, by rank 0
    assert "training step" not in run.stdout


@pytest.mark.slow
@pytest.mark.mpi
def test_in_graph_replication_loss_falls_and_precision(tmp_path, digits_file):
    steps, workers = 100, 3
    hosts = ",".join(f"localhost:{2223 + i}" for i in range(workers))
    tasks = [("ps", 0)] + [("worker", i) for i in range(workers)]
    common = [f"--data_dir={Path(digits_file).parent}", f"--worker_hosts={hosts}",
              f"--train_steps={steps}", "--log_every=10"]
    run = _mpmd("in_graph.py", tasks, common, tmp_path)
    _ok(run)
    losses = {int(s): float(v) for s, v in
              re.findall(r"^Step (\d+): loss = (\S+) \(\S+ sec\)$", run.stdout, re.M)}
    assert sorted(losses) == [0, *range(9, steps, 10)]  # one client logs, once per line
    assert losses[0] > 2.0 and losses[steps - 1] < losses[0] / 4, losses
    m = re.search(r"Num examples: (\d+)  Num correct: (\d+)  Precision @ 1: (\S+)", run.stdout)
    assert m and int(m.group(1)) == 359, run.stdout[-2000:]
    assert float(m.group(3)) >= 0.93 and int(m.group(2)) == round(float(m.group(3)) * 359)
    assert f"global step = {steps}" in run.stdout  # one update per global batch


@pytest.mark.slow
def test_cifar10_multi_gpu_train_towers(tmp_path, digits_file):
    steps, towers = 101, 2
    train_dir = tmp_path / "train"
    proc = subprocess.run(
        [sys.executable, str(PROGRAMS / "cifar10_multi_gpu_train.py"), f"--num_gpus={towers}",
         f"--max_steps={steps}", f"--train_dir={train_dir}",
         f"--data_dir={Path(digits_file).parent}", "--log_device_placement"],
        cwd=tmp_path, env=dict(os.environ, **_env(tmp_path)), capture_output=True, text=True,
        timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "tower_0: cpu" in out and "tower_1: cpu" in out  # soft placement without a GPU
    lines = re.findall(r"^\S+ \S+: step (\d+), loss = (\S+) \((\S+) examples/sec; (\S+) "
                       r"sec/batch\)$", out, re.M)
    assert [int(s) for s, *_ in lines] == list(range(0, steps, 10))
    losses = [float(v) for _, v, *_ in lines]
    assert losses[0] > 2.0 and losses[-1] < losses[0] / 3, losses
    assert all(float(e) > 0 and float(b) >= 0 for *_, e, b in lines)
    precision = float(re.search(r": precision @ 1 = (\S+)$", out, re.M).group(1))
    assert precision >= 0.8, out[-2000:]
    saved = sorted(p.name for p in train_dir.iterdir())
    assert saved == ["model.ckpt-0.npz", f"model.ckpt-{steps - 1}.npz"]
    with np.load(train_dir / saved[1]) as ckpt:
        assert ckpt.files == ["conv1/weights", "conv1/biases", "softmax_linear/weights",
                              "softmax_linear/biases"]
        assert all(np.isfinite(ckpt[name]).all() for name in ckpt.files)


@pytest.mark.parametrize("num_towers", [2, 3])
def test_towers_average_is_the_mean_of_the_tower_gradients(digits_file, num_towers):
    """average_gradients of the tutorial: the mean over the tower dimension, per variable."""
    import mpitf
    from mpitf.worker.towers import Towers, tower_backend

    data = mpitf.ShardedDataset(digits_file, "train", batch_size=16 * num_towers, prefetch=0)
    x, y = data.next_batch()
    data.close()
    model = mpitf.build_model("cnn", data.x_dim, data.num_classes, data.image_shape)
    towers = Towers(model, [tower_backend("gpu", i, allow_soft_placement=True)
                            for i in range(num_towers)])
    for name, value in towers.init(np.random.default_rng(4)).items():
        towers.params[name][...] = value
    loss = towers.loss_and_grads(towers.params, (x, y), towers.grads)
    tower_grads, tower_losses = [], []  # each tower's own gradient, computed apart
    for chunk_x, chunk_y in zip(np.split(x, num_towers), np.split(y, num_towers)):
        grads = {n: np.zeros(s, t) for n, s, t in model.variables()}
        tower_losses.append(model.loss_and_grads(towers.params, (chunk_x, chunk_y), grads))
        tower_grads.append(grads)
    assert loss == pytest.approx(np.mean(tower_losses), rel=1e-6)
    for name, _, _ in model.variables():
        mean = np.mean(np.stack([g[name] for g in tower_grads]), axis=0)  # concat, reduce_mean
        np.testing.assert_allclose(towers.grads[name], mean, rtol=1e-5, atol=1e-7)
        assert not np.allclose(tower_grads[0][name], tower_grads[1][name])  # towers differ


def test_tower_backend_soft_placement_falls_back_to_the_cpu():
    from mpitf.errors import ConfigurationError
    from mpitf.runtime.backend import _load_cupy
    from mpitf.worker.towers import tower_backend

    if _load_cupy()[0] is not None:
        pytest.skip("a GPU is visible: soft placement keeps the towers there")
    for index in range(3):
        assert not tower_backend("gpu", index, allow_soft_placement=True).is_gpu
    with pytest.raises(ConfigurationError):
        tower_backend("gpu", 0)


@pytest.mark.mpi
@pytest.mark.parametrize("mpmd", [True, False], ids=["one-process-per-task", "one-line"])
def test_local_cluster_task_0_prints_the_constant_made_on_task_1(tmp_path, mpmd):
    if mpmd:
        run = _mpmd("local_cluster.py", [("local", 0), ("local", 1)], [], tmp_path, timeout=30)
    else:
        run = run_mpi(2, [sys.executable, "-c", WHOLE_LINES, str(PROGRAMS / "local_cluster.py")],
                      timeout=30, env=_env(tmp_path), cwd=str(tmp_path), python=False)
    _ok(run)
    lines = run.stdout.splitlines()
    targets = sorted(re.findall(r"^task (\d): mpi://\S+/job:local/task:(\d)$", run.stdout, re.M))
    assert targets == [("0", "0"), ("1", "1")], run.stdout
    assert [x for x in lines if x.startswith("Hello")] == [
        "Hello, distributed TensorFlow! (made on /job:local/replica:0/task:1/device:CPU:0)"]
