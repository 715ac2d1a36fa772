"""Helpers for tests: run a command under mpiexec with a deadline and collect every rank's output.

Multi-rank tests start ``mpiexec -n N python ...`` in a subprocess, so a hang becomes a
failed test (the deadline kills the whole process group) instead of a stalled CI run.
"""

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from mpitf.runtime.launch import mpiexec_command

# Hydra's -prepend-rank "[R] line"; Open MPI's --output tag "[J,R]<stdout>: line"
_RANK_PREFIX = re.compile(r"^\[(?:\d+,)?(\d+)\](?:<std(?:out|err)>:)? ?(.*)$")


@dataclass
class MPIRun:
    """The outcome of one mpiexec run: exit code, output, seconds taken, per-rank lines."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool = False
    ranks: dict = field(default_factory=dict)

    @property
    def output(self):
        """Return stdout and stderr together."""
        return self.stdout + self.stderr

    def lines(self, rank):
        """Return the lines rank ``rank`` printed (needs ``tag_output=True``)."""
        return self.ranks.get(rank, [])


def run_mpi(n, argv, timeout=60, env=None, cwd=None, tag_output=False, python=True,
            mpiexec=None):
    """Run ``argv`` (a Python script and its args when ``python``) on ``n`` ranks with a deadline.

    Returns an :class:`MPIRun`; on timeout the whole process group is killed and
    ``timed_out`` is set, so callers can assert on it instead of hanging. ``mpiexec``: the
    launcher (None: :func:`~mpitf.runtime.launch.find_mpiexec`'s), e.g. Open MPI's.
    """
    argv = [sys.executable, *argv] if python else list(argv)
    cmd = mpiexec_command(n, argv, mpiexec=mpiexec, tag_output=tag_output)
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    if env:
        full_env.update(env)
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, cwd=cwd,
        start_new_session=True, stdin=subprocess.DEVNULL,
    )
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_group(proc)
        out, err = proc.communicate()
    result = MPIRun(proc.returncode, out, err, time.monotonic() - start, timed_out)
    if tag_output:
        for line in (out + err).splitlines():
            m = _RANK_PREFIX.match(line)
            if m:
                result.ranks.setdefault(int(m.group(1)), []).append(m.group(2))
    return result


def signal_when(n, argv, log, marker, wait=60, sig=signal.SIGTERM, cwd=None):
    """Run a Python ``argv`` on ``n`` ranks into ``log``; signal mpiexec once ``marker`` shows.

    Hydra's mpiexec forwards ``sig`` to every rank. Returns the exit code (None when the
    marker never showed within ``wait`` s) and the log's text; the group is killed after.
    """
    cmd = mpiexec_command(n, [sys.executable, *map(str, argv)])
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"),
                                start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        end = time.monotonic() + wait
        while marker not in log.read_text() and time.monotonic() < end and proc.poll() is None:
            time.sleep(0.01)
        if marker not in log.read_text():
            return None, log.read_text()
        os.kill(proc.pid, sig)
        code = proc.wait(timeout=30)
    finally:
        kill_group(proc)
    return code, log.read_text()


def kill_group(proc, sig=signal.SIGKILL):
    """Send ``sig`` to the process group of ``proc`` (mpiexec and every rank it started)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


# --- fake GPU arrays ---------------------------------------------------------------------
#
# A FakeGPUArray is host memory that presents itself only as a device array would: through
# ``__cuda_array_interface__`` (no buffer protocol, no implicit numpy conversion), so the
# code paths that hand device buffers to MPI, or stage them through host buffers, run on a
# machine without a GPU. mpi4py takes any object with the CUDA array interface as a buffer;
# an MPI library without GPU support then simply reads and writes the (host) pointer.

import contextlib  # noqa: E402  (kept with the section that uses it)

import numpy as _np  # noqa: E402
from numpy.lib.mixins import NDArrayOperatorsMixin as _OperatorsMixin  # noqa: E402

from mpitf.runtime.backend import Backend  # noqa: E402


def _unwrap(value, allow_host):
    """Replace FakeGPUArrays by their host arrays, recursively in tuples, lists and dicts.

    Raises TypeError on a plain numpy array (of at least one dimension) when ``allow_host``
    is False: CuPy refuses to mix host and device operands, and so do fake device arrays.
    """
    if isinstance(value, FakeGPUArray):
        return value._host
    if isinstance(value, _np.ndarray) and value.ndim > 0 and not allow_host:
        raise TypeError("mixing a host (numpy) array with a fake device array; copy it with "
                        "Backend.to_device or .get() first, as CuPy requires")
    if isinstance(value, (tuple, list)):
        return type(value)(_unwrap(v, allow_host) for v in value)
    if isinstance(value, dict):
        return {k: _unwrap(v, allow_host) for k, v in value.items()}
    return value


def _wrap(value):
    """Wrap numpy arrays of at least one dimension that a numpy call returned as fakes."""
    if isinstance(value, _np.ndarray) and value.ndim > 0:
        return FakeGPUArray(value)
    if isinstance(value, tuple):
        return tuple(_wrap(v) for v in value)
    return value


class FakeGPUArray(_OperatorsMixin):
    """A numpy array dressed as a device array: it exposes ``__cuda_array_interface__``.

    It behaves like a small CuPy array: slicing, ``view``, ``reshape`` and in-place
    operators give fake device arrays; numpy functions and ufuncs work on fakes and return
    fakes, but refuse plain numpy operands (as CuPy does); ``get()`` copies to the host,
    ``set()`` from it; ``numpy.asarray(fake)`` raises TypeError, so a missed staging copy
    fails loudly instead of passing by accident.

    Args:
        host: the numpy array whose memory this fake "device" array owns (not copied).
        readonly: advertised in the interface's ``data`` tuple.
    """

    __array_priority__ = 100

    def __init__(self, host, readonly=False):
        if isinstance(host, FakeGPUArray):
            host = host._host
        if not isinstance(host, _np.ndarray):
            raise TypeError(f"expecting a numpy array to wrap, got {type(host).__name__}")
        self._host = host
        self.readonly = bool(readonly)

    @classmethod
    def from_host(cls, a, dtype=None):
        """Return a new fake device array holding a copy of host data ``a``."""
        return cls(_np.array(a, dtype=dtype, copy=True))

    # -- the CUDA array interface ----------------------------------------------------------

    @property
    def __cuda_array_interface__(self):
        """Return the CUDA array interface (version 3) over the host memory."""
        h = self._host
        return {
            "version": 3,
            "data": (h.__array_interface__["data"][0] if h.size else 0, self.readonly),
            "typestr": h.dtype.str,
            "descr": [("", h.dtype.str)],
            "shape": tuple(h.shape),
            "strides": None if h.flags.c_contiguous else tuple(h.strides),
            "stream": None,  # no pending work: a fake device has no stream
        }

    @property
    def ptr(self):
        """Return the address of the first element (CuPy's ``a.data.ptr``)."""
        return self.__cuda_array_interface__["data"][0]

    # -- array attributes ------------------------------------------------------------------

    shape = property(lambda self: self._host.shape, doc="the shape")
    dtype = property(lambda self: self._host.dtype, doc="the dtype")
    ndim = property(lambda self: self._host.ndim, doc="the number of dimensions")
    size = property(lambda self: self._host.size, doc="the number of elements")
    nbytes = property(lambda self: self._host.nbytes, doc="the size in bytes")
    itemsize = property(lambda self: self._host.itemsize, doc="bytes per element")
    strides = property(lambda self: self._host.strides, doc="the strides in bytes")
    flags = property(lambda self: self._host.flags, doc="numpy's flags of the memory")

    @property
    def T(self):
        """Return the transpose (a view)."""
        return FakeGPUArray(self._host.T)

    def __len__(self):
        return len(self._host)

    def __repr__(self):
        return f"FakeGPUArray({self._host!r})"

    # -- host transfers (CuPy's names) -----------------------------------------------------

    def get(self, stream=None, out=None):
        """Copy to the host: a new numpy array, or into ``out``, which is returned."""
        if out is None:
            return self._host.copy()
        _np.copyto(out, self._host)
        return out

    def set(self, arr, stream=None):
        """Copy host array ``arr`` into this array."""
        if isinstance(arr, FakeGPUArray):
            raise TypeError("set() takes a host array; use copyto between device arrays")
        self._host[...] = arr

    def __array__(self, dtype=None, copy=None):
        raise TypeError("implicit conversion of a FakeGPUArray to a NumPy array is not "
                        "allowed (as with CuPy): use .get() or Backend.to_host")

    # -- views and copies ------------------------------------------------------------------

    def __getitem__(self, key):
        return _wrap(self._host[_unwrap(key, True)])

    def __setitem__(self, key, value):
        self._host[_unwrap(key, True)] = _unwrap(value, _np.ndim(_unwrap(value, True)) == 0)

    def view(self, dtype):
        """Return a view with another dtype."""
        return FakeGPUArray(self._host.view(dtype))

    def reshape(self, *shape):
        """Return a reshaped view (or copy, as numpy decides)."""
        return FakeGPUArray(self._host.reshape(*shape))

    def ravel(self):
        """Return the flattened array."""
        return FakeGPUArray(self._host.ravel())

    def copy(self):
        """Return a copy on the (fake) device."""
        return FakeGPUArray(self._host.copy())

    def fill(self, value):
        """Set every element to ``value``."""
        self._host.fill(value)

    def astype(self, dtype, copy=True):
        """Return the array cast to ``dtype``."""
        return FakeGPUArray(self._host.astype(dtype, copy=copy))

    def sum(self, *args, **kwargs):
        """Return the sum (a fake array, or a numpy scalar for a full reduction)."""
        return _wrap(self._host.sum(*args, **kwargs))

    # -- numpy interoperability ------------------------------------------------------------

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        inputs = _unwrap(inputs, False)
        if "out" in kwargs:
            kwargs["out"] = _unwrap(kwargs["out"], False)
        return _wrap(getattr(ufunc, method)(*inputs, **kwargs))

    def __array_function__(self, func, types, args, kwargs):
        return _wrap(func(*_unwrap(args, False), **_unwrap(kwargs, False)))


class FakeGPUBackend(Backend):
    """A :class:`~mpitf.runtime.backend.Backend` whose "device" arrays are :class:`FakeGPUArray`.

    ``xp`` is numpy; ``empty``/``zeros`` return fake device arrays; ``pinned_empty`` plain
    numpy arrays; ``to_host``/``to_device`` copy. It records what it was asked to do, so a
    test can check the order of events: ``synchronize_calls`` counts :meth:`synchronize`,
    and ``events`` lists ``"synchronize"``, ``"to_host"`` and ``"to_device"`` in call order.
    """

    @property
    def is_gpu(self):
        """Return True: arrays of this backend pose as device arrays."""
        return True

    def device(self):
        return contextlib.nullcontext()

    def empty(self, n, dtype):
        """Return an uninitialised fake device array of ``n`` elements."""
        return FakeGPUArray(_np.empty(n, dtype=dtype))

    def zeros(self, n, dtype):
        """Return a fake device array of ``n`` zeros."""
        return FakeGPUArray(_np.zeros(n, dtype=dtype))

    def to_host(self, a, out=None):
        """Copy a fake device array to the host (into ``out`` when given)."""
        self.events.append("to_host")
        return super().to_host(a, out)

    def to_device(self, a, out=None):
        """Copy ``a`` (host or fake device) into a new fake device array or into ``out``."""
        self.events.append("to_device")
        host = a.get() if isinstance(a, FakeGPUArray) else _np.asarray(a)
        if out is None:
            return FakeGPUArray(_np.array(host, copy=True))
        out.set(host)
        return out

    def pinned_empty(self, n, dtype):
        """Return a plain numpy array: a stand-in for page-locked host memory."""
        return _np.empty(n, dtype=dtype)

    def synchronize(self):
        """Count the call: tests check that the stream was synchronised before MPI."""
        self.synchronize_calls += 1
        self.events.append("synchronize")

    def is_device_array(self, a):
        """Return True for :class:`FakeGPUArray` only."""
        return isinstance(a, FakeGPUArray)

    def copy_to_host_async(self, src, dst):
        """Copy a fake device array into a host array; the returned event is complete."""
        self.events.append("to_host_async")
        _np.copyto(dst, src.get())
        return _Done()

    def copy_to_device_async(self, src, dst):
        """Copy a host array into a fake device array; the returned event is complete."""
        self.events.append("to_device_async")
        dst.set(src)
        return _Done()


class _Done:
    """A finished copy (fake device copies are synchronous)."""

    def synchronize(self):
        """Return at once."""


def fake_gpu_backend(cuda_aware=False):
    """Return a fresh :class:`FakeGPUBackend`, CUDA-aware or not, with zeroed counters.

    With ``cuda_aware`` the code under test should hand fake device arrays to MPI as they
    are; without it, stage them through ``pinned_empty`` host buffers.
    """
    reason = f"fake GPU backend for tests (cuda_aware={bool(cuda_aware)})"
    be = FakeGPUBackend("fake-gpu", _np, 0, bool(cuda_aware), reason)
    be.synchronize_calls = 0
    be.events = []
    return be
