"""mpitf run's launcher over hosts: which real launcher it wraps, and the line a lost node gets.

The box's tests (tests/jobs/test_multinode.py, tests/runtime/test_ulfm_node.py) kill a
node under ``mpitf run --hosts`` and read the line this launcher's log gives; here the
launcher script itself runs real processes that end as a node's proxy would.
"""

import os
import subprocess

import pytest

from mpitf.runtime.launch import find_mpiexec
from mpitf.runtime.proxies import ProxyWatch, real_launcher
from tests.support import openmpi_mpiexec

# A launcher of the user's own: "HOST COMMAND" run here, as ssh runs it there.
LOCAL_SHELL = """#!/bin/sh
while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
shift
exec sh -c "$*"
"""


@pytest.mark.parametrize("environ,launcher,expected", [
    ({}, None, ["ssh"]),
    ({}, "rsh -l me", ["rsh", "-l", "me"]),
    ({"HYDRA_LAUNCHER": "rsh"}, None, ["rsh"]),
    ({"HYDRA_LAUNCHER": "slurm"}, None, None),
    ({"SLURM_JOB_ID": "7"}, None, None),
    ({"SLURM_JOB_ID": "7"}, "ssh", ["ssh"]),
    ({"HYDRA_LAUNCHER": "ssh", "HYDRA_LAUNCHER_EXEC": "/opt/box/launch -q"}, None,
     ["/opt/box/launch", "-q"]),
])
def test_hydra_s_launcher_is_the_one_its_variables_name(environ, launcher, expected):
    assert real_launcher(find_mpiexec(), launcher, environ) == expected


@pytest.mark.parametrize("environ,expected", [
    ({}, ["ssh"]),
    ({"PRTE_MCA_plm_ssh_agent": "ssh : rsh"}, ["ssh"]),
    ({"PRTE_MCA_plm_ssh_agent": "/opt/box/launch"}, ["/opt/box/launch"]),
])
def test_open_mpi_s_launcher_is_its_ssh_agent(environ, expected):
    assert real_launcher(openmpi_mpiexec(), None, environ) == expected


def _start(watch, host, command):
    """Start ``command`` on ``host`` through the watch's launcher, as mpiexec calls it."""
    script = watch.env.get("HYDRA_LAUNCHER_EXEC") or watch.env["PRTE_MCA_plm_ssh_agent"]
    return subprocess.run([script, "-x", host, command], timeout=30,
                          env=dict(os.environ, **watch.env)).returncode


@pytest.mark.parametrize("openmpi", [False, True])
def test_the_node_whose_proxy_was_killed_is_named_with_its_ranks(tmp_path, openmpi):
    shell = tmp_path / "local-shell"
    shell.write_text(LOCAL_SHELL)
    shell.chmod(0o755)
    mpiexec = openmpi_mpiexec() if openmpi else find_mpiexec()
    watch = ProxyWatch(str(tmp_path), mpiexec, ["n1:2", "n2:2"], 4, launcher=str(shell))
    assert _start(watch, "n1", "exit 0") == 0
    assert _start(watch, "n2", "kill -9 $$") == 137
    assert _start(watch, "n1", "exit 3") == 3  # an abort: a proxy that ended on its own
    assert watch.lost_node(1) == (
        "node n2 was lost: its MPI launcher proxy ended (killed by signal 9) while the job "
        "ran, so mpiexec ended every other rank; ranks 2, 3 ran there")


def test_proxies_that_end_on_their_own_name_no_node(tmp_path):
    shell = tmp_path / "local-shell"
    shell.write_text(LOCAL_SHELL)
    shell.chmod(0o755)
    watch = ProxyWatch(str(tmp_path), find_mpiexec(), ["n1", "n2"], 2, launcher=str(shell))
    assert [_start(watch, h, "exit 1") for h in ("n1", "n2")] == [1, 1]
    assert watch.lost_node(1) is None
    with open(watch.log) as f:
        assert f.read().split("\n") == ["n1 1", "n2 1", ""]


def test_under_a_batch_system_s_launcher_nothing_is_wrapped(tmp_path):
    watch = ProxyWatch(str(tmp_path), find_mpiexec(), ["n1"], 1,
                       environ={"HYDRA_LAUNCHER": "slurm"})
    assert watch.env == {"MPITF_LAUNCH_LOG": watch.log}
    assert os.listdir(tmp_path) == []
