"""Reading checkpoints back, under any placement: a ps's shard, or every variable whole.

Variables are stored by name with their full shape and element ranges, so a checkpoint
restores under another ps count or partitioning (resharding).
"""

import os
from collections import defaultdict

import numpy as np

from ..errors import CheckpointError
from ..placement import VariableSlice
from .names import read_manifest
from .pieces import cover, index_pieces, read_piece


def _check_model(ckpt_dir, manifest, slices):
    """Raise CheckpointError unless every slice's variable is in the checkpoint as it is."""
    known = {v["name"]: v for v in manifest["variables"]}
    for s in slices:
        v = known.get(s.name)
        if v is None:
            raise CheckpointError(f"variable {s.name!r} of the model is not in {ckpt_dir}")
        if tuple(v["shape"]) != tuple(s.shape):
            raise CheckpointError(f"variable {s.name!r} has shape {tuple(s.shape)} in the "
                                  f"model but {tuple(v['shape'])} in {ckpt_dir}")
        if np.dtype(v["dtype"]) != np.dtype(s.dtype):
            raise CheckpointError(f"variable {s.name!r} is {np.dtype(s.dtype).name} in the "
                                  f"model but {np.dtype(v['dtype']).name} in {ckpt_dir}")


def load_shard(ckpt_dir, manifest, slices, params, slots=None, average=None):
    """Fill this ps's flat buffers from a checkpoint written under any placement.

    For each target slice the overlapping pieces of its variable are read, wherever they
    are, checked against their crc32 and copied to ``offset`` in the buffers. Slots
    (except ``_`` scratch) and the average are filled where the checkpoint has them;
    what it lacks is left as the caller initialised it.

    Returns:
        ``{"missing_slots": [names], "missing_average": bool, "global_step": step}``.
    """
    import h5py

    _check_model(ckpt_dir, manifest, slices)
    groups = index_pieces(ckpt_dir, manifest)
    targets = [("params", None, params)]
    targets += [("slots", n, b) for n, b in sorted((slots or {}).items())
                if not n.startswith("_")]
    if average is not None:
        targets.append(("average", None, average))
    missing = set()
    jobs = defaultdict(list)  # piece -> [(target slice, buffer)]: each piece is read once
    for kind, slot, buf in targets:
        for s in slices:
            group = groups.get((kind, slot, s.name))
            if not group and kind != "params":
                missing.add((kind, slot))
                continue
            pieces, _ = cover(group or [], s.start, s.stop)
            if pieces is None:
                where = "/".join(x for x in (kind, slot, s.name) if x)
                raise CheckpointError(f"{ckpt_dir}: {where} does not cover elements "
                                      f"[{s.start}:{s.stop}]; the checkpoint is damaged")
            for p in pieces:
                jobs[p].append((s, buf))
    files = {}
    try:
        for p in sorted(jobs, key=lambda p: (p.file, p.path)):
            if p.file not in files:
                files[p.file] = h5py.File(os.path.join(ckpt_dir, p.file), "r")
            data = read_piece(files[p.file], p)
            for s, buf in jobs[p]:
                lo, hi = max(s.start, p.start), min(s.stop, p.stop)
                at = s.offset + lo - s.start
                buf[at:at + hi - lo] = data[lo - p.start:hi - p.start]
    except OSError as e:
        raise CheckpointError(f"{ckpt_dir}: cannot read ({e})") from e
    finally:
        for f in files.values():
            f.close()
    return {"missing_slots": sorted(slot for kind, slot in missing if kind == "slots"),
            "missing_average": average is not None and ("average", None) in missing,
            "global_step": manifest["global_step"]}


def read_variables(ckpt_dir, manifest=None):
    """Return every variable of the checkpoint by name, reassembled at its full shape."""
    manifest = manifest or read_manifest(ckpt_dir)
    slices, offset = [], 0
    for v in manifest["variables"]:
        size = int(np.prod(v["shape"], dtype=np.int64))
        slices.append(VariableSlice(v["name"], tuple(v["shape"]), v["dtype"], 0, 0, size,
                                    offset))
        offset += size
    dtype = manifest["variables"][0]["dtype"] if slices else np.float32
    flat = np.zeros(offset, dtype=dtype)
    load_shard(ckpt_dir, manifest, slices, flat)
    return {s.name: flat[s.offset:s.offset + s.size].reshape(s.shape) for s in slices}
