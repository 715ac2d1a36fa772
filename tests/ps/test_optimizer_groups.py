"""Options per group of variables, and the optimizer state checked on restore.

Param groups (torch), an optax-style weight-decay mask and per-subtree rates (JAX), and
per-variable options of a numpy model run on the ps as a table of rules by element range
(mpitf/ps/groups.py); each multi-rank run is 1 ps + 1 worker, deterministic sync, 50 steps,
against plain torch or the same rule written in numpy. Restoring a checkpoint into an
optimizer with other slots is refused (exit 2) unless --reset-optimizer-state.
"""

import re
import subprocess
import sys

import numpy as np
import pytest

from mpitf.errors import ConfigurationError
from mpitf.placement import Placement
from mpitf.ps.optimizers import make_optimizer
from mpitf.ps.shard import Shard
from mpitf.runtime.backend import numpy_backend
from mpitf.testing import run_mpi
from tests.support import REPO

TORCH = "tests/mpi/torch_driver.py"
JAX = "tests/mpi/jax_driver.py"
MAXREL = re.compile(r"worker (\d+): step (\d+) maxrel: (\S+) moved: (\S+)")


def drive(n, driver, *args, timeout=90):
    run = run_mpi(n, [driver, *map(str, args)], timeout=timeout, cwd=str(REPO))
    assert not run.timed_out, run.output
    return run


def maxrel(run, steps=50):
    assert run.returncode == 0, run.output
    ((_, step, rel, moved),) = MAXREL.findall(run.stdout)
    assert int(step) == steps and float(moved) > 0.01, run.output
    return float(rel)


# ------------------------------------------------------------------ the ps's table


VARIABLES = [("l0/w", (4, 3), np.float32), ("l0/b", (3,), np.float32),
             ("l1/w", (3, 2), np.float32), ("l1/b", (2,), np.float32)]


def test_a_shard_applies_each_variables_rule_as_that_rule_alone():
    # No decay on biases, a tenth of the rate for l1/w; two ps, l0/w split over both.
    opt = make_optimizer("adamw", 0.01, weight_decay=0.1, groups=[
        {"variables": ["*/b"], "weight_decay": 0.0, "beta1": 0.8},
        {"variables": ["l1/w"], "learning_rate": 0.001}]).resolve([v[0] for v in VARIABLES])
    assert make_optimizer(**opt.config()).config() == opt.config()
    assert opt.config()["groups"][0]["variables"] == ["l0/b", "l1/b"]
    rules = {"l0/w": dict(), "l0/b": dict(weight_decay=0.0, beta1=0.8),
             "l1/w": dict(learning_rate=0.001), "l1/b": dict(weight_decay=0.0, beta1=0.8)}
    # TF's partitioner signature: 2 slices along axis 0 for the (4, 3) matrix only
    placement = Placement(VARIABLES, 2, partitioner=lambda shape, dtype: [
        2 if shape == (4, 3) else 1] + [1] * (len(shape) - 1))
    assert len([s for p in range(2) for s in placement.slices_for_ps(p)
                if s.name == "l0/w"]) == 2
    rng = np.random.default_rng(0)
    values = {n: rng.normal(size=s).astype(np.float32) for n, s, _ in VARIABLES}
    grads = [{n: rng.normal(size=s).astype(np.float32) for n, s, _ in VARIABLES}
             for _ in range(3)]
    shards = []
    for p in range(2):
        slices = placement.slices_for_ps(p)
        shard = Shard(slices, placement.shard_sizes[p], np.float32, opt, numpy_backend())
        for s in slices:
            shard.params[s.offset:s.offset + s.size] = values[s.name].reshape(-1)[s.start:s.stop]
        shards.append((shard, slices))
    for step, g in enumerate(grads):
        for shard, slices in shards:
            flat = np.zeros(shard.size, np.float32)
            for s in slices:
                flat[s.offset:s.offset + s.size] = g[s.name].reshape(-1)[s.start:s.stop]
            shard.apply(flat, step)
    for name, _, _ in VARIABLES:  # each variable alone, under its own rule
        kw = {"weight_decay": 0.1, **rules[name]}
        alone = make_optimizer("adamw", kw.pop("learning_rate", 0.01), **kw)
        p = values[name].reshape(-1).copy()
        slots = alone.make_slots(p.size, np, np.float32)
        for step, g in enumerate(grads):
            alone.apply(p, g[name].reshape(-1).copy(), slots, step)
        got = np.zeros(p.size, np.float32)
        for shard, slices in shards:
            for s in slices:
                if s.name == name:
                    got[s.start:s.stop] = shard.params[s.offset:s.offset + s.size]
        assert got.tobytes() == p.tobytes(), name  # the same kernels: bit for bit


def test_a_group_pattern_must_match_and_a_variable_is_in_one_group():
    names = [v[0] for v in VARIABLES]
    with pytest.raises(ConfigurationError, match=r"optimizer group 0: '\*/bias' matches no "
                                                 r"variable of the model"):
        make_optimizer("adamw", groups=[{"variables": ["*/bias"], "weight_decay": 0}]) \
            .resolve(names)
    with pytest.raises(ConfigurationError, match=r"variable 'l1/b' is in optimizer groups 0 "
                                                 r"and 1: put it in one"):
        make_optimizer("adamw", groups=[{"variables": ["*/b"]}, {"variables": ["l1/*"]}]) \
            .resolve(names)
    with pytest.raises(ConfigurationError, match=r"optimizer group 0: optimizer 'sgd' takes "
                                                 r"no option\(s\) \['weight_decay'\]"):
        make_optimizer("sgd", groups=[{"variables": ["*/b"], "weight_decay": 0}])


# ------------------------------------------------------------------------ torch, JAX


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("args", [
    ("--optimizer", "adamw_groups", "--schedule"),
    ("--optimizer", "layerwise", "--group-schedule"),
    ("--optimizer", "layerwise", "--group-schedule", "--bucket-bytes", 64),
], ids=["adamw-decay-no-decay", "layerwise-lambdalr", "layerwise-buckets"])
def test_torch_param_groups_equal_plain_torch(args):
    # AdamW: decay on matrices, none (and other betas) on biases; SGD: a rate and a
    # momentum per layer, each group's rate on its own LambdaLR curve.
    run = drive(2, TORCH, *args, "--steps", 50)
    assert maxrel(run) < 1e-5, run.output


@pytest.mark.slow
@pytest.mark.mpi
def test_jax_weight_decay_mask_and_a_subtree_rate_equal_the_rule():
    # optax.adamw's mask (matrices decay, biases do not) and layers/1/w at half the rate;
    # the reference is torch's AdamW arithmetic in numpy, leaf by leaf (no optax here).
    run = drive(2, JAX, "--masked", "--steps", 50)
    assert maxrel(run) < 1e-5, run.output


@pytest.mark.slow
@pytest.mark.mpi
def test_embedding_bag_sparse_is_one_message_and_every_rank_ends():
    run = drive(3, TORCH, "--model", "bag", "--optimizer", "sparse", "--steps", 5, timeout=30)
    assert run.returncode == 2, run.output
    words = ("parameter 'bag.weight' gets a sparse gradient (a torch.nn.Embedding or "
             "EmbeddingBag with sparse=True), which mpitf.torch.DistributedOptimizer cannot "
             "push: use mpitf.torch.EmbeddingBag or mpitf.torch.Embedding")
    assert run.output.count(words) == 1, run.output
    assert "Traceback" not in run.output and "Cannot access data pointer" not in run.output


# ---------------------------------------------------------------- restore refusal


@pytest.mark.slow
@pytest.mark.mpi
def test_a_checkpoint_of_another_optimizer_is_refused_unless_reset(digits_file, tmp_path):
    job = [str(REPO / "jobs" / "mnist_mlp.py"), "--data", digits_file, "--num-ps", "1",
           "--checkpoint-dir", str(tmp_path / "ckpt")]
    first = run_mpi(2, [*job, "--steps", "5", "--optimizer", "sgd"], timeout=60,
                    cwd=str(tmp_path))
    assert first.returncode == 0, first.output
    adam = run_mpi(2, [*job, "--steps", "10", "--optimizer", "adam"], timeout=60,
                   cwd=str(tmp_path))
    assert not adam.timed_out and adam.returncode == 2, adam.output
    words = (f"{tmp_path}/ckpt/ckpt-00000005 holds sgd's optimizer state (no slots for "
             "'hidden1/weights') but the job asks for adam (m, v): restored, its slots "
             "would start at zero; resume with the checkpoint's optimizer, or pass "
             "--reset-optimizer-state")
    assert adam.output.count(words) == 1, adam.output
    assert "Traceback" not in adam.output and "step 6," not in adam.output
    reset = run_mpi(2, [*job, "--steps", "10", "--optimizer", "adam",
                        "--reset-optimizer-state"], timeout=60, cwd=str(tmp_path))
    assert reset.returncode == 0, reset.output
    assert reset.output.count("reset_optimizer_state: ") == 1, reset.output
    assert "its optimizer state (sgd) is not: adam's slots start afresh at step 5" \
        in reset.output
    show = subprocess.run([sys.executable, "-m", "mpitf.cli.main", "ckpt", "show",
                           str(tmp_path / "ckpt")], capture_output=True, text=True,
                          timeout=60, cwd=str(REPO))
    assert "slots: m, v" in show.stdout and '"name": "adam"' in show.stdout, show.stdout


@pytest.mark.slow
@pytest.mark.mpi
def test_ckpt_show_names_each_variables_group(tmp_path):
    ckpt = tmp_path / "ckpt"
    run = drive(2, TORCH, "--optimizer", "adamw_groups", "--steps", 5, "--checkpoint-dir",
                ckpt)
    assert run.returncode == 0, run.output
    show = subprocess.run([sys.executable, "-m", "mpitf.cli.main", "ckpt", "show", str(ckpt)],
                          capture_output=True, text=True, timeout=60, cwd=str(REPO))
    out = show.stdout
    assert '  group 0: {"beta1": 0.9, "beta2": 0.999, "eps": 1e-08, "learning_rate": 0.01, ' \
           '"weight_decay": 0.1}' in out, out
    assert '"weight_decay": 0.0}' in out and "(variables in no group)" in out, out
    assert re.search(r"0\.weight\s+\(16, 8\)\s+float32\s+group 0\s+ps0", out), out
    assert re.search(r"0\.bias\s+\(16,\)\s+float32\s+group 1\s+ps0", out), out
    # The same groups resume; an SGD with momentum (other slots) is refused by name.
    again = drive(2, TORCH, "--optimizer", "adamw_groups", "--steps", 8, "--checkpoint-dir",
                  ckpt)
    assert again.returncode == 0 and f"restored {ckpt}" in again.stdout, again.output
    sgd = drive(2, TORCH, "--optimizer", "sgd", "--steps", 10, "--checkpoint-dir", ckpt)
    assert sgd.returncode == 2, sgd.output
    assert "holds adamw's optimizer state (exp_avg, exp_avg_sq for '0.weight') but the " \
           "job asks for torch_sgd (momentum_buffer)" in sgd.output, sgd.output
