"""A model's untrained state in checkpoints: BatchNorm running statistics, counters, frozen weights.

These values never reach the ps; the chief writes its own copy as ``buffers.h5`` in the
checkpoint directory (one dataset per name, full shape, any dtype, each with its crc32)
before the manifest, which records the file's sha256 and every buffer's name, shape and
dtype under ``buffers``. Every worker restores them from there. Arrays by name only: no
framework is imported here.
"""

import hashlib
import os

import numpy as np

from ..errors import CheckpointError
from .files import commit_file, crc32, sha256

FILE = "buffers.h5"


def buffer_dicts(arrays):
    """Return the manifest's description ``[{"name", "shape", "dtype"}]`` of ``arrays``."""
    return [{"name": n, "shape": [int(d) for d in np.shape(a)], "dtype": np.asarray(a).dtype.str}
            for n, a in arrays.items()]


def write_buffers(ckpt_dir, arrays):
    """Write ``arrays`` (name -> array) to ``ckpt_dir/buffers.h5`` atomically; return its entry.

    The entry (``{"file", "sha256", "buffers"}``) goes into the manifest.
    """
    import h5py

    with h5py.File(FILE, "w", driver="core", backing_store=False) as f:
        for name, value in arrays.items():
            if "/" in name or name in ("", ".", ".."):
                raise CheckpointError(f"buffer name {name!r} cannot be stored: use names "
                                      "without '/'")
            data = np.array(value, order="C")  # ascontiguousarray makes a 0-d array 1-d
            ds = f.create_dataset(name, data=data)
            ds.attrs["crc32"] = crc32(data, data.dtype)
        f.flush()
        image = f.id.get_file_image()
    path = os.path.join(ckpt_dir, FILE)
    with open(path + ".tmp", "wb") as out:
        out.write(image)
    commit_file(path + ".tmp", path)
    return {"file": FILE, "sha256": hashlib.sha256(image).hexdigest(),
            "buffers": buffer_dicts(arrays)}


def read_buffers(ckpt_dir, manifest):
    """Return the checkpoint's buffers by name ({} if it has none), each crc32-checked."""
    import h5py

    entry = manifest.get("buffers")
    if not entry:
        return {}
    path = os.path.join(ckpt_dir, entry["file"])
    out = {}
    try:
        with h5py.File(path, "r") as f:
            for b in entry["buffers"]:
                ds = f.get(b["name"])
                if ds is None:
                    raise CheckpointError(f"{path}: buffer {b['name']!r} missing")
                data = ds[()]
                if crc32(data, data.dtype) != int(ds.attrs["crc32"]):
                    raise CheckpointError(f"{path}: checksum mismatch in buffer {b['name']!r}")
                if list(np.shape(data)) != b["shape"] or data.dtype != np.dtype(b["dtype"]):
                    raise CheckpointError(
                        f"{path}: buffer {b['name']!r} is {np.shape(data)} {data.dtype}, the "
                        f"manifest says {tuple(b['shape'])} {np.dtype(b['dtype']).name}")
                out[b["name"]] = data
    except (OSError, KeyError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from e
    return out


def check_buffers(ckpt_dir, manifest):
    """Return the problems of the checkpoint's buffers file (missing, sha256, crc32)."""
    entry = manifest.get("buffers")
    if not entry:
        return []
    path = os.path.join(ckpt_dir, entry["file"])
    if not os.path.isfile(path):
        return [f"{entry['file']}: missing"]
    problems = [] if sha256(path) == entry["sha256"] else [f"{entry['file']}: sha256 mismatch"]
    try:
        read_buffers(ckpt_dir, manifest)
    except CheckpointError as e:
        problems.append(str(e).replace(path, entry["file"]))
    return problems


def check_model_buffers(ckpt_dir, manifest, arrays):
    """Raise CheckpointError unless the checkpoint holds every one of ``arrays`` as it is."""
    saved = {b["name"]: b for b in (manifest.get("buffers") or {}).get("buffers", [])}
    for name, value in arrays.items():
        b = saved.get(name)
        if b is None:
            raise CheckpointError(f"buffer {name!r} of the model is not in {ckpt_dir}: the "
                                  "model differs from the one that wrote the checkpoint")
        shape, dtype = tuple(np.shape(value)), np.asarray(value).dtype
        if tuple(b["shape"]) != shape or np.dtype(b["dtype"]) != dtype:
            raise CheckpointError(
                f"buffer {name!r} is {dtype.name} {shape} in the model but "
                f"{np.dtype(b['dtype']).name} {tuple(b['shape'])} in {ckpt_dir}")
    extra = sorted(set(saved) - set(arrays))
    if extra:
        raise CheckpointError(f"{ckpt_dir} holds buffer(s) {extra} that the model does not "
                              "have: the model differs from the one that wrote it")
