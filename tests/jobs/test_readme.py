"""The quick start's training script (the README's one example) runs as written, on three ranks."""

import os
import re
import subprocess
import sys

import pytest

from mpitf.testing import run_mpi
from tests.docs.blocks import block


def readme_script():
    script = block("docs/quickstart.md", "import sys")
    assert block("README.md", "import sys") == script  # the README shows the same script
    return script


@pytest.mark.slow
@pytest.mark.mpi
def test_readme_training_script_runs_as_written(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(readme_script())
    env = dict(os.environ, MPITF_DATA_DIR=str(tmp_path / "data"))
    subprocess.run([sys.executable, "-m", "mpitf.cli.main", "data", "digits"], check=True,
                   env=env, cwd=tmp_path, timeout=120, capture_output=True)
    run = run_mpi(3, [str(script)], timeout=180, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.output
    m = re.search(r"^step (\d+): loss ([0-9.]+)$", run.stdout, re.M)
    assert m, run.output
    assert int(m[1]) == 200
    assert float(m[2]) < 0.5  # the MLP learns the digits: the first losses are near 2.3
    assert (tmp_path / "ckpt" / "ckpt-00000200" / "manifest.json").is_file()
    assert (tmp_path / "ckpt" / "ckpt-00000100" / "manifest.json").is_file()
    # Run again: it resumes from the checkpoint at step 200 and stops at once.
    again = run_mpi(3, [str(script)], timeout=180, env=env, cwd=tmp_path)
    assert again.returncode == 0, again.output
    assert "restored ckpt/ckpt-00000200 at step 200" in again.stdout, again.output
    assert "step 200: loss None" in again.stdout, again.output
