"""mpitf works when installed: a wheel in a fresh venv, run from outside the checkout.

Builds the wheel from a copy of the packaging files (so setuptools leaves no ``build/`` in
the checkout, and nothing stale from it ships), installs it with the ``mpich``, ``bench``
and ``data`` extras into a venv under tmp_path (pip's cache makes the dependencies quick
after the first time), and runs ``mpitf run`` on a built-in job and ``mpitf bench --quick``
from tmp_path with a clean environment: no PYTHONPATH, a fresh HOME.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import REPO

# What the wheel is built from; setup.py reads README.md.
SOURCES = ("setup.py", "pyproject.toml", "README.md", "mpitf")

pytestmark = [pytest.mark.install, pytest.mark.slow, pytest.mark.timeout(900)]


def _run(cmd, timeout, **kwargs):
    started = time.monotonic()
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, **kwargs)
    print(f"{time.monotonic() - started:6.1f} s  {' '.join(map(str, cmd))}")
    assert proc.returncode == 0, (f"{cmd} exited {proc.returncode}\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """Return (venv bin dir, a clean environment, a working directory outside the checkout)."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(REPO / name, src / name)
    pip_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp / "wheel", src],
         300, env=pip_env)
    wheel, = (tmp / "wheel").glob("mpitf-*.whl")
    venv = tmp / "venv"
    # This pip installs into the venv (--python): no pip of its own to set up (6 s), and no
    # byte-compiling of every dependency (24 s); the jobs compile what they import.
    _run([sys.executable, "-m", "venv", "--without-pip", venv], 120, env=pip_env)
    _run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q",
          "--no-compile", f"{wheel}[mpich,bench,data]"], 600, env=pip_env)
    work = tmp / "work"
    (work / "home").mkdir(parents=True)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(work / "home"), "LANG": "C.UTF-8"}
    return venv / "bin", env, work


def test_the_installed_package_is_the_wheel_with_every_module(installed):
    bin_dir, env, work = installed
    proc = _run([bin_dir / "python", "-c", "import mpitf; print(mpitf.__file__)"], 60,
                env=env, cwd=work)
    package = Path(proc.stdout.strip()).parent
    assert package.is_relative_to(bin_dir.parent)
    # A subpackage without __init__.py is silently left out by find_packages.
    modules = {p.relative_to(REPO / "mpitf") for p in (REPO / "mpitf").rglob("*.py")}
    assert modules - {p.relative_to(package) for p in package.rglob("*.py")} == set()


@pytest.mark.mpi
def test_run_builtin_job_by_name(installed):
    bin_dir, env, work = installed
    proc = _run([bin_dir / "mpitf", "run", "-n", "3", "mnist_mlp", "--steps", "50"], 300,
                env=env, cwd=work)
    final = [line for line in proc.stdout.splitlines() if line.startswith("final: ")]
    assert len(final) == 1, proc.stdout
    summary = json.loads(final[0][len("final: "):])
    assert summary["step"] == 50 and summary["workers"] == 2 and summary["ps"] == 1
    assert summary["test_accuracy"] > 0.8, summary  # 0.90 measured after 50 steps


@pytest.mark.mpi
def test_bench_quick_writes_its_report(installed):
    bin_dir, env, work = installed
    out = work / "bench-out"
    # the MLP alone: each suite and the validation once, in three quarters of the time
    _run([bin_dir / "mpitf", "bench", "--quick", "--models", "mlp", "--out", out], 600,
         env=env, cwd=work)
    assert (out / "report.md").is_file()
    results = json.loads((out / "results.json").read_text())
    assert results["errors"] == []
    for suite in ("pushpull_main", "scaling", "modes"):
        assert results[suite]["results"], suite
    assert all(r["mpitf_us"] > 0 for r in results["pushpull_main"]["results"])
    for png in ("pushpull.png", "scaling.png", "modes.png"):
        assert (out / png).stat().st_size > 0
    keys = {"suite", "point", "ranks", "cores", "measured", "projected", "error_pct"}
    entries = results["validation"]
    assert {e["suite"] for e in entries} == {"pushpull", "scaling", "modes"}
    assert all(keys <= set(e) and e["measured"] > 0 and e["projected"] > 0 for e in entries)
    assert all(e["counted"] == (e["ranks"] <= e["cores"] and e["basis"] == "predicted")
               for e in entries)
    assert "## Validation" in (out / "report.md").read_text()
    assert json.loads((out / "fabric.json").read_text())["bytes_per_s"] > 0
