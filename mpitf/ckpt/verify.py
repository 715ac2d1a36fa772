"""Whether a checkpoint is whole, and which one a restart restores.

:func:`verify_checkpoint` reads every byte of a checkpoint and names what is wrong;
:func:`find_restorable` picks the newest checkpoint that verifies.
"""

import os
from collections import defaultdict

import numpy as np

from ..errors import CheckpointError
from .buffers import check_buffers
from .deltas import chain_of
from .files import sha256
from .names import MANIFEST, list_checkpoints, read_latest, read_manifest
from .pieces import cover, read_piece, walk
from .tables import check_counts, check_tables


def _check_shard(f, entry, manifest, variables, found):
    """Return the pieces of an open shard file; add its problems (attributes, crc32) to found."""
    attrs = {k: f.attrs.get(k) for k in ("global_step", "ps_task", "num_ps")}
    want = {"global_step": manifest["global_step"], "ps_task": entry["ps_task"],
            "num_ps": manifest["layout"].get("num_ps", len(manifest["shards"]))}
    found += [f"file attribute {k}={attrs[k]}, expecting {v}"
              for k, v in want.items() if attrs[k] != v]
    pieces, walk_problems = walk(f, entry)
    found += walk_problems
    for p in pieces:
        v = variables.get(p.var)
        if v is None:
            found.append(f"{p.path}: variable not in the manifest")
        elif list(p.shape) != v["shape"] or np.dtype(p.dtype) != v["dtype"]:
            found.append(f"{p.path}: shape {p.shape} {np.dtype(p.dtype).name}, "
                         f"manifest says {tuple(v['shape'])} {np.dtype(v['dtype']).name}")
        try:
            read_piece(f, p)
        except CheckpointError as e:
            found.append(str(e).split(": ", 1)[1])
    return pieces


def verify_checkpoint(ckpt_dir, chain=True):
    """Return the problems of the checkpoint in ``ckpt_dir``; an empty list means it is whole.

    Checks the manifest, every shard's sha256, every dataset's crc32 and attributes, that
    the pieces of every variable cover it exactly once, and the buffers file if any.
    A delta checkpoint (:mod:`~mpitf.ckpt.deltas`) is whole only with its chain: each base
    is verified too (``chain``), and a problem of one is named by its base.
    """
    import h5py

    if not os.path.isfile(os.path.join(ckpt_dir, MANIFEST)):
        return [f"incomplete (no {MANIFEST})"]
    try:
        manifest = read_manifest(ckpt_dir)
    except CheckpointError as e:
        return [str(e)]
    variables = {v["name"]: v for v in manifest["variables"]}
    problems, pieces, lost, rows = [], [], False, {}
    for entry in manifest["shards"]:
        fname, path = entry["file"], os.path.join(ckpt_dir, entry["file"])
        if not os.path.isfile(path):
            problems.append(f"{fname}: missing")
            lost = True
            continue
        found = []
        try:
            with h5py.File(path, "r") as f:
                pieces += _check_shard(f, entry, manifest, variables, found)
                found += check_tables(f, manifest, rows)
        except OSError as e:
            found.append(f"unreadable HDF5 ({e})")
            lost = True
        if sha256(path) != entry["sha256"]:
            found.append("sha256 mismatch")
        problems += [f"{fname}: {p}" for p in found]
    problems += check_buffers(ckpt_dir, manifest)
    if chain and manifest.get("delta"):
        problems += _chain_problems(ckpt_dir, manifest)
    if lost:
        return problems  # checking coverage would only repeat that a shard is gone
    if not manifest.get("delta"):  # a delta holds the rows that changed
        problems += check_counts(manifest, rows)
    return problems + _coverage_problems(pieces, variables)


def _coverage_problems(pieces, variables):
    """Return a problem for each variable (params, slot, average) its pieces do not tile."""
    problems = []
    groups = defaultdict(list)
    for p in pieces:
        groups[(p.kind, p.slot, p.var)].append(p)
    for name in variables:
        groups.setdefault(("params", None, name), [])
    for (kind, slot, var), group in sorted(groups.items(), key=str):
        v = variables.get(var)
        if v is not None:
            _, wrong = cover(group, 0, int(np.prod(v["shape"], dtype=np.int64)))
            if wrong:
                where = "/".join(x for x in (kind, slot, var) if x)
                problems.append(f"{where}: slices do not cover the variable ({wrong})")
    return problems


def _chain_problems(ckpt_dir, manifest):
    """Return the problems of a delta checkpoint's bases, each named by its base."""
    try:
        links = chain_of(ckpt_dir, manifest)
    except CheckpointError as e:
        return [str(e)]
    return [f"base {os.path.basename(path)} of this delta checkpoint: {p}"
            for path, _ in links[:-1] for p in verify_checkpoint(path, chain=False)]


def find_restorable(root, log=print):
    """Return ``(ckpt_dir, manifest)`` of the checkpoint to restore, or None if there is none.

    Tries the one ``latest`` names, then older ones, newest first; logs one line for each
    checkpoint passed over. Raises CheckpointError if checkpoints exist but none verifies.
    """
    found = list_checkpoints(root)
    latest, problem = read_latest(root)
    if problem:
        log(f"ignoring `latest`: {problem}; choosing the newest checkpoint that verifies")
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
