"""Shared test helpers: run scripts under mpiexec with a deadline, and the ``gpu`` marker.

Tests marked ``gpu`` skip without CuPy and a CUDA device, unless ``MPITF_TEST_GPU=1`` is
set: then they run, and fail where CUDA is missing.
"""

import compileall
import os
import sys
import warnings
from pathlib import Path

import pytest

from mpitf.runtime.launch import find_mpiexec
from mpitf.testing import run_mpi
from tests.support import REPO

_MPIEXEC_PROBLEM = []  # filled at session start when no mpiexec is found


def pytest_sessionstart(session):
    # Every test starts Python processes that import mpitf; where PYTHONDONTWRITEBYTECODE
    # is set (as here) each would compile the package from source again (about 0.13 s of
    # CPU a process). Byte-compile it once: imports read a .pyc whatever that variable says.
    compileall.compile_dir(str(REPO / "mpitf"), quiet=1)
    compileall.compile_dir(str(REPO / "tests"), quiet=1)
    venv_mpiexec = Path(sys.executable).parent / "mpiexec"
    if venv_mpiexec.exists():
        return
    try:
        find_mpiexec()
    except RuntimeError as exc:
        _MPIEXEC_PROBLEM.append(
            f"{exc}. The multi-rank tests expect {venv_mpiexec}: create the venv with"
            f" `{sys.executable} -m pip install -e '.[mpich,test]'` from {REPO}")


def _uses_mpi(item):
    return item.get_closest_marker("mpi") is not None or "mpirun" in getattr(
        item, "fixturenames", ())


def _cuda_problem():
    """Return why CUDA cannot be used here, or "" when it can."""
    from mpitf.runtime.backend import _load_cupy

    return _load_cupy()[2]


def _module_fixtures_on_one_worker(items):
    """Mark the tests that share a module-scoped fixture as one xdist group.

    The suite runs on three pytest-xdist workers (``--dist loadgroup``, pyproject.toml), each
    test wherever a worker is free; a module's fixture (a built wheel, a Slurm on a box)
    is then made once, by the worker that runs that module's tests.
    """
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info else ()
        if any(d[-1].scope in ("package", "module", "class") for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


def pytest_collection_finish(session):
    """Warn, on an xdist worker, when its groups did not take (pytest 9.2, setup.py says why).

    xdist groups a test by adding ``@group`` to its id as collected; where pytest ignores
    that, the tests still pass but each worker builds the shared fixtures again.
    """
    if not getattr(session.config.option, "loadgroup", False):  # set on workers only
        return
    lost = [item.nodeid for item in session.items
            if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if lost:
        warnings.warn(f"pytest {pytest.__version__} drops xdist's groups ({lost[0]} and "
                      f"{len(lost) - 1} more): each worker builds their module fixtures; "
                      "install the test extra's pytest (setup.py)", stacklevel=1)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    _module_fixtures_on_one_worker(items)
    if _MPIEXEC_PROBLEM and any(_uses_mpi(item) for item in items):
        raise pytest.UsageError(_MPIEXEC_PROBLEM[0])
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items or os.environ.get("MPITF_TEST_GPU") == "1":
        return  # with MPITF_TEST_GPU=1 they run, and fail where CUDA is missing
    why = _cuda_problem()
    if why:
        skip = pytest.mark.skip(reason=f"needs CUDA: {why} (MPITF_TEST_GPU=1 makes this fail)")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture
def mpirun():
    """Return ``mpirun(n, script, *args, timeout=60, env=None, mpiexec=None)``: an MPIRun, from
    the repo root (``mpiexec``: another launcher, e.g. tests.support.openmpi_mpiexec())."""
    def run(n, script, *args, timeout=60, env=None, tag_output=False, mpiexec=None):
        return run_mpi(n, [str(script), *map(str, args)], timeout=timeout, env=env,
                       cwd=str(REPO), tag_output=tag_output, mpiexec=mpiexec)

    return run


@pytest.fixture(scope="session")
def digits_file(tmp_path_factory):
    """The digits set written once for the whole run, for jobs started by tests."""
    from mpitf.data.datasets import ensure_digits

    return ensure_digits(str(tmp_path_factory.mktemp("data") / "digits.h5"))


@pytest.fixture(scope="session")
def box():
    """A 3-node cluster in a box (mpitf.testing.netcluster), made once, always removed.

    Skips with the reason where this machine cannot make one (not root, no iproute2); CI
    here runs as root, so there the multi-node tests run.
    """
    from mpitf.testing import netcluster

    why = netcluster.unavailable()
    if why:
        pytest.skip(why)
    made = netcluster.Box(3, name=f"t{os.getpid() % 10_000_000}")
    made.up()
    try:
        yield made
    finally:
        made.down()
