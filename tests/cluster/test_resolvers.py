"""TF_CONFIG and Slurm as a job reads them: the resolvers' mpitf side and cluster_from_args.

TensorFlow's own resolver tests are in tests/tf/; these cover what mpitf adds: bad input
named with its fix, the srun path of cluster_from_args (real host names and ports, each
task pinned to its node, Slurm task r on MPI rank r), and TF_CONFIG's ``task`` held against
the rank's role on every rank of a real mpiexec run.
"""

import argparse
import json
import re
import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpitf.cluster import add_cluster_arguments
from mpitf.cluster.flags import check_claimed_role, claimed_roles, cluster_from_args
from mpitf.cluster.resolvers import SlurmClusterResolver, TFConfigClusterResolver, expand_hostlist
from mpitf.cluster.roles import assign_roles
from mpitf.errors import ConfigurationError

HELLO = "jobs/hello.py"
PS_WORKER = {"ps": ["localhost:1"], "worker": ["localhost:2", "localhost:3"]}


def parse(argv):
    parser = argparse.ArgumentParser()
    add_cluster_arguments(parser)
    return parser.parse_args(argv)


def tf_config(**config):
    return {"TF_CONFIG": json.dumps(config)}


def slurm(nodelist, tasks_per_node, num_tasks, procid=0):
    return {"SLURM_PROCID": str(procid), "SLURM_STEP_NODELIST": nodelist,
            "SLURM_STEP_TASKS_PER_NODE": tasks_per_node, "SLURM_STEP_NUM_TASKS": str(num_tasks)}


# --- TF_CONFIG ----------------------------------------------------------------------------
def test_an_empty_tf_config_is_an_empty_spec_and_leaves_the_cluster_to_num_ps():
    for value in ("{}", " ", '{"task": {"type": "worker"}}'):
        assert TFConfigClusterResolver(env={"TF_CONFIG": value}).cluster_spec() == {}
        spec = cluster_from_args(parse(["--num-ps", "1"]), 3, {"TF_CONFIG": value})
        assert spec == {"ps": ["localhost"], "worker": ["localhost", "localhost"]}
    assert not TFConfigClusterResolver(env={}).cluster_spec()


def test_a_task_without_index_is_index_none_and_agrees_with_any_index():
    env = tf_config(cluster=PS_WORKER, task={"type": "worker"})
    resolver = TFConfigClusterResolver(env=env)
    assert (resolver.task_type, resolver.task_id) == ("worker", None)
    assert claimed_roles(parse([]), env) == [('TF_CONFIG task {"type": "worker"}', "worker", None)]
    check_claimed_role(parse([]), "worker", 0, env=env)
    check_claimed_role(parse([]), "worker", 1, env=env)
    with pytest.raises(ConfigurationError, match=re.escape(
            'TF_CONFIG task {"type": "worker"} but MPI rank 0 runs /job:ps/task:0')):
        check_claimed_role(parse([]), "ps", 0, rank=0, env=env)
    # a task with an index and no type: index 1 of any job, as --task_index=1 alone
    env = tf_config(cluster=PS_WORKER, task={"index": 1})
    check_claimed_role(parse([]), "worker", 1, env=env)
    with pytest.raises(ConfigurationError, match=re.escape('TF_CONFIG task {"index": 1} but')):
        check_claimed_role(parse([]), "worker", 0, env=env)


@pytest.mark.parametrize("task, role", [
    ({"type": "chief", "index": 0}, ("worker", 0)),  # any type is read; it names another job
    ({"type": "worker", "index": 7}, ("worker", 1)),  # an index past the job's tasks
    ({"type": "evaluator", "index": "0"}, ("ps", 0)),
])
def test_any_task_type_is_read_and_a_disagreeing_one_is_named_with_the_role(task, role):
    env = tf_config(cluster=PS_WORKER, task=task)
    shown = json.dumps({"type": task["type"], "index": int(task["index"])})
    with pytest.raises(ConfigurationError, match=re.escape(
            f"TF_CONFIG task {shown} but MPI rank 2 runs /job:{role[0]}/task:{role[1]}")):
        check_claimed_role(parse([]), *role, rank=2, env=env)


@pytest.mark.parametrize("value, message", [
    ("{nope", "TF_CONFIG is not valid JSON"),
    ("[1]", "TF_CONFIG must be a JSON object"),
    ('{"task": [0]}', "bad TF_CONFIG task [0]"),
    ('{"task": {"type": "worker", "index": -1}}', "bad TF_CONFIG task index -1"),
    ('{"task": {"type": "worker", "index": "one"}}', "bad TF_CONFIG task index 'one'"),
    ('{"cluster": {"worker": 1.5}}', "TF_CONFIG's cluster: bad tasks 1.5 for job 'worker'"),
])
def test_bad_tf_config_is_named(value, message):
    def resolve_and_check(env):  # as start_job: the cluster, then the rank's claims
        cluster_from_args(parse([]), 2, env)
        check_claimed_role(parse([]), "worker", 0, env=env)

    with pytest.raises(ConfigurationError, match=re.escape(message)):
        resolve_and_check({"TF_CONFIG": value})


def test_parse_spec_reads_tf_config_through_the_resolver():
    from mpitf.cli.main import parse_spec

    text = json.dumps({"cluster": PS_WORKER, "task": {"type": "ps", "index": 0}})
    assert parse_spec(text) == PS_WORKER


# --- Slurm ------------------------------------------------------------------------------------
def test_the_srun_path_names_real_hosts_with_ports():
    env = slurm("t02n[13,41-43]", "2(x3),1", 7)
    spec = cluster_from_args(parse(["--num-ps", "2"]), 7, env)
    assert spec.as_dict() == {
        "ps": ["t02n13:8888", "t02n13:8889"],
        "worker": ["t02n41:8888", "t02n41:8889", "t02n42:8888", "t02n42:8889", "t02n43:8888"]}
    assert cluster_from_args(parse(["--num-ps", "0"]), 7, env) == {
        "ps": [], "worker": ["t02n13:8888", "t02n13:8889", "t02n41:8888", "t02n41:8889",
                             "t02n42:8888", "t02n42:8889", "t02n43:8888"]}


def test_slurm_is_used_only_when_the_world_is_the_step():
    local = {"ps": ["localhost"], "worker": ["localhost"] * 2}
    batch_shell = {"SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NTASKS": "3"}
    assert cluster_from_args(parse([]), 3, batch_shell) == local  # no SLURM_STEP_*
    assert cluster_from_args(parse([]), 3, slurm("n[1-2]", "1(x2)", 2)) == local  # mpiexec's
    # TF_CONFIG and the cluster flags come first
    env = {**slurm("n[1-3]", "1(x3)", 3), **tf_config(cluster=PS_WORKER)}
    assert cluster_from_args(parse([]), 3, env) == PS_WORKER
    assert cluster_from_args(parse(["--cluster_spec", "worker|a"]), 1, env) == {
        "ps": [], "worker": ["a"]}
    # slurm/README.md: a TF_CONFIG of counts makes free tasks, whose ps spread over the nodes
    env = {**slurm("n[1-2]", "2(x2)", 4), **tf_config(cluster={"ps": 2, "worker": 2})}
    spec = cluster_from_args(parse([]), 4, env)
    assert assign_roles(spec, ["n1", "n1", "n2", "n2"]) == [
        ("ps", 0), ("worker", 0), ("ps", 1), ("worker", 1)]
    assert assign_roles(cluster_from_args(parse(["--num-ps", "2"]), 4, slurm(
        "n[1-2]", "2(x2)", 4)), ["n1", "n1", "n2", "n2"]) == [
        ("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1)]  # TF's order: ps on node 1


@pytest.mark.parametrize("env, message", [
    (slurm("n[1-3]", "2(x2)", 4), "SLURM_STEP_TASKS_PER_NODE='2(x2)' gives 2 nodes but"
                                  " SLURM_STEP_NODELIST names 3"),
    (slurm("n[1-3", "1(x3)", 3), "bad Slurm hostlist 'n[1-3' ('[' without ']')"),
    (slurm("n[3-1]", "1(x3)", 3), "bad Slurm hostlist 'n[3-1]' (range '3-1' runs backwards)"),
    (slurm("n[1-2],,m", "1(x3)", 3), "bad Slurm hostlist 'n[1-2],,m' (an empty host name)"),
    (slurm("n[a-b]", "1(x2)", 2), "bad Slurm hostlist 'n[a-b]' (bad range 'a-b')"),
    (slurm("n[1-2]", "2x2", 4), "bad Slurm tasks-per-node list '2x2'"),
])
def test_bad_slurm_variables_are_named(env, message):
    world = int(env["SLURM_STEP_NUM_TASKS"])
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        cluster_from_args(parse([]), world, env)


def test_resolver_errors_say_what_to_fix():
    env = slurm("n[1-2]", "2(x2)", 4)
    with pytest.raises(ConfigurationError, match="SLURM_PROCID is not set: this is not inside"
                                                 " a Slurm job step; run the job under srun"):
        SlurmClusterResolver(env={})
    with pytest.raises(ConfigurationError, match=re.escape(
            "the jobs {'ps': 1, 'worker': 2} ask for 3 tasks but the Slurm step runs 4")):
        SlurmClusterResolver({"ps": 1, "worker": 2}, gpus_per_node=0, env=env)
    with pytest.raises(ConfigurationError, match="2 tasks on a node with 1 GPUs each need 2,"
                                                 " but a node has 1"):
        SlurmClusterResolver(gpus_per_node=1, gpus_per_task=1, env=env)
    with pytest.raises(ConfigurationError, match="SLURM_PROCID=4 is not one of the step's 4"):
        SlurmClusterResolver(gpus_per_node=0, env={**env, "SLURM_PROCID": "4"})


def test_gpus_come_from_cuda_visible_devices_and_none_is_no_gpu():
    env = {**slurm("n[1-2]", "2(x2)", 4, procid=3), "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    resolver = SlurmClusterResolver(env=env)
    resolver.cluster_spec()
    assert resolver.num_accelerators() == {"GPU": 2}
    assert resolver.get_task_info() == ("worker", 3) and env["CUDA_VISIBLE_DEVICES"] == "2,3"
    env = {**slurm("n[1-2]", "2(x2)", 4, procid=3), "CUDA_VISIBLE_DEVICES": ""}
    resolver = SlurmClusterResolver(env=env)
    assert resolver.cluster_spec().num_tasks("worker") == 4  # TF fails without GPUs
    assert resolver.num_accelerators() == {} and env["CUDA_VISIBLE_DEVICES"] == ""
    assert resolver.environment == "" and resolver.master() == "grpc://n2:8889"


def _tf_tasks(env, jobs):
    """Return TensorFlow's (job, index) for each SLURM_PROCID of the step."""
    tasks = []
    for procid in range(int(env["SLURM_STEP_NUM_TASKS"])):
        resolver = SlurmClusterResolver(jobs, gpus_per_node=0, auto_set_gpu=False,
                                        env={**env, "SLURM_PROCID": str(procid)})
        resolver.cluster_spec()
        tasks.append(resolver.get_task_info())
    return tasks


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(1, 4), min_size=1, max_size=5), data=st.data(),
       fqdn=st.booleans())
def test_slurm_task_r_runs_on_mpi_rank_r(counts, data, fqdn):
    # srun gives procid r MPI rank r, block by block over the nodes in nodelist order; the
    # roles policy pins each task to the node of its address, ps before worker, each in
    # index order on the lowest free rank: so rank r runs the task TF gives procid r.
    hosts = [f"gpu{i + 1:02d}" for i in range(len(counts))]
    nodelist = f"gpu[01-{len(counts):02d}]" if len(counts) > 1 else hosts[0]
    total = sum(counts)
    num_ps = data.draw(st.integers(0, total - 1))
    env = slurm(nodelist, ",".join(map(str, counts)), total)
    spec = cluster_from_args(parse(["--num-ps", str(num_ps)]), total, env)
    rank_hosts = [h + (".cluster.example" if fqdn else "")
                  for h, n in zip(hosts, counts) for _ in range(n)]  # MPI's processor names
    jobs = {"ps": num_ps, "worker": total - num_ps}
    assert assign_roles(spec, rank_hosts) == _tf_tasks(env, jobs)


def test_nodes_tf_sorts_otherwise_than_slurm_still_run_each_task_on_its_node():
    # TF sorts node names as strings (n10 before n9); srun numbers tasks in Slurm's
    # numeric order. mpitf follows the addresses: every task runs on the node it names.
    env = slurm("n[9-10]", "1(x2)", 2)
    spec = cluster_from_args(parse(["--num-ps", "1"]), 2, env)
    assert spec == {"ps": ["n10:8888"], "worker": ["n9:8888"]}
    assert assign_roles(spec, ["n9", "n10"]) == [("worker", 0), ("ps", 0)]
    assert expand_hostlist("n[9-10]") == ["n9", "n10"]


# --- on real ranks -------------------------------------------------------------------------
def _refused_by_every_rank(run, message):
    """Assert the refusal, said once; the run had a deadline of 15 s (``timeout=15``)."""
    assert not run.timed_out and run.returncode == 2, run.output
    assert run.output.count(message) == 1, run.output  # rank 0 alone says it
    assert "Hello" not in run.stdout and "Traceback" not in run.output


@pytest.mark.mpi
@pytest.mark.parametrize("task, message, more", [
    ({"type": "chief", "index": 0},
     'TF_CONFIG task {"type": "chief", "index": 0} but MPI rank 0 runs /job:ps/task:0',
     "(and 2 more ranks disagree)"),
    ({"type": "worker"}, 'TF_CONFIG task {"type": "worker"} but MPI rank 0 runs /job:ps/task:0',
     None),
    ({"type": "worker", "index": 7},
     'TF_CONFIG task {"type": "worker", "index": 7} but MPI rank 0 runs /job:ps/task:0',
     "(and 2 more ranks disagree)"),
])
def test_a_tf_config_task_is_held_on_every_rank(mpirun, task, message, more):
    run = mpirun(3, HELLO, timeout=15, env=tf_config(cluster=PS_WORKER, task=task))
    _refused_by_every_rank(run, message)
    assert (more in run.stderr) if more else "more rank" not in run.stderr, run.output


@pytest.mark.mpi
def test_an_empty_tf_config_runs_the_num_ps_cluster(mpirun):
    run = mpirun(2, HELLO, timeout=30, env={"TF_CONFIG": "{}"})
    assert run.returncode == 0, run.output
    assert "from /job:ps/replica:0/task:0/device:CPU:0" in run.stdout
    assert "from /job:worker/replica:0/task:0/device:CPU:0" in run.stdout


@pytest.mark.mpi
def test_a_slurm_step_pins_its_tasks_to_its_nodes(mpirun):
    host = socket.gethostname().split(".")[0]
    run = mpirun(3, HELLO, "--num-ps", "1", timeout=30, env=slurm(host, "3", 3))
    assert run.returncode == 0, run.output
    got = re.findall(r"from /job:(\w+)/replica:0/task:(\d)/\S* on \S+ \(rank (\d)\)", run.stdout)
    assert got == [("ps", "0", "0"), ("worker", "0", "1"), ("worker", "1", "2")], run.output
    # a node list that names no node the ranks run on: the addresses came from Slurm
    run = mpirun(3, HELLO, "--num-ps", "1", timeout=15, env=slurm("elsewhere[1-3]", "1(x3)", 3))
    _refused_by_every_rank(run, "/job:ps/task:0 is pinned to host 'elsewhere1', but no MPI"
                                " rank runs there")

