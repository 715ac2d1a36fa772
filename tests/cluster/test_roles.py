"""mpitf.cluster.roles' placement order for chief, evaluator and other jobs (issue 14): pure.

No MPI.
"""

import pytest

from mpitf.cluster import ClusterSpec
from mpitf.cluster.roles import assign_roles, check_training_cluster, job_order, training_replicas
from mpitf.errors import ConfigurationError


def test_free_tasks_take_ps_chief_worker_others_then_evaluator():
    spec = {"evaluator": 1, "other": 1, "worker": 2, "chief": 1, "ps": 1, "extra": 1}
    assert job_order(ClusterSpec(spec)) == ["ps", "chief", "worker", "other", "extra",
                                            "evaluator"]
    assert assign_roles(spec, ["n"] * 7) == [
        ("ps", 0), ("chief", 0), ("worker", 0), ("worker", 1), ("other", 0), ("extra", 0),
        ("evaluator", 0)]


def test_evaluator_lands_on_the_highest_free_rank_with_ps_spread():
    hosts = ["a", "a", "b", "b"]
    spec = {"ps": 2, "chief": 1, "evaluator": 1}
    # ps 0 on node a (rank 0), ps 1 on node b (rank 2); chief then evaluator fill 1 and 3
    assert assign_roles(spec, hosts) == [("ps", 0), ("chief", 0), ("ps", 1), ("evaluator", 0)]


def test_pinned_tasks_first_in_spec_order():
    spec = {"evaluator": ["b:1"], "other": ["localhost:3"], "worker": ["localhost:1", "b:2"],
            "chief": ["a:1"], "ps": ["localhost:2"]}
    hosts = ["a", "b", "a", "b", "b"]
    # pinned, in the spec's job order (as TF's SlurmClusterResolver numbers Slurm tasks):
    # evaluator -> b (rank 1), worker 1 -> b (rank 3), chief -> a (rank 0); then the free
    # ps prefers node a (rank 2); worker 0 and other fill rank 4
    # and... nothing: one rank is left for two free tasks, so the spec must fit
    with pytest.raises(ConfigurationError, match="6 tasks"):
        assign_roles(spec, hosts)
    del spec["other"]
    assert assign_roles(spec, hosts) == [("chief", 0), ("evaluator", 0), ("ps", 0),
                                         ("worker", 1), ("worker", 0)]


def test_training_replicas_are_the_chief_then_workers_by_index():
    assert training_replicas({"worker": {2: "a", 0: "b"}, "chief": ["c"], "ps": 1}) == [
        ("chief", 0), ("worker", 0), ("worker", 2)]
    assert training_replicas({"ps": 1, "worker": 2}) == [("worker", 0), ("worker", 1)]
    assert training_replicas({"local": 2}) == []


@pytest.mark.parametrize("spec, words", [
    ({"local": 2}, ["needs a chief or worker task", "local (2)"]),
    ({"ps": 1, "evaluator": 1}, ["needs a chief or worker task"]),
    ({"ps": 1, "worker": 1, "evaluator": 1}, ["evaluator task", "--checkpoint-dir"]),
])
def test_training_refuses_a_cluster_it_cannot_run(spec, words):
    with pytest.raises(ConfigurationError) as exc:
        check_training_cluster(spec)
    for word in words:
        assert word in str(exc.value)
    check_training_cluster({"ps": 1, "chief": 1, "evaluator": 1}, "/tmp/ckpt")


@pytest.mark.parametrize("job, count", [("chief", 2), ("evaluator", 3)])
def test_at_most_one_chief_or_evaluator(job, count):
    with pytest.raises(ConfigurationError, match=f"{count} '{job}' tasks"):
        assign_roles({"worker": 1, job: count}, ["n"] * (count + 1))


def test_a_training_session_refuses_a_task_that_does_not_train():
    from types import SimpleNamespace

    from mpitf.worker.session import TrainingSession

    evaluator = SimpleNamespace(replica_index=None, num_replicas=2, job_name="evaluator",
                                task_index=0)
    with pytest.raises(ConfigurationError, match="not on /job:evaluator/task:0"):
        TrainingSession(evaluator, model=None, optimizer=None)
    alone = SimpleNamespace(replica_index=None, num_replicas=0, job_name="local", task_index=1)
    with pytest.raises(ConfigurationError, match="the cluster has none"):
        TrainingSession(alone, model=None, optimizer=None)


def test_a_ps_refuses_a_cluster_with_nothing_to_serve():
    from types import SimpleNamespace

    from mpitf.ps.service import serve

    with pytest.raises(ConfigurationError, match="serves the chief and worker tasks"):
        serve(SimpleNamespace(replica_ranks=[]))


def test_an_evaluator_needs_a_checkpoint_directory_and_a_training_run():
    from types import SimpleNamespace

    from mpitf.worker.evaluator import Evaluator

    server = SimpleNamespace(replica_ranks=[1])
    with pytest.raises(ConfigurationError, match="no checkpoint directory is set"):
        Evaluator(server, None, None, [], [])
    with pytest.raises(ConfigurationError, match="no chief or worker task"):
        Evaluator(SimpleNamespace(replica_ranks=[]), None, "ckpt", [], [])
    assert Evaluator(server, None, "ckpt", [], [], run_dir="run").path == "run/eval/metrics.jsonl"
