"""Towers over the devices of one process (TF's multi-GPU ``cifar10_multi_gpu_train``).

:class:`Towers` splits the batch over local devices (``cpu:k`` = numpy, ``gpu:k`` = CuPy on
device k), computes each tower's gradient on its device and averages them on the first
device, where they are applied locally (:class:`LocalSession`) or pushed to the ps like any
worker's gradient.
"""

import contextlib
import logging

import numpy as np

from ..errors import ConfigurationError
from ..models.wrapper import ModelWrapper
from ..runtime.backend import copy_array, numpy_backend, select_backend

__all__ = ["LocalSession", "Towers", "parse_devices", "tower_backend"]


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

    def apply_locally(self, optimizer, step, slots=None, keep_gradient=False):
        """Apply tower 0's averaged gradient to its parameters with ``optimizer``.

        The optimizer may consume the gradient buffer; with ``keep_gradient`` it works on
        a copy (in a scratch buffer made once), so the gradient can still be read.
        Returns the optimizer slots (pass them back on the next call).
        """
        first = self.towers[0]
        with _on(first.backend):
            if slots is None:
                slots = {k: first.backend.to_device(v) for k, v in optimizer.make_slots(
                    self.size, first.backend.xp, self.dtype).items()}
            grad = first.grads_flat
            if keep_gradient:
                grad = copy_array(self.incoming, grad)  # not in use between steps
            optimizer.apply(first.params_flat, grad, slots, step)
        return slots


class LocalSession:
    """The session of towers that train alone (no ps), as the session hooks see it.

    Each :meth:`run` is one global step: the towers' averaged gradient, applied on tower 0.
    Its hooks get what a :class:`~mpitf.worker.session.TrainingSession` gives them (steps,
    parameters and gradients, the optimizer; no ps, so nothing is stale or dropped), so a
    local run logs, writes ``metrics.jsonl`` and TensorBoard events the same way.

    Args:
        towers: the :class:`Towers`, whose parameters are set to ``towers.init(rng)``.
        optimizer: the optimizer applied on tower 0.
        dataset: the batches (each spans every tower).
        config: the :class:`~mpitf.config.TrainingConfig` (last_step, seed, summary_every).
        hooks: session hooks.
    """

    class _NoPs:
        """The counters of a reply, for a run without a ps."""

        dropped = max_staleness = max_lead = 0

    def __init__(self, towers, optimizer, dataset, config, hooks=()):
        self.towers = towers
        self.optimizer = optimizer
        self.dataset = dataset
        self.config = config
        self.examples_per_global_step = dataset.batch_size
        self.last_reply = self._NoPs()
        self.global_step = self.steps_run = self.nonfinite_skipped = 0
        self.loss = float("nan")
        self._slots = None
        for name, value in towers.init(np.random.default_rng(config.seed)).items():
            towers.backends[0].to_device(value, out=towers.params[name])
        self.hooks = list(hooks)
        for hook in self.hooks:
            hook.begin(self)

    @property
    def params(self):
        """Return the parameters (tower 0's)."""
        return self.towers.params

    @property
    def grads(self):
        """Return the averaged gradient of the last step (kept on ``summary_every`` steps)."""
        return self.towers.grads

    def should_stop(self):
        """Return True once the global step reached the config's ``last_step``."""
        return self.config.last_step is not None and self.global_step >= self.config.last_step

    def run(self):
        """Run one step: the towers' gradients, averaged, applied; then the hooks."""
        towers = self.towers
        self.loss = towers.loss_and_grads(towers.params, self.dataset.next_batch(), towers.grads)
        every = self.config.summary_every
        self._slots = towers.apply_locally(self.optimizer, self.global_step, self._slots,
                                           keep_gradient=bool(every) and
                                           (self.global_step + 1) % every == 0)
        self.global_step += 1
        self.steps_run += 1
        for hook in self.hooks:
            hook.after_run(self, self.loss)
        return self.loss

    def close(self):
        """Run the hooks' ends."""
        for hook in self.hooks:
            hook.end(self)
