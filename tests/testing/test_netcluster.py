"""The cluster in a box itself (mpitf.testing.netcluster): bad input, leftovers, a second box.

Each case gives one message and leaves nothing behind: no namespace, no /etc/netns entry, no
state directory.
"""

import subprocess
import sys

import pytest

from mpitf.testing import netcluster
from mpitf.testing.netcluster import STATE_ROOT, Box, BoxError

CLI = [sys.executable, "-m", "mpitf.testing.netcluster"]


def namespaces(name):
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [ns for ns in out.split() if ns.startswith(f"{name}-")]


@pytest.fixture(scope="module", autouse=True)
def root_only():
    why = netcluster.unavailable()
    if why:
        pytest.skip(why)


@pytest.mark.parametrize("args, message", [
    (["up", "--rate", "fast"], "--rate 'fast': give a rate as tc writes it, e.g. 1gbit"),
    (["up", "--nodes", "0"], "--nodes 0: a box has 1 to 16 nodes"),
    (["up", "--nodes", "2", "--rate", "node3=1gbit"], "box mtfbox has no node 'node3'"),
    (["up", "--name", "Bad-Name"], "box name 'Bad-Name': lower-case letters and digits"),
    (["run", "-n", "1", "--name", "nosuchbx", "--", "true"], "no box nosuchbx is up"),
])
def test_bad_input_is_one_message_and_exit_2(args, message):
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("netcluster: ") and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.mpi
def test_a_node_the_box_does_not_have_is_named():
    with Box(2, name="tbadnode") as box:
        with pytest.raises(BoxError, match=r"box tbadnode has no node 'node7' \(it has: "
                                           r"node1, node2\)"):
            box.mpiexec(2, ["true"], hosts=["node1", "node7"])
        # the same through Hydra: its launcher says so, and the job fails
        cmd = box.mpiexec(1, ["true"], hosts=["node1"])
        cmd[cmd.index("-hosts") + 1] = "node9"
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0
        assert "netcluster: box tbadnode has no node 'node9' (it has: node1 node2)" in \
            proc.stderr + proc.stdout
    assert namespaces("tbadnode") == []


def test_a_second_box_of_the_same_name_is_refused_and_the_first_stays():
    with Box(1, name="tsecond") as first:
        with pytest.raises(BoxError, match="box tsecond is already up"):
            Box(2, name="tsecond").up()
        assert sorted(namespaces("tsecond")) == ["tsecond-head", "tsecond-node1"]
        assert first.pids("node1") == []
    assert namespaces("tsecond") == [] and not (STATE_ROOT / "tsecond").exists()


def test_a_box_left_by_a_killed_run_is_swept_by_the_next_one():
    dead = subprocess.Popen(["true"])
    dead.wait()
    Box(2, name="tleft").up(owner=dead.pid)  # as if its test run had been SIGKILLed
    assert len(namespaces("tleft")) == 3
    with Box(1, name="tnext"):
        assert namespaces("tleft") == []
        assert not (STATE_ROOT / "tleft").exists()
    assert namespaces("tnext") == []


@pytest.mark.slow
@pytest.mark.mpi
def test_cli_up_status_run_down(tmp_path):
    up = subprocess.run([*CLI, "up", "--nodes", "2", "--rate", "node1=1gbit", "--name", "tcli"],
                        capture_output=True, text=True, timeout=60)
    try:
        assert up.returncode == 0, up.stderr
        assert "box tcli up: node1, node2 (node1=1gbit links)" in up.stdout
        status = subprocess.run([*CLI, "status"], capture_output=True, text=True, timeout=60)
        assert "tcli: node1 node2" in status.stdout
        qdisc = subprocess.run(["ip", "netns", "exec", "tcli-node1", "tc", "qdisc", "show",
                                "dev", "eth0"], capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "rate 1Gbit" in qdisc, qdisc
        other = subprocess.run(["ip", "netns", "exec", "tcli-node2", "tc", "qdisc", "show",
                                "dev", "eth0"], capture_output=True, text=True).stdout
        assert "tbf" not in other, other  # node2's link is unshaped
        run = subprocess.run([*CLI, "run", "-n", "2", "--name", "tcli", "--", "hostname"],
                             capture_output=True, text=True, timeout=60)
        assert sorted(run.stdout.split()) == ["node1", "node2"], run.stderr
    finally:
        down = subprocess.run([*CLI, "down", "--name", "tcli"], capture_output=True,
                              text=True, timeout=60)
    assert down.returncode == 0
    assert namespaces("tcli") == [] and not (STATE_ROOT / "tcli").exists()
