"""jobs/hello.py under a real mpiexec: greetings at several rank counts, and every bad input
ends every rank quickly with one message."""

import re

import pytest

from tests.support import openmpi_mpiexec

pytestmark = pytest.mark.mpi

HELLO = "jobs/hello.py"
SPEC5 = "ps|localhost:2222;localhost:2223,worker|localhost:2224;localhost:2225;localhost:2226"
GREETING = re.compile(r"^Hello, distributed TensorFlow! from (\S+) on (\S+) \(rank (\d+)\)$",
                      re.MULTILINE)


def greetings(run):
    assert run.returncode == 0 and not run.timed_out, run.output
    return [(device, int(rank)) for device, _host, rank in GREETING.findall(run.stdout)]


def test_one_rank_is_a_single_worker(mpirun):
    run = mpirun(1, HELLO, "--job_name=worker", "--task_index=0", timeout=30)
    assert greetings(run) == [("/job:worker/replica:0/task:0/device:CPU:0", 0)]
    assert "/job:ps" not in run.stdout


def test_two_ranks_default_to_one_ps(mpirun):
    run = mpirun(2, HELLO, timeout=30)
    assert greetings(run) == [("/job:ps/replica:0/task:0/device:CPU:0", 0),
                              ("/job:worker/replica:0/task:0/device:CPU:0", 1)]


def test_five_ranks_greet_in_task_order(mpirun):
    run = mpirun(5, HELLO, f"--cluster_spec={SPEC5}", timeout=30)
    got = greetings(run)
    assert [d for d, _ in got] == [f"/job:{job}/replica:0/task:{i}/device:CPU:0"
                                   for job, n in (("ps", 2), ("worker", 3)) for i in range(n)]
    assert ("/job:ps/replica:0/task:1/device:CPU:0", 1) in got
    assert ("/job:worker/replica:0/task:2/device:CPU:0", 4) in got
    # the placement table comes first, printed once
    assert run.stdout.count("/job:worker/replica:0/task:2  ") == 1
    assert run.stdout.index("rank  task") < run.stdout.index("Hello")


def test_roles_under_open_mpi(mpirun):
    run = mpirun(5, HELLO, f"--cluster_spec={SPEC5}", timeout=30, mpiexec=openmpi_mpiexec())
    assert [d for d, _ in greetings(run)] == [
        f"/job:{job}/replica:0/task:{i}/device:CPU:0" for job, n in (("ps", 2), ("worker", 3))
        for i in range(n)]


@pytest.mark.parametrize("n, args, want", [
    (3, ["--ps_hosts=localhost:2222", "--worker_hosts=localhost:2223,localhost:2224"],
     ["ps:0", "worker:0", "worker:1"]),
    (4, ["--num-ps", "2"], ["ps:0", "ps:1", "worker:0", "worker:1"]),
    # issue 14: the same address on two tasks is accepted, as TensorFlow does
    (2, ["--cluster_spec=ps|localhost:7,worker|localhost:7"], ["ps:0", "worker:0"]),
])
def test_host_flags_and_num_ps(mpirun, n, args, want):
    got = greetings(mpirun(n, HELLO, *args, timeout=30))
    assert [re.sub(r"/job:(\w+)/replica:0/task:(\d+)/.*", r"\1:\2", d) for d, _ in got] == want


@pytest.mark.parametrize("n, args, words", [
    (4, [f"--cluster_spec={SPEC5}"], ["5 tasks", "4 ranks", "mpiexec -n 5"]),
    # issue 14: any job name runs (this case expected "unknown job name 'chief'" before);
    # TensorFlow's rule of at most one chief task holds
    (3, ["--cluster_spec=ps|localhost:1,chief|localhost:2;localhost:3"],
     ["2 'chief' tasks", "at most one chief task"]),
    (1, ["--cluster_spec=worker|nosuchhost:1"], ["'nosuchhost'", "no MPI rank runs there"]),
    (2, ["--cluster_spec=ps;localhost:1"], ["missing '|'", "'ps;localhost:1'"]),
    (3, ["--job_name=ps", "--task_index=0"], ["--job_name=ps", "/job:worker/task:0"]),
    (1, ["--num-ps", "1"], ["--num-ps=1", "mpiexec -n 2"]),
], ids=["size", "two-chiefs", "missing-host", "malformed",
        "claimed-role", "num-ps"])
def test_bad_input_ends_every_rank_with_one_message(mpirun, n, args, words):
    run = mpirun(n, HELLO, *args, timeout=15)
    assert not run.timed_out and run.returncode != 0, run.output
    assert run.output.count("mpitf: error") == 1, run.output
    for word in words:
        assert word in run.output, run.output
    assert "Hello" not in run.stdout


def test_the_tutorials_local_cluster_greets_from_both_tasks(mpirun):
    """issue 14: the "Hello, distributed TensorFlow" tutorial's {"local": [a, b]} cluster."""
    run = mpirun(2, HELLO, "--cluster_spec=local|localhost:2222;localhost:2223", timeout=30)
    assert greetings(run) == [("/job:local/replica:0/task:0/device:CPU:0", 0),
                              ("/job:local/replica:0/task:1/device:CPU:0", 1)]


def test_ps_chief_worker_evaluator_greet_in_spec_order(mpirun):
    """Greetings follow the spec's job order; ranks follow mpitf.cluster.roles' placement order."""
    spec = ("evaluator|localhost:1,worker|localhost:2;localhost:3,chief|localhost:4,"
            "ps|localhost:5")
    got = greetings(mpirun(5, HELLO, f"--cluster_spec={spec}", timeout=30))
    assert [(re.sub(r"/job:(\w+)/replica:0/task:(\d+)/.*", r"\1:\2", d), r) for d, r in got] \
        == [("evaluator:0", 4), ("worker:0", 2), ("worker:1", 3), ("chief:0", 1), ("ps:0", 0)]


def test_bad_flag_is_a_usage_error_printed_once(mpirun):
    run = mpirun(3, HELLO, "--deadline=soon", timeout=30)
    assert not run.timed_out and run.returncode == 2, run.output
    assert run.stderr.count("invalid float value: 'soon'") == 1


def test_missing_greeting_fails_at_the_deadline(mpirun):
    run = mpirun(3, HELLO, "--deadline=1", "--drop-greeting=2", timeout=15)
    assert not run.timed_out and run.returncode != 0, run.output
    assert "no answer within 1 s" in run.stderr
    assert "rank 2, /job:worker/task:1" in run.stderr
