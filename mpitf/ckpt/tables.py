"""Embedding tables in checkpoints: each ps saves its rows by id; any ps count restores them.

In a ps's shard file, table ``<name>`` is the group ``tables/<name>`` (attributes ``rows``,
``dim``, ``dtype``) with datasets ``ids`` (the global row ids, int64), ``rows`` (their
values, ids x dim) and ``slots/<slot>`` (optimizer slots of the same rows), each with its
``crc32``. The manifest's ``layout.tables`` lists every table's name, rows, dim and
dtype. Restore reads every shard's ids and keeps the rows the new ps holds, so a table
saved under P ps tasks restores bit for bit under any other count; a table whose rows,
dim or dtype differ from the model's is refused by name.

A table that grows (manifest ``rows`` null, attribute ``rows`` -1) saves the rows its ps
holds, by id, with ``state/last_seen`` and ``state/uses`` of each row and
``pending/ids``, ``pending/counts`` (ids counted but not admitted yet); restore routes
each id to the ps its hash names under the new ps count.
"""

import os
import zlib

import numpy as np

from ..errors import CheckpointError
from .files import crc32

GROUP = "tables"
BLOCK = 1 << 18  # rows read at a time on restore (memory stays bounded for large tables)


def table_dicts(specs):
    """Return the manifest's description of ``specs`` (EmbeddingTable objects)."""
    return [{"name": t.name, "rows": None if t.rows is None else int(t.rows),
             "dim": int(t.dim), "dtype": t.dtype} for t in specs]


def _rows_attr(rows):
    return -1 if rows is None else int(rows)


def write_tables(f, tables):
    """Write ``tables`` (``[{"spec", "ids", "rows", "slots"}]``) into the open shard ``f``."""
    for t in tables:
        spec = t["spec"]
        g = f.create_group(f"{GROUP}/{spec.name}")
        g.attrs.update(rows=_rows_attr(spec.rows), dim=int(spec.dim), dtype=spec.dtype)
        items = [("ids", t["ids"]), ("rows", t["rows"])]
        items += [(f"slots/{k}", v) for k, v in sorted(t["slots"].items())]
        items += sorted(t.get("extra", {}).items())
        for name, data in items:
            ds = g.create_dataset(name, data=np.ascontiguousarray(data))
            ds.attrs["crc32"] = crc32(data, data.dtype)


def _read(ds, path):
    data = ds[...]
    if crc32(data, data.dtype) != int(ds.attrs["crc32"]):
        raise CheckpointError(f"checksum mismatch in {path}")
    return data


def check_tables(f, manifest, counts):
    """Return the problems of the tables in one open shard file (attributes, crc32).

    Adds each table's saved rows to ``counts`` (name -> rows), for :func:`check_counts`.
    """
    problems = []
    want = {t["name"]: t for t in manifest["layout"].get("tables", [])}
    group = f.get(GROUP)
    for name in (group.keys() if group is not None else ()):
        t, g = want.get(name), group[name]
        if t is None:
            problems.append(f"{GROUP}/{name}: table not in the manifest")
            continue
        if (int(g.attrs["rows"]), int(g.attrs["dim"]), str(g.attrs["dtype"])) != \
                (_rows_attr(t["rows"]), t["dim"], t["dtype"]):
            problems.append(f"{GROUP}/{name}: attributes differ from the manifest")
        try:
            ids = _read(g["ids"], f"{GROUP}/{name}/ids")
            counts[name] = counts.get(name, 0) + len(ids)
            for key in ["rows"] + [f"slots/{k}" for k in g.get("slots", {}).keys()] \
                    + [f"state/{k}" for k in g.get("state", {}).keys()] \
                    + [f"pending/{k}" for k in g.get("pending", {}).keys()] \
                    + (["evicted"] if "evicted" in g else []):
                data = _read(g[key], f"{GROUP}/{name}/{key}")
                if not key.startswith(("rows", "slots")):
                    continue
                if data.shape != (len(ids), t["dim"]):
                    problems.append(f"{GROUP}/{name}/{key}: shape {data.shape}, expecting "
                                    f"({len(ids)}, {t['dim']})")
        except (CheckpointError, KeyError, OSError) as e:
            problems.append(str(e))
    return problems


def check_counts(manifest, counts):
    """Return a problem for every table whose shards do not hold each row once in all."""
    return [f"{GROUP}/{t['name']}: the shards hold {counts.get(t['name'], 0)} rows of "
            f"{t['rows']}" for t in manifest["layout"].get("tables", [])
            if t["rows"] is not None and counts.get(t["name"], 0) != t["rows"]]


def check_model(ckpt_dir, manifest, specs):
    """Raise CheckpointError unless every table of the model is saved with its shape."""
    saved = {t["name"]: t for t in manifest["layout"].get("tables", [])}
    for spec in specs:
        t = saved.get(spec.name)
        if t is None:
            raise CheckpointError(f"table {spec.name!r} of the model is not in {ckpt_dir}")
        if (t["rows"], t["dim"], t["dtype"]) != (spec.rows, spec.dim, spec.dtype):
            def shape(rows, dim, dtype):
                return f"{'dynamic' if rows is None else rows} x {dim} {dtype}"
            raise CheckpointError(
                f"table {spec.name!r} is {shape(spec.rows, spec.dim, spec.dtype)} in the model "
                f"but {shape(t['rows'], t['dim'], t['dtype'])} in {ckpt_dir}; restore it into "
                "the model that saved it, or start from another checkpoint directory")


def table_shards(ckpt_dir, manifest):
    """Return {table: [(ps_task, rows saved)]} from every shard (shapes only, no data)."""
    import h5py

    out = {t["name"]: [] for t in manifest["layout"].get("tables", [])}
    for entry in manifest["shards"]:
        path = os.path.join(ckpt_dir, entry["file"])
        try:
            with h5py.File(path, "r") as f:
                for name, where in out.items():
                    g = f.get(f"{GROUP}/{name}/ids")
                    where.append((entry["ps_task"], 0 if g is None else len(g)))
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read ({e})") from e
    return out


def read_tables(ckpt_dir, manifest):
    """Return {table: rows x dim array} of every table, assembled from every shard.

    Each shard's ids and rows are checked against their crc32; every row must be saved
    exactly once. The whole table is in memory (it is for export, not for a ps).
    """
    import h5py

    out = {}
    for t in manifest["layout"].get("tables", []):
        if t["rows"] is None:
            out[t["name"] + "/ids"], out[t["name"]] = _read_dynamic(ckpt_dir, manifest, t)
            continue
        table = np.zeros((t["rows"], t["dim"]), t["dtype"])
        seen = np.zeros(t["rows"], bool)
        for entry in manifest["shards"]:
            path = os.path.join(ckpt_dir, entry["file"])
            where = f"{path}: {GROUP}/{t['name']}"
            try:
                with h5py.File(path, "r") as f:
                    g = f.get(f"{GROUP}/{t['name']}")
                    if g is None:
                        continue
                    ids = _read(g["ids"], f"{where}/ids")
                    rows = _read(g["rows"], f"{where}/rows")
            except OSError as e:
                raise CheckpointError(f"{path}: cannot read ({e})") from e
            if len(ids) and (ids.min() < 0 or ids.max() >= t["rows"] or seen[ids].any()
                             or len(np.unique(ids)) != len(ids)):
                raise CheckpointError(f"{where}/ids: a row out of range or saved twice")
            if rows.shape != (len(ids), t["dim"]):
                raise CheckpointError(f"{where}/rows: shape {rows.shape}, expecting "
                                      f"({len(ids)}, {t['dim']})")
            seen[ids] = True
            table[ids] = rows
        if not seen.all():
            raise CheckpointError(f"{ckpt_dir}: table {t['name']!r} lacks "
                                  f"{int((~seen).sum())} rows; the checkpoint is damaged")
        out[t["name"]] = table
    return out


def _read_dynamic(ckpt_dir, manifest, t):
    """Return (ids ascending, rows) of a dynamic table from every shard, checked."""
    import h5py

    ids, rows = [np.empty(0, np.int64)], [np.empty((0, t["dim"]), t["dtype"])]
    for entry in manifest["shards"]:
        path = os.path.join(ckpt_dir, entry["file"])
        try:
            with h5py.File(path, "r") as f:
                g = f.get(f"{GROUP}/{t['name']}")
                if g is not None:
                    ids.append(_read(g["ids"], f"{path}: {GROUP}/{t['name']}/ids"))
                    rows.append(_read(g["rows"], f"{path}: {GROUP}/{t['name']}/rows"))
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read ({e})") from e
    ids, rows = np.concatenate(ids), np.concatenate(rows)
    order = np.argsort(ids, kind="stable")
    if len(ids) and (np.diff(ids[order]) == 0).any():
        raise CheckpointError(f"{ckpt_dir}: table {t['name']!r} holds an id twice")
    return ids[order], rows[order]


def load_tables(ckpt_dir, manifest, tables):
    """Fill ``tables`` (``[{"spec", "placement", "ps", "rows", "slots"}]``) from every shard.

    Each shard's rows are read in blocks and the ones this ps holds are copied in; every
    row must be found exactly once. Slots the checkpoint lacks keep their initial values.
    """
    import h5py

    check_model(ckpt_dir, manifest, [t["spec"] for t in tables])
    found = [np.zeros(0 if "dynamic" in t else len(t["rows"]), bool) for t in tables]
    for entry in manifest["shards"]:
        path = os.path.join(ckpt_dir, entry["file"])
        try:
            with h5py.File(path, "r") as f:
                for t, seen in zip(tables, found):
                    load = _load_dynamic if "dynamic" in t else _load_one
                    load(f, t, seen, f"{path}: {GROUP}/{t['spec'].name}")
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read ({e})") from e
    for t, seen in zip(tables, found):
        if not seen.all():
            raise CheckpointError(f"{ckpt_dir}: table {t['spec'].name!r} lacks "
                                  f"{int((~seen).sum())} rows; the checkpoint is damaged")


def _load_one(f, t, seen, where):
    """Copy the rows of one table in an open shard that this ps holds, checking crc32s.

    Blocks are read in order and their crc32 chained, so a table of any size is checked
    and copied in bounded memory; a mismatch raises after the copy (the job then ends,
    nothing is written).
    """
    g = f.get(f"{GROUP}/{t['spec'].name}")
    if g is None:
        return
    keys = [("ids", None), ("rows", t["rows"])]
    keys += [(f"slots/{k}", v) for k, v in t["slots"].items() if f"slots/{k}" in g]
    crcs = dict.fromkeys((k for k, _ in keys), 0)
    placement, ps, n = t["placement"], t["ps"], len(g["ids"])
    for lo in range(0, n, BLOCK):
        block = g["ids"][lo:lo + BLOCK]
        crcs["ids"] = zlib.crc32(np.ascontiguousarray(block).tobytes(), crcs["ids"])
        mine = placement.owner(block) == ps
        local = placement.local(block[mine], ps)
        if seen[local].any():
            raise CheckpointError(f"{where}: a row is saved twice")
        seen[local] = True
        for key, dest in keys[1:]:
            data = g[key][lo:lo + len(block)]
            crcs[key] = zlib.crc32(np.ascontiguousarray(data).tobytes(), crcs[key])
            dest[local] = data[mine]
    for key, value in crcs.items():
        if value != int(g[key].attrs["crc32"]):
            raise CheckpointError(f"{where}/{key}: checksum mismatch")


def _load_dynamic(f, t, seen, where):
    """Give a dynamic table's shard the rows (and pending counts) of an open shard it owns.

    Read in blocks, each id routed by the new ps count's hash; crc32s chained as
    :func:`_load_one` does.
    """
    g = f.get(f"{GROUP}/{t['spec'].name}")
    if g is None:
        return
    shard, placement, ps = t["dynamic"], t["placement"], t["ps"]
    keys = ["ids", "rows"] + [f"{part}/{k}" for part in ("slots", "state")
                              for k in g.get(part, {}).keys()]
    crcs = dict.fromkeys(keys, 0)
    for lo in range(0, len(g["ids"]), BLOCK):
        block = {k: g[k][lo:lo + BLOCK] for k in keys}
        for k, data in block.items():
            crcs[k] = zlib.crc32(np.ascontiguousarray(data).tobytes(), crcs[k])
        mine = placement.owner(block["ids"]) == ps
        values = {k: v[mine] for k, v in block.items() if not k.startswith("slots/")}
        values["slots"] = {k[6:]: v[mine] for k, v in block.items() if k.startswith("slots/")}
        shard.restore(values.pop("ids"), values)
    if "pending" in g:
        ids, counts = g["pending/ids"][...], g["pending/counts"][...]
        crcs.update({"pending/ids": zlib.crc32(ids.tobytes()),
                     "pending/counts": zlib.crc32(counts.tobytes())})
        mine = placement.owner(ids) == ps
        shard.restore_counts(ids[mine], counts[mine])
    for key, value in crcs.items():
        if value != int(g[key].attrs["crc32"]):
            raise CheckpointError(f"{where}/{key}: checksum mismatch")
