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


def latest_name(root):
    """Return the checkpoint name ``latest`` holds, or None if it is missing or not one."""
    try:
        with open(os.path.join(root, LATEST)) as f:
            name = os.path.basename(f.read().strip())
    except FileNotFoundError:
        return None
    return name if CKPT_RE.match(name) else None


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
