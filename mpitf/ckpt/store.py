"""Checkpoint storage: sharded HDF5 files, a manifest written last, an atomic ``latest``.

Storage only, no messages: each ps calls :func:`write_shard` for its own shard, the chief
calls :func:`write_manifest` once every shard is in, and a restarted job calls
:func:`find_restorable` then :func:`load_shard` on every ps. Variables are stored by name
with their full shape and element ranges, so a checkpoint restores under another ps count
or partitioning. The format is described in ``docs/checkpoint-format.md``.
"""

import errno
import hashlib
import json
import os
import re
import shutil
import time
import zlib
from collections import defaultdict, namedtuple

import numpy as np

from ..errors import CheckpointError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
CKPT_RE = re.compile(r"^ckpt-(\d+)$")
_PART_RE = re.compile(r"^part(\d+)$")

# One dataset of a shard file, as its attributes describe it.
_Piece = namedtuple("_Piece", "file ps_task path kind slot var start stop shape dtype crc")


def checkpoint_name(global_step):
    """Return the directory name of the checkpoint at ``global_step``: ``ckpt-00001200``."""
    return f"ckpt-{int(global_step):08d}"


def shard_name(ps_task, num_ps):
    """Return the file name of ps task ``ps_task``'s shard: ``shard-00000-of-00002.h5``."""
    return f"shard-{int(ps_task):05d}-of-{int(num_ps):05d}.h5"


# ------------------------------------------------------------------ atomic files


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


def _write_text(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
    commit_file(tmp, path)


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(4 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _crc32(array, dtype):
    return zlib.crc32(np.ascontiguousarray(array, dtype=np.dtype(dtype)).tobytes())


# ------------------------------------------------------------------------ writing


def write_shard(ckpt_dir, ps_task, num_ps, global_step, slices, params, slots=None,
                average=None):
    """Write this ps's shard file atomically and return its manifest entry.

    ``ckpt_dir`` is created if needed (ps tasks may race to). ``slices`` are this ps's
    :class:`~mpitf.placement.VariableSlice` list; ``params`` is its flat host buffer,
    ``slots`` maps slot name to a flat buffer (names starting with ``_`` are scratch and
    skipped) and ``average`` is the moving-average buffer or None. Returns
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
    with h5py.File(path + ".tmp", "w") as f:
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
                                dtype=np.dtype(s.dtype).str, crc32=_crc32(data, s.dtype))
    commit_file(path + ".tmp", path)
    return {"file": fname, "ps_task": int(ps_task), "global_step": int(global_step),
            "sha256": _sha256(path)}


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
            n = 1
            while os.path.exists(f"{info['path']}.skipped-{n}"):
                n += 1
            target = f"{info['path']}.skipped-{n}"
            os.replace(info["path"], target)
            moved.append(target)
            log(f"set aside {info['name']} (newer than the restored step {global_step}) "
                f"as {os.path.basename(target)}")
    return moved


def write_manifest(root, global_step, shard_entries, variables, layout, workers, extra=None,
                   max_to_keep=5):
    """Check the shards, write ``manifest.json``, move ``latest``, prune; return the dir.

    ``shard_entries`` are what every ps's :func:`write_shard` returned; ``variables`` is
    ``[(name, shape, dtype)]`` (as ``Placement.variables``) or dicts; ``layout`` is
    ``{"num_ps", "num_workers", "cluster", "mode", "optimizer"}``; ``workers`` maps each
    worker task to its data position ``{"epoch", "cursor", ...}``; ``extra`` is any
    JSON-able dict. ``max_to_keep`` complete checkpoints are kept (None or 0 keeps all).
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
        if _sha256(path) != e["sha256"]:
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
    _write_text(os.path.join(ckpt_dir, MANIFEST), json.dumps(manifest, indent=1) + "\n")
    _write_text(os.path.join(root, LATEST), checkpoint_name(global_step) + "\n")
    _prune(root, checkpoint_name(global_step), max_to_keep)
    return ckpt_dir


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
    # one; they are not counted and not deleted (prepare_save replaces them in turn).
    found = list_checkpoints(root)
    step = int(CKPT_RE.match(current)[1])
    complete = [c["name"] for c in found if c["complete"] and c["global_step"] <= step]
    keep = set(complete[-max_to_keep:] if max_to_keep else complete) | {current}
    newest = max(c["global_step"] for c in found if c["complete"])
    for c in found:
        if c["name"] in keep or c["global_step"] > step:
            continue
        if c["complete"] or c["global_step"] < newest:
            _remove(c["path"])


# ----------------------------------------------------------------------- listing


def latest_name(root):
    try:
        with open(os.path.join(root, LATEST)) as f:
            name = os.path.basename(f.read().strip())
    except FileNotFoundError:
        return None
    return name if CKPT_RE.match(name) else None


def list_checkpoints(root):
    """Return every ``ckpt-*`` directory under ``root``, oldest first.

    Each is ``{"name", "path", "global_step", "complete"}``; complete means its manifest
    is in place (whether it verifies is :func:`verify_checkpoint`'s question).
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


# ------------------------------------------------------------------- verification


def _walk(f, entry):
    """Return the pieces of an open shard file and the problems with their attributes."""
    import h5py

    pieces, problems = [], []

    def visit(path, obj):
        if not isinstance(obj, h5py.Dataset):
            return
        kind, _, rest = path.partition("/")
        slot, var, leaf = None, *rest.rpartition("/")[::2]
        if kind == "slots":
            slot, _, var = var.partition("/")
        if kind not in ("params", "slots", "average") or not var or not _PART_RE.match(leaf):
            problems.append(f"unexpected dataset {path}")
            return
        try:
            a = obj.attrs
            p = _Piece(entry["file"], entry["ps_task"], path, kind, slot, var,
                       int(a["start"]), int(a["stop"]), tuple(int(d) for d in a["shape"]),
                       np.dtype(str(a["dtype"])).str, int(a["crc32"]))
        except (KeyError, OSError, TypeError, ValueError) as e:
            problems.append(f"attributes of {path} missing or unreadable ({e})")
            return
        if obj.ndim != 1 or obj.shape[0] != p.stop - p.start or np.dtype(obj.dtype) != p.dtype:
            problems.append(f"{path} holds {obj.shape} {obj.dtype}, its attributes say "
                            f"[{p.start}:{p.stop}] {np.dtype(p.dtype).name}")
        pieces.append(p)

    f.visititems(visit)
    return pieces, problems


def _read_piece(f, p):
    """Read a piece's elements and check its crc32; raise CheckpointError naming it."""
    try:
        data = f[p.path][...]
    except (OSError, KeyError) as e:
        raise CheckpointError(f"{p.file}: cannot read {p.path} ({e})") from e
    if _crc32(data, p.dtype) != p.crc:
        raise CheckpointError(f"{p.file}: checksum mismatch in {p.path}")
    return data


def _tiles(pieces, size):
    """Return None if ``pieces`` cover ``[0, size)`` exactly, else what is wrong."""
    pos = 0
    for p in sorted(pieces, key=lambda p: (p.start, p.stop)):
        if p.start != pos:
            return f"{'gap' if p.start > pos else 'overlap'} at element {pos}"
        pos = p.stop
    return None if pos == size else f"covered up to element {pos} of {size}"


def verify_checkpoint(ckpt_dir):
    """Return the problems of the checkpoint in ``ckpt_dir``; an empty list means it is whole.

    Checks the manifest, every shard's sha256, every dataset's crc32 and attributes, and
    that the pieces of every variable cover it exactly once.
    """
    import h5py

    if not os.path.isfile(os.path.join(ckpt_dir, MANIFEST)):
        return [f"incomplete (no {MANIFEST})"]
    try:
        manifest = read_manifest(ckpt_dir)
    except CheckpointError as e:
        return [str(e)]
    step = manifest["global_step"]
    variables = {v["name"]: v for v in manifest["variables"]}
    problems, pieces, lost = [], [], False
    for entry in manifest["shards"]:
        fname, path = entry["file"], os.path.join(ckpt_dir, entry["file"])
        if not os.path.isfile(path):
            problems.append(f"{fname}: missing")
            lost = True
            continue
        found = []
        try:
            with h5py.File(path, "r") as f:
                attrs = {k: f.attrs.get(k) for k in ("global_step", "ps_task", "num_ps")}
                want = {"global_step": step, "ps_task": entry["ps_task"],
                        "num_ps": manifest["layout"].get("num_ps", len(manifest["shards"]))}
                found += [f"file attribute {k}={attrs[k]}, expecting {v}"
                          for k, v in want.items() if attrs[k] != v]
                shard_pieces, walk_problems = _walk(f, entry)
                found += walk_problems
                for p in shard_pieces:
                    v = variables.get(p.var)
                    if v is None:
                        found.append(f"{p.path}: variable not in the manifest")
                    elif list(p.shape) != v["shape"] or np.dtype(p.dtype) != v["dtype"]:
                        found.append(f"{p.path}: shape {p.shape} {np.dtype(p.dtype).name}, "
                                     f"manifest says {tuple(v['shape'])} "
                                     f"{np.dtype(v['dtype']).name}")
                    try:
                        _read_piece(f, p)
                    except CheckpointError as e:
                        found.append(str(e).split(": ", 1)[1])
                pieces += shard_pieces
        except OSError as e:
            found.append(f"unreadable HDF5 ({e})")
            lost = True
        if _sha256(path) != entry["sha256"]:
            found.append("sha256 mismatch")
        problems += [f"{fname}: {p}" for p in found]
    if lost:
        return problems  # checking coverage would only repeat that a shard is gone
    groups = defaultdict(list)
    for p in pieces:
        groups[(p.kind, p.slot, p.var)].append(p)
    for name in variables:
        groups.setdefault(("params", None, name), [])
    for (kind, slot, var), group in sorted(groups.items(), key=str):
        v = variables.get(var)
        if v is not None:
            wrong = _tiles(group, int(np.prod(v["shape"], dtype=np.int64)))
            if wrong:
                where = "/".join(x for x in (kind, slot, var) if x)
                problems.append(f"{where}: slices do not cover the variable ({wrong})")
    return problems


def find_restorable(root, log=print):
    """Return ``(ckpt_dir, manifest)`` of the checkpoint to restore, or None if there is none.

    Tries the one ``latest`` names, then older ones, newest first; logs one line for each
    checkpoint passed over. Raises CheckpointError if checkpoints exist but none verifies.
    """
    found = list_checkpoints(root)
    latest = latest_name(root)
    names = [c["name"] for c in found]
    if (latest is None and not any(c["complete"] for c in found)) or not names:
        for name in names:
            log(f"skipping {name}: incomplete (no {MANIFEST}); starting from scratch")
        if latest is not None:
            log(f"skipping {latest}: named by `latest` but does not exist; starting from "
                "scratch")
        return None
    skipped = []
    if latest is not None and latest not in names:
        skipped.append((latest, "named by `latest` but does not exist"))
    top = names.index(latest) if latest in names else len(names) - 1
    skipped += [(n, f"newer than {latest}, which `latest` names") for n in names[top + 1:]]
    for name in reversed(names[:top + 1]):
        path = os.path.join(root, name)
        problems = verify_checkpoint(path)
        if not problems:
            for bad, why in skipped:
                log(f"skipping {bad}: {why}; using {name}")
            return path, read_manifest(path)
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        skipped.append((name, problems[0] + more))
    raise CheckpointError(f"no checkpoint under {root} can be restored: "
                          + "; ".join(f"{n}: {why}" for n, why in skipped)
                          + ". Move the damaged ones away to start from scratch.")


# ------------------------------------------------------------------------ reading


def index_pieces(ckpt_dir, manifest):
    """Return ``{(kind, slot, var): [pieces]}`` for every dataset of the checkpoint."""
    import h5py

    groups = defaultdict(list)
    for entry in manifest["shards"]:
        path = os.path.join(ckpt_dir, entry["file"])
        try:
            with h5py.File(path, "r") as f:
                pieces, problems = _walk(f, entry)
        except OSError as e:
            raise CheckpointError(f"{path}: unreadable HDF5 ({e})") from e
        if problems:
            raise CheckpointError(f"{path}: {problems[0]}")
        for p in pieces:
            groups[(p.kind, p.slot, p.var)].append(p)
    return groups


def _cover(pieces, lo, hi):
    """Return the pieces that tile ``[lo, hi)`` in order, or None on a gap or an overlap."""
    over = sorted((p for p in pieces if p.start < hi and p.stop > lo), key=lambda p: p.start)
    pos = lo
    for p in over:
        if p.start > pos or (p is not over[0] and p.start != pos):
            return None
        pos = p.stop
    return over if pos >= hi else None


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
            cover = _cover(group or [], s.start, s.stop)
            if cover is None:
                where = "/".join(x for x in (kind, slot, s.name) if x)
                raise CheckpointError(f"{ckpt_dir}: {where} does not cover elements "
                                      f"[{s.start}:{s.stop}]; the checkpoint is damaged")
            for p in cover:
                jobs[p].append((s, buf))
    files = {}
    try:
        for p in sorted(jobs, key=lambda p: (p.file, p.path)):
            if p.file not in files:
                files[p.file] = h5py.File(os.path.join(ckpt_dir, p.file), "r")
            data = _read_piece(files[p.file], p)
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
    from ..placement import VariableSlice

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
