"""The flat-buffer layout every worker shares: ps by ps, a header slot before each part.

Between placement (who owns what) and transport (what MPI sends): given a placement, a
:class:`FlatLayout` says where each ps's frame and each variable live in one flat buffer,
and hands out the model's variables as views into any buffer of that layout.
"""

import numpy as np

from ..errors import ConfigurationError
from .header import HEADER_BYTES


class VariableViews:
    """The model's variables over one flat buffer: views, plus copies for partitioned ones.

    A variable partitioned over several ps is not contiguous in the buffer, so it gets an
    array of its own; :meth:`gather` and :meth:`scatter` move it from and to its slices.
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

    def scatter(self):
        """Copy partitioned variables into their slices in the flat buffer."""
        for name, parts in self.split:
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


class FlatLayout:
    """Where each ps's frame and each variable sit in a worker's flat buffer (in elements)."""

    def __init__(self, placement):
        self.placement = placement
        self.dtype = placement.dtype
        # (start of header, start of payload, end) per ps
        self.segments = frame_segments(placement.shard_sizes, self.dtype)
        self.size = self.segments[-1][2] if self.segments else 0

    @property
    def num_elements(self):
        """Return the number of parameter elements (headers excluded)."""
        return sum(c - b for _, b, c in self.segments)

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
                at = self.segments[s.ps_task][1] + s.offset
                parts.append((s, flat[at:at + s.size]))
            if len(parts) == 1:
                arrays[name] = parts[0][1].reshape(shape)
            else:
                size = int(np.prod(shape, dtype=np.int64))
                whole = backend.zeros(size, dtype) if backend is not None else np.zeros(size,
                                                                                         dtype)
                arrays[name] = whole.reshape(shape)
                split.append((name, parts))
        return VariableViews(arrays, split)
