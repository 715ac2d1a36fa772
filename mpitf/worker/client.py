"""The worker side: one flat parameter buffer and one flat gradient buffer, laid out ps by ps.

Each ps's part is preceded by a header slot, so a push sends one contiguous view (header and
gradient) and a pull receives one (header and parameters) straight into place. Model
variables are views into these buffers: the model's backward pass writes gradients where
the push reads them, and the pull writes parameters where the forward pass reads them.
Only a variable partitioned over several ps needs a gather after each pull and a scatter
before each push, since its slices are not adjacent.
"""

import dataclasses

import numpy as np

from ..config import (
    DEFAULT_DEADLINE,
    PsAssignment,
    TrainingConfig,
    check_multiple,
    shard_bucket_bytes,
)
from ..errors import ConfigurationError
from ..runtime.backend import get_backend, numpy_backend
from ..wire import dtypes
from ..wire import header as H
from ..wire import protocol as P
from ..wire.frame import Frame, frames_over
from ..wire.layout import FlatLayout, bucket_ranges
from .handles import PushPullHandle, Replies
from .link import PsLink
from .rates import GroupRates
from .transport import Frames, transport_for
from .wire_frames import NativeFrames, wire_stage


class Client:
    """A worker's view of the sharded parameters.

    How its frames travel is one transport strategy (flat, bucketed or node-aggregated,
    :mod:`mpitf.worker.transport`), chosen here once; what they carry is the wire stage
    (:mod:`mpitf.worker.wire_frames`); both reach the ps through one
    :class:`~mpitf.worker.link.PsLink` (``link``).

    Args:
        server: this rank's :class:`~mpitf.runtime.server.Server` (communicator and ranks).
        placement: the :class:`~mpitf.placement.Placement` of the model's variables.
        config: the :class:`~mpitf.config.TrainingConfig` every ps gets at :meth:`start`
            (mode, consistency options, checkpoints, ...); its ``bucket_bytes`` (push in
            buckets of about this many bytes per ps; 0: one frame per ps, see
            :mod:`mpitf.worker.buckets`) and ``wire_dtype`` (what the frames carry; the
            model's buffers stay float32, see :mod:`mpitf.worker.wire_frames`) shape the
            client's frames too. Default: ``TrainingConfig(bucket_bytes=0)``.
        backend: the array backend (numpy by default).
        deadline: seconds to wait for a ps before ending the job; None waits forever.
            The session lowers it as steps run unless ``adaptive`` is False.
        adaptive: tell every ps to adapt its waits to the step time (see ``start``).
        chunk_bytes: chunk size when device buffers are staged through host memory.
        node: a :class:`~mpitf.worker.node.NodeGroup` to aggregate gradients over the node
            (its leader alone talks to the ps; the buffers are the node's shared window),
            or None.
        timeline: the session's :class:`~mpitf.runtime.timeline.Timeline` (bucketed pushes
            and node aggregation record their parts), or None.
    """

    def __init__(self, server, placement, config=None, backend=None, deadline=DEFAULT_DEADLINE,
                 chunk_bytes=P.DEFAULT_CHUNK_BYTES, adaptive=False, node=None, timeline=None):
        self.server = server
        self.placement = placement
        self.config = config = TrainingConfig(bucket_bytes=0) if config is None else config
        self.backend = backend = backend or get_backend()
        self.adaptive = adaptive
        self.comm = server.comm
        self.worker = server.replica_index  # the chief is replica 0
        self.ps_ranks = server.ranks_of("ps")
        if len(self.ps_ranks) != placement.num_ps:
            raise ConfigurationError(
                f"the placement has {placement.num_ps} ps but the cluster has "
                f"{len(self.ps_ranks)}")
        self.layout = FlatLayout(placement)
        self.segments = self.layout.segments
        wire = dtypes.wire_dtype(config.wire_dtype, placement.dtype)
        itemsize = wire.itemsize  # buckets are cut by the bytes they take on the wire
        self.buckets = [bucket_ranges(placement.slices_for_ps(p), n,
                                      shard_bucket_bytes(config, n * itemsize), itemsize)
                        for p, n in enumerate(placement.shard_sizes)]
        self.bucketed = any(len(b) > 1 for b in self.buckets)
        # Gradients: one frame per bucket (a header slot each); parameters: one per ps.
        self.grad_layout = FlatLayout(placement, self.buckets) if self.bucketed else self.layout
        if chunk_bytes is not None:
            check_multiple("chunk_bytes", chunk_bytes, H.HEADER_BYTES)
        transport = transport_for(node, self.bucketed)  # the one choice
        self.params_flat, self.grads_flat = transport.allocate(
            node, backend, self.layout.size, self.grad_layout.size, placement.dtype)
        self.chunk_bytes = chunk_bytes
        self.stage = stage = wire_stage(  # the buffers MPI moves, and their conversions
            NativeFrames(self.layout, self.grad_layout, self.params_flat, self.grads_flat),
            wire, placement, self.buckets, backend)
        # One frame per ps in each buffer: sent as they are, or staged through pinned
        # host memory in chunks (and then the ps is told so, to answer in chunks).
        self.param_frames = frames_over(backend, stage.params_flat, stage.layout.segments,
                                        chunk_bytes)
        self.grad_frames = frames_over(backend, stage.grads_flat,
                                       [seg for _, _, seg in stage.grad_layout.frames],
                                       chunk_bytes)
        self.chunked = self.param_frames[0].staged
        self.link = PsLink(self.comm, self.ps_ranks, self.worker,
                           P.FLAG_CHUNKED if self.chunked else 0, [0] * len(self.segments),
                           deadline, server.host_of)
        # Header-only requests (pull, done, paused) go from small host frames of their own.
        requests = [Frame.allocate(numpy_backend(), 0, np.int64) for _ in self.segments]
        self.param_views = self.layout.views(self.params_flat, backend)
        self.grad_views = self.grad_layout.views(self.grads_flat, backend)
        self.params = self.param_views.arrays
        self.grads = self.grad_views.arrays
        self.timeline = timeline
        self.rates = GroupRates()  # the learning rates each push asks for (see .rates)
        self.replies = Replies(self.link, self.param_frames, stage, self.param_views)
        self.transport = transport(
            self.link, Frames(self.grad_frames, requests, self.segments, chunk_bytes),
            self.replies, stage, self.grad_views, self.rates, backend, timeline, node=node,
            buckets=self.buckets, slices=placement.slices)

    @property
    def deadline(self):
        """Return the seconds every wait on a ps may last (None: forever)."""
        return self.link.deadline

    @deadline.setter
    def deadline(self, seconds):
        self.link.deadline = seconds

    @property
    def learning_rate(self):
        """Return the rate each push asks the ps to apply (a float), or None: the ps's own."""
        return self.rates.learning_rate

    @learning_rate.setter
    def learning_rate(self, rate):
        self.rates.learning_rate = rate

    @property
    def bucketed_push(self):
        """Return the :class:`~mpitf.worker.buckets.BucketedPush` (None without buckets)."""
        return self.transport.bucketed_push

    @classmethod
    def from_config(cls, server, placement, config, node=None, timeline=None):
        """Return the client a :class:`~mpitf.config.TrainingConfig` asks for on ``server``.

        The deadline is the server's (adaptive unless fixed).
        """
        return cls(server, placement, config, deadline=server.deadline,
                   adaptive=not server.fixed_deadline, node=node, timeline=timeline)

    # -- the data path -------------------------------------------------------------------

    def push_pull(self, data_position=(0, 0)):
        """Start pushing the gradient buffer to every ps and pulling parameters back.

        Returns a :class:`PushPullHandle`; parameters must not be read until it is waited.
        ``data_position`` (epoch, cursor after this batch) travels in the header so each ps
        can save it with the checkpoint that includes this gradient. With buckets every
        bucket goes, last layers first (:meth:`start_push` pushes them one by one).
        """
        return self.transport.push_pull(data_position)

    def start_push(self, data_position=(0, 0)):
        """Begin a bucketed push: post every reply's receive; return the push.

        The push is a :class:`~mpitf.worker.buckets.BucketedPush`.

        Then ``final(names)`` as backward finishes variables (each bucket leaves once all
        its variables are final), ``push_rest()``, and ``wait()`` (or ``wait_params(name)``
        for one variable's bucket first). Needs ``bucket_bytes`` that cut some shard.
        """
        return self.transport.start_push(data_position)

    def nonfinite_gradient(self):
        """Return the name of a variable whose gradient holds NaN or Inf, or None.

        One dot product of each ps part with itself finds out cheaply (a NaN or Inf makes
        it NaN or Inf; BLAS reads 2.55 MiB in a third of the time a sum takes); only then
        are variables searched. Checking here, on every worker in parallel, keeps the ps's
        path free of it.
        """
        xp = self.backend.xp
        if all(_finite(xp, self.grads_flat[b:c]) for _, _, (_, b, c) in self.grad_layout.frames) \
                and all(_finite(xp, self.grads[name].reshape(-1))  # a partitioned variable's
                        for name, _ in self.grad_views.split):  # reaches it in push_pull
            return None
        for name, grad in self.grads.items():
            if not bool(xp.isfinite(grad).all()):
                return name
        return None  # the dot product overflowed, but every element is finite

    def skip_push(self):
        """Tell every ps this worker dropped its gradient; return the fresh parameters."""
        return self.transport.request(P.SKIP, True, operation="skip of a non-finite gradient")

    def pull(self, average=False):
        """Fetch the current parameters (or their moving average) from every ps; blocking."""
        kind = P.PULL_AVERAGE if average else P.PULL
        return self.transport.request(kind, True,
                                      operation="pull of the average" if average else "pull")

    # -- set-up and shutdown -------------------------------------------------------------

    def set_gradients(self, grads):
        """Copy a dict of gradients into the flat buffer, checking names, shapes and dtypes.

        The zero-copy way is to write into ``self.grads`` directly; this one is for code
        that computes gradients elsewhere. Nothing is sent.
        """
        for name, value in grads.items():  # check everything before touching anything
            if name not in self.grads:
                raise ConfigurationError(f"gradient for unknown variable {name!r}")
            target = self.grads[name]
            if tuple(value.shape) != tuple(target.shape):
                raise ConfigurationError(
                    f"gradient of {name!r} has shape {tuple(value.shape)}, the variable has "
                    f"{tuple(target.shape)}")
            if np.dtype(value.dtype) != target.dtype:
                raise ConfigurationError(
                    f"gradient of {name!r} has dtype {np.dtype(value.dtype).name}, the "
                    f"variable has {target.dtype.name}")
        missing = set(self.grads) - set(grads)
        if missing:
            raise ConfigurationError(f"no gradient given for {sorted(missing)}")
        for name, value in grads.items():
            self.grads[name][...] = value

    def set_params(self, values):
        """Copy initial values into the flat parameter buffer (names and shapes checked)."""
        for name, target in self.params.items():
            if name not in values:
                raise ConfigurationError(f"no initial value for variable {name!r}")
            value = values[name]
            if tuple(value.shape) != tuple(target.shape):
                raise ConfigurationError(
                    f"initial value of {name!r} has shape {tuple(value.shape)}, the variable "
                    f"has {tuple(target.shape)}")
            target[...] = self.backend.to_device(np.asarray(value, dtype=target.dtype))
        self.param_views.scatter()

    def send_initial_values(self):
        """Send the parameter buffer to every ps as its initial shard (the chief does this)."""
        self.stage.narrow_params()  # a 16-bit wire: the ps starts from the rounded values
        link = self.link
        for p, frame in enumerate(self.param_frames):
            count = self.segments[p][2] - self.segments[p][1]
            H.pack_init(frame.header, link.worker, count, link.flags)
            frame.commit()
        self.backend.synchronize()
        sends = []
        for p, rank in enumerate(link.ranks):
            sends.extend(self.param_frames[p].isend(link.comm, rank, P.TAG_REQUEST))
        PushPullHandle.over(link, [], sends, "init").wait_sends()

    def send_control(self, kind, flags=0):
        """Send a header-only request (done, paused, save) to every ps."""
        self.transport.control(kind, flags)

    def paused(self):
        """Tell every ps this worker paused for a checkpoint (see :mod:`mpitf.ckpt.cut`).

        With node aggregation the leader says it for its node, with each member's data
        position; the other members say nothing.
        """
        self.transport.paused()

    def rejoined(self, lost):
        """After a heal that replaced the ``lost`` ranks: each ps serves its own shard again.

        The chief configures a replaced ps as at the start (its shard comes from its buddy);
        the push's persistent requests were made on the old communicator.
        """
        self.transport.round = None
        self.link.home_again(lost)
        if self.server.is_chief:
            optimizer, total_num_replicas, sparse = self._started_with
            assignments = self._assignments(self.config, optimizer, None, total_num_replicas,
                                            sparse)
            for assignment, rank in zip(assignments, self.ps_ranks):
                if rank in lost:
                    self.comm.send((self.config, assignment), dest=rank, tag=P.TAG_CONTROL)

    def done(self, flags=0):
        """Tell every ps this worker has finished (a node's leader: the node has)."""
        self.transport.done(flags)

    def ps_counters(self):
        """Return each ps's counters (global step, pushes applied, drops, staleness, bytes)."""
        self.send_control(P.COUNTERS)
        link = self.link
        return [P.recv_object(link.comm, rank, P.TAG_CONTROL, link.deadline,
                              lambda p=p: link.describe(p, "counters"))
                for p, rank in enumerate(link.ranks)]

    def start(self, optimizer, initial_values=None, restore=None, total_num_replicas=None,
              sparse=None):
        """Configure every ps (chief only), then pull the starting parameters (every worker).

        Every ps gets the client's :class:`~mpitf.config.TrainingConfig`.

        Args:
            optimizer: the config dict of an optimizer (``Optimizer.config()``).
            initial_values: dict of starting values, sent by the chief unless restoring.
            restore: a checkpoint directory every ps loads its shard from, or None.
            total_num_replicas: the number of workers that push (None: all of them).
            sparse: the embedding tables every ps holds rows of (``Embeddings.assignment``,
                or one per ps: ``Embeddings.assignments``).
        Returns the :class:`~mpitf.worker.handles.Reply` of the first pull (its
        ``global_step`` is where to start).
        """
        config = self.config
        if config.ps_replication_steps:  # a lost ps's frame goes to its buddy (ps/replica.py)
            self.server.survive(self.ps_ranks)
            self.link.replicated = True
        self._started_with = (optimizer, total_num_replicas, sparse)  # for a ps's replacement
        if self.server.is_chief:
            assignments = self._assignments(config, optimizer, restore, total_num_replicas,
                                            sparse)
            for assignment, rank in zip(assignments, self.ps_ranks):
                self.comm.send((config, assignment), dest=rank, tag=P.TAG_CONTROL)
            if restore is None:
                if initial_values is None:
                    raise ConfigurationError("the chief needs initial values or a checkpoint")
                self.set_params(initial_values)
                self.send_initial_values()
        return self.transport.started(self.pull)

    def _assignments(self, config, optimizer, restore, total_num_replicas, sparse):
        """Return each ps's :class:`~mpitf.config.PsAssignment` (the chief sends them)."""
        assignments = []
        for p in range(len(self.ps_ranks)):
            assignments.append(PsAssignment(
                slices=self.placement.slices_for_ps(p),
                shard_size=self.placement.shard_sizes[p],
                dtype=self.placement.dtype.str, num_ps=len(self.ps_ranks),
                optimizer=optimizer, chief_rank=self.server.rank, restore=restore,
                deadline=self.deadline, adaptive=self.adaptive,
                chunk_bytes=self.chunk_bytes,
                total_num_replicas=total_num_replicas,
                sparse=sparse[p] if isinstance(sparse, list) else sparse,
                nodes=self.transport.nodes))
        if config.ps_replication_steps:  # each ps keeps a copy of the one before it
            n = len(assignments)
            assignments = [dataclasses.replace(a, ward=assignments[(p - 1) % n])
                           for p, a in enumerate(assignments)]
        return assignments

    @property
    def num_elements(self):
        """Return the number of parameter elements (without headers)."""
        return self.layout.num_elements


def _finite(xp, x):
    """Return False where 1-D ``x`` holds NaN or Inf (or is so large that x . x overflows)."""
    return np.isfinite(float(xp.dot(x, x)))
