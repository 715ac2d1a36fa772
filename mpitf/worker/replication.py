"""In-graph replication over worker ranks, and towers over the devices of one process.

In-graph (TF's one client, many ``/job:worker/task:i`` devices): worker task 0 is the
only client of the ps. Each step it scatters equal chunks of the global batch over the
worker tasks, broadcasts its flat parameter buffer, every task computes the gradient of
its chunk into its own flat buffer, and the client gathers them and combines them exactly
as a deterministic sync ps would (sum in worker order, then divide by the worker count),
so in-graph training is bit-for-bit equal to between-graph deterministic sync training.
:class:`InGraphReplica` is the client's model (it has the model protocol, so a plain
:class:`~mpitf.worker.session.TrainingSession` drives it); :class:`InGraphWorker` is the loop of
the other tasks, which never talk to a ps.
"""


import numpy as np
from mpi4py import MPI

from ..errors import ConfigurationError
from ..models.wrapper import ModelWrapper
from ..runtime.backend import get_backend
from ..wire.frame import MPIBuffer

__all__ = ["InGraphBatches", "InGraphReplica", "InGraphWorker"]

_STOP, _RUN = 0, 1


class _Channel:
    """Bcast and Gather of flat buffers that may live on a GPU.

    Each buffer reaches MPI through its :class:`~mpitf.wire.frame.MPIBuffer`: as it is with
    a CUDA-aware MPI (or on CPU), after the stream is synchronised; otherwise through a
    page-locked host mirror, allocated once per buffer.
    """

    def __init__(self, comm, backend):
        self.comm = comm
        self.backend = backend
        self._buffers = {}  # (operation, id(array)) -> MPIBuffer, which keeps the array alive

    def _buffer(self, operation, array):
        buffer = self._buffers.get((operation, id(array)))
        if buffer is None or buffer.array is not array:
            buffer = self._buffers[(operation, id(array))] = MPIBuffer(self.backend, array)
        return buffer

    def bcast(self, buf, root=0):
        """Broadcast ``buf`` from ``root`` into ``buf`` on every rank."""
        mine = self.comm.Get_rank() == root
        buffer = self._buffer("bcast", buf)
        if mine:
            self.backend.synchronize()  # MPI (or the copy below) must see finished data
            buffer.to_mpi()
        self.comm.Bcast(buffer.mpi, root=root)
        if not mine:
            buffer.from_mpi()
        return buf

    def gather(self, send, recv=None, root=0):
        """Gather ``send`` of every rank into the rows of ``recv`` on ``root``.

        On ``root``, its own contribution must already be in ``recv[root]`` (MPI.IN_PLACE).
        """
        self.backend.synchronize()
        if self.comm.Get_rank() == root:
            buffer = self._buffer("gather", recv)
            buffer.to_mpi(root)
            self.comm.Gather(MPI.IN_PLACE, buffer.mpi, root=root)
            buffer.from_mpi()
        else:
            buffer = self._buffer("gather", send)
            buffer.to_mpi()
            self.comm.Gather(buffer.mpi, None, root=root)
        return recv


# --------------------------------------------------------------------------- in-graph


class InGraphReplica(ModelWrapper):
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
        super().__init__(model)
        self.comm = comm
        self.backend = backend or get_backend()
        self.num_replicas = comm.Get_size()
        self.channel = _Channel(comm, self.backend)
        self.client = None
        self._planned = False
        self._control = np.zeros(2, np.int64)
        self._losses = np.zeros(self.num_replicas, np.float64)

    def attach(self, client):
        """Use ``client``'s flat buffers: broadcast its parameters, gather into its layout."""
        if client.bucketed:
            raise ConfigurationError("in-graph replication gathers into one frame per ps: "
                                     "leave bucket_bytes (--bucket-bytes) at 0")
        self.client = client
        n = client.params_flat.shape[0]
        xp = self.backend.xp
        self.gathered = xp.zeros((self.num_replicas, n), client.grads_flat.dtype)
        self.local_grads = client.layout.views(self.gathered[0], self.backend)
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
        loss = self.model.loss_and_grads(params, (x[:chunk], y[:chunk]),
                                         self.local_grads.arrays)
        self.local_grads.scatter()
        self.channel.gather(None, self.gathered)
        self._losses[0] = loss
        self.comm.Gather(MPI.IN_PLACE, self._losses, root=0)
        self._combine()
        self.client.grad_views.gather()
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
        layout: the :class:`~mpitf.wire.layout.FlatLayout` of the client's placement.
        backend: where the buffers live (the current backend by default).
    """

    def __init__(self, comm, model, layout, backend=None):
        self.comm = comm
        self.model = model
        self.backend = backend or get_backend()
        self.params_flat = self.backend.zeros(layout.size, layout.dtype)
        self.grads_flat = self.backend.zeros(layout.size, layout.dtype)
        self.channel = _Channel(comm, self.backend)
        self.params = layout.views(self.params_flat, self.backend)
        self.grads = layout.views(self.grads_flat, self.backend)
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
            self.channel.bcast(self.params_flat)
            self.params.gather()
            loss[0] = self.model.loss_and_grads(self.params.arrays, (x, y), self.grads.arrays)
            self.grads.scatter()
            self.channel.gather(self.grads_flat)
            self.comm.Gather(loss, None, root=0)
            self.steps += 1


class InGraphBatches:
    """The client's global batches: chunk ``i`` is what worker ``i`` reads between-graph.

    Opens one :class:`~mpitf.data.sharded.ShardedDataset` per worker (shard ``i`` of ``W``) and
    stacks their batches, so the chunks equal the between-graph batches exactly. Its
    position (for checkpoints) is the number of global batches served, kept as
    ``cursor`` (``epoch`` stays 0): every shard's own position follows from it.
    """

    def __init__(self, path, num_shards, batch_size, seed=0, split="train"):
        from ..data.sharded import ShardedDataset

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
