"""TensorFlow's own SlurmClusterResolver tests, run against mpitf.

Origin: tensorflow/python/distribute/cluster_resolver/slurm_cluster_resolver_test.py
(Apache License 2.0, The TensorFlow Authors), class SlurmClusterResolverTest; each test
below names the TF test it follows. The Slurm variables, arguments and expected values
are TF's; the changes:
- imports: ``mpitf.cluster.resolvers`` for TF's ``slurm_cluster_resolver`` module; pytest
  functions for ``test.TestCase`` methods; ``monkeypatch.setenv`` for
  ``mock.patch.dict(os.environ, ...)`` (and every other SLURM_* variable and
  CUDA_VISIBLE_DEVICES cleared first, so a suite run under srun reads only these).
- no protobuf ``ClusterDef`` (a design choice: MPI needs no wire description of the
  cluster): where TF compares ``as_cluster_def()`` protos, these compare the spec, a copy
  of it and its ``as_dict()`` with the same jobs and tasks.
"""

import os

import pytest

from mpitf.cluster import ClusterSpec
from mpitf.cluster.resolvers import SlurmClusterResolver, expand_hostlist, expand_tasks_per_node


@pytest.fixture
def slurm_env(monkeypatch):
    """Give the test exactly these variables, as TF's mock.patch.dict(os.environ, ...)."""
    for name in [n for n in os.environ if n.startswith("SLURM_")] + ["CUDA_VISIBLE_DEVICES"]:
        monkeypatch.setenv(name, "")  # recorded, so the test's own writes are undone too
        monkeypatch.delenv(name)

    def set_env(values):
        for name, value in values.items():
            monkeypatch.setenv(name, value)
    return set_env


def _verify_cluster_spec_equality(spec, expected):
    for form in (spec, ClusterSpec(spec), ClusterSpec(spec.as_dict())):
        assert form == expected
        assert form.as_dict() == ClusterSpec(expected).as_dict()


def test_expand_hostlist():  # test_expand_hostlist
    assert expand_hostlist("n1") == ["n1"]
    assert expand_hostlist("n[1,3]") == ["n1", "n3"]
    assert expand_hostlist("n[1-3]") == ["n1", "n2", "n3"]
    assert expand_hostlist("n[1-2],m5,o[3-4,6,7-9]") == [
        "n1", "n2", "m5", "o3", "o4", "o6", "o7", "o8", "o9"]
    assert expand_hostlist("n[0001-0003],m5,o[009-011]") == [
        "n0001", "n0002", "n0003", "m5", "o009", "o010", "o011"]


def test_expand_tasks_per_node():  # test_expand_tasks_per_node
    assert expand_tasks_per_node("2") == [2]
    assert expand_tasks_per_node("2,1,3") == [2, 1, 3]
    assert expand_tasks_per_node("3(x2),2,1") == [3, 3, 2, 1]
    assert expand_tasks_per_node("3(x2),2,11(x4)") == [3, 3, 2, 11, 11, 11, 11]
    assert expand_tasks_per_node("13(x10)") == [13, 13, 13, 13, 13, 13, 13, 13, 13, 13]


def test_simple_retrieval_from_env(slurm_env):  # testSimpleRetrievalFromEnv
    slurm_env({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "3",
               "SLURM_STEP_TASKS_PER_NODE": "1(x3)",
               "SLURM_STEP_NODELIST": "t02n13,t02n41,t02n43", "CUDA_VISIBLE_DEVICES": "0"})
    resolver = SlurmClusterResolver()
    _verify_cluster_spec_equality(resolver.cluster_spec(), {
        "worker": {0: "t02n13:8888", 1: "t02n41:8888", 2: "t02n43:8888"}})
    assert resolver.master("worker", 0, rpc_layer="grpc") == "grpc://t02n13:8888"
    assert resolver.num_accelerators() == {"GPU": 1}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"


def _ps1_worker2(slurm_env, **kwargs):
    slurm_env({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "3",
               "SLURM_STEP_NODELIST": "t02n13,t02n41,t02n43"})
    return SlurmClusterResolver(jobs={"ps": 1, "worker": 2}, port_base=8888,
                                gpus_per_node=1, gpus_per_task=1, auto_set_gpu=False, **kwargs)


def test_simple_successful_retrieval(slurm_env):  # testSimpleSuccessfulRetrieval
    resolver = _ps1_worker2(slurm_env, tasks_per_node=1)
    _verify_cluster_spec_equality(resolver.cluster_spec(), {
        "ps": {0: "t02n13:8888"}, "worker": {0: "t02n41:8888", 1: "t02n43:8888"}})


def test_simple_master_retrieval(slurm_env):  # testSimpleMasterRetrieval
    resolver = _ps1_worker2(slurm_env, tasks_per_node=1)
    resolver.task_type = "worker"
    resolver.task_id = 1
    assert resolver.master() == "grpc://t02n43:8888"

    resolver.rpc_layer = "ab"
    assert resolver.master("ps", 0) == "ab://t02n13:8888"
    assert resolver.master("ps", 0, rpc_layer="test") == "test://t02n13:8888"


def test_task_per_node_not_set_retrieval(slurm_env):  # testTaskPerNodeNotSetRetrieval
    slurm_env({"SLURM_STEP_TASKS_PER_NODE": "1(x3)"})
    resolver = _ps1_worker2(slurm_env)
    _verify_cluster_spec_equality(resolver.cluster_spec(), {
        "ps": {0: "t02n13:8888"}, "worker": {0: "t02n41:8888", 1: "t02n43:8888"}})


MULTI_TASK_ENV = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "5",
                  "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
                  "SLURM_STEP_NODELIST": "t02n13,t02n41,t02n43", "CUDA_VISIBLE_DEVICES": ""}
MULTI_TASK_SPEC = {"ps": {0: "t02n13:8888"},
                   "worker": {0: "t02n13:8889", 1: "t02n41:8888", 2: "t02n41:8889",
                              3: "t02n43:8888"}}


def test_multi_task_per_node_retrieval(slurm_env):  # testMultiTaskPerNodeRetrieval
    slurm_env(MULTI_TASK_ENV)
    resolver = SlurmClusterResolver(jobs={"ps": 1, "worker": 4}, port_base=8888,
                                    gpus_per_node=2, gpus_per_task=1, auto_set_gpu=True)
    _verify_cluster_spec_equality(resolver.cluster_spec(), MULTI_TASK_SPEC)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"


def test_multiple_gpus_per_task_retrieval(slurm_env):  # testMultipleGpusPerTaskRetrieval
    slurm_env(MULTI_TASK_ENV)
    resolver = SlurmClusterResolver(jobs={"ps": 1, "worker": 4}, port_base=8888,
                                    gpus_per_node=4, gpus_per_task=2, auto_set_gpu=True)
    _verify_cluster_spec_equality(resolver.cluster_spec(), MULTI_TASK_SPEC)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
