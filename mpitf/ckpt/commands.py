"""The ``mpitf ckpt`` commands: list, show, verify and export checkpoints.

Each ``cmd_*`` prints to stdout and returns the exit code; the storage itself is the
other ``mpitf.ckpt`` modules'.
"""

import json
import os
import time
import zipfile

import numpy as np

from ..errors import CheckpointError
from .buffers import read_buffers
from .deltas import read_whole_tables
from .files import commit_file
from .names import (
    CKPT_RE,
    LATEST,
    MANIFEST,
    checkpoint_name,
    list_checkpoints,
    read_latest,
    read_manifest,
)
from .pieces import index_pieces
from .restore import read_variables
from .tables import table_shards
from .verify import verify_checkpoint


def describe_checkpoint(ckpt_dir):
    """Return a readable account of a checkpoint: step, layout, variables, worker positions."""
    m = read_manifest(ckpt_dir)
    groups = index_pieces(ckpt_dir, m)
    layout = dict(m["layout"])
    optimizer = layout.pop("optimizer", None)
    tables = layout.pop("tables", [])
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(m.get("time", 0)))
    lines = [f"{os.path.basename(os.path.normpath(ckpt_dir))}: global step {m['global_step']}, "
             f"written {when}", f"path: {os.path.abspath(ckpt_dir)}",
             "layout: " + ", ".join(f"{k} {v}" for k, v in layout.items())]
    if m.get("delta"):
        lines.append(f"delta on {m['delta']['base']}: its tables hold the rows changed since "
                     f"(chain {', '.join(m['delta']['chain'])}); the dense shard whole")
    rules = []  # options per group: each variable's rule is its group's
    if optimizer is not None:
        optimizer = dict(optimizer)
        rules = optimizer.pop("groups", [])
        lines.append(f"optimizer: {json.dumps(optimizer, sort_keys=True)}"
                     + (" (variables in no group)" if rules else ""))
        for k, rule in enumerate(rules):
            options = {o: x for o, x in rule.items() if o != "variables"}
            lines.append(f"  group {k}: {json.dumps(options, sort_keys=True)}")
    group_of = {n: k for k, rule in enumerate(rules) for n in rule["variables"]}
    lines.append(f"variables ({len(m['variables'])}):")
    width = max([len(v["name"]) for v in m["variables"]] + [8])
    for v in m["variables"]:
        where = " ".join(f"ps{p.ps_task}[{p.start}:{p.stop}]" for p in
                         sorted(groups.get(("params", None, v["name"]), []),
                                key=lambda p: p.start))
        rule = ""
        if rules:
            k = group_of.get(v["name"])
            rule = f"{'no group' if k is None else f'group {k}':<9}"
        lines.append(f"  {v['name']:<{width}}  {str(tuple(v['shape'])):<16} "
                     f"{np.dtype(v['dtype']).name:<8} {rule}{where}")
    if tables:
        shards = table_shards(ckpt_dir, m)
        lines.append(f"tables ({len(tables)}):")
        width = max([len(t["name"]) for t in tables] + [8])
        for t in tables:
            where = " ".join(f"ps{p}:{n}" for p, n in sorted(shards[t["name"]]))
            rows = "dynamic" if t["rows"] is None else t["rows"]  # a table that grows
            lines.append(f"  {t['name']:<{width}}  {rows} x {t['dim']:<10} "
                         f"{t['dtype']:<8} rows {where}")
    buffers = (m.get("buffers") or {}).get("buffers", [])
    if buffers:
        lines.append(f"buffers ({len(buffers)}, the chief's, in {m['buffers']['file']}):")
        width = max([len(b["name"]) for b in buffers] + [8])
        lines += [f"  {b['name']:<{width}}  {str(tuple(b['shape'])):<16} "
                  f"{np.dtype(b['dtype']).name}" for b in buffers]
    slots = sorted({slot for kind, slot, _ in groups if kind == "slots"})
    lines.append(f"slots: {', '.join(slots) or 'none'}")
    lines.append(f"average: {'yes' if any(k == 'average' for k, _, _ in groups) else 'no'}")
    lines.append("workers:")
    for task, pos in m["workers"].items():
        lines.append(f"  worker {task}: " + ", ".join(f"{k} {v}" for k, v in pos.items()))
    if m.get("extra"):
        lines.append(f"extra: {json.dumps(m['extra'], sort_keys=True)}")
    return "\n".join(lines)


def _write_npz(arrays, path):
    # np.savez(**variables) would clash with a variable named "file".
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
        for name, value in arrays.items():
            with z.open(name + ".npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, value)


# ------------------------------------------------------------ `mpitf ckpt` commands


def _is_ckpt_dir(path):
    base = os.path.basename(os.path.normpath(path))
    return os.path.isdir(path) and (bool(CKPT_RE.match(base))
                                    or os.path.isfile(os.path.join(path, MANIFEST)))


def _choose(root, step=None):
    """Return the checkpoint directory a command means; raise CheckpointError if none."""
    if step is None and _is_ckpt_dir(root):
        return root
    found = list_checkpoints(root)
    if not found:
        why = "no such directory" if not os.path.isdir(root) else "no ckpt-* directories"
        raise CheckpointError(f"{root}: no checkpoints ({why})")
    if step is not None:
        path = os.path.join(root, checkpoint_name(step))
        if not os.path.isdir(path):
            raise CheckpointError(f"{root}: no checkpoint at step {step}; steps there: "
                                  + ", ".join(str(c["global_step"]) for c in found))
        return path
    latest = _latest(root)
    if latest and os.path.isdir(os.path.join(root, latest)):
        return os.path.join(root, latest)
    complete = [c for c in found if c["complete"]]
    if not complete:
        raise CheckpointError(f"{root}: no complete checkpoint")
    return complete[-1]["path"]


def _latest(root):
    """Return the name ``latest`` holds; print why it is ignored if it is garbage."""
    name, problem = read_latest(root)
    if problem:
        print(f"{LATEST}: ignored: {problem}")
    return name


def _fail(e):
    print(f"mpitf ckpt: {e}")
    return 1


def cmd_ls(root):
    """Print every checkpoint under ``root``, oldest first; return the exit code."""
    found = list_checkpoints(root)
    if not found:
        return _fail(CheckpointError(f"{root}: no checkpoints"))
    latest = _latest(root)
    for c in found:
        size = sum(e.stat().st_size for e in os.scandir(c["path"]) if e.is_file())
        state = "complete" if c["complete"] else "incomplete"
        mark = "  <- latest" if c["name"] == latest else ""
        print(f"{c['name']}  step {c['global_step']:>10}  {size:>14} bytes  {state}"
              f"{_kind(c)}{mark}")
    return 0


def _kind(info):
    """Return how ``ls`` says what a complete checkpoint is: full, or a delta and its base."""
    if not info["complete"]:
        return ""
    try:
        delta = read_manifest(info["path"]).get("delta")
    except CheckpointError:
        return ", unreadable manifest"
    if not delta:
        return ", full"
    return f", delta on {delta['base']} (chain {', '.join(delta['chain'])})"


def cmd_show(root, step=None):
    """Print the checkpoint ``latest`` names (or the one at ``step``); return the exit code."""
    try:
        print(describe_checkpoint(_choose(root, step)))
    except CheckpointError as e:
        return _fail(e)
    return 0


def cmd_verify(root_or_ckpt_dir):
    """Verify one checkpoint or every one under a root; return 0 if whole, 1 if damaged.

    Under a root, an incomplete directory (a save cut short) is listed but is not damage,
    unless ``latest`` names it.
    """
    path = root_or_ckpt_dir
    if _is_ckpt_dir(path):
        problems = verify_checkpoint(path)
        print(f"{os.path.basename(os.path.normpath(path))}: "
              + ("; ".join(problems) if problems else "OK"))
        return 1 if problems else 0
    found = list_checkpoints(path)
    if not found:
        return _fail(CheckpointError(f"{path}: no checkpoints"))
    latest, problem = read_latest(path)
    bad = 0
    if problem:
        print(f"{LATEST}: ignored: {problem}")
        bad += 1
    if latest and latest not in [c["name"] for c in found]:
        print(f"{LATEST}: names {latest}, which does not exist")
        bad += 1
    for c in found:
        if not c["complete"] and c["name"] != latest:
            print(f"{c['name']}: incomplete (no {MANIFEST}); a restore ignores it")
            continue
        problems = verify_checkpoint(c["path"])
        bad += bool(problems)
        print(f"{c['name']}: " + ("; ".join(problems) if problems else "OK"))
    return 1 if bad else 0


def cmd_export(root, out_npz, step=None, write=None):
    """Write every variable, buffer and table of a checkpoint to ``out_npz`` by name.

    A table is one entry ``<table>`` of rows x dim, assembled from every ps's shard (a
    delta checkpoint's with its chain); a table that grows is ``<table>`` (its rows, ids
    ascending) and ``<table>/ids``. A torch model's variables and buffers are its
    ``state_dict()`` keys. ``write(arrays, path)`` writes another format (the torch
    state_dict of :mod:`mpitf.torch.export`); None: an ``.npz``. Returns the exit code.
    """
    try:
        path = _choose(root, step)
        manifest = read_manifest(path)
        variables = read_variables(path, manifest)
        buffers = read_buffers(path, manifest)
        tables = read_whole_tables(path, manifest)
    except CheckpointError as e:
        return _fail(e)
    clash = sorted((set(variables) & set(tables)) | (set(buffers) & (set(variables)
                                                                     | set(tables))))
    if clash:
        return _fail(f"{path}: {clash} name two of a variable, a buffer and a table; an "
                     "npz entry holds one of them")
    tmp = out_npz + ".tmp"
    try:
        (write or _write_npz)({**variables, **buffers, **tables}, tmp)
        commit_file(tmp, out_npz)
    except OSError as e:
        return _fail(f"cannot write {out_npz} ({e})")
    what = (f", {len(buffers)} buffers" if buffers else "") + (
        f" and {len(tables)} tables" if tables else "")
    print(f"wrote {len(variables)} variables{what} of {os.path.basename(path)} to {out_npz}")
    return 0
