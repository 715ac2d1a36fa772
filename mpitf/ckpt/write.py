"""Writing checkpoints: each ps's shard, the chief's manifest and ``latest``, and pruning.

A checkpoint is complete once its manifest is in place; it is written last, after every
shard checks out, and removed first, so a crash never leaves a "complete" checkpoint with
shards missing. The order is described in ``docs/checkpoint-format.md``.
"""

import hashlib
import json
import os
import shutil
import time

import numpy as np

from ..errors import CheckpointError
from .files import commit_file, crc32, sha256, write_text
from .names import (
    CKPT_RE,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    checkpoint_name,
    latest_name,
    list_checkpoints,
    read_manifest,
    shard_name,
)
from .tables import write_tables
from .verify import verify_checkpoint


def write_shard(ckpt_dir, ps_task, num_ps, global_step, slices, params, slots=None,
                average=None, tables=None):
    """Write this ps's shard file atomically and return its manifest entry.

    ``ckpt_dir`` is created if needed (ps tasks may race to). ``slices`` are this ps's
    :class:`~mpitf.placement.VariableSlice` list; ``params`` is its flat host buffer,
    ``slots`` maps slot name to a flat buffer (names starting with ``_`` are scratch and
    skipped) and ``average`` is the moving-average buffer or None; ``tables`` this ps's
    rows of the embedding tables (see :func:`~mpitf.ckpt.tables.write_tables`). Returns
    ``{"file", "ps_task", "global_step", "sha256"}``.
    """
    import h5py

    os.makedirs(ckpt_dir, exist_ok=True)
    if os.path.exists(os.path.join(ckpt_dir, MANIFEST)):
        raise CheckpointError(
            f"{ckpt_dir} is already a complete checkpoint: call prepare_save() before a save")
    buffers = [("params", params)]
    buffers += [(f"slots/{n}", b) for n, b in sorted((slots or {}).items())
                if not n.startswith("_")]
    if average is not None:
        buffers.append(("average", average))
    fname = shard_name(ps_task, num_ps)
    path = os.path.join(ckpt_dir, fname)
    # The file is built in memory and written with plain I/O: a full or failing disk is
    # then one OSError here, not HDF5 errors raised while objects are freed.
    with h5py.File(fname, "w", driver="core", backing_store=False) as f:
        f.attrs.update(global_step=int(global_step), ps_task=int(ps_task),
                       num_ps=int(num_ps), format_version=FORMAT_VERSION)
        for prefix, buf in buffers:
            flat = np.asarray(buf).reshape(-1)
            for s in slices:
                parts = s.name.split("/")
                if any(p in ("", ".", "..") for p in parts):
                    raise CheckpointError(f"variable name {s.name!r} cannot be stored: "
                                          "use names without empty, '.' or '..' parts")
                data = np.ascontiguousarray(flat[s.offset:s.offset + s.size], dtype=s.dtype)
                try:
                    ds = f.create_dataset(f"{prefix}/{s.name}/part{s.part}", data=data)
                except ValueError as e:
                    raise CheckpointError(f"cannot store variable {s.name!r}: {e}") from e
                ds.attrs.update(start=int(s.start), stop=int(s.stop),
                                shape=np.array(s.shape, dtype=np.int64),
                                dtype=np.dtype(s.dtype).str, crc32=crc32(data, s.dtype))
        if tables:
            write_tables(f, tables)
        f.flush()
        image = f.id.get_file_image()
    # The hash of the bytes in hand, not of the file read back: the chief's write_manifest
    # checks the file on disk against it.
    digest = hashlib.sha256(image).hexdigest()
    with open(path + ".tmp", "wb") as out:
        out.write(image)
    del image
    commit_file(path + ".tmp", path)
    return {"file": fname, "ps_task": int(ps_task), "global_step": int(global_step),
            "sha256": digest}


def prepare_save(root, global_step):
    """Make way for a save at ``global_step``; return False if there is nothing to save.

    The chief calls this before it asks the ps tasks to cut. A complete checkpoint at this
    step that ``latest`` names and that verifies is the same cut: returns False. Any other
    directory at this step (left by a crash, or by a run that fell back to an older
    checkpoint) is removed, manifest first, and True is returned.
    """
    path = os.path.join(root, checkpoint_name(global_step))
    if not os.path.isdir(path):
        return True
    if (latest_name(root) == checkpoint_name(global_step)
            and os.path.isfile(os.path.join(path, MANIFEST)) and not verify_checkpoint(path)):
        return False
    _remove(path)
    return True


def set_aside_newer(root, global_step, log=print):
    """Rename checkpoints newer than ``global_step`` out of the way; return the new names.

    After a restore falls back past a damaged or incomplete checkpoint, training reaches
    its step again and must be able to save there. The skipped directories are renamed
    (``ckpt-00000300.skipped-1``), never deleted, so nothing on disk is lost.
    """
    moved = []
    for info in list_checkpoints(root):
        if info["global_step"] > global_step:
            target = _set_aside(info["path"])
            moved.append(target)
            log(f"set aside {info['name']} (newer than the restored step {global_step}) "
                f"as {os.path.basename(target)}")
    return moved


def _set_aside(path):
    """Rename ``path`` to the first free ``path.skipped-N``; return the new path."""
    n = 1
    while os.path.exists(f"{path}.skipped-{n}"):
        n += 1
    os.replace(path, f"{path}.skipped-{n}")
    return f"{path}.skipped-{n}"


def write_manifest(root, global_step, shard_entries, variables, layout, workers, extra=None,
                   max_to_keep=5, buffers=None, delta=None):
    """Check the shards, write ``manifest.json``, move ``latest``, prune; return the dir.

    ``shard_entries`` are what every ps's :func:`write_shard` returned; ``variables`` is
    ``[(name, shape, dtype)]`` (as ``Placement.variables``) or dicts; ``layout`` is
    ``{"num_ps", "num_workers", "cluster", "mode", "optimizer"}``; ``workers`` maps each
    worker task to its data position ``{"epoch", "cursor", ...}``; ``extra`` is any
    JSON-able dict. ``max_to_keep`` complete checkpoints are kept (None or 0 keeps all).
    ``buffers`` is the entry :func:`~mpitf.ckpt.buffers.write_buffers` returned, or None.
    ``delta``: a delta's entry (:func:`~mpitf.ckpt.deltas.delta_entry`), its chain complete.
    """
    ckpt_dir = os.path.join(root, checkpoint_name(global_step))
    entries = sorted((dict(e) for e in shard_entries), key=lambda e: e["ps_task"])
    num_ps = layout.get("num_ps", len(entries))
    if [e["ps_task"] for e in entries] != list(range(num_ps)):
        raise CheckpointError(f"expecting one shard from each of {num_ps} ps tasks, got "
                              f"{[e['ps_task'] for e in entries]}")
    for e in entries:
        path = os.path.join(ckpt_dir, e["file"])
        if int(e["global_step"]) != int(global_step):
            raise CheckpointError(f"{path}: written at step {e['global_step']}, "
                                  f"expecting {global_step}")
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing; ps task {e['ps_task']} did not write it")
        if sha256(path) != e["sha256"]:
            raise CheckpointError(f"{path}: sha256 differs from what ps task "
                                  f"{e['ps_task']} reported")
    manifest = {
        "format_version": FORMAT_VERSION, "global_step": int(global_step),
        "layout": dict(layout),
        "variables": [_variable_dict(v) for v in variables],
        "shards": entries,
        "workers": {str(k): v for k, v in
                    sorted(workers.items(), key=lambda kv: (len(str(kv[0])), str(kv[0])))},
        "extra": dict(extra or {}), "time": time.time(),
    }
    if buffers:
        manifest["buffers"] = dict(buffers)
    _add_delta(root, manifest, delta)
    write_text(os.path.join(ckpt_dir, MANIFEST), json.dumps(manifest, indent=1) + "\n")
    latest = os.path.join(root, LATEST)
    if os.path.isdir(latest) and not os.path.islink(latest):  # garbage; never deleted
        _set_aside(latest)
    write_text(latest, checkpoint_name(global_step) + "\n")
    _prune(root, checkpoint_name(global_step), max_to_keep)
    return ckpt_dir


def _add_delta(root, manifest, delta):
    """Put a delta's entry in its manifest once every base is complete.

    ``latest`` then always names something whole.
    """
    for name in (delta or {}).get("chain", []):
        if not os.path.isfile(os.path.join(root, name, MANIFEST)):
            raise CheckpointError(f"{checkpoint_name(manifest['global_step'])}: base {name} of "
                                  "this delta checkpoint is not complete")
    if delta:
        manifest["delta"] = dict(delta)


def _variable_dict(v):
    name, shape, dtype = (v["name"], v["shape"], v["dtype"]) if isinstance(v, dict) else v
    return {"name": str(name), "shape": [int(d) for d in shape], "dtype": np.dtype(dtype).str}


def _remove(path):
    # The manifest goes first: a crash halfway leaves an incomplete directory, never a
    # "complete" one with shards missing.
    try:
        os.remove(os.path.join(path, MANIFEST))
    except FileNotFoundError:
        pass
    shutil.rmtree(path)


def _prune(root, current, max_to_keep):
    # Complete checkpoints newer than this one belong to a run that fell back to an older
    # one; they are not counted and not deleted (prepare_save replaces them in turn). A
    # directory whose name is not ckpt-<step> is not listed at all, and a "complete" one
    # whose manifest cannot be read or names another step is left alone: only what is
    # known to be a checkpoint is deleted.
    found = list_checkpoints(root)
    step = int(CKPT_RE.match(current)[1])
    complete = [c["name"] for c in found if c["complete"] and c["global_step"] <= step]
    keep = set(complete[-max_to_keep:] if max_to_keep else complete) | {current}
    best = {"path": os.path.join(root, "best")}  # ckpt/best.py's copy: a delta's bases stay
    keep |= {base for c in found + [best] if c is best or (c["name"] in keep and c["complete"])
             for base in _chain(c)}  # a kept delta keeps its bases
    newest = max((c["global_step"] for c in found if c["complete"]), default=step)
    for c in found:
        if c["name"] in keep or c["global_step"] > step:
            continue
        if c["complete"] and _identified(c):
            _remove(c["path"])
        elif not c["complete"] and c["global_step"] < newest:
            _remove(c["path"])


def _chain(info):
    try:
        return (read_manifest(info["path"]).get("delta") or {}).get("chain", [])
    except CheckpointError:
        return []


def _identified(info):
    try:
        return int(read_manifest(info["path"])["global_step"]) == info["global_step"]
    except (CheckpointError, KeyError, TypeError, ValueError):
        return False
