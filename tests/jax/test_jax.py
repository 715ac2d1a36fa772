"""mpitf.jax: equal to a single-process jax loop, resume bit for bit, bad pytrees refused.

The multi-rank runs are 1 ps + W workers on a small MLP (tests/mpi/jax_driver.py); every
worker also trains it in one process with the ps's rule on the W batches' mean gradient
and prints the largest relative difference. The refusals that happen before any rank
talks (optimizer, options, leaf dtypes and structure) are tested in this process. jax is a
test requirement: without it these tests fail.
"""

import json
import re
import subprocess
import sys

import jax  # noqa: F401 - fail here, loudly, when the jax extra is missing
import jax.numpy as jnp
import numpy as np
import pytest

from mpitf.errors import ConfigurationError
from mpitf.jax import DistributedOptimizer
from mpitf.jax.threads import local_ranks
from mpitf.jax.tree import ALIAS_BYTES, TreeLayout, leaf_name, to_jax
from mpitf.runtime.exits import EXIT_REQUEUE
from mpitf.testing import run_mpi, signal_when
from tests.support import REPO

DRIVER = "tests/mpi/jax_driver.py"
RESULT = re.compile(r"worker (\d+): step (\d+) maxrel: (\S+) moved: (\S+)")
NAMES = re.compile(r"names: (\S+) digest: (\w+)")
LEAVES = "layers/0/b,layers/0/w,layers/1/b,layers/1/w"


def drive(n, *args, timeout=90):
    run = run_mpi(n, [DRIVER, *map(str, args)], timeout=timeout, cwd=str(REPO))
    assert not run.timed_out, run.output
    return run


def results(run, steps, workers):
    assert run.returncode == 0, run.output
    found = RESULT.findall(run.stdout)
    assert sorted(int(w) for w, *_ in found) == list(range(workers)), run.output
    for _, step, _, moved in found:
        assert int(step) == steps
        assert float(moved) > 0.01  # training moved the parameters
    return [float(r[2]) for r in found]


@pytest.mark.slow
@pytest.mark.mpi
def test_one_worker_equals_plain_jax_and_sigterm_resumes_bit_for_bit(tmp_path):
    # AdamW with warmup + cosine on the ps, deterministic sync: the reference run.
    ref = drive(2, "--steps", 40)
    (maxrel,) = results(ref, 40, 1)
    assert maxrel < 1e-5, ref.output
    ((names, digest),) = NAMES.findall(ref.stdout)
    assert names == LEAVES
    # The same run, SIGTERM after step 10: checkpoint, exit 75; rerun resumes bit for bit.
    ckpt, log = tmp_path / "ckpt", tmp_path / "out.log"
    code, text = signal_when(2, [DRIVER, "--steps", 100000, "--checkpoint-dir", ckpt,
                                 "--sleep", 0.02], log, "step 10,", wait=60, cwd=str(REPO))
    assert code == EXIT_REQUEUE, text
    (step,) = re.findall(r"SIGTERM: checkpointed at step (\d+); exiting with code 75", text)
    assert 10 <= int(step) < 40, text
    resumed = drive(2, "--steps", 40, "--checkpoint-dir", ckpt)
    assert f"restored {ckpt}" in resumed.stdout and f"at step {step}" in resumed.stdout
    assert results(resumed, 40, 1)[0] < 1e-5
    assert NAMES.findall(resumed.stdout) == [(LEAVES, digest)], resumed.output
    # The export's names are the '/'-joined key paths.
    out = tmp_path / "export.npz"
    subprocess.run([sys.executable, "-m", "mpitf.cli.main", "ckpt", "export", str(ckpt),
                    "--out", str(out)], check=True, timeout=60, cwd=str(REPO))
    assert sorted(np.load(out)) == LEAVES.split(",")


@pytest.mark.slow
@pytest.mark.mpi
def test_two_workers_equal_the_mean_gradient_from_the_chiefs_start():
    # Worker 1 starts from other values: the chief's must win (its reference starts there).
    run = drive(3, "--optimizer", "momentum")
    assert max(results(run, 30, 2)) < 1e-5, run.output
    assert run.stdout.count("mpitf.jax: rank") == 2  # each worker says its threads once


@pytest.mark.slow
@pytest.mark.mpi
def test_local_sgd_equals_each_workers_copy_averaged_every_k_steps():
    # --mode local --local-steps 4, momentum: each worker steps its own copy with its own
    # slots, and the ps puts the copies' mean in place every 4 steps. The reference does
    # the same in one process (exact: 0 here; with K = 8 it is 0.06 off); 16 steps are
    # 4 averages of 2 pushes each, where sync would have received 32.
    run = drive(3, "--optimizer", "momentum", "--steps", 16, "--local", 4)
    assert max(results(run, 16, 2)) < 1e-6, run.output
    assert re.findall(r"pushes: (\d+) applied: (\d+)", run.stdout) == [("8", "4")], run.output


@pytest.mark.slow
@pytest.mark.mpi
def test_clip_norm_clips_the_mean_gradient_over_two_ps_in_buckets():
    # optax.clip_by_global_norm(0.2) of the 2 workers' mean, as the session's clip_norm: two
    # ps hold 64-byte buckets until each step's last is in, and agree on the norm
    run = drive(4, "--num-ps", 2, "--clip", 0.2, "--bucket-bytes", 64,
                "--optimizer", "momentum")
    assert max(results(run, 30, 2)) < 1e-5, run.output
    assert run.stdout.count("the reference clipped 30 of 30 steps") == 2, run.output


@pytest.mark.slow
@pytest.mark.mpi
def test_a_gradient_pytree_missing_a_leaf_ends_every_rank_naming_it():
    run = drive(3, "--break", "missing")
    assert run.returncode != 0, run.output
    assert ("step 2: the gradient pytree has no leaf 'layers/1/b' (1 of the parameters' 4 "
            "leaves missing)") in run.output, run.output
    assert "maxrel" not in run.stdout


@pytest.mark.slow
@pytest.mark.mpi
def test_jax_mnist_job_reaches_95_percent(tmp_path, digits_file):
    run = run_mpi(3, ["jobs/jax_mnist.py", "--data", digits_file, "--run-dir", tmp_path / "run"],
                  timeout=180, cwd=str(REPO))
    assert not run.timed_out and run.returncode == 0, run.output
    (line,) = re.findall(r"^final: (.*)$", run.stdout, re.M)
    final = json.loads(line)
    assert final["step"] == 300 and final["workers"] == 2, final
    assert final["test_accuracy"] >= 0.95, run.output


# -- refused before any rank talks (the same on every rank) --------------------------------

PARAMS = {"dense": [{"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)}], "scale": jnp.ones(())}


@pytest.mark.parametrize("args,kwargs,words", [
    (("lamb",), {}, "unknown optimizer 'lamb'; expected one of ["),
    (("adamw",), {"betas": (0.9, 0.99)},
     "optimizer 'adamw' takes no option(s) ['betas']; valid options: ['learning_rate', "
     "'beta1', 'beta2', 'eps', 'weight_decay']; session options: ["),
    (("momentum",), {"momentum": -1.0}, "momentum"),
    (("sgd",), {"deadline": 5}, "deadline is the Server's, not a session option"),
])
def test_an_unknown_optimizer_or_option_is_refused_by_name(args, kwargs, words):
    with pytest.raises(ConfigurationError) as err:
        DistributedOptimizer(PARAMS, None, *args, **kwargs)
    assert words in str(err.value)


@pytest.mark.parametrize("params,words", [
    ({"w": jnp.zeros(3), "n": jnp.zeros(3, jnp.int32)},
     "parameter leaf 'n' is int32: mpitf.jax trains float32 leaves only"),
    ({"w": np.zeros(3)}, "parameter leaf 'w' is float64: mpitf.jax trains float32"),
    ({"w": jnp.zeros(3, jnp.bfloat16)}, "parameter leaf 'w' is bfloat16"),
    ({}, "the parameter pytree has no leaf"),
    ({"a/b": jnp.zeros(1), "a": {"b": jnp.zeros(1)}}, "both named 'a/b'"),
])
def test_a_bad_parameter_pytree_is_refused(params, words):
    with pytest.raises(ConfigurationError) as err:
        DistributedOptimizer(params, None, "sgd")
    assert words in str(err.value)


def test_a_gradient_pytree_that_differs_is_refused_naming_the_leaf():
    layout = TreeLayout(PARAMS)
    assert layout.names == ["dense/0/b", "dense/0/w", "scale"]
    good = jax.tree_util.tree_map(jnp.zeros_like, PARAMS)
    assert len(layout.leaves(good, "gradient")) == 3
    shape = {**good, "dense": [{"w": jnp.zeros((2, 3)), "b": jnp.zeros(2)}]}
    dtype = {**good, "scale": jnp.zeros((), jnp.int32)}
    missing = {"dense": [{"w": jnp.zeros((3, 2))}], "scale": jnp.ones(())}
    extra = {**good, "other": jnp.zeros(1)}
    cases = [
        (shape, "gradient leaf 'dense/0/w' has shape (2, 3) but the parameter has (3, 2)"),
        (dtype, "gradient leaf 'scale' is int32: mpitf.jax trains float32 leaves only"),
        (missing, "the gradient pytree has no leaf 'dense/0/b' (1 of the parameters' 3"),
        (extra, "the gradient pytree has a leaf 'other' that the parameters do not have"),
        ([good["dense"], good["scale"]], "the gradient pytree has no leaf 'dense/0/b'"),
    ]
    for tree, words in cases:
        with pytest.raises(ConfigurationError) as err:
            layout.leaves(tree, "gradient")
        assert words in str(err.value)


def test_leaf_names_join_the_key_paths():
    from collections import namedtuple

    point = namedtuple("Point", "x y")
    tree = {"a": [jnp.zeros(1), (jnp.zeros(1),)], "p": point(jnp.zeros(1), jnp.zeros(1))}
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    assert [leaf_name(p) for p in paths] == ["a/0", "a/1/0", "p/x", "p/y"]
    assert TreeLayout(jnp.zeros(2)).names == ["params"]  # one array: the root


@pytest.mark.parametrize("size", [10, ALIAS_BYTES // 4 * 3])
def test_to_jax_copies_once_and_never_aliases_the_pulled_buffer(size):
    view = np.arange(size, dtype=np.float32).reshape(-1, 1)
    out = to_jax(view)
    view[:] = -1.0  # the next pull overwrites the buffer
    assert out.shape == (size, 1) and out.dtype == jnp.float32
    assert float(out[0, 0]) == 0.0 and float(out[-1, 0]) == size - 1


def test_local_ranks_read_the_launchers_variables():
    assert local_ranks({"MPI_LOCALNRANKS": "3"}) == 3
    assert local_ranks({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}) == 4
    assert local_ranks({"SLURM_NTASKS_PER_NODE": "x"}) == 1
    assert local_ranks({}) == 1


def test_jax_mnist_refuses_the_cnn_with_exit_2():
    run = subprocess.run([sys.executable, "jobs/jax_mnist.py", "--model", "cnn"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr
    assert "jax_mnist trains an MLP on the CPU: leave --model at mlp and --device at cpu" \
        in run.stderr
