"""Scaling over links (mpitf/bench/boxscaling.py, linkstep.py): the grid, bad input, the box.

The box cases need root (network namespaces); each leaves nothing behind.
"""

import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from mpitf.bench import boxscaling as bs
from mpitf.bench import costmodel as cm
from mpitf.bench import linkfigures as lf
from mpitf.errors import ConfigurationError
from mpitf.worker.buckets import push_window
from tests.support import REPO

MPITF = [sys.executable, "-m", "mpitf.cli.main", "bench", "--suite", "scaling"]


def namespaces(prefix):
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [ns for ns in out.split() if ns.startswith(prefix)]


def test_the_grid_keeps_what_the_nodes_hold_and_names_what_a_point_needs():
    points = bs.grid(16, [1, 2, 4, 8], [1, 2, 4, 8])
    assert (8, 8, "own") in points and (8, 8, "beside") in points
    assert len([p for p in points if p[2] == "own"]) == 16  # W + P <= 16 everywhere
    assert len([p for p in points if p[2] == "beside"]) == 10  # P <= W
    assert (4, 8, "own") in bs.grid(12, [4], [8])
    assert bs.grid(5, [4], [1, 2]) == [(4, 1, "own"), (4, 1, "beside"), (4, 2, "beside")]
    with pytest.raises(ConfigurationError, match="8 workers and 8 ps on nodes of their own "
                                                 "need 16 nodes; 10 given"):
        bs.grid(10, [8], [8], explicit=True)
    assert bs.hosts_for([f"n{k}" for k in range(1, 9)], 2, 3, "own") == ["n1", "n2", "n3",
                                                                          "n4", "n5"]
    assert bs.hosts_for([f"n{k}" for k in range(1, 9)], 4, 2, "beside") == ["n1", "n2", "n3",
                                                                             "n4"]


def test_the_links_limit_is_half_of_allreduce_with_a_ps_node_per_worker():
    row = dict(workers=4, num_ps=4, bytes=1 << 20, placement="own")
    assert lf.limit_ratio(row) == pytest.approx(4 / 6)  # N / (2 (N - 1))
    assert lf.limit_ratio(dict(row, workers=8, num_ps=8)) == pytest.approx(8 / 14)
    # beside the workers each node carries (P - 1) + (N - 1) shares each way: about equal
    assert lf.limit_ratio(dict(row, placement="beside")) == pytest.approx(1.0)


def test_the_cost_model_projects_allreduce_and_ps_beside_the_workers():
    fabric = cm.Fabric(0.0, 25e6)
    work = cm.Workload(25e6, 1e-9)
    # the ring: 2 B (N - 1) / N each way through every link
    assert cm.allreduce_step(fabric, work, 4) == pytest.approx(1.5, rel=1e-6)
    assert cm.allreduce_step(fabric, work, 1) == pytest.approx(0.0, abs=1e-6)
    own = cm.project(fabric, work, cm.PsNode(apply_rate=1e15), cm.Layout(4, 1, 4))
    beside = cm.project(fabric, work, cm.PsNode(apply_rate=1e15), cm.Layout(4, 1, 4,
                                                                          beside=True))
    assert own.terms["ps_link"] == pytest.approx(1.0)  # 4 pushes of a quarter
    assert beside.terms["ps_link"] == pytest.approx(1.5)  # 3 quarters out, 3 in, each way


def test_a_worker_limits_its_unanswered_buckets_only_across_nodes():
    def link(hosts, chunked=False):
        return SimpleNamespace(chunked=chunked, ranks=list(range(1, len(hosts))),
                               host_of=hosts.__getitem__,
                               comm=SimpleNamespace(Get_rank=lambda: 0))

    assert push_window(link(["a", "a", "a"]), environ={}) == 0
    assert push_window(link(["a", "b"]), environ={}) == 2  # one ps: two in flight
    assert push_window(link(["a", "b", "a"]), environ={}) == 1  # two ps: one each
    assert push_window(link(["a"] + ["b"] * 8), environ={}) == 1
    assert push_window(link(["a", "b", "a"], chunked=True), environ={}) == 0
    assert push_window(link(["a", "a", "a"]), environ={"MPITF_PUSH_WINDOW": "3"}) == 3


@pytest.mark.parametrize("args, message", [
    (["--link-scaling", "--hosts", "nosuchhost.invalid"],
     "--hosts: host 'nosuchhost.invalid' does not exist"),
    (["--box", "4", "--workers", "4", "--ps", "4"],
     "4 workers and 4 ps on nodes of their own need 8 nodes; 4 given"),
    (["--link-scaling", "--hosts", "localhost", "--workers", "2", "--ps", "1"],
     "2 workers and 1 ps on nodes of their own need 3 nodes; 1 given"),
])
def test_bad_input_is_one_message_and_exit_2(args, message, tmp_path):
    proc = subprocess.run([*MPITF, *args, "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=60, cwd=str(REPO))
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def _root():
    from mpitf.testing import netcluster

    why = netcluster.unavailable()
    if why:
        pytest.skip(why)


def test_a_box_that_cannot_be_made_is_one_message_naming_why(tmp_path):
    _root()
    proc = subprocess.run([*MPITF, "--box", "17", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, cwd=str(REPO))
    assert proc.returncode == 2, proc.stderr
    assert "--box 17: cannot make the box: --nodes 17: a box has 1 to 16 nodes" in \
        proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.slow
@pytest.mark.mpi
def test_sixteen_nodes_run_both_systems_and_come_down(tmp_path):
    """8 ps on nodes of their own and 8 workers, 1 MiB at 200 Mbit/s, one short round."""
    _root()
    from mpitf.testing import netcluster

    box = netcluster.Box(16, "200mbit", name=f"s{os.getpid() % 10_000_000}")
    box.up()
    try:
        out = tmp_path / "point.json"
        argv = box.mpiexec(16, bs.linkstep_argv(8, [1 << 20], ["0"], [128 << 10], 25e6, 1,
                                                2, str(out)))
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                              cwd=str(REPO))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        rows = json.loads(out.read_text())["results"]
    finally:
        box.down()
    assert not namespaces(f"{box.name}-")
    assert {(r["system"], r["workers"], r["num_ps"]) for r in rows} == {
        ("mpitf", 8, 8), ("allreduce", 8, 8)}
    # 1 MiB over a 25 MB/s link takes 42 ms each way: no step of either is shorter
    assert all(r["step_s"] > 0.04 for r in rows), rows


@pytest.mark.slow
@pytest.mark.mpi
def test_a_run_ended_by_sigterm_takes_its_box_down(tmp_path):
    _root()
    from mpitf.testing.netcluster import STATE_ROOT

    proc = subprocess.Popen([*MPITF, "--box", "2", "--workers", "1", "--ps", "1",
                             "--sizes", "1048576", "--quick", "--out", str(tmp_path)],
                            cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    name = f"sc{proc.pid % 1000000}"
    deadline = time.monotonic() + 60
    while not (tmp_path / "fabric.json").exists() and time.monotonic() < deadline:
        time.sleep(0.2)  # polls for the run's first file; no figure depends on it
    assert namespaces(f"{name}-"), "the box was never made"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert not namespaces(f"{name}-"), err
    assert not (STATE_ROOT / name).exists()
    assert not [p for p in os.listdir("/etc/netns") if p.startswith(f"{name}-")]
