"""How the converters lay out arrays: chunks of whole rows sized for batch reads.

Every array of a split gets the same rows per chunk (a power of two, about 1 MiB of a
split's row, at least 64 rows), so a reader's block is one chunk of each array and reads
whole chunks (:mod:`mpitf.data.stream`). Compression (gzip or lzf) is optional, off by
default: it saves disk and costs a decompression per block read.
"""

import numpy

from ..errors import ConfigurationError

__all__ = ["COMPRESSIONS", "check_compression", "chunk_rows", "create_rows", "split_rows"]

COMPRESSIONS = ("gzip", "lzf")
CHUNK_BYTES = 1 << 20
MIN_ROWS, MAX_ROWS = 64, 1 << 16


def chunk_rows(row_bytes, n):
    """Return the rows per chunk for ``n`` rows of ``row_bytes`` (all a split's arrays)."""
    rows = MIN_ROWS
    while rows < MAX_ROWS and 2 * rows * max(1, int(row_bytes)) <= CHUNK_BYTES:
        rows *= 2
    return max(1, min(rows, int(n)))


def check_compression(compression):
    """Return ``compression`` (None, "gzip" or "lzf"); raise on another."""
    if compression not in (None, *COMPRESSIONS):
        raise ConfigurationError(f"unknown compression {compression!r}: use "
                                 f"{' or '.join(COMPRESSIONS)}, or none")
    return compression


def create_rows(f, name, shape, dtype, rows, compression=None, data=None):
    """Create dataset ``name`` in ``f`` chunked by ``rows`` whole rows (unchunked if empty)."""
    shape = tuple(int(d) for d in shape)
    if not all(shape):  # h5py cannot chunk an empty array
        return f.create_dataset(name, shape=shape, dtype=dtype, data=data)
    return f.create_dataset(name, shape=shape, dtype=dtype, data=data,
                            chunks=(min(rows, shape[0]), *shape[1:]),
                            compression=check_compression(compression))


def split_rows(arrays):
    """Return the rows per chunk shared by ``arrays`` (one split's, row-aligned)."""
    row_bytes = sum(numpy.dtype(a.dtype).itemsize * int(numpy.prod(a.shape[1:]))
                    for a in arrays)
    return chunk_rows(row_bytes, len(arrays[0]) if len(arrays) else 0)
