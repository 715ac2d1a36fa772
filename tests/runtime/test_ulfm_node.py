"""Losing node2 of the cluster in a box under Open MPI's ULFM: what is survived and what not.

The job runs under ``mpitf run --hosts node1:2,node2:2`` on 4 ranks and 2 ps with
``--ps-replication-steps 1``: node1 holds ps task 0 (rank 0) and the chief, node2 ps task 1
and worker 1, each node with its own PRRTE daemon (``prted``).

- The ranks of node2 SIGKILLed at once (a ps and a worker, their daemon left alive): the
  job goes on, as the survival rules say (the buddy serves the lost shard, sync steps
  aggregate the survivor's gradient) and ends within 0.02 of an uninterrupted run. This is
  not a node loss: the node's daemon lives.
- The same with ``--heal``: both are replaced by processes spawned on node1, the buddy
  hands the shard back, and the job ends at full strength (2 ps, 2 workers), its
  checkpoints cut after the heal whole.
- Every process of node2 killed, its daemon with them (a node loss): Open MPI 5.0.11's
  launcher, PRRTE 3.0.14, ends the whole job whatever ``--with-ft ulfm`` says (its
  errmgr aborts on any lost daemon; docs/reliability.md), so the job ends as under MPICH:
  named, non-zero, its checkpoint whole. The day Open MPI ships a PRRTE that runs through a
  lost daemon, this test fails and the first one's assertions become its own.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from mpitf.testing import kill_group
from tests.support import (
    FINAL,
    JOB,
    OPENMPI_ENV,
    REPO,
    STEP,
    cli_verify,
    job_args,
    latest_step,
    openmpi_mpiexec,
)

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

STEPS, KILL_AT = 300, 150
HOSTS = "node1:2,node2:2"  # ranks 0-1 on node1, 2-3 on node2
ARGS = dict(steps=STEPS, num_ps=2, mode="sync", deterministic=False,
            extra=["--ps-replication-steps", "1", "--lr-decay", "0.5", "--lr-decay-steps", "75",
                   "--checkpoint-every", "50", "--log-device-placement"])
PLACED = re.compile(r"^\s+(\d)\s+/job:(\w+)/replica:0/task:(\d)\s+(node\d)$", re.MULTILINE)
WORKER = re.compile(r"\[rank 0\] WARNING lost rank 3 \(/job:worker/task:1 on node2\) at step "
                    r"(\d+): sync steps now aggregate 1 gradient \(replicas_to_aggregate was "
                    r"2\); 1 of 2 workers go on")
BUDDY = re.compile(r"\[rank 0\] WARNING lost ps rank 2 \(/job:ps/task:1 on node2\) at step "
                   r"(\d+): /job:ps/task:0 serves its shard from its copy of step (\d+); (\d+) "
                   r"of its steps lost \(a copy every 1 steps\)")
CHIEF = re.compile(r"ps task 1 \(rank 2\) was lost at step (\d+): its shard is served by "
                   r"/job:ps/task:0 from its copy")


class BoxJob:
    """``mpitf run`` of the slow job under Open MPI on the box's head, output to a file."""

    def __init__(self, box, tmp, heal=False):
        self.box, self.tmp, self.log = box, tmp, tmp / "log"
        tmp.mkdir()
        args = dict(ARGS, extra=ARGS["extra"] + ["--heal"]) if heal else ARGS
        argv = [sys.executable, "-m", "mpitf.cli.main", "run", "--mpiexec", openmpi_mpiexec(),
                "-n", "4", "--hosts", HOSTS, JOB,
                *job_args(tmp, ckpt=tmp / "ckpt", **args)]
        env = dict(os.environ, PYTHONUNBUFFERED="1", MPITF_TEST_STEP_SLEEP="0.005",
                   **OPENMPI_ENV, **box.env())
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(box.on_head(argv), stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, cwd=str(REPO),
                                         start_new_session=True)

    @property
    def output(self):
        return self.log.read_text()

    def ranks_on(self, node):
        """Return the pids (as the machine sees them) of this job's ranks on ``node``."""
        return self.box.pids(node, JOB, self.tmp)

    def wait_for_step(self, step, timeout=60):
        end = time.monotonic() + timeout
        while not any(int(s) >= step for s in STEP.findall(self.output)):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.kill()
                pytest.fail(f"no step {step}:\n{self.output}")
            time.sleep(0.01)

    def finish(self, timeout):
        """Return the exit code; past ``timeout`` the job is killed and the test fails."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"still running {timeout} s later; killed:\n{self.output}")

    def kill(self):
        kill_group(self.proc)
        for node in self.box.nodes:  # the ranks and daemons live in the nodes' sessions
            for pid in self.ranks_on(node):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(30)


def placement(out):
    return {(job, int(task)): host for _, job, task, host in PLACED.findall(out)}


def test_the_ranks_of_a_node_killed_at_once_are_survived_but_not_its_daemon(box, tmp_path):
    whole = BoxJob(box, tmp_path / "whole")
    assert whole.finish(120) == 0, whole.output
    assert placement(whole.output) == {("ps", 0): "node1", ("worker", 0): "node1",
                                       ("ps", 1): "node2", ("worker", 1): "node2"}, whole.output
    expected = json.loads(FINAL.findall(whole.output)[-1])["test_accuracy"]
    job = BoxJob(box, tmp_path / "killed")
    job.wait_for_step(KILL_AT)
    ranks = job.ranks_on("node2")
    assert len(ranks) == 2, ranks  # ps task 1 and worker 1; node2's prted is left alive
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)
    code = job.finish(120)
    out = job.output
    assert code == 0, out
    worker, buddy, chief = WORKER.search(out), BUDDY.search(out), CHIEF.search(out)
    assert worker and buddy and chief, out
    assert min(int(worker.group(1)), int(chief.group(1))) >= KILL_AT, out
    at, copy, lost = map(int, buddy.groups())
    assert at >= KILL_AT and lost == at - copy <= 1, out
    summary = json.loads(FINAL.findall(out)[-1])
    assert summary["step"] == STEPS, out
    assert abs(summary["test_accuracy"] - expected) <= 0.02, (summary, expected)
    assert latest_step(job.tmp / "ckpt") >= STEPS, out  # ps 0 writes both shards' pieces
    assert cli_verify(job.tmp / "ckpt").returncode == 0, out


REPLACED = re.compile(r"replaced rank (\d) \(/job:(\w+)/task:1\) by a spawned process on "
                      r"(\S+) at step (\d+)")


def test_with_heal_the_ranks_of_a_node_killed_at_once_are_replaced(box, tmp_path):
    whole = BoxJob(box, tmp_path / "whole", heal=True)
    assert whole.finish(120) == 0, whole.output
    expected = json.loads(FINAL.findall(whole.output)[-1])["test_accuracy"]
    job = BoxJob(box, tmp_path / "healed", heal=True)
    job.wait_for_step(KILL_AT)
    ranks = job.ranks_on("node2")
    assert len(ranks) == 2, ranks
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)
    code = job.finish(120)
    out = job.output
    assert code == 0, out
    replaced = {(int(rank), job_name): (host, int(at))
                for rank, job_name, host, at in REPLACED.findall(out)}
    assert set(replaced) == {(2, "ps"), (3, "worker")}, out
    # spawned on node1, the allocation's first node (PRRTE maps a spawn by slot from there;
    # node2's daemon lives, but nothing is placed on it again)
    assert all(host == "node1" and at >= KILL_AT for host, at in replaced.values()), out
    summary = json.loads(FINAL.findall(out)[-1])
    assert summary["step"] == STEPS, out
    assert summary["workers"] == 2 and summary["ps"] == 2, summary  # full strength at the end
    assert abs(summary["test_accuracy"] - expected) <= 0.02, (summary, expected)
    assert cli_verify(job.tmp / "ckpt").returncode == 0, out


def test_a_lost_node_ends_the_job_under_open_mpi_5_named_with_its_checkpoint_whole(box,
                                                                                  tmp_path):
    job = BoxJob(box, tmp_path / "lost")
    job.wait_for_step(KILL_AT)
    daemons = box.pids("node2", "prted")
    assert daemons and len(job.ranks_on("node2")) == 2, daemons
    box.kill_node("node2")  # its ranks, its prted, the shells that started them
    code = job.finish(10)  # the job ends within 10 s of the loss
    out = job.output
    # PRRTE's mpiexec ends with 137 when the node's agent reports first; when its lost
    # connection to the daemon does ("PRTE has lost communication with a remote daemon"),
    # with 0 (6 runs in 14 here), and mpitf run, told by the node's launcher, returns 1
    assert code in (137, 1), out
    # PRRTE's own line, then mpitf run's, from how the node's launcher ended
    assert re.search(r"Remote host:\s+node2|Remote daemon: \S+ on node node2", out), out
    assert ("mpitf: node node2 was lost: its MPI launcher proxy ended (killed by signal 9) "
            "while the job ran, so mpiexec ended every other rank; ranks 2, 3 ran there") in out
    assert FINAL.search(out) is None, out
    assert latest_step(job.tmp / "ckpt") >= 100, out
    assert cli_verify(job.tmp / "ckpt").returncode == 0, out
