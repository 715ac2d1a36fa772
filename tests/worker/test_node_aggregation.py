"""Node-local aggregation (``--aggregate-per-node``): sums, determinism, resume, fan-in, refusals.

On this machine every rank shares memory, so the replicas form one node; ``MPITF_NODE_SIZE``
cuts them into blocks of that many replicas to test several nodes (each block still shares
memory, as the window needs). What is guaranteed, bit for bit: a node's leader sums its
members' gradients in replica order and the ps sums the leaders in leader order (in
deterministic mode), then divides by the replicas; so a run equals one process summing in
that grouped order, and equals the run without aggregation whenever the grouping does not
change the order (one node, or nodes after the first of one replica each).
"""

import json
import re

import numpy as np
import pytest

from mpitf.ckpt.names import checkpoint_name, read_manifest
from mpitf.config import JobFacts, TrainingConfig
from mpitf.errors import ConfigurationError
from mpitf.ps.consistency import make_policy
from mpitf.ps.optimizers import make_optimizer
from mpitf.testing import run_mpi
from mpitf.worker.node import node_plan
from tests.support import (
    JOB,
    PS_DRIVER,
    REPO,
    Background,
    assert_bitwise_equal,
    final_summary,
    job_args,
    latest_step,
    load_npz,
    ok,
    params,
    ps_driver,
    ps_reports,
    run_job,
)

driver = ps_driver()  # the model, initial values and gradients the ranks use

STEPS = 5


def reference_by_node(optimizer, nodes, steps):
    """The ps's arithmetic in one process, summing each node in replica order, then nodes."""
    opt = make_optimizer(optimizer, driver.LEARNING_RATES[optimizer])
    values = driver.initial_values()
    flat = {k: v.reshape(-1).copy() for k, v in values.items()}
    slots = {k: opt.make_slots(v.size, np, v.dtype) for k, v in flat.items()}
    replicas = sum(len(n) for n in nodes)
    for step in range(steps):
        current = {k: flat[k].reshape(values[k].shape) for k in flat}
        grads = [driver.gradient(current, w, step) for w in range(replicas)]
        for name in flat:
            sums = []
            for node in nodes:
                acc = grads[node[0]][name].reshape(-1).copy()
                for w in node[1:]:
                    acc += grads[w][name].reshape(-1)
                sums.append(acc)
            total = sums[0].copy()
            for acc in sums[1:]:
                total += acc
            np.divide(total, replicas, out=total)
            opt.apply(flat[name], total, slots[name], step)
    return {k: flat[k].reshape(values[k].shape) for k in flat}


@pytest.mark.mpi
def test_two_nodes_sum_in_node_order_and_the_ps_sees_two_pushes_a_step(tmp_path):
    # 2 ps + 4 workers, nodes of 2: each ps gets one push per node per step (fan-in 4 -> 2)
    # and applies (g0 + g1) + (g2 + g3), divided by 4 replicas, not by 2 pushes.
    phases = ["sgd", "adam"]
    ok(run_mpi(6, [str(PS_DRIVER), "sync", str(tmp_path), "--num-ps", "2",
                   "--phases", ",".join(phases), "--steps", str(STEPS),
                   "--deterministic", "--aggregate"],
               timeout=90, cwd=str(REPO), env={"MPITF_NODE_SIZE": "2"}))
    nodes = ((0, 1), (2, 3))
    for phase in phases:
        got, want = params(tmp_path, phase), reference_by_node(phase, nodes, STEPS)
        flat = reference_by_node(phase, ((0, 1, 2, 3),), STEPS)  # no aggregation's order
        for name in want:
            assert got[name].tobytes() == want[name].tobytes(), f"{phase}: {name}"
            np.testing.assert_allclose(got[name], flat[name], rtol=1e-5, atol=1e-6)
        for r in ps_reports(tmp_path, phase, 2):
            c = r["counters"]
            assert (c["fan_in"], c["replicas"], r["num_workers"]) == (2, 4, 2)
            assert c["pushes_received"] == 2 * STEPS and c["pushes_applied"] == STEPS
            assert c["staleness_histogram"] == {"0": 2 * STEPS}
            assert r["pool"] == 3  # deterministic: a frame per pushing leader, plus one
        for w in range(4):
            steps = json.loads((tmp_path / f"{phase}-worker{w}.json").read_text())["steps"]
            assert steps == list(range(1, STEPS + 1))  # every member read each reply


@pytest.mark.slow
@pytest.mark.mpi
def test_kill_and_resume_with_two_nodes_gives_the_bits_of_no_aggregation(tmp_path):
    # 3 workers in nodes (0, 1) and (2,): the order (g0 + g1) + g2 is the one without
    # aggregation, so the resumed run must give its bits. Replica 1 is not a leader: its
    # data position reaches the checkpoint through its leader, and the cut's release too.
    tmp, extra = tmp_path, ["--checkpoint-every", "10", "--optimizer", "adam", "--lr", "0.01"]
    two_nodes = {"MPITF_NODE_SIZE": "2"}
    ref = run_job(tmp, n=4, ckpt=tmp / "ref-ckpt", steps=30,
                  extra=[*extra, "--export", tmp / "ref.npz"])
    assert ref.returncode == 0, ref.output
    assert (final_summary(ref)["fan_in"], final_summary(ref)["pushes_received"]) == (3, 90)
    root, agg = tmp / "ckpt", ["--aggregate-per-node"]
    job = Background(tmp, n=4, ckpt=root, steps=30, step_sleep=0.03, run_dir="killed",
                     env=two_nodes, extra=[*extra, *agg, "--log-every", "1"])
    job.wait_until(lambda: (latest_step(root) or 0) >= 10, 60, "a checkpoint at step 10")
    job.kill_and_finish()
    saved = latest_step(root)
    assert saved is not None and 10 <= saved < 30, job.output
    # every replica's data position is in the checkpoint (replica 1's came via its leader)
    assert sorted(read_manifest(root / checkpoint_name(saved))["workers"]) == ["0", "1", "2"]
    trace = tmp / "trace.json"
    resumed = run_mpi(4, [JOB, *job_args(tmp, ckpt=root, steps=30, extra=[
        *extra, *agg, "--export", tmp / "out.npz", "--timeline", trace])],
        timeout=90, cwd=str(REPO), env=two_nodes)
    assert not resumed.timed_out and resumed.returncode == 0, resumed.output
    assert f"at step {saved}" in resumed.stdout
    summary = final_summary(resumed)
    assert summary["step"] == 30
    assert (summary["fan_in"], summary["pushes_received"]) == (2, 2 * (30 - saved))
    assert_bitwise_equal(load_npz(tmp / "out.npz"), load_npz(tmp / "ref.npz"))
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    spans = {(e["pid"], e["name"]) for e in events if e.get("ph") == "X"}
    for rank in (1, 2, 3):  # the workers: each reduces over its node and reads the share
        assert (rank, "node_reduce") in spans and (rank, "node_share") in spans


@pytest.mark.mpi
@pytest.mark.parametrize("mode, flags, message", [
    ("async", [], "aggregate_per_node (--aggregate-per-node) does not support mode 'async'"),
    ("sync", ["--replicas-to-aggregate", "2"], "does not support backup workers "
                                               "(replicas_to_aggregate 2 of 3 replicas)"),
])
def test_unsupported_combinations_are_refused_on_every_rank(tmp_path, mode, flags, message):
    run = run_mpi(4, [JOB, *job_args(tmp_path, steps=5, extra=["--aggregate-per-node", *flags],
                                     mode=mode)], timeout=60, cwd=str(REPO))
    assert not run.timed_out and run.returncode == 2, run.output
    assert run.output.count(message) == 1, run.output  # rank 0 alone prints it
    assert "step " not in run.stdout  # before training


def test_config_refusals_and_the_plan_are_pure():
    for options, what in [(dict(mode="ssp"), "mode 'ssp'"),
                          (dict(bucket_bytes=64), "bucket_bytes=64"),
                          (dict(skip_nonfinite=True), "skip_nonfinite"),
                          (dict(clients=(0,)), "in-graph replication")]:
        with pytest.raises(ConfigurationError, match=f"does not support {what}"):
            TrainingConfig(aggregate_per_node=True, **options)
    config = TrainingConfig(aggregate_per_node=True, replicas_to_aggregate=3)
    config.check_job(JobFacts(num_ps=1, num_replicas=3))  # every replica: no backups, fine
    config.check_job(JobFacts(1, 3, backends=("cupy", "numpy")))  # a ps on a GPU: fine
    for facts, message in [
            (JobFacts(1, 4), "does not support backup workers (replicas_to_aggregate 3 of 4 "
                             "replicas)"),
            (JobFacts(1, 3, tables=True), "does not support embedding tables (their rows are "
                                          "pushed by id); drop the flag"),
            (JobFacts(1, 3, replica_backends=("cupy",)), "does not support the cupy backend (a "
             "node shares host memory); use --device cpu or drop the flag"),
            (JobFacts(1, 3, nodes_problem="MPITF_NODE_SIZE=3 puts replicas 0..2"),
             "aggregate_per_node (--aggregate-per-node): MPITF_NODE_SIZE=3 puts")]:
        with pytest.raises(ConfigurationError, match=re.escape(message)):
            config.check_job(facts)
    # nodes by shared-memory domain, in replica order; or blocks of MPITF_NODE_SIZE
    assert node_plan([5, 5, 9, 5, 9]) == ((0, 1, 3), (2, 4))
    assert node_plan([0] * 5, size=2) == ((0, 1), (2, 3), (4,))
    with pytest.raises(ConfigurationError, match="do not share memory"):
        node_plan([0, 0, 1, 1], size=3)
    # the ps divides by replicas: a policy with weights refuses a count that is not every one
    with pytest.raises(ConfigurationError, match="every replica"):
        make_policy(TrainingConfig(), 2, 5, weights=[2, 2])
