"""The worker side: one flat parameter buffer and one flat gradient buffer, laid out ps by ps.

Each ps's part is preceded by a header slot, so a push sends one contiguous view (header and
gradient) and a pull receives one (header and parameters) straight into place. Model
variables are views into these buffers: the model's backward pass writes gradients where
the push reads them, and the pull writes parameters where the forward pass reads them.
Only a variable partitioned over several ps needs a gather after each pull and a scatter
before each push, since its slices are not adjacent.
"""

import numpy as np

from ..config import DEFAULT_DEADLINE, PsAssignment, check_multiple
from ..errors import ConfigurationError, PeerError
from ..runtime.backend import get_backend, numpy_backend
from ..wire import dtypes
from ..wire import header as H
from ..wire import protocol as P
from ..wire.frame import Frame, frames_over
from ..wire.layout import FlatLayout, bucket_ranges
from .buckets import BucketedPush
from .handles import NodeHandle, PushPullHandle, Reply
from .rates import GroupRates


class Client:
    """A worker's view of the sharded parameters.

    Args:
        server: this rank's :class:`~mpitf.runtime.server.Server` (communicator and ranks).
        placement: the :class:`~mpitf.placement.Placement` of the model's variables.
        backend: the array backend (numpy by default).
        deadline: seconds to wait for a ps before ending the job; None waits forever.
            The session lowers it as steps run unless ``adaptive`` is False.
        adaptive: tell every ps to adapt its waits to the step time (see ``start``).
        chunk_bytes: chunk size when device buffers are staged through host memory.
        bucket_bytes: push in buckets of about this many bytes per ps (0: one frame per
            ps); see :mod:`mpitf.worker.buckets`.
        node: a :class:`~mpitf.worker.node.NodeGroup` to aggregate gradients over the node
            (its leader alone talks to the ps; the buffers are the node's shared window),
            or None.
        wire_dtype: "float32", "bfloat16" or "float16": what the frames carry; the model's
            buffers stay float32 (see :mod:`mpitf.worker.wire_frames`).
    """

    def __init__(self, server, placement, backend=None, deadline=DEFAULT_DEADLINE,
                 chunk_bytes=P.DEFAULT_CHUNK_BYTES, adaptive=False, bucket_bytes=0,
                 node=None, wire_dtype="float32"):
        self.server = server
        self.placement = placement
        self.backend = backend or get_backend()
        self.deadline = deadline
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
        wire = dtypes.wire_dtype(wire_dtype, placement.dtype, self.backend.name)
        itemsize = wire.itemsize  # buckets are cut by the bytes they take on the wire
        self.wire_dtype, self.wire_itemsize = wire_dtype, itemsize
        self.bucket_bytes = bucket_bytes
        self.buckets = [bucket_ranges(placement.slices_for_ps(p), n, bucket_bytes, itemsize)
                        for p, n in enumerate(placement.shard_sizes)]
        self.bucketed = any(len(b) > 1 for b in self.buckets)
        # Gradients: one frame per bucket (a header slot each); parameters: one per ps.
        self.grad_layout = FlatLayout(placement, self.buckets) if self.bucketed else self.layout
        dtype = placement.dtype
        if chunk_bytes is not None:
            check_multiple("chunk_bytes", chunk_bytes, H.HEADER_BYTES)
        self.node = node
        if node is None:
            self.params_flat = self.backend.zeros(self.layout.size, dtype)
            self.grads_flat = self.backend.zeros(self.grad_layout.size, dtype)
        else:  # the node's shared window: one parameter buffer, a gradient slot each
            if self.backend.name != "numpy" or self.bucketed:
                raise ConfigurationError(
                    "aggregate_per_node shares host memory over a node, one frame per ps: "
                    "it needs the numpy backend (--device cpu) and bucket_bytes 0")
            self.params_flat, self.grads_flat = node.allocate(
                self.layout.size, self.grad_layout.size, dtype)
        self.chunk_bytes = chunk_bytes
        self.wire = None  # a 16-bit wire: the frames' buffers, converted to and from these
        if wire != dtype:
            from .wire_frames import WireFrames  # loads numba: only when it converts
            self.wire = WireFrames(self, wire)
        moved = self.wire or self  # the buffers MPI moves
        self.frame_segments = moved.layout.segments
        # One frame per ps in each buffer: sent as they are, or staged through pinned
        # host memory in chunks (and then the ps is told so, to answer in chunks).
        self.param_frames = frames_over(self.backend, moved.params_flat, self.frame_segments,
                                        chunk_bytes)
        self.grad_frames = frames_over(self.backend, moved.grads_flat,
                                       [seg for _, _, seg in moved.grad_layout.frames],
                                       chunk_bytes)
        self.chunked = self.param_frames[0].staged
        self.request_flags = P.FLAG_CHUNKED if self.chunked else 0
        # Header-only requests (pull, done, paused) go from small host frames of their own.
        self.request_frames = [Frame.allocate(numpy_backend(), 0, np.int64)
                               for _ in self.segments]
        self.ps_steps = [0] * len(self.segments)
        self.param_views = self.layout.views(self.params_flat, self.backend)
        self.grad_views = self.grad_layout.views(self.grads_flat, self.backend)
        self.params = self.param_views.arrays
        self.grads = self.grad_views.arrays
        self.timeline = None  # the session's Timeline: bucketed pushes record per bucket
        self.bucketed_push = BucketedPush(self) if self.bucketed else None
        self.learning_rate = None  # a float: each push asks the ps to apply this rate
        self.rates = GroupRates()  # several optimizer groups: their rates (see .rates)
        self.position_frames = None  # a node's leader: its PAUSED and DONE carry positions
        if node is not None:  # nobody may use the shared buffers before all have mapped them
            node.sync(node.deadline, "node start-up")

    @classmethod
    def from_config(cls, server, placement, config, node=None, tables=()):
        """Return the client a :class:`~mpitf.config.TrainingConfig` asks for on ``server``.

        The deadline is the server's (adaptive unless fixed); ``tables`` are the model's
        embedding tables (a 16-bit wire refuses them).
        """
        if tables:
            dtypes.wire_dtype(config.wire_dtype, placement.dtype, tables=True)
        return cls(server, placement, deadline=server.deadline,
                   adaptive=not server.fixed_deadline, bucket_bytes=config.bucket_bytes,
                   node=node, wire_dtype=config.wire_dtype)

    def _describe_ps(self, p):
        rank = self.ps_ranks[p]
        return dict(rank=rank, job="ps", task=p, host=self.server.host_of(rank))

    # -- the data path -------------------------------------------------------------------

    def push_pull(self, data_position=(0, 0)):
        """Start pushing the gradient buffer to every ps and pulling parameters back.

        Returns a :class:`PushPullHandle`; parameters must not be read until it is waited.
        ``data_position`` (epoch, cursor after this batch) travels in the header so each ps
        can save it with the checkpoint that includes this gradient. With buckets every
        bucket goes, last layers first (:meth:`start_push` pushes them one by one).
        """
        if self.bucketed:
            return self.start_push(data_position).push_rest()
        self.grad_views.scatter()
        if self.wire is not None:
            self.wire.narrow_grads()
        epoch, cursor = data_position
        for p, frame in enumerate(self.grad_frames):
            count = self.segments[p][2] - self.segments[p][1]
            H.pack_request(frame.header, P.PUSH, self.ps_steps[p], self.worker, count,
                           self.request_flags, epoch, cursor, self.learning_rate)
            frame.commit()
        self.backend.synchronize()  # MPI must see the finished gradient
        node = self.node
        if node is not None:
            node.reduce(self.segments, self.deadline, self.timeline)
            if not node.leader:
                return NodeHandle(self, None)
        self.rates.send(self)
        receives, sends = [], []
        for p, rank in enumerate(self.ps_ranks):
            receives.append(self.param_frames[p].irecv(self.comm, rank, P.TAG_REPLY))
            sends.extend(self.grad_frames[p].isend(self.comm, rank, P.TAG_REQUEST))
        handle = PushPullHandle(self, receives, sends, "push_pull")
        return handle if node is None else NodeHandle(self, handle)

    def start_push(self, data_position=(0, 0)):
        """Begin a bucketed push: post every reply's receive; return the :class:`BucketedPush`.

        Then ``final(names)`` as backward finishes variables (each bucket leaves once all
        its variables are final), ``push_rest()``, and ``wait()`` (or ``wait_params(name)``
        for one variable's bucket first). Needs ``bucket_bytes`` that cut some shard.
        """
        if self.bucketed_push is None:
            raise ConfigurationError("start_push needs buckets: give the client a "
                                     "bucket_bytes smaller than a ps's shard")
        return self.bucketed_push.begin(data_position)

    def _request(self, kind, want_reply, flags=0, operation="pull", payload=None):
        if self.node is not None and not self.node.leader:
            raise ConfigurationError(
                f"{operation} from a replica that is not its node's leader: with "
                "aggregate_per_node only the leader talks to the ps (the others share "
                "its buffers)")
        frames = self.request_frames
        if payload is not None:  # int64 words after the header (a node's data positions)
            if self.position_frames is None:
                self.position_frames = [Frame.allocate(numpy_backend(), len(payload), np.int64)
                                        for _ in self.segments]
            frames = self.position_frames
        receives, sends = [], []
        for p, rank in enumerate(self.ps_ranks):
            H.pack_request(frames[p].header, kind, self.ps_steps[p], self.worker,
                           0 if payload is None else len(payload), flags | self.request_flags)
            if payload is not None:
                frames[p].payload[...] = payload
            if want_reply:
                receives.append(self.param_frames[p].irecv(self.comm, rank, P.TAG_REPLY))
            sends.extend(frames[p].isend(self.comm, rank, P.TAG_REQUEST))
        handle = PushPullHandle(self, receives, sends, operation)
        return handle.wait() if want_reply else handle.wait_sends()

    def nonfinite_gradient(self):
        """Return the name of a variable whose gradient holds NaN or Inf, or None.

        One reduction per ps part finds out cheaply; only then are variables searched.
        Checking here, on every worker in parallel, keeps the ps's path free of it.
        """
        xp = self.backend.xp
        for _, _, (_, b, c) in self.grad_layout.frames:
            if not np.isfinite(float(xp.add.reduce(self.grads_flat[b:c]))):
                break
        else:
            # A partitioned variable's gradient reaches the flat buffer only in push_pull.
            if all(np.isfinite(float(xp.add.reduce(self.grads[name].reshape(-1))))
                   for name, _ in self.grad_views.split):
                return None
        for name, grad in self.grads.items():
            if not bool(xp.isfinite(grad).all()):
                return name
        return None  # a sum overflowed, but every element is finite

    def skip_push(self):
        """Tell every ps this worker dropped its gradient; return the fresh parameters."""
        return self._request(P.SKIP, True, operation="skip of a non-finite gradient")

    def pull(self, average=False):
        """Fetch the current parameters (or their moving average) from every ps; blocking."""
        kind = P.PULL_AVERAGE if average else P.PULL
        return self._request(kind, True, operation="pull of the average" if average else "pull")

    def _finish(self, widen=True):
        """Read the reply headers, gather partitioned variables, raise on refused gradients.

        ``widen``: a 16-bit wire's replies are widened here (False: per bucket, done).
        """
        if widen and self.wire is not None:
            self.wire.widen_params()
        step = None
        flags = dropped = applied = staleness = lead = 0
        for p, frame in enumerate(self.param_frames):
            reply = H.unpack_reply(frame.fetch_header())
            if reply.kind != P.REPLY:
                raise PeerError(f"unexpected message kind {reply.kind} from a ps",
                                **self._describe_ps(p))
            self.ps_steps[p] = ps_step = reply.step
            step = ps_step if step is None else min(step, ps_step)
            flags |= reply.flags
            dropped += reply.stale_dropped
            applied += reply.pushes_applied
            staleness = max(staleness, reply.max_staleness)
            lead = max(lead, reply.max_lead)
        self.param_views.gather()
        return Reply(step or 0, flags, dropped, applied, staleness, lead)

    # -- set-up and shutdown -------------------------------------------------------------

    def set_gradients(self, grads):
        """Copy a dict of gradients into the flat buffer, checking names, shapes and dtypes.

        The zero-copy way is to write into :attr:`grads` directly; this one is for code
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
        if self.wire is not None:  # a 16-bit wire: the ps starts from the rounded values
            self.wire.narrow_params()
        for p, frame in enumerate(self.param_frames):
            count = self.segments[p][2] - self.segments[p][1]
            H.pack_request(frame.header, P.INIT, 0, self.worker, count, self.request_flags)
            frame.commit()
        self.backend.synchronize()
        sends = []
        for p, rank in enumerate(self.ps_ranks):
            sends.extend(self.param_frames[p].isend(self.comm, rank, P.TAG_REQUEST))
        PushPullHandle(self, [], sends, "init").wait_sends()

    def send_control(self, kind, flags=0):
        """Send a header-only request (done, paused, save) to every ps."""
        self._request(kind, False, flags, operation=P.KIND_NAMES.get(kind, "control"))

    def paused(self):
        """Tell every ps this worker paused for a checkpoint (see :mod:`mpitf.ckpt.cut`).

        With node aggregation the leader says it for its node, with each member's data
        position; the other members say nothing.
        """
        if self.node is not None:
            self.node.fresh = True  # the step after a checkpoint may start late
        self._node_control(P.PAUSED, 0)

    def done(self, flags=0):
        """Tell every ps this worker has finished (a node's leader: the node has)."""
        try:
            self._node_control(P.DONE, flags)
        finally:
            if self.node is not None:
                self.node.close()

    def _node_control(self, kind, flags):
        node = self.node
        if node is None:
            self.send_control(kind, flags)
        elif node.leader:
            self._request(kind, False, flags, operation=P.KIND_NAMES[kind],
                          payload=node.positions(self.segments))

    def ps_counters(self):
        """Return each ps's counters (global step, pushes applied, drops, staleness, bytes)."""
        self.send_control(P.COUNTERS)
        return [P.recv_object(self.comm, rank, P.TAG_CONTROL, self.deadline,
                              lambda p=p: dict(self._describe_ps(p), operation="counters"))
                for p, rank in enumerate(self.ps_ranks)]

    def start(self, config, optimizer, initial_values=None, restore=None,
              total_num_replicas=None, sparse=None):
        """Configure every ps (chief only), then pull the starting parameters (every worker).

        Args:
            config: the :class:`~mpitf.config.TrainingConfig` (mode, consistency options,
                checkpoint directory, ...); every ps gets it.
            optimizer: the config dict of an optimizer (``Optimizer.config()``).
            initial_values: dict of starting values, sent by the chief unless restoring.
            restore: a checkpoint directory every ps loads its shard from, or None.
            total_num_replicas: the number of workers that push (None: all of them).
            sparse: the embedding tables every ps holds rows of (``Embeddings.assignment``).
        Returns the :class:`Reply` of the first pull (its ``global_step`` is where to start).
        """
        if config.wire_dtype != self.wire_dtype:
            raise ConfigurationError(f"the client carries {self.wire_dtype} but the config says "
                                     f"{config.wire_dtype}: give both the same wire_dtype")
        itemsize = self.wire_itemsize
        if [bucket_ranges(self.placement.slices_for_ps(p), n, config.bucket_bytes, itemsize)
                for p, n in enumerate(self.placement.shard_sizes)] != self.buckets:
            raise ConfigurationError(
                f"the client cuts buckets of {self.bucket_bytes} bytes but the config says "
                f"{config.bucket_bytes}: give both the same bucket_bytes")
        if self.server.is_chief:
            for p, rank in enumerate(self.ps_ranks):
                assignment = PsAssignment(
                    slices=self.placement.slices_for_ps(p),
                    shard_size=self.placement.shard_sizes[p],
                    dtype=self.placement.dtype.str, num_ps=len(self.ps_ranks),
                    optimizer=optimizer, chief_rank=self.server.rank, restore=restore,
                    deadline=self.deadline, adaptive=self.adaptive,
                    chunk_bytes=self.chunk_bytes,
                    total_num_replicas=total_num_replicas, sparse=sparse,
                    nodes=None if self.node is None else self.node.nodes)
                self.comm.send((config, assignment), dest=rank, tag=P.TAG_CONTROL)
            if restore is None:
                if initial_values is None:
                    raise ConfigurationError("the chief needs initial values or a checkpoint")
                self.set_params(initial_values)
                self.send_initial_values()
        if self.node is None:
            return self.pull()
        return NodeHandle(self, self.pull() if self.node.leader else None).wait()

    @property
    def num_elements(self):
        """Return the number of parameter elements (without headers)."""
        return self.layout.num_elements
