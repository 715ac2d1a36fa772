import argparse
import json
import logging
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mpitf.cluster import ClusterSpec, add_cluster_arguments
from mpitf.cluster import spec as cluster_mod
from mpitf.cluster.flags import check_claimed_role, cluster_from_args
from mpitf.cluster.roles import assign_roles, check_training_cluster, describe_roles
from mpitf.errors import ConfigurationError


def parse(argv):
    parser = argparse.ArgumentParser()
    add_cluster_arguments(parser)
    return parser.parse_args(argv)


# --- the tf.train.ClusterSpec interface ---------------------------------------
def test_dense_lists():
    spec = ClusterSpec({"worker": ["w0:2222", "w1:2222"], "ps": ["p0:2222"]})
    assert spec.jobs == ["worker", "ps"]  # insertion order, as TensorFlow (issue 14)
    assert spec.num_tasks("worker") == 2
    assert spec.task_indices("worker") == [0, 1]
    assert spec.task_address("worker", 1) == "w1:2222"
    assert spec.job_tasks("ps") == ["p0:2222"]
    assert spec.total_tasks == 3
    assert spec.as_dict() == {"ps": ["p0:2222"], "worker": ["w0:2222", "w1:2222"]}
    assert bool(spec)
    assert spec.to_string() == "worker|w0:2222;w1:2222,ps|p0:2222"


def test_sparse_indices_keep_their_tf_index():
    spec = ClusterSpec({"worker": {1: "a:1", 3: "b:1"}})
    assert spec.task_indices("worker") == [1, 3]
    assert spec.job_tasks("worker") == [None, "a:1", None, "b:1"]
    assert spec.as_dict() == {"worker": {1: "a:1", 3: "b:1"}}
    assert ClusterSpec(spec.as_dict()) == spec
    assert ClusterSpec({"worker": {"0": "a", "1": "b"}}).as_dict() == {"worker": ["a", "b"]}
    with pytest.raises(ConfigurationError, match="sparse task indices"):
        spec.to_string()
    with pytest.raises(ConfigurationError, match="no task with index 0"):
        spec.task_address("worker", 0)


def test_counts_and_mixed_forms():
    spec = ClusterSpec({"ps": 2, "worker": ["h:1", "h:2"]})
    assert spec.job_tasks("ps") == ["localhost", "localhost"]
    assert spec == ClusterSpec({"ps": ["localhost"] * 2, "worker": {0: "h:1", 1: "h:2"}})
    assert ClusterSpec.from_counts(1, 3).as_dict() == {
        "ps": ["localhost"], "worker": ["localhost"] * 3}


def test_zero_ps_and_empty_spec():
    spec = ClusterSpec.from_counts(0, 2)
    assert spec.jobs == ["ps", "worker"]  # the empty ps job is kept (issue 14)
    assert spec.num_tasks("ps") == 0
    assert spec.task_indices("ps") == [] and spec.job_tasks("ps") == []
    assert spec == ClusterSpec({"ps": [], "worker": 2})
    assert spec != ClusterSpec({"worker": 2})  # an empty job is a job, as in TensorFlow
    assert spec.as_dict() == {"ps": {}, "worker": ["localhost"] * 2}
    assert spec.to_string() == "worker|localhost;localhost"
    with pytest.raises(ValueError, match="no such job in cluster: 'ps'"):
        ClusterSpec({"worker": 2}).num_tasks("ps")
    empty = ClusterSpec({})
    assert not empty and empty.total_tasks == 0 and empty.jobs == []


def test_equality_hash_copy_repr():
    a = ClusterSpec({"ps": ["p:1"], "worker": ["w:1"]})
    b = ClusterSpec.from_string("worker|w:1,ps|p:1")
    assert a == b and not (a != b) and hash(a) == hash(b)
    assert ClusterSpec(a) == a
    assert a != ClusterSpec({"worker": ["w:1"]})
    assert a == {"ps": ["p:1"], "worker": ["w:1"]}  # equal to an equal dict (issue 14)
    assert a == {"worker": {0: "w:1"}, "ps": ["p:1"]} and a != {"worker": ["w:1"]}
    assert a != {"worker": "w:1"} and a != ["w:1"]
    assert hash(ClusterSpec({"worker": ["w:1"], "ps": ["p:1"]})) == hash(a)
    assert eval(repr(a), {"ClusterSpec": ClusterSpec}) == a


@pytest.mark.parametrize("bad", [["worker|a"], "worker|a", 3, None])
def test_bad_types(bad):
    with pytest.raises(ConfigurationError, match="expecting a dict"):
        ClusterSpec(bad)


@pytest.mark.parametrize("job", ["foo", "evaluator", "chief", "master"])
def test_any_job_runs(job):
    # issue 14 (on purpose): every job's tasks run; this test refused all but ps and worker
    spec = ClusterSpec({job: ["a"], "worker": ["b"]})
    assert spec.jobs == [job, "worker"] and spec.num_tasks(job) == 1
    want = [(job, 0), ("worker", 0)] if job == "chief" else [("worker", 0), (job, 0)]
    assert assign_roles({job: ["localhost:1"], "worker": ["localhost:2"]}, ["n", "n"]) == want
    with pytest.raises(ValueError, match=f"no such job in cluster: '{job}'"):
        ClusterSpec({"worker": ["b"]}).num_tasks(job)
    assert assign_roles({job: [], "worker": ["localhost"]}, ["n"]) == [("worker", 0)]


@pytest.mark.parametrize("job", ["chief", "evaluator"])
def test_at_most_one_chief_and_evaluator(job):
    # TensorFlow's multi_worker_util._validate_cluster_spec
    with pytest.raises(ConfigurationError, match=f"2 '{job}' tasks.*at most one {job} task"):
        assign_roles(ClusterSpec({job: ["a", "b"], "worker": ["c"]}), ["n"] * 3)


@pytest.mark.parametrize("job", ["", "a-b", "1st", "x/y", "job:1", 3, None])
def test_bad_job_name(job):
    with pytest.raises(ConfigurationError, match="bad job name.*letters, digits and '_'"):
        ClusterSpec({job: ["a"]})


def test_a_cluster_without_workers_runs_but_does_not_train():
    # issue 14 (on purpose): assign_roles places it (the tutorial's {"local": [a, b]});
    # the training side refuses it (mpitf.cluster.roles.check_training_cluster)
    for cluster in ({"ps": ["localhost:1"]}, {"ps": 1, "worker": 0}):
        assert assign_roles(cluster, ["n"]) == [("ps", 0)]
        with pytest.raises(ConfigurationError, match="needs a chief or worker task"):
            check_training_cluster(cluster)
    assert assign_roles({"local": 2}, ["n", "n"]) == [("local", 0), ("local", 1)]


def test_same_address_twice_as_in_tf():
    # issue 14: TensorFlow accepts the same address on two tasks; ports are ignored anyway
    spec = ClusterSpec({"ps": ["h:2222"], "worker": ["w:1", "h:2222"]})
    assert spec.task_address("worker", 1) == spec.task_address("ps", 0) == "h:2222"


@pytest.mark.parametrize("address", [
    "h:abc", "h:70000", "h:", ":22", "[::1]x", "unix:/tmp/w0", "/tmp/sock", "localhost"])
def test_addresses_tf_accepts(address):
    # issue 14: TF's ClusterSpec takes any address string; mpitf ignores ports
    assert ClusterSpec({"worker": [address]}).task_address("worker", 0) == address


@pytest.mark.parametrize("address", ["", "  ", 3, None])
def test_address_must_be_a_string(address):
    with pytest.raises(ConfigurationError, match="expecting an address string"):
        ClusterSpec({"worker": [address]})


def test_lenient_addresses_place_by_host():
    # a path-like address names no host: the task is free; 'h:abc' is pinned to h
    spec = {"ps": ["unix:/tmp/ps0"], "worker": ["/tmp/w0", "node-b:port"]}
    hosts = ["node-a", "node-b", "node-a"]
    assert assign_roles(spec, hosts) == [("ps", 0), ("worker", 1), ("worker", 0)]
    assert assign_roles({"worker": [":22", "[::1]x"]}, ["n", "n"]) == [
        ("worker", 0), ("worker", 1)]


def test_ipv6_and_bad_values():
    spec = ClusterSpec({"worker": ["[::1]:2222", "fe80::1"]})
    assert spec.task_address("worker", 0) == "[::1]:2222"
    with pytest.raises(ConfigurationError, match="bad task index -1"):
        ClusterSpec({"worker": {-1: "a"}})
    with pytest.raises(ConfigurationError, match="given twice"):
        ClusterSpec({"worker": {1: "a", "1": "b"}})
    with pytest.raises(ConfigurationError, match="bad tasks"):
        ClusterSpec({"worker": "a:1"})
    with pytest.raises(ConfigurationError, match="expecting an address string"):
        ClusterSpec({"worker": [3]})


def test_port_note_logged_once(caplog, monkeypatch):
    monkeypatch.setitem(cluster_mod._port_note, "given", False)
    with caplog.at_level(logging.INFO, logger="mpitf"):
        ClusterSpec({"worker": ["localhost"]})
        assert not caplog.records
        ClusterSpec({"worker": ["a:1"]})
        ClusterSpec({"worker": ["b:1"]})
    notes = [r for r in caplog.records if "ports" in r.getMessage()]
    assert len(notes) == 1 and notes[0].name == "mpitf" and notes[0].levelno == logging.INFO


# --- constructors ---------------------------------------------------------------
def test_from_string():
    spec = ClusterSpec.from_string("ps|h1:2222;h1:2223,worker|h2:2224;h2:2225")
    assert spec.job_tasks("ps") == ["h1:2222", "h1:2223"]
    assert spec.job_tasks("worker") == ["h2:2224", "h2:2225"]
    assert ClusterSpec.from_string(" worker | a ; b ").job_tasks("worker") == ["a", "b"]


@pytest.mark.parametrize("text,message", [
    ("ps:h1:2222", "missing '\\|' in 'ps:h1:2222'"),
    ("|h1:2222", "empty job name in '\\|h1:2222'"),
    ("worker|h1:1;;h2:2", "empty host in 'worker\\|h1:1;;h2:2'"),
    ("worker|", "empty host in 'worker\\|'"),
    ("worker|a,worker|b", "job 'worker' is given twice"),
    ("worker|a,,ps|b", "missing '\\|' in ''"),
    ("", "empty cluster spec"),
    ("f-o|a,worker|b", "bad job name 'f-o'"),
])
def test_from_string_errors(text, message):
    with pytest.raises(ConfigurationError, match=message):
        ClusterSpec.from_string(text)


def test_from_hosts():
    spec = ClusterSpec.from_hosts("p0:2222,p1:2222", "w0:2222, w1:2222")
    assert spec.job_tasks("ps") == ["p0:2222", "p1:2222"]
    assert spec.job_tasks("worker") == ["w0:2222", "w1:2222"]
    assert ClusterSpec.from_hosts("", "w0").jobs == ["ps", "worker"]  # empty ps kept
    assert ClusterSpec.from_hosts(None, ["w0", "w1"]).num_tasks("worker") == 2
    with pytest.raises(ConfigurationError, match="--worker_hosts is empty"):
        ClusterSpec.from_hosts("p0", "")
    with pytest.raises(ConfigurationError, match="empty host in --ps_hosts='p0,'"):
        ClusterSpec.from_hosts("p0,", "w0")


def test_a_chief_job_runs_as_the_chief_replica():
    chief = ClusterSpec({"chief": ["c:1"], "worker": ["w:1"]})
    assert assign_roles(chief, ["c", "w"]) == [("chief", 0), ("worker", 0)]  # issue 14


def test_from_counts_errors():
    with pytest.raises(ConfigurationError, match="at least one worker"):
        ClusterSpec.from_counts(1, 0)
    with pytest.raises(ConfigurationError, match="bad num_ps=-1"):
        ClusterSpec.from_counts(-1, 2)


# --- argument resolution ----------------------------------------------------------
def test_precedence():
    env = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["t:1"]}})}
    args = parse(["--cluster_spec", "worker|a:1"])
    assert cluster_from_args(args, 1, env).job_tasks("worker") == ["a:1"]
    args = parse(["--ps_hosts", "p:1", "--worker_hosts", "w:1"])
    assert cluster_from_args(args, 2, env).jobs == ["ps", "worker"]
    assert cluster_from_args(parse(["--worker-hosts", "w:9"]), 1, env).jobs == ["ps", "worker"]
    assert cluster_from_args(parse([]), 1, env).job_tasks("worker") == ["t:1"]
    spec = cluster_from_args(parse(["--num-ps", "2"]), 5, {})
    assert (spec.num_tasks("ps"), spec.num_tasks("worker")) == (2, 3)
    assert cluster_from_args(parse([]), 3, {}).num_tasks("ps") == 1
    assert cluster_from_args(parse(["--num_ps", "0"]), 1, {}).jobs == ["ps", "worker"]
    # a spec with workers but no ps job runs without ps: an empty ps job is added
    spec = cluster_from_args(parse(["--cluster_spec", "worker|a:1"]), 1, {})
    assert spec == {"ps": [], "worker": ["a:1"]} and spec.num_tasks("ps") == 0


def test_resolution_errors():
    with pytest.raises(ConfigurationError, match="both given"):
        cluster_from_args(parse(["--cluster_spec", "worker|a", "--ps_hosts", "p"]), 2, {})
    with pytest.raises(ConfigurationError, match="--ps_hosts needs --worker_hosts"):
        cluster_from_args(parse(["--ps_hosts", "p"]), 2, {})
    with pytest.raises(ConfigurationError, match="--num-ps=3 .* world's 3 .* mpiexec -n 4"):
        cluster_from_args(parse(["--num-ps", "3"]), 3, {})
    with pytest.raises(ConfigurationError, match="--num-ps=1 .* world's 1"):
        cluster_from_args(parse([]), 1, {})


def test_check_claimed_role():
    check_claimed_role(parse([]), "ps", 0)
    check_claimed_role(parse(["--job_name", "ps", "--task_index", "0"]), "ps", 0)
    args = parse(["--job_name", "worker", "--task_index", "1"])
    message = ("--job_name=worker --task_index=1 but MPI rank 2 runs /job:ps/task:0;"
               " roles come from the MPI rank")
    with pytest.raises(ConfigurationError, match=message):
        check_claimed_role(args, "ps", 0, rank=2)
    with pytest.raises(ConfigurationError, match="--task_index=3 but this MPI rank"):
        check_claimed_role(parse(["--task_index", "3"]), "worker", 1)


# --- rank mapping -------------------------------------------------------------------
def nodes_of(roles, rank_hosts, job):
    return [rank_hosts[roles.index((job, i))] for i in sorted(i for j, i in roles if j == job)]


def test_world_size_mismatch_names_both():
    spec = ClusterSpec.from_counts(2, 3)
    message = ("the cluster spec has 5 tasks \\(2 ps, 3 worker\\) but the MPI world has 4"
               " ranks: run with mpiexec -n 5")
    with pytest.raises(ConfigurationError, match=message):
        assign_roles(spec, ["n"] * 4)


def test_single_node():
    roles = assign_roles(ClusterSpec.from_counts(2, 3), ["n"] * 5)
    assert roles == [("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1), ("worker", 2)]


def test_ps_spread_over_nodes():
    hosts = ["a", "a", "b", "b", "c", "c"]
    roles = assign_roles(ClusterSpec.from_counts(2, 4), hosts)
    assert roles == [("ps", 0), ("worker", 0), ("ps", 1), ("worker", 1), ("worker", 2),
                     ("worker", 3)]
    roles = assign_roles(ClusterSpec.from_counts(3, 3), ["a", "a", "a", "b", "b", "b"])
    assert nodes_of(roles, ["a", "a", "a", "b", "b", "b"], "ps") == ["a", "b", "a"]


def test_nodes_ordered_by_first_rank_and_full_node_skipped():
    hosts = ["b", "a", "b", "c"]  # nodes: b (ranks 0, 2), a (1), c (3)
    roles = assign_roles(ClusterSpec.from_counts(3, 1), hosts)
    assert nodes_of(roles, hosts, "ps") == ["b", "a", "c"]
    hosts = ["a", "a", "a", "a", "b"]  # ps 3 prefers b, which is full: it goes to a
    roles = assign_roles(ClusterSpec.from_counts(4, 1), hosts)
    assert roles == [("ps", 0), ("ps", 2), ("ps", 3), ("worker", 0), ("ps", 1)]


def test_pinned_tasks():
    hosts = ["n1.cluster", "n1.cluster", "n2.cluster", "n2.cluster"]
    spec = ClusterSpec({"ps": ["n2:2222", "localhost"], "worker": ["n1.cluster", "n2"]})
    roles = assign_roles(spec, hosts)
    assert roles == [("worker", 0), ("ps", 1), ("ps", 0), ("worker", 1)]
    assert assign_roles(ClusterSpec({"worker": ["127.0.0.1", "localhost:1"]}), ["x", "y"]) == [
        ("worker", 0), ("worker", 1)]


def test_pinned_errors_name_the_host():
    message = "/job:ps/task:0 is pinned to host 'gpu7'.* run on a, b"
    with pytest.raises(ConfigurationError, match=message):
        assign_roles(ClusterSpec({"ps": ["gpu7:1"], "worker": ["w"]}), ["a", "b"])
    with pytest.raises(ConfigurationError, match="pinned to 'a', which has no free rank"):
        assign_roles(ClusterSpec({"ps": ["a:1"], "worker": ["a:2"]}), ["a", "b"])


def test_sparse_roles():
    spec = ClusterSpec({"worker": {1: "localhost", 3: "localhost"}, "ps": {2: "localhost"}})
    assert assign_roles(spec, ["n"] * 3) == [("ps", 2), ("worker", 1), ("worker", 3)]


def test_describe_roles():
    roles = assign_roles(ClusterSpec.from_counts(1, 1), ["node-a", "node-b"])
    text = describe_roles(roles, ["node-a", "node-b"])
    lines = text.splitlines()
    assert lines[0].split() == ["rank", "task", "host"]
    assert lines[1].split() == ["0", "/job:ps/replica:0/task:0", "node-a"]
    assert lines[2].split() == ["1", "/job:worker/replica:0/task:0", "node-b"]


# --- properties ------------------------------------------------------------------
hostname = st.from_regex(r"[a-z][a-z0-9-]{0,8}(\.[a-z]{1,4})?", fullmatch=True)
address = st.one_of(hostname, st.builds("{}:{}".format, hostname, st.integers(0, 65535)))
dense_spec = st.fixed_dictionaries(
    {"worker": st.lists(address, min_size=1, max_size=5)},
    optional={"ps": st.lists(address, min_size=1, max_size=4)})


def unique_ports(cluster):
    seen = [a for tasks in cluster.values() for a in tasks if ":" in a]
    return len(seen) == len(set(seen))


@given(dense_spec.filter(unique_ports))
def test_string_round_trip(cluster):
    spec = ClusterSpec(cluster)
    assert ClusterSpec.from_string(spec.to_string()) == spec
    assert ClusterSpec(spec.as_dict()) == spec


@given(st.integers(0, 6), st.integers(1, 6), st.lists(st.sampled_from("abc"), min_size=1),
       st.randoms(use_true_random=False))
def test_assign_roles_is_a_permutation(num_ps, num_workers, pool, rnd):
    hosts = [rnd.choice(pool) for _ in range(num_ps + num_workers)]
    roles = assign_roles(ClusterSpec.from_counts(num_ps, num_workers), hosts)
    expected = [("ps", i) for i in range(num_ps)] + [("worker", i) for i in range(num_workers)]
    assert sorted(roles) == sorted(expected)
    assert roles == assign_roles(ClusterSpec.from_counts(num_ps, num_workers), hosts)
    ps_nodes = nodes_of(roles, hosts, "ps")
    num_nodes = len(set(hosts))
    # one ps per node before a second lands on any node
    assert len(set(ps_nodes[:num_nodes])) == min(num_ps, num_nodes)


def test_a_tf_config_task_is_checked_like_job_name():
    spec = {"cluster": {"ps": ["localhost:1"], "worker": ["localhost:2"]}}
    env = {"TF_CONFIG": json.dumps(dict(spec, task={"type": "worker", "index": 0}))}
    check_claimed_role(parse([]), "worker", 0, env=env)
    message = ('TF_CONFIG task {"type": "worker", "index": 0} but MPI rank 0 runs '
               "/job:ps/task:0")
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        check_claimed_role(parse([]), "ps", 0, rank=0, env=env)
    # a cluster flag wins over TF_CONFIG, whose task then describes another cluster
    check_claimed_role(parse(["--cluster_spec", "worker|a"]), "ps", 0, env=env)
    with pytest.raises(ConfigurationError, match="--job_name=ps but"):
        check_claimed_role(parse(["--job_name", "ps"]), "worker", 0, env=env)


def test_cluster_flags_given_empty_are_errors_not_defaults():
    with pytest.raises(ConfigurationError, match="empty cluster spec ''"):
        cluster_from_args(parse(["--cluster_spec", ""]), 2, {})
    with pytest.raises(ConfigurationError, match="--worker_hosts is empty"):
        cluster_from_args(parse(["--worker_hosts", ""]), 2, {})
    with pytest.raises(ConfigurationError, match="--ps_hosts needs --worker_hosts"):
        cluster_from_args(parse(["--ps_hosts", ""]), 2, {})
