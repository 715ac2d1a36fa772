"""One ps's slice of the model: parameters in a reply frame, optimizer slots, moving average.

The parameters are the payload of a reply :class:`~mpitf.wire.frame.Frame`, right behind
its header, so answering a worker is one send of one contiguous view; the optimizer updates
them in place. A ps on a GPU keeps its shard on the device; how its frames reach MPI
(directly, or staged through pinned host memory) is the frame's business.

With a 16-bit wire (bfloat16, float16) the parameters are a float32 master of their own and
the reply frame holds them rounded: the fused kernel writes both in its one pass; the
reference passes (optimizers without a kernel) read a gradient widened into a scratch
buffer and round the reply after.
"""

import numpy as np

from ..wire.dtypes import wire_dtype
from ..wire.frame import Frame
from .groups import ElementRules
from .optimizers import FUSED_MIN_SIZE, ExponentialMovingAverage, make_optimizer
from .threads import KernelPool, default_threads


class Shard:
    """The variables one ps owns, as flat buffers, with the optimizer that updates them."""

    def __init__(self, slices, size, dtype, optimizer, backend, average=None, threads=1,
                 wire=None):
        self.slices = slices
        self.size = size
        self.dtype = np.dtype(dtype)
        self.wire = self.dtype if wire is None else np.dtype(wire)  # what the frames carry
        self.backend = backend
        self.xp = backend.xp
        self.optimizer = optimizer
        self.rules = ElementRules(optimizer, slices, size)  # which rule updates which range
        self.reply = Frame.allocate(backend, size, self.wire)
        self.params = self.reply.payload
        self.widened = None  # a 16-bit wire: a gradient widened for the reference passes
        self.convert = None  # ... and its conversions (numba's: loaded for such a wire only)
        if self.wire != self.dtype:
            from ..wire import convert

            self.params = backend.zeros(size, dtype)
            self.widened = np.empty(size, dtype)
            self.convert = convert
        # Slots are made with the array module, then placed on the backend's device (a
        # no-op for numpy and CuPy; it matters for backends whose module is numpy).
        self.slots = {k: backend.to_device(v)
                      for k, v in self.rules.make_slots(size, self.xp, dtype).items()}
        # The kernel threads, and the kernel compiled (or loaded from numba's cache) now,
        # at start-up, not in the first step. A device shard, and a host one too small for
        # the kernels (optimizers.FUSED_MIN_SIZE), run the ufunc passes.
        self.pool = KernelPool(threads) if backend.name == "numpy" else None
        if self.pool is not None and size >= FUSED_MIN_SIZE:
            from .kernels import warm_up  # numba: a small shard never loads it

            for opt in self.rules.optimizers:
                warm_up(opt, self.dtype, self.wire)
        if self.widened is not None:
            self.convert.warm_up(self.wire)
        self.average = average  # an ExponentialMovingAverage or None
        self.average_frame = Frame.allocate(backend, size, dtype) if average is not None else None
        self._views = {}  # (lo, hi) -> (params, slots, average, reply, widened) views, made once
        self._whole = self._views[(0, size)] = self._views_of(0, size)  # every push's, unbucketed
        parts = self._whole[0]
        # A one-frame push's update: the rule's own bound update where one rule covers the
        # shard and no average follows it (a call less at 4 KiB), else :meth:`apply`.
        self.apply_whole = parts[0][0] if len(parts) == 1 and average is None else self.apply

    @classmethod
    def from_config(cls, config, assignment, backend, server):
        """Return the shard a ps's :class:`~mpitf.config.PsAssignment` describes."""
        dtype = np.dtype(assignment.dtype)
        wire = wire_dtype(config.wire_dtype, dtype)
        ema = config.moving_average_decay
        return cls(assignment.slices, assignment.shard_size, dtype,
                   make_optimizer(**assignment.optimizer), backend,
                   ExponentialMovingAverage(ema) if ema else None,
                   config.ps_threads or default_threads(server.hosts, server.rank), wire)

    def apply(self, grad, step, lo=0, hi=None):
        """Update the parameters with ``grad`` at global step ``step`` (before the update).

        ``lo``, ``hi``: update elements ``[lo, hi)`` only (a bucket), ``grad`` being theirs.
        The optimizers work element by element, so a slice's update is the same arithmetic
        as the whole shard's on those elements (bit for bit).
        """
        views = self._range(lo, hi)
        parts, average, params = views
        if len(parts) == 1:  # one rule (no groups, or one group here): the gradient as it is
            parts[0][0](grad, step)
        else:  # a rule per range: each range's own options, the same kernels
            for update, a, b in parts:
                update(grad[a:b], step)
        if average is not None:
            self.average.apply(average, params, step)

    def assign(self, values, step, lo=0, hi=None):
        """Put ``values`` in place of elements ``[lo, hi)`` (local SGD's average).

        The update rule of a policy that averages parameters instead of applying a
        gradient; the moving average, if any, follows as after an optimizer's step.
        """
        _, average, params = self._range(lo, hi)
        params[...] = values
        if average is not None:
            self.average.apply(average, params, step)

    def _range(self, lo, hi):
        """Return the views of ``[lo, hi)`` (None: the whole shard), made once per range."""
        if hi is None:  # the whole shard (lo is 0)
            return self._whole
        views = self._views.get((lo, hi))
        if views is None:
            views = self._views[(lo, hi)] = self._views_of(lo, hi)
        return views

    def _views_of(self, lo, hi):
        """Return ``(parts, average, params)`` for ``[lo, hi)``, made once per range.

        ``parts``: ``(update, a, b)`` per rule, its update bound to its views of ``[a, b)``
        within the range; then the average's and the parameters' views of the range.
        """
        wire = self.widened is not None

        def cut(a, x, y):
            return a if x == 0 and y == self.size else a[x:y]

        parts = []
        for a, b, opt in self.rules.parts(lo, hi):
            x, y = lo + a, lo + b
            update = opt.bind(cut(self.params, x, y),
                              {k: cut(v, x, y) for k, v in self.slots.items()}, self.pool,
                              cut(self.reply.payload, x, y) if wire else None,
                              cut(self.widened, x, y) if wire else None)
            parts.append((update, a, b))
        average = (cut(self.average_frame.payload, lo, hi) if self.average is not None
                   else None)
        return tuple(parts), average, cut(self.params, lo, hi)

    def set_learning_rates(self, rates):
        """Apply each group's learning rate (a worker's ``RATES`` request)."""
        self.optimizer.set_learning_rates(rates)

    def widen(self, grad, lo, hi):
        """Return a wire-dtype gradient of elements ``[lo, hi)`` widened (scratch: reused)."""
        out = self.widened[lo:hi]
        self.convert.widen_into(grad, out)
        return out

    def initialize(self, values):
        """Take the initial values a worker sent (in the wire dtype) as the parameters."""
        if self.widened is None:
            self.params[...] = values
        else:
            self.convert.widen_into(values, self.params)
            self.reply.payload[...] = values
        self.start_average()

    def restored(self):
        """Round the float32 parameters, just restored, into the reply (a 16-bit wire)."""
        if self.widened is not None:
            self.convert.narrow_into(self.params, self.reply.payload)

    def publish(self, lo, hi):
        """Make elements ``[lo, hi)`` as updated visible to MPI (the header untouched)."""
        if self.reply.staged:
            for frame in (self.reply, self.average_frame):
                if frame is not None:
                    frame.publish(lo, hi)
        else:
            self.backend.synchronize()

    def close(self):
        """Stop the kernel threads."""
        if self.pool is not None:
            self.pool.close()

    def start_average(self):
        """Begin the moving average at the current parameters."""
        if self.average_frame is not None:
            self.average_frame.payload[...] = self.params

    def saved_slots(self):
        """Return the slots a checkpoint keeps (scratch buffers excluded)."""
        return {k: v for k, v in self.slots.items() if not k.startswith("_")}
