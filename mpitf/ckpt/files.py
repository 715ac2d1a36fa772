"""Durable files and checksums: write to ``.tmp``, fsync, rename, fsync the directory.

Every file of a checkpoint (each shard, the manifest, ``latest``) and an exported ``.npz``
goes through :func:`commit_file`, so a crash leaves the old file or the new one, never half.
"""

import contextlib
import errno
import hashlib
import os
import zlib

import numpy as np

from ..errors import CheckpointError
from ..runtime.exits import EXIT_IO


class CheckpointWriteError(CheckpointError):
    """A checkpoint file could not be written; the job ends with ``exit_code`` (74)."""

    exit_code = EXIT_IO


def os_cause(exc):
    """Return the short cause of an OSError (h5py's included): ``No space left on device``."""
    if getattr(exc, "errno", None):
        return os.strerror(exc.errno)
    text = str(exc)
    for key in ("error message = '", "errno = "):
        if key in text:  # h5py: "... errno = 28, error message = 'No space left on device'"
            tail = text.split(key, 1)[1]
            return tail.split("'", 1)[0] if key.endswith("'") else f"errno {tail.split(',')[0]}"
    return text.splitlines()[0] if text else type(exc).__name__


@contextlib.contextmanager
def writing(path, what="checkpoint file"):
    """Turn an OSError while writing ``path`` into one line; remove its ``.tmp`` leftover."""
    try:
        yield
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        raise CheckpointWriteError(f"cannot write {what} {path}: {os_cause(exc)}; the earlier "
                                   "checkpoints and `latest` are untouched") from None


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
