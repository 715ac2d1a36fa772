"""Towers over the devices of one process (TF's multi-GPU ``cifar10_multi_gpu_train``).

:class:`Towers` splits the batch over local devices (``cpu:k`` = numpy, ``gpu:k`` = CuPy on
device k), computes each tower's gradient on its device and averages them on the first
device, where they are applied locally or pushed to the ps like any worker's gradient.
"""

import contextlib
import logging

import numpy as np

from ..errors import ConfigurationError
from ..models.wrapper import ModelWrapper
from ..runtime.backend import copy_array, numpy_backend, select_backend

__all__ = ["Towers", "parse_devices", "tower_backend"]


def parse_devices(spec):
    """Parse ``"cpu:0,cpu:1"`` or ``"gpu:0,gpu:1"`` into ``[("cpu", 0), ("cpu", 1)]``."""
    out = []
    for item in str(spec).split(","):
        kind, _, index = item.strip().lower().partition(":")
        if kind not in ("cpu", "gpu") or not index.isdigit():
            raise ConfigurationError(f"bad device {item.strip()!r} in {spec!r}: expecting "
                                     "a list like cpu:0,cpu:1 or gpu:0,gpu:1")
        out.append((kind, int(index)))
    if len(set(out)) != len(out):
        raise ConfigurationError(f"device list {spec!r} names a device twice")
    return out


def tower_backend(kind, index, **select):
    """Return the backend of one tower: numpy for ``cpu``, CuPy on GPU ``index`` for ``gpu``.

    ``select`` goes to :func:`~mpitf.runtime.backend.select_backend`; with
    ``allow_soft_placement=True`` a GPU that cannot be had gives a CPU tower, as
    TensorFlow's soft placement puts a ``/gpu:k`` tower on the CPU.
    """
    if kind == "cpu":
        return numpy_backend()
    be = select_backend("gpu", local_rank=index, **select)
    if not be.is_gpu:
        return be  # soft placement fell back to the CPU (and said so)
    if be.device_id != index:
        if select.get("allow_soft_placement"):
            logging.getLogger("mpitf").warning(
                "gpu:%d asked for, but only GPUs below %d are visible; the tower runs on "
                "the CPU (numpy)", index, index)
            return numpy_backend()
        raise ConfigurationError(f"gpu:{index} asked for, but only GPUs below {index} are "
                                 "visible (check CUDA_VISIBLE_DEVICES)")
    return be


def _on(be):
    """Return a context manager that makes ``be``'s device current (nothing on CPU)."""
    return be.device() if be.is_gpu else contextlib.nullcontext()


class _Tower:
    """One device's copy of the parameters and its gradient buffer, as flat arrays."""

    def __init__(self, be, specs, size, dtype):
        self.backend = be
        with _on(be):
            self.params_flat = be.zeros(size, dtype)
            self.grads_flat = be.zeros(size, dtype)
        self.params = {n: self.params_flat[a:b].reshape(s) for n, s, a, b in specs}
        self.grads = {n: self.grads_flat[a:b].reshape(s) for n, s, a, b in specs}


class Towers(ModelWrapper):
    """A model that splits each batch over local devices and averages their gradients.

    It has the model protocol, so it trains locally (see :meth:`apply_locally`) or as the
    model of a worker's ``TrainingSession``. Tower 0's device holds the average.

    Args:
        model: the model every tower runs.
        backends: one :class:`~mpitf.runtime.backend.Backend` per tower (see :func:`tower_backend`).
    """

    def __init__(self, model, backends):
        if not backends:
            raise ConfigurationError("towers need at least one device")
        super().__init__(model)
        self.backends = list(backends)
        dtypes = {np.dtype(t) for _, _, t in model.variables()}
        if len(dtypes) != 1:
            raise ConfigurationError("towers need every variable in one dtype")
        self.dtype = dtypes.pop()
        self.specs, pos = [], 0
        for name, shape, _ in model.variables():
            size = int(np.prod(shape, dtype=np.int64))
            self.specs.append((name, tuple(shape), pos, pos + size))
            pos += size
        self.size = pos
        self.towers = [_Tower(be, self.specs, pos, self.dtype) for be in self.backends]
        with _on(self.backends[0]):
            self.incoming = self.backends[0].zeros(pos, self.dtype)  # a tower's grads on dev 0
        self.losses = [0.0] * len(self.towers)

    @property
    def params(self):
        """Return tower 0's parameters (the master copy when training locally)."""
        return self.towers[0].params

    @property
    def grads(self):
        """Return tower 0's gradient views (the average after a step)."""
        return self.towers[0].grads

    def loss_and_grads(self, params, batch, grads):
        """Write the mean gradient of ``batch`` over all towers into ``grads``; return the loss.

        ``batch`` rows split into as many equal chunks as towers. ``params`` and ``grads``
        may live anywhere (host or a device); they are copied only when they are not
        tower 0's own.
        """
        first = self.towers[0]
        if params is not first.params:
            for name, value in params.items():
                copy_array(first.params[name], value)
        x, y = batch
        t = len(self.towers)
        if len(x) % t or len(x) != len(y):
            raise ConfigurationError(f"a batch of {len(x)} rows does not split into {t} "
                                     "equal tower chunks (with as many labels)")
        chunk = len(x) // t
        with _on(first.backend):
            first.backend.synchronize()
        for k, tower in enumerate(self.towers):
            with _on(tower.backend):
                if k:
                    copy_array(tower.params_flat, first.params_flat)
                part = (x[k * chunk:(k + 1) * chunk], y[k * chunk:(k + 1) * chunk])
                self.losses[k] = self.model.loss_and_grads(tower.params, part, tower.grads)
        self._average()
        if grads is not first.grads:
            for name, value in grads.items():
                copy_array(value, first.grads[name])
        return float(np.mean(self.losses))

    def _average(self):
        """Sum the towers' gradients on tower 0 in tower order, then divide by their count."""
        first = self.towers[0]
        xp, acc = first.backend.xp, first.grads_flat
        for tower in self.towers[1:]:
            with _on(tower.backend):
                tower.backend.synchronize()
            with _on(first.backend):
                src = tower.grads_flat
                if tower.backend.is_gpu or first.backend.is_gpu:  # another device's memory
                    src = copy_array(self.incoming, src)
                xp.add(acc, src, out=acc)
        if len(self.towers) > 1:
            with _on(first.backend):
                xp.divide(acc, len(self.towers), out=acc)

    def apply_locally(self, optimizer, step, slots=None):
        """Apply tower 0's averaged gradient to its parameters with ``optimizer``.

        Returns the optimizer slots (pass them back on the next call).
        """
        first = self.towers[0]
        with _on(first.backend):
            if slots is None:
                slots = {k: first.backend.to_device(v) for k, v in optimizer.make_slots(
                    self.size, first.backend.xp, self.dtype).items()}
            optimizer.apply(first.params_flat, first.grads_flat, slots, step)
        return slots
