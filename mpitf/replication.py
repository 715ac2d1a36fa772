"""In-graph replication over worker ranks, and towers over the devices of one process.

In-graph (TF's one client, many ``/job:worker/task:i`` devices): worker task 0 is the
only client of the ps. Each step it scatters equal chunks of the global batch over the
worker tasks, broadcasts its flat parameter buffer, every task computes the gradient of
its chunk into its own flat buffer, and the client gathers them and combines them exactly
as a deterministic sync ps would (sum in worker order, then divide by the worker count),
so in-graph training is bit-for-bit equal to between-graph deterministic sync training.
:class:`InGraphReplica` is the client's model (it has the model protocol, so a plain
:class:`~mpitf.session.TrainingSession` drives it); :class:`InGraphWorker` is the loop of
the other tasks, which never talk to a ps.

Towers (TF's multi-GPU ``cifar10_multi_gpu_train``): :class:`Towers` splits the batch
over local devices (``cpu:k`` = numpy, ``gpu:k`` = CuPy on device k), computes each
tower's gradient on its device and averages them on the first device.
"""

import contextlib

import numpy as np
from mpi4py import MPI

from .backend import get_backend, numpy_backend, select_backend
from .errors import ConfigurationError

__all__ = ["InGraphBatches", "InGraphReplica", "InGraphWorker", "Towers", "parse_devices",
           "variable_views"]

_STOP, _RUN = 0, 1


def variable_views(placement, segments, flat, xp):
    """Return ``(views, split)``: each variable as a view into ``flat`` laid out as the Client.

    ``segments`` are the Client's ``(header, payload, end)`` offsets per ps. A variable
    partitioned over several ps is not contiguous: it gets an array of its own, and
    ``split`` lists ``(name, [(slice, flat view), ...])`` to copy between the two.
    """
    views, split = {}, []
    for name, shape, dtype in placement.variables:
        pieces = placement.owner(name)
        parts = [(s, flat[segments[s.ps_task][1] + s.offset:
                          segments[s.ps_task][1] + s.offset + s.size]) for s in pieces]
        if len(parts) == 1:
            views[name] = parts[0][1].reshape(shape)
        else:
            views[name] = xp.zeros(shape, dtype)
            split.append((name, parts))
    return views, split


def _gather_split(views, split):
    """Copy partitioned variables from their flat slices into their own arrays."""
    for name, parts in split:
        whole = views[name].reshape(-1)
        for s, piece in parts:
            whole[s.start:s.stop] = piece


def _scatter_split(views, split):
    """Copy partitioned variables from their own arrays into their flat slices."""
    for name, parts in split:
        whole = views[name].reshape(-1)
        for s, piece in parts:
            piece[...] = whole[s.start:s.stop]


class _Channel:
    """Bcast and Gather of flat buffers that may live on a GPU.

    With a CUDA-aware MPI (or on CPU) buffers go to MPI as they are, after the stream is
    synchronised; otherwise through page-locked host buffers, allocated once per buffer.
    """

    def __init__(self, comm, backend):
        self.comm = comm
        self.backend = backend
        self.staged = backend.is_gpu and not backend.cuda_aware
        self._stages = {}

    def _stage(self, key, shape, dtype):
        stage = self._stages.get(key)
        if stage is None:
            stage = self.backend.pinned_empty(int(np.prod(shape)), dtype).reshape(shape)
            self._stages[key] = stage
        return stage

    def bcast(self, buf, root=0):
        """Broadcast ``buf`` from ``root`` into ``buf`` on every rank."""
        be, mine = self.backend, self.comm.Get_rank() == root
        if mine:
            be.synchronize()  # MPI (or the copy below) must see finished data
        if not self.staged:
            self.comm.Bcast(buf, root=root)
            return buf
        stage = self._stage(("bcast", buf.shape), buf.shape, buf.dtype)
        if mine:
            be.to_host(buf, out=stage)
        self.comm.Bcast(stage, root=root)
        if not mine:
            be.to_device(stage, out=buf)
        return buf

    def gather(self, send, recv=None, root=0):
        """Gather ``send`` of every rank into the rows of ``recv`` on ``root``.

        On ``root``, its own contribution must already be in ``recv[root]`` (MPI.IN_PLACE).
        """
        be, mine = self.backend, self.comm.Get_rank() == root
        be.synchronize()
        if not self.staged:
            self.comm.Gather(MPI.IN_PLACE if mine else send, recv, root=root)
            return recv
        if mine:
            stage = self._stage(("gather", recv.shape), recv.shape, recv.dtype)
            be.to_host(recv[root], out=stage[root])
            self.comm.Gather(MPI.IN_PLACE, stage, root=root)
            be.to_device(stage, out=recv)
        else:
            stage = self._stage(("gather", send.shape), send.shape, send.dtype)
            be.to_host(send, out=stage)
            self.comm.Gather(stage, None, root=root)
        return recv


# --------------------------------------------------------------------------- in-graph


class InGraphReplica:
    """The in-graph client's model: each ``loss_and_grads`` runs one step on every worker.

    Use it in place of the model in the client's ``TrainingSession(..., clients=[0])``,
    then :meth:`attach` the session's client before the first step and :meth:`stop` the
    workers at the end. The global batch holds ``comm.size`` equal chunks; chunk ``i``
    goes to worker task ``i`` (the client computes chunk 0).

    Args:
        comm: the workers' communicator (``server.job_comm``); the client is its rank 0.
        model: the model (``variables``, ``init``, ``loss_and_grads``, ``logits``).
        backend: where the client's buffers live (the current backend by default).
    """

    def __init__(self, comm, model, backend=None):
        if comm.Get_rank() != 0:
            raise ConfigurationError("the in-graph client must be rank 0 of the workers' comm")
        self.comm = comm
        self.model = model
        self.backend = backend or get_backend()
        self.num_replicas = comm.Get_size()
        self.channel = _Channel(comm, self.backend)
        self.client = None
        self._planned = False
        self._control = np.zeros(2, np.int64)
        self._losses = np.zeros(self.num_replicas, np.float64)

    def variables(self):
        """Return the model's variables."""
        return self.model.variables()

    def init(self, rng):
        """Return the model's initial values."""
        return self.model.init(rng)

    def logits(self, params, x):
        """Return the model's logits (evaluation runs on the client alone)."""
        return self.model.logits(params, x)

    def attach(self, client):
        """Use ``client``'s flat buffers: broadcast its parameters, gather into its layout."""
        self.client = client
        n = client.params_flat.shape[0]
        xp = self.backend.xp
        self.gathered = xp.zeros((self.num_replicas, n), client.grads_flat.dtype)
        self.local_grads, self.local_split = variable_views(
            client.placement, client.segments, self.gathered[0], xp)
        _, self.push_split = variable_views(client.placement, client.segments,
                                            client.grads_flat, xp)
        return self

    def loss_and_grads(self, params, batch, grads):
        """Compute the mean gradient of the global ``batch`` over all workers into ``grads``.

        ``params`` and ``grads`` must be the attached client's. Returns the mean loss.
        """
        if self.client is None or grads is not self.client.grads:
            raise ConfigurationError("attach() the session's client before the first step")
        x, y = batch
        w = self.num_replicas
        if len(x) % w or len(x) != len(y):
            raise ConfigurationError(f"a global batch of {len(x)} rows does not split into "
                                     f"{w} equal chunks (with as many labels)")
        chunk = len(x) // w
        x, y = np.ascontiguousarray(x), np.ascontiguousarray(y)
        self._control[...] = (_RUN, chunk)
        self.comm.Bcast(self._control, root=0)
        if not self._planned:  # the chunk's row shape and dtypes, once
            self.comm.bcast((x.shape[1:], x.dtype.str, y.dtype.str), root=0)
            self._planned = True
        self.comm.Scatter(x, MPI.IN_PLACE, root=0)
        self.comm.Scatter(y, MPI.IN_PLACE, root=0)
        self.channel.bcast(self.client.params_flat)
        loss = self.model.loss_and_grads(params, (x[:chunk], y[:chunk]), self.local_grads)
        _scatter_split(self.local_grads, self.local_split)
        self.channel.gather(None, self.gathered)
        self._losses[0] = loss
        self.comm.Gather(MPI.IN_PLACE, self._losses, root=0)
        self._combine()
        _gather_split(grads, self.push_split)
        return float(self._losses.mean())

    def _combine(self):
        """Average the gathered gradients into the push buffer as a deterministic ps would."""
        xp, g, out = self.backend.xp, self.gathered, self.client.grads_flat
        for _, start, end in self.client.segments:
            acc = out[start:end]
            acc[...] = g[0, start:end]
            for i in range(1, self.num_replicas):
                xp.add(acc, g[i, start:end], out=acc)
            if self.num_replicas > 1:
                xp.divide(acc, self.num_replicas, out=acc)

    def stop(self):
        """Tell every worker task that training is over (they return from ``serve``)."""
        self._control[...] = (_STOP, 0)
        self.comm.Bcast(self._control, root=0)


class InGraphWorker:
    """A worker task of in-graph replication: computes chunks for the client until stopped.

    Args:
        comm: the workers' communicator (``server.job_comm``); the client is rank 0.
        model: the same model the client trains.
        layout: a :class:`~mpitf.client.Client` built from the client's placement; only
            its buffers and layout are used (it never talks to a ps).
    """

    def __init__(self, comm, model, layout):
        self.comm = comm
        self.model = model
        self.layout = layout
        self.backend = layout.backend
        xp = self.backend.xp
        self.channel = _Channel(comm, self.backend)
        self.params, self.params_split = variable_views(
            layout.placement, layout.segments, layout.params_flat, xp)
        self.grads, self.grads_split = variable_views(
            layout.placement, layout.segments, layout.grads_flat, xp)
        self.steps = 0

    def serve(self):
        """Compute the gradients of the chunks the client sends until it says stop."""
        control = np.zeros(2, np.int64)
        loss = np.zeros(1, np.float64)
        x = y = None
        while True:
            self.comm.Bcast(control, root=0)
            if control[0] == _STOP:
                return self.steps
            chunk = int(control[1])
            if x is None:
                row_shape, x_dtype, y_dtype = self.comm.bcast(None, root=0)
            if x is None or len(x) != chunk:
                x = np.empty((chunk, *row_shape), x_dtype)
                y = np.empty(chunk, y_dtype)
            self.comm.Scatter(None, x, root=0)
            self.comm.Scatter(None, y, root=0)
            self.channel.bcast(self.layout.params_flat)
            _gather_split(self.params, self.params_split)
            loss[0] = self.model.loss_and_grads(self.params, (x, y), self.grads)
            _scatter_split(self.grads, self.grads_split)
            self.channel.gather(self.layout.grads_flat)
            self.comm.Gather(loss, None, root=0)
            self.steps += 1


class InGraphBatches:
    """The client's global batches: chunk ``i`` is what worker ``i`` reads between-graph.

    Opens one :class:`~mpitf.data.ShardedDataset` per worker (shard ``i`` of ``W``) and
    stacks their batches, so the chunks equal the between-graph batches exactly. Its
    position (for checkpoints) is the number of global batches served, kept as
    ``cursor`` (``epoch`` stays 0): every shard's own position follows from it.
    """

    def __init__(self, path, num_shards, batch_size, seed=0, split="train"):
        from .data import ShardedDataset

        self.shards = [ShardedDataset(path, split, i, num_shards, batch_size, seed)
                       for i in range(num_shards)]
        self.batch_size = batch_size * num_shards
        self.per_shard = batch_size
        self.served = 0
        first = self.shards[0]
        self.x_dim, self.num_classes, self.image_shape = (first.x_dim, first.num_classes,
                                                          first.image_shape)

    def next_batch(self):
        """Return the next global ``(x, y)``: the shards' batches stacked in shard order."""
        xs, ys = zip(*(s.next_batch() for s in self.shards))
        self.served += 1
        return np.concatenate(xs), np.concatenate(ys)

    def state(self):
        """Return the position: ``{"epoch": 0, "cursor": global batches served}``."""
        return {"epoch": 0, "cursor": self.served}

    def restore(self, state):
        """Reposition every shard to where ``state["cursor"]`` global batches leave it."""
        served = int(state.get("cursor", 0))
        for s in self.shards:
            per_epoch = s.batches_per_epoch
            s.restore({"epoch": served // per_epoch,
                       "cursor": (served % per_epoch) * self.per_shard})
        self.served = served

    def close(self):
        """Stop every shard's prefetching."""
        for s in self.shards:
            s.close()


# ----------------------------------------------------------------------------- towers


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
    """Return the backend of one tower: numpy for ``cpu``, CuPy on GPU ``index`` for ``gpu``."""
    if kind == "cpu":
        return numpy_backend()
    be = select_backend("gpu", local_rank=index, **select)
    if be.device_id != index:
        raise ConfigurationError(f"gpu:{index} asked for, but only GPUs below {index} are "
                                 "visible (check CUDA_VISIBLE_DEVICES)")
    return be


def _on(be):
    """Return a context manager that makes ``be``'s device current (nothing on CPU)."""
    return be._on_device() if be.is_gpu else contextlib.nullcontext()


def _is_device(a):
    return hasattr(a, "__cuda_array_interface__") and not isinstance(a, np.ndarray)


def copy_array(dst, src):
    """Copy ``src`` into ``dst`` (same shape, contiguous) between host and devices."""
    src_dev, dst_dev = _is_device(src), _is_device(dst)
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


class _Tower:
    """One device's copy of the parameters and its gradient buffer, as flat arrays."""

    def __init__(self, be, specs, size, dtype):
        self.backend = be
        with _on(be):
            self.params_flat = be.zeros(size, dtype)
            self.grads_flat = be.zeros(size, dtype)
        self.params = {n: self.params_flat[a:b].reshape(s) for n, s, a, b in specs}
        self.grads = {n: self.grads_flat[a:b].reshape(s) for n, s, a, b in specs}


class Towers:
    """A model that splits each batch over local devices and averages their gradients.

    It has the model protocol, so it trains locally (see :meth:`apply_locally`) or as the
    model of a worker's ``TrainingSession``. Tower 0's device holds the average.

    Args:
        model: the model every tower runs.
        backends: one :class:`~mpitf.backend.Backend` per tower (see :func:`tower_backend`).
    """

    def __init__(self, model, backends):
        if not backends:
            raise ConfigurationError("towers need at least one device")
        self.model = model
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

    def variables(self):
        """Return the model's variables."""
        return self.model.variables()

    def init(self, rng):
        """Return the model's initial values."""
        return self.model.init(rng)

    def logits(self, params, x):
        """Return the model's logits."""
        return self.model.logits(params, x)

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
                slots = optimizer.make_slots(self.size, first.backend.xp, self.dtype)
            optimizer.apply(first.params_flat, first.grads_flat, slots, step)
        return slots
