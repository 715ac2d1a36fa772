"""TensorFlow's own ClusterSpec tests, run against mpitf.

Origin: tensorflow/python/training/server_lib_test.py (Apache License 2.0, The
TensorFlow Authors), classes ClusterSpecTest and ServerDefTest; each test below
names the TF test it follows. The cases and expected values are TF's; the changes:
- imports: ``mpitf.cluster.ClusterSpec`` for ``server_lib.ClusterSpec``; pytest
  functions for ``test.TestCase`` methods.
- no protobuf ``ClusterDef`` (a design choice: MPI needs no wire description of the
  cluster): where TF compares ``as_cluster_def()`` protos, these compare specs and
  their ``as_dict()``, which hold the same jobs and tasks.
- no gRPC servers (a design choice: MPI carries the traffic and ports are ignored):
  GrpcServerTest and the ``ServerDef`` halves are left out, and so is
  ``testInvalidHostname`` (TF refuses ``"localhost"`` without a port when it starts
  a gRPC server; mpitf accepts it, since it opens no port).
"""

import pytest

from mpitf.cluster import ClusterSpec


# --- ClusterSpecTest ---------------------------------------------------------------
def test_string_conversion():  # testStringConversion
    spec = ClusterSpec({"ps": ["ps0:1111"], "worker": ["worker0:3333", "worker1:4444"]})
    assert str(spec) == ("ClusterSpec({'ps': ['ps0:1111'], 'worker': ['worker0:3333', "
                         "'worker1:4444']})")


def _equivalent_forms(spec):
    return [spec, ClusterSpec(spec), ClusterSpec(spec.as_dict())]


def test_dict_equivalences():  # testProtoDictDefEquivalences, without the proto
    spec = ClusterSpec({"ps": ["ps0:2222", "ps1:2222"],
                        "worker": ["worker0:2222", "worker1:2222", "worker2:2222"]})
    expected = {"ps": {0: "ps0:2222", 1: "ps1:2222"},
                "worker": {0: "worker0:2222", 1: "worker1:2222", 2: "worker2:2222"}}
    for form in _equivalent_forms(spec):
        assert form == expected and form == spec
        assert form.jobs == ["ps", "worker"]


def test_dict_equivalences_with_zero_worker():  # testProtoDictDefEquivalencesWithZeroWorker
    spec = ClusterSpec({"ps": ["ps0:2222", "ps1:2222"], "worker": []})
    for form in _equivalent_forms(spec):
        assert form == {"ps": {0: "ps0:2222", 1: "ps1:2222"}, "worker": {}}
        assert form.jobs == ["ps", "worker"] and form.num_tasks("worker") == 0


def test_cluster_spec_accessors():  # testClusterSpecAccessors
    original = {"ps": ["ps0:2222", "ps1:2222"],
                "worker": ["worker0:2222", "worker1:2222", "worker2:2222"],
                "sparse": {0: "sparse0:2222", 3: "sparse3:2222"}}
    spec = ClusterSpec(original)
    assert spec.as_dict() == original

    assert spec.num_tasks("ps") == 2
    assert spec.num_tasks("worker") == 3
    assert spec.num_tasks("sparse") == 2
    with pytest.raises(ValueError):
        spec.num_tasks("unknown")

    assert spec.task_address("ps", 0) == "ps0:2222"
    assert spec.task_address("sparse", 0) == "sparse0:2222"
    with pytest.raises(ValueError):
        spec.task_address("unknown", 0)
    with pytest.raises(ValueError):
        spec.task_address("sparse", 2)

    assert spec.task_indices("ps") == [0, 1]
    assert spec.task_indices("worker") == [0, 1, 2]
    assert spec.task_indices("sparse") == [0, 3]
    with pytest.raises(ValueError):
        spec.task_indices("unknown")

    assert spec.job_tasks("ps") == ["ps0:2222", "ps1:2222"]
    assert spec.job_tasks("worker") == ["worker0:2222", "worker1:2222", "worker2:2222"]
    assert spec.job_tasks("sparse") == ["sparse0:2222", None, None, "sparse3:2222"]
    with pytest.raises(ValueError):
        spec.job_tasks("unknown")


def test_empty_cluster_spec_is_false():  # testEmptyClusterSpecIsFalse
    assert not ClusterSpec({})


def test_non_empty_cluster_spec_is_true():  # testNonEmptyClusterSpecIsTrue
    assert ClusterSpec({"job": ["host:port"]})


def test_eq():  # testEq
    assert ClusterSpec({}) == ClusterSpec({})
    assert ClusterSpec({"job": ["host:2222"]}) == ClusterSpec({"job": ["host:2222"]})
    assert ClusterSpec({"job": {0: "host:2222"}}) == ClusterSpec({"job": ["host:2222"]})


@pytest.mark.parametrize("a, b", [
    ({}, {"job": ["host:2223"]}),
    ({"job1": ["host:2222"]}, {"job2": ["host:2222"]}),
    ({"job": ["host:2222"]}, {"job": ["host:2223"]}),
    ({"job": ["host:2222", "host:2223"]}, {"job": ["host:2223", "host:2222"]}),
])
def test_ne(a, b):  # testNe
    assert ClusterSpec(a) != ClusterSpec(b)
    assert not ClusterSpec(a) == ClusterSpec(b)


# --- ServerDefTest, the ClusterSpec half (no ServerDef proto) ------------------------
@pytest.mark.parametrize("cluster", [
    {"local": ["localhost:2222"]},  # testLocalServer
    {"local": ["localhost:2222", "localhost:2223"]},  # testTwoProcesses
    {"ps": ["ps0:2222", "ps1:2222"],  # testTwoJobs
     "worker": ["worker0:2222", "worker1:2222", "worker2:2222"]},
    {"ps": ["ps0:2222", "ps1:2222"], "worker": {0: "worker0:2222", 2: "worker2:2222"}},
])  # the last: testDenseAndSparseJobs
def test_server_def_clusters_round_trip(cluster):
    spec = ClusterSpec(cluster)
    assert spec.as_dict() == cluster
    assert ClusterSpec(spec.as_dict()) == spec == cluster
    assert spec.jobs == list(cluster)
    for job, tasks in cluster.items():
        indices = list(tasks) if isinstance(tasks, dict) else list(range(len(tasks)))
        assert spec.task_indices(job) == indices
        assert [spec.task_address(job, i) for i in indices] == [tasks[i] for i in indices]
