"""Every example on the documentation's pages runs in a test or says why it cannot.

The shell blocks run as written, with ``python``, ``mpiexec`` and ``mpitf`` this checkout's
(the venv's bin first on PATH, this checkout first on PYTHONPATH), in a scratch directory
that links the checkout's ``jobs/`` and ``tests/`` so their relative paths hold.
"""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mpitf.testing import kill_group
from tests.docs.blocks import PAGES, RUN, block, examples
from tests.support import REPO

MARKERS = ("# needs ", "# excerpt")
PATH_IN_TEXT = re.compile(r"\b((?:jobs|tests|mpitf)/[\w/]+\.py)\b")


def test_every_example_runs_in_a_test_or_says_why_not():
    unlisted, marked = [], 0
    for page in PAGES:
        for code in examples(page):
            first = code.splitlines()[0]
            if first.startswith(MARKERS):
                marked += 1
                if first.startswith("# excerpt"):
                    named = PATH_IN_TEXT.findall(first)
                    assert named, f"{page}: an excerpt names the program it is from: {first}"
                    for path in named:
                        assert (REPO / path).is_file(), f"{page}: {path} does not exist"
            elif (page, first) not in RUN:
                unlisted.append((page, first))
    assert not unlisted, f"run these in a test (tests/docs/blocks.py RUN) or mark them " \
                         f"with a first line '# needs ...' or '# excerpt ...': {unlisted}"
    assert marked >= 30  # the cluster, Slurm, benchmark and excerpt blocks were found


def test_each_listed_block_exists_and_its_test_does():
    for (page, first), test in RUN.items():
        block(page, first)  # exactly one such block
        path, name = test.split("::")
        assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), test


def run_block(code, tmp_path, timeout):
    """Run a shell block with bash in a scratch directory; return its output."""
    for name in ("jobs", "tests"):
        (tmp_path / name).symlink_to(REPO / name)
    bin_dir = str(Path(sys.executable).parent)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                        os.environ.get("PYTHONPATH")])),
               MPITF_DATA_DIR=str(tmp_path / "data"))
    proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", code], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"still running after {timeout} s:\n{out}")
    assert proc.returncode == 0, out
    return out


def finals(out):
    """Return the ``final: {...}`` summaries a run printed, in order."""
    return [json.loads(m) for m in re.findall(r"^final: (\{.*\})$", out, re.M)]


@pytest.mark.slow
@pytest.mark.mpi
def test_quickstart_mpiexec_and_mpitf_run(tmp_path):
    code = block("docs/quickstart.md", RUN_FIRST["quickstart"])
    out = run_block(code, tmp_path, timeout=240)
    runs = finals(out)
    assert len(runs) == 2, out
    for final in runs:
        assert final["step"] == 300 and final["mode"] == "sync", final
        assert final["test_accuracy"] > 0.9, final  # digits: about 0.97 after 300 steps


@pytest.mark.slow
@pytest.mark.mpi
def test_tensorflow_cluster_flags(tmp_path):
    out = run_block(block("docs/tensorflow.md", RUN_FIRST["tensorflow"]), tmp_path, timeout=240)
    (final,) = finals(out)
    assert final["step"] == 100, final
    for task in ("/job:ps/replica:0/task:0", "/job:ps/replica:0/task:1",
                 "/job:worker/replica:0/task:2"):
        assert task in out, out  # hello: every task of the flag's cluster greets
    # mpitf cluster: the 2 ps one per node (ranks 0 and 4), 3 workers on each of n1 and n2
    rows = re.findall(r"^\s*(\d+)\s+(/job:\w+/replica:0/task:\d+)\s+(n[12])$", out, re.M)
    assert ("0", "/job:ps/replica:0/task:0", "n1") in rows, out
    assert ("4", "/job:ps/replica:0/task:1", "n2") in rows, out
    assert sorted(host for _, task, host in rows if "worker" in task) == ["n1"] * 3 + ["n2"] * 3


@pytest.mark.slow
@pytest.mark.mpi
def test_tensorflow_tutorial_started_as_tensorflow_starts_it(tmp_path):
    out = run_block(block("docs/tensorflow.md", RUN_FIRST["tutorial"]), tmp_path, timeout=300)
    assert re.search(r"Training elapsed time", out), out


@pytest.mark.slow
@pytest.mark.mpi
def test_checkpoint_commands(tmp_path):
    out = run_block(block("docs/checkpoints.md", RUN_FIRST["checkpoints"]), tmp_path,
                    timeout=300)
    (final,) = finals(out)
    assert final["step"] == 1000, final
    assert "ckpt-00001000" in out, out  # ls and show name the last checkpoint
    import numpy as np

    with np.load(tmp_path / "params.npz") as params:
        assert len(params.files) >= 4, params.files  # the MLP's weights and biases


RUN_FIRST = {
    "quickstart": "mpiexec -n 3 python jobs/mnist_mlp.py --num-ps 1 --steps 300 --mode sync",
    "tensorflow": "mpiexec -n 3 python jobs/mnist_mlp.py --ps_hosts=localhost:2222 \\",
    "tutorial": "python tests/tutorials/mnist_replica.py --download_only   "
                "# the data, once, before the tasks",
    "checkpoints": "mpiexec -n 3 python jobs/mnist_mlp.py --checkpoint-dir ckpt "
                   "--checkpoint-every 100 --steps 1000",
}
