"""What a checkpoint root holds by name: ``ckpt-*`` directories, ``latest``, manifests.

Reads names and manifests only; nothing here opens a shard file.
"""

import json
import os
import re

from ..errors import CheckpointError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
CKPT_RE = re.compile(r"^ckpt-(\d+)$")


def checkpoint_name(global_step):
    """Return the directory name of the checkpoint at ``global_step``: ``ckpt-00001200``."""
    return f"ckpt-{int(global_step):08d}"


def shard_name(ps_task, num_ps):
    """Return the file name of ps task ``ps_task``'s shard: ``shard-00000-of-00002.h5``."""
    return f"shard-{int(ps_task):05d}-of-{int(num_ps):05d}.h5"


def read_latest(root):
    """Return ``(name, problem)`` of ``latest``: the checkpoint name it holds, or why none.

    ``(None, None)`` when there is no ``latest``; a ``latest`` that is a directory, holds
    binary bytes or something other than a checkpoint name gives ``(None, problem)``.
    """
    path = os.path.join(root, LATEST)
    try:
        with open(path, "rb") as f:
            data = f.read(4096)
    except FileNotFoundError:
        return None, None
    except IsADirectoryError:
        return None, f"{path} is a directory, not a file naming a checkpoint"
    except OSError as e:
        return None, f"{path} is unreadable ({e.strerror})"
    try:
        text = data.decode("ascii").strip()
    except UnicodeDecodeError:
        return None, f"{path} holds binary bytes, not a checkpoint name"
    name = os.path.basename(text)
    if not CKPT_RE.match(name):
        return None, f"{path} holds {text[:40]!r}, not a checkpoint name like ckpt-00001200"
    return name, None


def latest_name(root):
    """Return the checkpoint name ``latest`` holds, or None if it is missing or not one."""
    return read_latest(root)[0]


def list_checkpoints(root):
    """Return every ``ckpt-*`` directory under ``root``, oldest first.

    Each is ``{"name", "path", "global_step", "complete"}``; complete means its manifest
    is in place (whether it verifies is :func:`~mpitf.ckpt.verify.verify_checkpoint`'s
    question).
    """
    if not os.path.isdir(root):
        return []
    found = []
    for entry in os.scandir(root):
        m = CKPT_RE.match(entry.name)
        if m and entry.is_dir():
            found.append({"name": entry.name, "path": entry.path, "global_step": int(m[1]),
                          "complete": os.path.isfile(os.path.join(entry.path, MANIFEST))})
    return sorted(found, key=lambda c: c["global_step"])


def read_manifest(ckpt_dir):
    """Return the manifest of ``ckpt_dir``; raise CheckpointError if missing or unreadable."""
    path = os.path.join(ckpt_dir, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; the checkpoint is incomplete") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from e
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {manifest.get('format_version')!r}, "
                              f"this mpitf reads {FORMAT_VERSION}")
    return manifest
