"""The documentation site builds strictly, and a broken link or reference fails the build.

Built as ``bash run.sh docs`` builds it (sphinx -W --keep-going -n): a warning of any kind,
a link to a page that does not exist, a reference to a name the code does not have, is an
error.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.support import REPO

STRICT = ["-b", "html", "-W", "--keep-going", "-n", "-q"]


def build(source, out, timeout=300):
    """Run sphinx on ``source`` into ``out`` with this checkout's mpitf; return the run."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "sphinx", *STRICT, str(source), str(out)],
                          capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.slow
def test_the_site_builds_with_no_warning(tmp_path):
    run = build(REPO / "docs", tmp_path / "html")
    assert run.returncode == 0, run.stdout + run.stderr
    html = tmp_path / "html"
    pages = {p.stem for p in html.glob("*.html")}
    assert {"index", "quickstart", "tensorflow", "pytorch", "jax", "recommender", "data",
            "clusters", "checkpoints", "reliability", "benchmarks", "cli", "api", "design",
            "costmodel", "checkpoint-format", "search"} <= pages, pages
    assert (html / "searchindex.js").stat().st_size > 10_000
    # The command line page comes from the parsers: a flag of mpitf run and one of dlrm.
    cli = (html / "cli.html").read_text()
    assert 'id="cmdoption-mpitf-run-hosts"' in cli
    assert 'id="cmdoption-mpitf.jobs.dlrm-embedding-dim"' in cli
    # The API page comes from the docstrings: every public name has its entry.
    import mpitf

    api = (html / "api.html").read_text()
    missing = [n for n in mpitf.__all__ if n != "__version__" and f'id="mpitf.{n}"' not in api]
    assert not missing, missing
    for name in ("mpitf.torch.DistributedOptimizer", "mpitf.jax.DistributedOptimizer"):
        assert f'id="{name}"' in api, name


@pytest.mark.slow
def test_a_broken_link_or_reference_fails_the_build_naming_it(tmp_path):
    source = tmp_path / "repo"
    shutil.copytree(REPO / "docs", source / "docs", ignore=shutil.ignore_patterns("_build"))
    for included in ("slurm/README.md", "benchmarks/README.md"):
        (source / included).parent.mkdir()
        shutil.copy(REPO / included, source / included)
    (source / "jobs").symlink_to(REPO / "jobs")  # the CLI page reads jobs/torch_mnist.py
    quickstart = source / "docs" / "quickstart.md"
    text = quickstart.read_text()
    assert "(cli.md)" in text
    quickstart.write_text(text.replace("(cli.md)", "(no-such-page.md)", 1))
    api = source / "docs" / "api.md"
    api.write_text(api.read_text() + "\nSee {py:class}`mpitf.NoSuchSession`.\n")
    run = build(source / "docs", tmp_path / "html")
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    assert re.search(r"quickstart\.md:\d+: WARNING: .*no-such-page", out), out
    assert re.search(r"api\.md:\d+: WARNING: .*mpitf\.NoSuchSession", out), out
