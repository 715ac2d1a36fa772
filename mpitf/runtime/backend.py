"""Choose the array module (numpy or CuPy) for this rank and say whether MPI is CUDA-aware.

This is the only module of mpitf that imports CuPy. Everything else writes
``be.xp`` for a :class:`Backend`, or :func:`array_module` for an array, so CPU
and GPU share one code path.

TensorFlow's ``ConfigProto`` maps onto :func:`select_backend` this way:

* ``log_device_placement``: log :func:`describe_backend` (the caller does).
* ``allow_soft_placement=True``: a rank that asked for a GPU it cannot have
  falls back to numpy, with one warning on the ``mpitf`` logger.
* ``gpu_options.per_process_gpu_memory_fraction``: ``memory_fraction``, which
  caps CuPy's default memory pool with ``set_limit(fraction=...)``.
* ``gpu_options.allow_growth=False``: with ``memory_fraction`` set, that much
  is allocated once at start and kept in CuPy's pool; without a fraction
  nothing is preallocated (grabbing the whole GPU, as TF did, would starve
  the other ranks sharing it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from mpitf.errors import ConfigurationError
from mpitf.runtime.cuda_aware import cuda_aware_support

__all__ = [
    "Backend",
    "array_module",
    "copy_array",
    "describe_backend",
    "get_backend",
    "numpy_backend",
    "select_backend",
    "set_backend",
]

_DEVICES = ("auto", "cpu", "gpu")
# (local_rank, reason) pairs already warned about, so a fallback is logged once.
_SOFT_PLACEMENT_WARNED: set = set()


def array_module(a):
    """Return the array module of ``a``: cupy for CuPy arrays, numpy otherwise.

    Looks CuPy up in ``sys.modules`` instead of importing it: a CuPy array
    cannot exist unless CuPy is already imported.
    """
    if type(a) is np.ndarray:  # the ps's every push: no string work
        return np
    top = type(a).__module__.split(".", 1)[0]
    if top == "cupy":
        return sys.modules["cupy"]
    return np


@dataclass
class Backend:
    """The array module of one rank, with its device and how its buffers reach MPI."""

    name: str  # "numpy" or "cupy"
    xp: Any
    device_id: Optional[int] = None  # CUDA ordinal, None on CPU
    cuda_aware: bool = False  # device buffers may be handed to MPI as they are
    cuda_aware_reason: str = field(default="", compare=False)

    @property
    def is_gpu(self):
        """Whether arrays of this backend live on a GPU."""
        return self.name == "cupy"

    def device(self):
        """Return a context manager that makes this backend's GPU current (no-op on CPU)."""
        if self.is_gpu:
            return self.xp.cuda.Device(self.device_id)
        return contextlib.nullcontext()

    def empty(self, n, dtype):
        """Return an uninitialised 1-D array of ``n`` elements on this backend."""
        with self.device():
            return self.xp.empty(n, dtype=dtype)

    def zeros(self, n, dtype):
        """Return a 1-D array of ``n`` zeros on this backend."""
        with self.device():
            return self.xp.zeros(n, dtype=dtype)

    def to_host(self, a, out=None):
        """Return ``a`` as a numpy array, without a copy when it already is one.

        With ``out`` (a numpy array, e.g. from :meth:`pinned_empty`), copy into
        it and return it.
        """
        if self.is_device_array(a):
            if out is None:
                return a.get()
            a.get(out=out)
            return out
        if out is None:
            return np.asarray(a)
        np.copyto(out, a)
        return out

    def to_device(self, a, out=None):
        """Return ``a`` as an array of this backend, without a copy when it already is one.

        With ``out`` (an array of this backend), copy into it and return it.
        """
        if not self.is_gpu:
            a = a.get() if self.is_device_array(a) else a
            if out is None:
                return np.asarray(a)
            np.copyto(out, a)
            return out
        with self.device():
            if out is None:
                return self.xp.asarray(a)
            if self.is_device_array(a):
                self.xp.copyto(out, a)
            else:
                out.set(np.asarray(a))
            return out

    def pinned_empty(self, n, dtype):
        """Return an uninitialised numpy array of ``n`` elements in page-locked memory.

        Page-locked (pinned) host memory makes device-host copies fast and
        lets them run asynchronously; on CPU this is a plain numpy array.
        """
        if not self.is_gpu:
            return np.empty(n, dtype=dtype)
        try:
            import cupyx

            return cupyx.empty_pinned(n, dtype=dtype)
        except (ImportError, AttributeError):
            dtype = np.dtype(dtype)
            mem = self.xp.cuda.alloc_pinned_memory(max(n, 1) * dtype.itemsize)
            # frombuffer keeps ``mem`` alive through the array's base.
            return np.frombuffer(mem, dtype=dtype, count=n)

    def synchronize(self):
        """Wait for the current CUDA stream, so MPI sees finished data; no-op on numpy."""
        if self.is_gpu:
            self.xp.cuda.get_current_stream().synchronize()

    def copy_to_host_async(self, src, dst):
        """Start copying device array ``src`` into pinned host array ``dst``; return an event.

        On numpy the copy is done at once and the event is already complete.
        """
        if not self.is_gpu:
            np.copyto(dst, src)
            return _DONE
        stream = self.xp.cuda.get_current_stream()
        src.get(out=dst, stream=stream, blocking=False)
        return self._record(stream)

    def copy_to_device_async(self, src, dst):
        """Start copying pinned host array ``src`` into device array ``dst``; return an event."""
        if not self.is_gpu:
            np.copyto(dst, src)
            return _DONE
        stream = self.xp.cuda.get_current_stream()
        dst.set(src, stream=stream)
        return self._record(stream)

    def _record(self, stream):
        event = self.xp.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
        return event

    def is_device_array(self, a):
        """Whether ``a`` is a device array: it has ``__cuda_array_interface__`` and is not numpy."""
        return is_device_array(a)


def is_device_array(a):
    """Whether ``a`` is a device array: it has ``__cuda_array_interface__`` and is not numpy."""
    return hasattr(a, "__cuda_array_interface__") and not isinstance(a, np.ndarray)


def copy_array(dst, src):
    """Copy ``src`` into ``dst`` (same shape, contiguous) between the host and any devices."""
    src_dev, dst_dev = is_device_array(src), is_device_array(dst)
    if not src_dev and not dst_dev:
        np.copyto(dst, src)
    elif src_dev and not dst_dev:
        src.get(out=dst)
    elif dst_dev and not src_dev:
        dst.set(np.ascontiguousarray(src))
    elif hasattr(dst, "data") and hasattr(dst.data, "copy_from_device"):
        # CuPy: a raw memcpy works between two GPUs too (peer or through the host).
        dst.data.copy_from_device(src.data, src.nbytes)
    else:
        dst[...] = src
    return dst


class _Done:
    """An event that has already happened (numpy copies are synchronous)."""

    def synchronize(self):
        """Return at once."""


_DONE = _Done()


def numpy_backend():
    """Return a CPU backend on numpy."""
    return Backend("numpy", np, None, False, "CPU buffers")


_current: Optional[Backend] = None


def get_backend():
    """Return this process's current backend (numpy until :func:`set_backend` is called)."""
    global _current
    if _current is None:
        _current = numpy_backend()
    return _current


def set_backend(be):
    """Make ``be`` this process's current backend and return it."""
    global _current
    if not isinstance(be, Backend):
        raise TypeError(f"expecting a Backend, got {type(be).__name__}")
    _current = be
    return be


# ------------------------------------------------------------------ selection


class _BrokenGpuStack(Exception):
    """CuPy is installed but cannot be used: its import or the CUDA runtime failed.

    Unlike an absent GPU (no CuPy, no device), this is worth saying even with
    ``device="auto"``: the rank would otherwise train on the CPU without a word.
    """


# The CUDA runtime's answer on a machine with no GPU: an absent device, not a broken stack.
_NO_DEVICE = 100  # cudaErrorNoDevice


def _load_cupy():
    """Import CuPy and count the visible devices; return ``(cupy, count, why_not)``.

    ``cupy`` is None, with the reason in ``why_not``, when there is no GPU to use: CuPy is
    not installed, or CUDA sees no device. Raises ``_BrokenGpuStack`` naming the error when
    CuPy is there but broken (its import or the CUDA runtime fails otherwise).
    """
    try:
        import cupy
    except ModuleNotFoundError as exc:
        if exc.name != "cupy":  # CuPy is there, one of its own imports is not
            raise _BrokenGpuStack(f"CuPy failed to import ({type(exc).__name__}: {exc})") \
                from exc
        return None, 0, f"CuPy is not installed ({exc})"
    except Exception as exc:  # a broken CUDA install can fail in many ways on import
        raise _BrokenGpuStack(f"CuPy failed to import ({type(exc).__name__}: {exc})") from exc
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # CUDARuntimeError: no device, or no (or a mismatched) driver
        if getattr(exc, "status", None) == _NO_DEVICE or "cudaErrorNoDevice" in str(exc):
            return None, 0, f"CUDA reports no device ({exc})"
        raise _BrokenGpuStack(
            f"CUDA failed to count the devices ({type(exc).__name__}: {exc})") from exc
    if count < 1:
        return None, 0, "CUDA reports no device"
    return cupy, count, ""


def select_backend(
    device="auto",
    local_rank=0,
    *,
    allow_soft_placement=False,
    memory_fraction=None,
    allow_growth=True,
    env=os.environ,
    log=None,
    rank=None,
    mpi=None,
):
    """Choose this rank's backend: numpy on CPU, or CuPy on GPU ``local_rank % count``.

    Args:
        device: "auto" (a GPU when CuPy imports and a device is visible, else
            CPU; a CuPy or CUDA that is there but fails is a warning naming the
            error), "cpu" or "gpu" (a ConfigurationError naming why not).
        local_rank: this rank's index on its node; picks the GPU. CuPy's
            device count already respects ``CUDA_VISIBLE_DEVICES``.
        allow_soft_placement: fall back to numpy, with one warning, when
            "gpu" cannot be had, instead of raising ConfigurationError.
        memory_fraction: cap on CuPy's memory pool as a fraction of the GPU.
        allow_growth: when False and ``memory_fraction`` is set, preallocate
            that much once.
        env: the environment to read (CUDA-aware overrides and the like).
        log: logger for the fallback warning; the "mpitf" logger by default.
        rank: the world rank, only to name it in messages.
        mpi: the ``mpi4py.MPI`` module or a stand-in, for
            :func:`cuda_aware_support`.

    Returns:
        a :class:`Backend`; it does not become current until :func:`set_backend`.
    """
    log = log or logging.getLogger("mpitf")
    kind = device.lower() if isinstance(device, str) else device
    if kind not in _DEVICES:
        raise ConfigurationError(f"unknown device {device!r}; expected one of {list(_DEVICES)}")
    if memory_fraction is not None and not (0.0 < float(memory_fraction) <= 1.0):
        raise ConfigurationError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
    if kind == "cpu":
        return numpy_backend()
    who = f"local rank {local_rank}" if rank is None else f"rank {rank} (local rank {local_rank})"
    try:
        cupy, count, why_not = _load_cupy()
    except _BrokenGpuStack as exc:  # said even with "auto": the CPU would be a surprise
        cupy, count, why_not = None, 0, f"the GPU stack is broken: {exc}"
        if kind == "auto":
            log.warning("%s: device='auto' found a GPU stack that does not work: %s; using "
                        "the CPU (numpy): fix the CuPy/CUDA install, or pass device='cpu' "
                        "(--device cpu)", who, exc)
            return numpy_backend()
    if cupy is None:
        if kind == "auto":
            log.debug("device='auto' on local rank %s: %s; using CPU (numpy)", local_rank, why_not)
            return numpy_backend()
        visible = env.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            why_not += f", CUDA_VISIBLE_DEVICES={visible!r}"
        if not allow_soft_placement:
            raise ConfigurationError(
                f"{who} asked for a GPU (device='gpu') but {why_not}; install CuPy for your CUDA "
                "(pip install cupy-cuda12x), request GPUs from the scheduler "
                "(e.g. srun --gpus-per-task=1), or use device='cpu' or allow_soft_placement"
            )
        key = (local_rank, why_not)
        if key not in _SOFT_PLACEMENT_WARNED:
            _SOFT_PLACEMENT_WARNED.add(key)
            log.warning("%s asked for a GPU but %s; falling back to CPU (numpy)", who, why_not)
        return numpy_backend()

    ordinal = int(local_rank) % count
    cupy.cuda.Device(ordinal).use()
    if memory_fraction is not None:
        pool = cupy.get_default_memory_pool()
        pool.set_limit(fraction=float(memory_fraction))
        if not allow_growth:
            # Round down to the pool's 512-byte unit so the block fits under the limit.
            nbytes = (int(pool.get_limit()) // 512) * 512
            if nbytes:
                block = pool.malloc(nbytes)
                del block  # back to the pool, which keeps it cached for later arrays
    aware, reason = cuda_aware_support(mpi, env)
    return Backend("cupy", cupy, ordinal, bool(aware), reason)


def describe_backend(be):
    """Return one line for the log that says where arrays live and how they reach MPI."""
    if not be.is_gpu:
        return f"backend {be.name} on CPU"
    answer = "yes" if be.cuda_aware else "no"
    why = f" ({be.cuda_aware_reason})" if be.cuda_aware_reason else ""
    how = (
        "device buffers go to MPI as they are"
        if be.cuda_aware
        else "staging through pinned host buffers"
    )
    return f"backend {be.name} on GPU {be.device_id}, CUDA-aware MPI: {answer}{why}, {how}"
