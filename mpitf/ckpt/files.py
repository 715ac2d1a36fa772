"""Durable files and checksums: write to ``.tmp``, fsync, rename, fsync the directory.

Every file of a checkpoint (each shard, the manifest, ``latest``) and an exported ``.npz``
goes through :func:`commit_file`, so a crash leaves the old file or the new one, never half.
"""

import errno
import hashlib
import os
import zlib

import numpy as np


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        # Some file systems cannot fsync a directory; the rename is then as durable as they
        # make it, which is all we can ask for.
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _fsync_file(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_file(tmp, path):
    """Make the finished temporary file ``tmp`` durable, then move it to ``path``."""
    _fsync_file(tmp)
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_text(path, text):
    """Write ``text`` to ``path`` atomically (through ``path.tmp``)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
    commit_file(tmp, path)


def sha256(path):
    """Return the hex sha256 of the whole file at ``path``."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(4 << 20), b""):
            h.update(block)
    return h.hexdigest()


def crc32(array, dtype):
    """Return the crc32 of ``array``'s bytes in ``dtype`` (how each dataset is checked)."""
    return zlib.crc32(np.ascontiguousarray(array, dtype=np.dtype(dtype)).tobytes())
