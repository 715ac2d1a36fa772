"""The flat-buffer layout every worker shares: ps by ps, a header slot before each part.

Between placement (who owns what) and transport (what MPI sends): given a placement, a
:class:`FlatLayout` says where each ps's frame and each variable live in one flat buffer,
and hands out the model's variables as views into any buffer of that layout.
"""

from dataclasses import replace
from itertools import groupby

import numpy as np

from ..errors import ConfigurationError
from .header import HEADER_BYTES


class VariableViews:
    """The model's variables over one flat buffer: views, plus copies for partitioned ones.

    A variable partitioned over several ps, or cut between buckets (a gradient buffer's
    header slots lie between them), is not contiguous in the buffer, so it gets an array
    of its own; :meth:`gather` and :meth:`scatter` move it from and to its slices.
    """

    def __init__(self, arrays, split):
        self.arrays = arrays  # name -> array (a view unless partitioned)
        self.split = split  # [(name, [(slice, flat piece), ...])] for partitioned variables

    def gather(self):
        """Copy partitioned variables from their slices in the flat buffer."""
        for name, parts in self.split:
            whole = self.arrays[name].reshape(-1)
            for s, piece in parts:
                whole[s.start:s.stop] = piece

    def scatter(self, names=None):
        """Copy partitioned variables (or those of ``names``) into their slices."""
        for name, parts in self.split:
            if names is not None and name not in names:
                continue
            whole = self.arrays[name].reshape(-1)
            for s, piece in parts:
                piece[...] = whole[s.start:s.stop]


def frame_segments(sizes, dtype):
    """Return ``(start of header, start of payload, end)`` in elements of each frame.

    Frames of payloads of ``sizes`` elements of ``dtype`` follow each other in one flat
    buffer, each behind a header slot.
    """
    itemsize = np.dtype(dtype).itemsize
    if HEADER_BYTES % itemsize:
        raise ConfigurationError(f"unsupported parameter dtype {np.dtype(dtype)}")
    hdr = HEADER_BYTES // itemsize
    segments, pos = [], 0
    for size in sizes:
        segments.append((pos, pos + hdr, pos + hdr + size))
        pos += hdr + size
    return segments


def bucket_ranges(slices, size, bucket_bytes, itemsize):
    """Return a shard's buckets as element ranges ``(lo, hi)`` in push order.

    ``slices`` (with ``name``, ``offset`` and ``size``) cover a shard of ``size`` elements.
    Backward produces the last layers' gradients first, so buckets are filled and pushed
    from the end of the shard, and cut between modules (a variable's name up to its last
    ``.`` or ``/``: a layer's weight and bias are ready together). A bucket closes before
    the module that would take it over ``bucket_bytes`` (0 or None: one bucket); a module
    larger than that has buckets of its own, cut between its variables, and a variable
    larger than a bucket is cut into equal pieces of at most ``bucket_bytes``. So no bucket
    waits for a layer that backward reaches after its own, and a ps's first answer waits
    for one bucket, however large its variables (8 ps with 512 KiB each in 128 KiB
    variables: a quarter of the model crossed before any answer). The last one pushed,
    whose round trip nothing overlaps, starts the shard, right behind the header slot, and
    carries the reply header back.
    """
    if not bucket_bytes or size * itemsize <= bucket_bytes:
        return [(0, size)]
    ranges, hi, filled = [], size, 0

    def close(at):  # end the bucket being filled at element ``at``
        nonlocal hi, filled
        if filled:
            ranges.append((at, hi))
            hi, filled = at, 0

    in_push_order = sorted(slices, key=lambda s: s.offset, reverse=True)
    for _, group in groupby(in_push_order, key=_module_of):  # consecutive: one module
        module = list(group)
        nbytes = sum(s.size for s in module) * itemsize
        top = module[0].offset + module[0].size
        if nbytes <= bucket_bytes:
            if filled + nbytes > bucket_bytes:
                close(top)
            filled += nbytes
            continue
        close(top)
        for s in module:
            if filled + s.size * itemsize > bucket_bytes:
                close(s.offset + s.size)
            cuts = _cuts_from_end(s, bucket_bytes, itemsize)
            for at in cuts:  # a variable larger than a bucket
                ranges.append((at, hi))
                hi = at
            filled = (hi - s.offset) * itemsize if cuts else filled + s.size * itemsize
        close(module[-1].offset)
    if hi > 0:
        ranges.append((0, hi))
    return ranges


def _cuts_from_end(s, bucket_bytes, itemsize):
    """Return where slice ``s`` is cut into equal pieces of at most ``bucket_bytes``, last first."""
    pieces = -(-s.size * itemsize // bucket_bytes)
    return [s.offset + s.size - j * s.size // pieces for j in range(1, pieces)]


def _module_of(s):
    """Return the module of slice ``s``: its name up to the last ``.`` or ``/`` (or all)."""
    cut = max(s.name.rfind("."), s.name.rfind("/"))
    return s.name[:cut] if cut >= 0 else s.name  # a top-level variable is its own


class FlatLayout:
    """Where each ps's frame and each variable sit in a worker's flat buffer (in elements).

    With ``buckets`` (per ps, the element ranges of :func:`bucket_ranges` in push order)
    every bucket gets a header slot of its own, so each goes out as one frame; without,
    each ps's part is one frame. ``frames`` lists ``(ps, bucket, segment)`` in memory order.
    ``dtype`` (default: the placement's) is the buffer's: a wire dtype's frames have the
    same order and payload sizes, in elements of that dtype.
    """

    def __init__(self, placement, buckets=None, dtype=None):
        self.placement = placement
        self.dtype = placement.dtype if dtype is None else np.dtype(dtype)
        if buckets is None:
            buckets = [[(0, n)] for n in placement.shard_sizes]
        self.buckets = buckets
        cuts = [(p, k, hi - lo) for p, ranges in enumerate(buckets)
                for k, (lo, hi) in reversed(list(enumerate(ranges)))]
        segments = frame_segments([n for _, _, n in cuts], self.dtype)
        self.frames = [(p, k, seg) for (p, k, _), seg in zip(cuts, segments)]
        self._at = {(p, k): seg[1] for p, k, seg in self.frames}
        # (start of header, start of payload, end) per ps: its first frame's header and the
        # end of its last frame (the ps's whole part when there is one bucket per ps)
        self.segments = []
        for p in range(len(buckets)):
            mine = [seg for q, _, seg in self.frames if q == p]
            self.segments.append((mine[0][0], mine[0][1], mine[-1][2]))
        self.size = segments[-1][2] if segments else 0

    def at(self, ps, offset):
        """Return where element ``offset`` of ps ``ps``'s shard lies in the flat buffer."""
        for k, (lo, hi) in enumerate(self.buckets[ps]):
            if lo <= offset < hi or (offset == lo == hi):
                return self._at[(ps, k)] + offset - lo
        raise ValueError(f"offset {offset} is outside the shard of ps {ps}")

    def _pieces(self, s):
        """Return slice ``s`` cut where its ps's buckets are (one piece: ``s`` itself)."""
        end = s.offset + s.size
        cuts = sorted(lo for lo, _ in self.buckets[s.ps_task] if s.offset < lo < end)
        if not cuts:
            return [s]
        bounds = [s.offset, *cuts, end]
        return [replace(s, start=s.start + a - s.offset, stop=s.start + b - s.offset, offset=a)
                for a, b in zip(bounds, bounds[1:])]

    @property
    def num_elements(self):
        """Return the number of parameter elements (headers excluded)."""
        return sum(c - b for _, _, (_, b, c) in self.frames)

    def payloads(self, flat):
        """Return the payload view of every ps's part of ``flat``."""
        return [flat[b:c] for _, b, c in self.segments]

    def views(self, flat, backend=None):
        """Return the :class:`VariableViews` of the model's variables over ``flat``.

        A partitioned variable's own array is allocated on ``backend`` (numpy if None).
        """
        arrays, split = {}, []
        for name, shape, dtype in self.placement.variables:
            parts = []
            for s in self.placement.owner(name):
                for piece in self._pieces(s):
                    at = self.at(piece.ps_task, piece.offset)
                    parts.append((piece, flat[at:at + piece.size]))
            if len(parts) == 1:
                arrays[name] = parts[0][1].reshape(shape)
            else:
                size = int(np.prod(shape, dtype=np.int64))
                whole = backend.zeros(size, dtype) if backend is not None else np.zeros(size,
                                                                                         dtype)
                arrays[name] = whole.reshape(shape)
                split.append((name, parts))
        return VariableViews(arrays, split)
