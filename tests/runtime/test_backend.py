"""The backend: numpy methods, GPU selection with a fake CuPy, CUDA-aware detection."""

import logging
import os
import types

import numpy as np
import pytest

from mpitf.errors import ConfigurationError
from mpitf.runtime import backend as bk
from mpitf.runtime.backend import (
    Backend,
    describe_backend,
    get_backend,
    numpy_backend,
    select_backend,
    set_backend,
)
from mpitf.runtime.cuda_aware import cuda_aware_support
from tests.support import REPO


class FakeMPI:
    """A stand-in for mpi4py.MPI: a library version string and, optionally, the CUDA query."""

    def __init__(self, version, query=None):
        self._version = version
        if query is not None:
            self.Query_cuda_support = query

    def Get_library_version(self):
        return self._version


OPEN_MPI = "Open MPI v4.1.5, package: Open MPI builder Distribution, ident: 4.1.5"
MVAPICH = "MVAPICH2 Version      :\t2.3.7\nMVAPICH2 Release date :\tWed March 02 22:00:00 EST 2022"
MPICH = "MPICH Version:      4.2.0\nMPICH Release date: Fri Feb  9 12:29:21 CST 2024"
INTEL = "Intel(R) MPI Library 2021.10 for Linux* OS"


def _no_cupy():
    return None, 0, "CuPy is not installed (No module named 'cupy')"


@pytest.fixture
def no_cupy(monkeypatch):
    monkeypatch.setattr(bk, "_load_cupy", _no_cupy)
    monkeypatch.setattr(bk, "_SOFT_PLACEMENT_WARNED", set())


# ---------------------------------------------------------------- numpy backend


def test_numpy_backend_methods():
    be = numpy_backend()
    assert (be.name, be.xp, be.device_id, be.cuda_aware) == ("numpy", np, None, False)
    e = be.empty(5, np.float32)
    assert e.shape == (5,) and e.dtype == np.float32
    z = be.zeros(4, np.float64)
    assert np.array_equal(z, np.zeros(4)) and z.dtype == np.float64
    assert be.to_host(z) is z
    assert be.to_device(z) is z
    out = np.empty(4)
    assert be.to_host(np.arange(4.0), out=out) is out and np.array_equal(out, np.arange(4.0))
    assert be.to_device(np.ones(4), out=out) is out and np.all(out == 1)
    p = be.pinned_empty(3, np.int64)
    assert isinstance(p, np.ndarray) and p.shape == (3,) and p.dtype == np.int64
    assert be.synchronize() is None
    assert not be.is_device_array(z)
    assert describe_backend(be) == "backend numpy on CPU"


def test_is_device_array_sees_cuda_array_interface():
    be = numpy_backend()

    class DeviceArray:
        __cuda_array_interface__ = {"shape": (2,), "typestr": "<f8", "data": (0, False)}

        def get(self, out=None):
            host = np.array([1.0, 2.0])
            if out is None:
                return host
            out[...] = host
            return out

    assert be.is_device_array(DeviceArray())
    assert np.array_equal(be.to_host(DeviceArray()), [1.0, 2.0])
    assert np.array_equal(be.to_device(DeviceArray()), [1.0, 2.0])


def test_current_backend_defaults_to_numpy_and_can_be_set(monkeypatch):
    monkeypatch.setattr(bk, "_current", None)
    assert get_backend().name == "numpy"
    be = Backend("numpy", np)
    assert set_backend(be) is be and get_backend() is be
    with pytest.raises(TypeError):
        set_backend("numpy")


# -------------------------------------------------------------------- selection


def test_select_cpu():
    be = select_backend("cpu", local_rank=3)
    assert be.name == "numpy" and be.xp is np and be.device_id is None and not be.cuda_aware


def test_select_auto_is_numpy_here(no_cupy):
    assert select_backend("auto").name == "numpy"


def test_select_auto_on_this_machine():
    try:
        import cupy  # noqa: F401

        pytest.skip("CuPy is installed here")
    except ImportError:
        pass
    assert select_backend().name == "numpy"


def test_select_gpu_without_cupy_names_the_rank(no_cupy):
    with pytest.raises(ConfigurationError, match="local rank 3") as err:
        select_backend("gpu", local_rank=3, env={})
    assert "GPU" in str(err.value) and "CuPy is not installed" in str(err.value)
    with pytest.raises(ConfigurationError, match=r"rank 7 \(local rank 1\)"):
        select_backend("gpu", local_rank=1, rank=7, env={"CUDA_VISIBLE_DEVICES": ""})


def test_select_gpu_soft_placement_falls_back_and_logs_once(no_cupy, caplog):
    with caplog.at_level(logging.WARNING, logger="mpitf"):
        for _ in range(3):
            be = select_backend("gpu", local_rank=2, allow_soft_placement=True, env={})
            assert be.name == "numpy"
    records = [r for r in caplog.records if r.name == "mpitf"]
    assert len(records) == 1
    assert records[0].levelno == logging.WARNING
    assert "local rank 2" in records[0].getMessage() and "CPU" in records[0].getMessage()


# A CuPy that is installed but broken, as a stand-in package on sys.path: its import
# fails, or the CUDA runtime under it does. device="auto" says so; device="gpu" refuses.
BROKEN_IMPORT = "raise ImportError('libcudart.so.12: cannot open shared object file')\n"
MISSING_DEPENDENCY = "import fastrlock_not_here  # noqa\n"
RUNTIME = """
class CUDARuntimeError(RuntimeError):
    def __init__(self, status, text):
        self.status = status
        super().__init__(text)

class runtime:
    @staticmethod
    def getDeviceCount():
        raise CUDARuntimeError({status}, {text!r})

cuda = type("cuda", (), {{"runtime": runtime}})
"""
NO_DRIVER = RUNTIME.format(status=35, text="cudaErrorInsufficientDriver: CUDA driver version "
                           "is insufficient for CUDA runtime version")
NO_DEVICE = RUNTIME.format(status=100, text="cudaErrorNoDevice: no CUDA-capable device is "
                           "detected")


@pytest.fixture
def fake_cupy(tmp_path, monkeypatch):
    """Install a stand-in ``cupy`` package whose ``__init__`` is the given source."""
    import sys

    def install(source):
        package = tmp_path / "cupy"
        package.mkdir(exist_ok=True)
        (package / "__init__.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
        sys.modules.pop("cupy", None)

    monkeypatch.setattr(bk, "_SOFT_PLACEMENT_WARNED", set())
    yield install
    sys.modules.pop("cupy", None)


@pytest.mark.parametrize("source, error", [
    (BROKEN_IMPORT, "ImportError: libcudart.so.12: cannot open shared object file"),
    (MISSING_DEPENDENCY, "ModuleNotFoundError: No module named 'fastrlock_not_here'"),
    (NO_DRIVER, "cudaErrorInsufficientDriver"),
])
def test_a_broken_gpu_stack_is_a_warning_with_auto_and_an_error_with_gpu(
        fake_cupy, caplog, source, error):
    fake_cupy(source)
    with caplog.at_level(logging.DEBUG, logger="mpitf"):
        be = select_backend("auto", local_rank=1, rank=5, env={})
    assert be.name == "numpy"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, caplog.text
    assert error in warnings[0] and "rank 5 (local rank 1)" in warnings[0]
    assert "device='cpu'" in warnings[0]  # and how to say so
    with pytest.raises(ConfigurationError, match="asked for a GPU") as err:
        select_backend("gpu", local_rank=1, env={})
    assert error in str(err.value) and "broken" in str(err.value)


def test_no_device_under_an_installed_cupy_is_not_a_warning(fake_cupy, caplog):
    fake_cupy(NO_DEVICE)
    with caplog.at_level(logging.DEBUG, logger="mpitf"):
        assert select_backend("auto", env={}).name == "numpy"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "cudaErrorNoDevice" in caplog.text  # said at debug level, as a missing CuPy is
    with pytest.raises(ConfigurationError, match="CUDA reports no device"):
        select_backend("gpu", env={})


@pytest.mark.mpi
def test_device_gpu_with_a_broken_gpu_stack_ends_the_job_with_one_message(
        digits_file, tmp_path):
    from mpitf.testing import run_mpi

    (tmp_path / "fake" / "cupy").mkdir(parents=True)
    (tmp_path / "fake" / "cupy" / "__init__.py").write_text(BROKEN_IMPORT)
    path = os.pathsep.join([str(tmp_path / "fake"), str(REPO),
                            *filter(None, [os.environ.get("PYTHONPATH")])])
    run = run_mpi(3, [str(REPO / "jobs" / "mnist_mlp.py"), "--data", digits_file,
                      "--num-ps", "1", "--steps", "5", "--device", "gpu"], timeout=60,
                  cwd=str(tmp_path), env={"PYTHONPATH": path})
    assert not run.timed_out, run.output
    assert run.returncode == 2, run.output
    assert run.output.count("asked for a GPU") == 1, run.output  # rank 0 alone says it
    assert "ImportError: libcudart.so.12" in run.stderr, run.output
    assert "Traceback" not in run.output and "final:" not in run.stdout


@pytest.mark.parametrize("kwargs", [{"device": "tpu"}, {"memory_fraction": 1.5}])
def test_select_bad_arguments(kwargs):
    with pytest.raises(ConfigurationError):
        select_backend(**kwargs)


class _FakePool:
    def __init__(self, total):
        self.total, self.limit, self.mallocs = total, 0, []

    def set_limit(self, size=None, fraction=None):
        self.limit = int(self.total * fraction) if fraction is not None else size

    def get_limit(self):
        return self.limit

    def malloc(self, nbytes):
        assert nbytes <= self.limit
        self.mallocs.append(nbytes)
        return object()


def _fake_cupy(count, total=16 * 2**30 + 100):
    used = []
    pool = _FakePool(total)

    class Device:
        def __init__(self, ordinal):
            self.ordinal = ordinal

        def use(self):
            used.append(self.ordinal)

    cuda = types.SimpleNamespace(Device=Device)
    cupy = types.SimpleNamespace(cuda=cuda, get_default_memory_pool=lambda: pool)
    return cupy, used, pool


@pytest.mark.parametrize("local_rank, count, want", [(0, 4, 0), (5, 4, 1), (3, 1, 0)])
def test_select_gpu_ordinal_is_local_rank_mod_count(monkeypatch, local_rank, count, want):
    cupy, used, pool = _fake_cupy(count)
    monkeypatch.setattr(bk, "_load_cupy", lambda: (cupy, count, ""))
    be = select_backend("gpu", local_rank=local_rank, env={}, mpi=FakeMPI(MPICH))
    assert (be.name, be.xp, be.device_id) == ("cupy", cupy, want)
    assert used == [want]
    assert pool.limit == 0 and pool.mallocs == []  # no memory options: pool untouched
    assert be.cuda_aware is False
    assert describe_backend(be) == (
        f"backend cupy on GPU {want}, CUDA-aware MPI: no (MPICH: MPIR_CVAR_ENABLE_GPU unset), "
        "staging through pinned host buffers"
    )


def test_select_gpu_memory_fraction_and_preallocation(monkeypatch):
    cupy, used, pool = _fake_cupy(2)
    monkeypatch.setattr(bk, "_load_cupy", lambda: (cupy, 2, ""))
    select_backend("auto", memory_fraction=0.5, env={}, mpi=FakeMPI(MPICH))
    assert pool.limit == pool.total // 2 and pool.mallocs == []
    env = {"MPITF_CUDA_AWARE": "1"}
    be = select_backend("gpu", memory_fraction=0.25, allow_growth=False, env=env)
    assert pool.mallocs == [(pool.limit // 512) * 512]
    assert be.cuda_aware is True
    assert describe_backend(be).endswith(
        "CUDA-aware MPI: yes (MPITF_CUDA_AWARE=1), device buffers go to MPI as they are"
    )


# ------------------------------------------------------------------- CUDA-aware


@pytest.mark.parametrize(
    "version, env, want, reason",
    [
        (OPEN_MPI, {}, None, "OMPI_MCA_opal_cuda_support unset"),
        (OPEN_MPI, {"OMPI_MCA_opal_cuda_support": "1"}, True, "Open MPI"),
        (OPEN_MPI, {"OMPI_MCA_opal_cuda_support": "true"}, True, "Open MPI"),
        (OPEN_MPI, {"OMPI_MCA_opal_cuda_support": "0"}, False, "Open MPI"),
        (MVAPICH, {"MV2_USE_CUDA": "1"}, True, "MVAPICH2: MV2_USE_CUDA=1"),
        (MVAPICH, {"MV2_USE_CUDA": "0"}, False, "MVAPICH2: MV2_USE_CUDA=0"),
        (MVAPICH, {}, False, "MVAPICH2: MV2_USE_CUDA unset"),
        (MPICH, {"MPIR_CVAR_ENABLE_GPU": "1"}, True, "MPICH: MPIR_CVAR_ENABLE_GPU=1"),
        (MPICH, {"MPIR_CVAR_ENABLE_GPU": "0"}, False, "MPICH: MPIR_CVAR_ENABLE_GPU=0"),
        (MPICH, {}, None, "MPICH: MPIR_CVAR_ENABLE_GPU unset"),
        (INTEL, {"I_MPI_OFFLOAD": "1"}, True, "I_MPI_OFFLOAD=1"),
        (INTEL, {}, False, "I_MPI_OFFLOAD unset"),
        ("Some Vendor MPI 1.0", {}, None, "unknown MPI library"),
    ],
)
def test_cuda_aware_by_family(version, env, want, reason):
    aware, why = cuda_aware_support(FakeMPI(version), env)
    assert aware is want
    assert reason in why


@pytest.mark.parametrize("answer", [True, False])
def test_cuda_aware_query_wins_over_family(answer):
    mpi = FakeMPI(MPICH, query=lambda: answer)
    aware, why = cuda_aware_support(mpi, {"MPIR_CVAR_ENABLE_GPU": "1"})
    assert aware is answer
    assert "MPIX_Query_cuda_support" in why


def test_cuda_aware_query_not_implemented_falls_back_to_family():
    def query():
        raise NotImplementedError

    aware, why = cuda_aware_support(FakeMPI(MVAPICH, query=query), {"MV2_USE_CUDA": "1"})
    assert aware is True and "MV2_USE_CUDA" in why


@pytest.mark.parametrize("value, want", [("0", False), ("1", True)])
def test_cuda_aware_override(value, want):
    mpi = FakeMPI(OPEN_MPI, query=lambda: not want)
    aware, why = cuda_aware_support(mpi, {"MPITF_CUDA_AWARE": value})
    assert aware is want and why == f"MPITF_CUDA_AWARE={value}"


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_cuda_aware_bad_override(value):
    with pytest.raises(ConfigurationError, match="MPITF_CUDA_AWARE"):
        cuda_aware_support(FakeMPI(MPICH), {"MPITF_CUDA_AWARE": value})


def test_cuda_aware_real_mpi4py_answers():
    aware, why = cuda_aware_support(env={})
    assert aware in (True, False, None) and why


# -------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_backend_round_trip():
    required = os.environ.get("MPITF_TEST_GPU") == "1"
    cupy, count, why_not = bk._load_cupy()
    if cupy is None:
        if required:
            pytest.fail(f"MPITF_TEST_GPU=1 but {why_not}")
        pytest.skip(why_not)
    be = select_backend("gpu", local_rank=0)
    assert be.name == "cupy" and be.device_id == 0
    host = np.arange(1000, dtype=np.float32)
    dev = be.to_device(host)
    assert be.is_device_array(dev) and not be.is_device_array(host)
    assert be.to_device(dev) is dev
    dev *= 2
    be.synchronize()
    pinned = be.pinned_empty(1000, np.float32)
    assert be.to_host(dev, out=pinned) is pinned
    np.testing.assert_array_equal(pinned, host * 2)
    np.testing.assert_array_equal(be.to_host(be.zeros(3, np.float64)), np.zeros(3))
    assert describe_backend(be).startswith("backend cupy on GPU 0, CUDA-aware MPI: ")
