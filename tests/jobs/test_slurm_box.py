"""Slurm across the three nodes of a cluster in a box: slurm/train.sbatch on `sbatch -N 3`.

The module's fixture makes its own box (mpitf.testing.netcluster) and starts Slurm on it
with tests/slurm/start-slurm-box.sh: slurmctld in the box's head namespace, one slurmd per
node in the node's namespace with the node's host name, so srun's tasks run on three hosts
joined by TCP. Clients run in the head namespace. Everything (jobs, daemons, munged, the
box, the files under a temporary directory) is removed afterwards, also after a failure.
Where this machine cannot run Slurm or make a box, the tests skip; with MPITF_TEST_SLURM=1
they fail instead. About 15 s, most of it Slurm's delay before a requeued job starts again.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from mpitf.testing import run_mpi
from tests.jobs.test_slurm import (
    JOB_SCRIPT,
    REPO,
    SBATCH_SCRIPT,
    TF_TASKS,
    _read,
    _steps,
    _unavailable,
    _wait_for,
    _wait_terminal,
    usr1_after_step,
)

pytestmark = [pytest.mark.slurm, pytest.mark.mpi, pytest.mark.slow]

START = REPO / "tests" / "slurm" / "start-slurm-box.sh"
STOP = REPO / "tests" / "slurm" / "stop-slurm.sh"
EXIT_CANNOT = 3  # start-slurm.sh: this machine cannot run Slurm
NODES = ["node1", "node2", "node3"]
# The real job, deterministic sync so that the resumed run can be compared bit for bit with
# an uninterrupted one. Its steps take about a millisecond across the box: the USR1 sent
# after step 100 lands while its tasks are stopped (usr1_after_step).
STEPS = 1000
JOB_ARGS = ["--num-ps", "1", "--mode", "sync", "--deterministic", "--seed", "5",
            "--steps", str(STEPS), "--log-every", "100", "--log-device-placement"]
PLACEMENT = re.compile(r"^\s*(\d+)\s+/job:(\w+)/replica:0/task:(\d+)\s+(\S+)$", re.MULTILINE)


class SlurmBox:
    """A box with Slurm on it: ``env`` for the clients, ``client`` the prefix they run under."""

    def __init__(self, box, env):
        self.box, self.env = box, env
        self.client = ["ip", "netns", "exec", box.head]

    def run(self, argv, timeout=30, **kw):
        return subprocess.run([*self.client, *map(str, argv)], env=kw.pop("env", self.env),
                              capture_output=True, text=True, timeout=timeout, **kw)


def _sweep():
    """Stop and remove the Slurm of a killed test session (its owner pid is dead).

    Its box is swept by Box.up; what lives outside the box (munged, the files) is swept here.
    """
    for root in Path(tempfile.gettempdir()).glob("mpitf-slurmbox-*"):
        try:
            os.kill(int((root / "owner").read_text()), 0)
            continue  # a live session's
        except ProcessLookupError:
            pass  # its owner is dead
        except (OSError, ValueError):
            continue  # no owner yet: being made right now
        subprocess.run(["bash", str(STOP)], env=dict(os.environ, SLURM_TEST_ROOT=str(root)),
                       capture_output=True, timeout=120)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def slurm_box():
    """Make a 3-node box, start Slurm on it; stop exactly that and remove the box after."""
    if sys.platform != "linux" or os.geteuid() != 0:
        _unavailable("needs root on Linux")
    if shutil.which("apt-get") is None and shutil.which("slurmctld") is None:
        _unavailable("no apt-get to install Slurm and no Slurm installed")
    from mpitf.testing import netcluster

    why = netcluster.unavailable()
    if why:
        _unavailable(f"cannot make a cluster in a box: {why}")
    _sweep()
    root = Path(tempfile.mkdtemp(prefix="mpitf-slurmbox-"))
    (root / "owner").write_text(str(os.getpid()))
    env = dict(os.environ, SLURM_TEST_ROOT=str(root))
    box = netcluster.Box(3, name=f"s{os.getpid() % 10_000_000}")
    try:
        box.up()
        try:
            res = subprocess.run(["bash", str(START), box.name], env=env, capture_output=True,
                                 text=True, timeout=300)
        except subprocess.TimeoutExpired:
            pytest.fail("start-slurm-box.sh did not finish in 300 s")
        if res.returncode == EXIT_CANNOT:
            _unavailable(res.stderr.strip())
        assert res.returncode == 0, f"start-slurm-box.sh failed:\n{res.stdout}\n{res.stderr}"
        yield SlurmBox(box, dict(env, SLURM_CONF=str(root / "etc" / "slurm.conf")))
    finally:
        # Jobs, slurmd x3, slurmctld, their slurmstepds and munged, by their pid files; then
        # whatever still runs in the box's namespaces, the namespaces, and the files.
        subprocess.run(["bash", str(STOP)], env=env, capture_output=True, timeout=120)
        box.down()
        shutil.rmtree(root, ignore_errors=True)


def test_srun_places_tensorflows_tasks_on_the_three_nodes(slurm_box, tmp_path):
    # One task per node: TensorFlow's SlurmClusterResolver gives Slurm task r the address
    # node(r+1):8888, and mpitf's roles put MPI rank r (= SLURM_PROCID r) there.
    res = slurm_box.run(["srun", "-N", "3", "-n", "3", "--mpi=pmi2", "--time=2",
                         sys.executable, TF_TASKS, "--num-ps", "1"],
                        env=dict(slurm_box.env, PYTHONPATH=str(REPO)), cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = sorted((json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")),
                  key=lambda row: row["rank"])
    assert [r["rank"] for r in rows] == [r["procid"] for r in rows] == [0, 1, 2], res.stdout
    assert [r["host"] for r in rows] == NODES, res.stdout
    assert [r["role"] for r in rows] == [r["tf"] for r in rows] == [
        ["ps", 0], ["worker", 0], ["worker", 1]], res.stdout
    assert [r["address"] for r in rows] == [f"{n}:8888" for n in NODES], res.stdout


def _placement(run):
    """Return {rank: (job, task, host)} from a run's --log-device-placement table."""
    return {int(r): (job, int(task), host) for r, job, task, host in PLACEMENT.findall(run)}


def test_sbatch_on_three_nodes_requeues_on_usr1_and_resumes_to_the_same_bits(
        slurm_box, digits_file, tmp_path):
    args = [JOB_SCRIPT, "--data", digits_file, *JOB_ARGS]
    env = dict(slurm_box.env, MPITF_PYTHON=sys.executable, MPITF_CKPT_ROOT=str(tmp_path / "ckpt"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    # --time=10 keeps train.sbatch's own USR1 (120 s before the limit) out of the test.
    res = slurm_box.run(["sbatch", "--parsable", "-N", "3", "-n", "3", "--time=10",
                         f"--chdir={tmp_path}", SBATCH_SCRIPT, *args,
                         "--export", tmp_path / "slurm.npz", "--run-dir", tmp_path / "run-slurm"],
                        env=env)
    assert res.returncode == 0, f"sbatch failed: {res.stderr}"
    jobid = res.stdout.strip().split(";")[0]
    out = tmp_path / f"mpitf-{jobid}.out"
    try:
        # What --signal=B:USR1@120 does before the time limit, now: USR1 to the batch shell.
        usr1_after_step(slurm_box.run, jobid, 3, 100, out)
        _wait_for("the requeue", lambda: "requeueing job" in _read(out), 60, out)
        # The uninterrupted reference, on one node under mpiexec, while Slurm waits to restart
        # the job (deterministic sync across nodes has the bits of one node: test_multinode).
        ref = run_mpi(3, [*map(str, args), "--export", str(tmp_path / "ref.npz"),
                          "--run-dir", str(tmp_path / "run-ref")], timeout=120, cwd=str(REPO))
        assert ref.returncode == 0 and not ref.timed_out, ref.output
        info = _wait_terminal(env, jobid, 150, out, slurm_box.client)
    finally:
        slurm_box.run(["scancel", jobid])
    log = _read(out)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, log)
    assert info["Restarts"] == "1", log
    assert re.search(r"srun exited with 75 after SIGUSR1: .*requeueing job", log), log

    runs = re.split(r"^.*\] start: job \d+ ", log, flags=re.M)[1:]
    assert len(runs) == 2, log
    assert runs[0].startswith("SLURM_RESTART_COUNT=unset on 3 node(s) (node[1-3]), 3 tasks"), log
    assert runs[1].startswith("SLURM_RESTART_COUNT=1 on 3 node(s) (node[1-3]), 3 tasks"), log
    # srun placed one task on each node, both times: SlurmClusterResolver's ps on node1.
    for run in runs:
        assert _placement(run) == {0: ("ps", 0, "node1"), 1: ("worker", 0, "node2"),
                                   2: ("worker", 1, "node3")}, log
    saved = re.findall(r"^checkpoint (\S+) at step (\d+)$", runs[0], re.M)
    restored = re.findall(r"^restored (\S+) at step (\d+)$", runs[1], re.M)
    assert len(saved) == 1 and restored == saved, log
    step = int(saved[0][1])
    first, second = _steps(runs[0]), _steps(runs[1])
    assert 100 <= max(first) <= step < STEPS and second[0] > step, log
    final = json.loads(re.search(r"^final: (.*)$", runs[1], re.M).group(1))
    assert final["step"] == STEPS, log
    assert "srun exited with 0: training finished" in log, log

    with np.load(tmp_path / "slurm.npz") as got, np.load(tmp_path / "ref.npz") as want:
        assert sorted(got.files) == sorted(want.files) and got.files
        for name in got.files:
            assert got[name].tobytes() == want[name].tobytes(), f"{name} differs in its bits"
