"""Delta checkpoints: the table rows changed since the previous checkpoint, on a full one.

A delta checkpoint is a checkpoint directory like any other (``ckpt-<step>``, a shard per
ps, ``manifest.json``) whose manifest has ``"delta": {"base": <the previous checkpoint>,
"chain": [<the full one>, ..., <base>]}``. Its shards hold the dense shard whole (params,
slots, average: small beside the tables, and every checkpoint's dense part then restores
from its own files) and, per table, only the rows changed since ``base`` was written,
with their slots (for a table that grows: their ``state/...``, the ``evicted`` ids that
hold no row now, and the pending counts whole). Restore reads the full checkpoint, then
each delta of the chain in order, each id routed to its owner under the new ps count.
"""

import os

import numpy as np

from ..errors import CheckpointError
from .names import checkpoint_name, read_manifest
from .tables import GROUP, _read, load_tables, read_tables

_DENSE = "whole"  # how a delta holds the dense shard (the manifest says so)


def next_delta(root, committed, full_every):
    """Chief: return the ``delta`` entry of the next checkpoint, or None for a full one.

    ``committed``: the steps this run has checkpointed; ``full_every``
    (``--full-checkpoint-every``): every that many checkpoints one is full, the first of
    a run included, and the ones between are deltas, each on the one before.
    """
    if full_every is None or full_every <= 1 or len(committed) % full_every == 0:
        return None
    return delta_entry(root, committed[-1])


def delta_entry(root, base_step):
    """Return the manifest's ``delta`` entry of a delta on the checkpoint at ``base_step``."""
    base = checkpoint_name(base_step)
    manifest = read_manifest(os.path.join(root, base))
    chain = list((manifest.get("delta") or {}).get("chain", [])) + [base]
    return {"base": base, "chain": chain, "dense": _DENSE}


def chain_of(ckpt_dir, manifest):
    """Return ``[(dir, manifest)]`` from the full checkpoint to ``ckpt_dir``, in order.

    A full checkpoint is its own chain. A base that is missing, incomplete or unreadable
    raises CheckpointError naming it.
    """
    delta = manifest.get("delta")
    if not delta:
        return [(ckpt_dir, manifest)]
    root = os.path.dirname(os.path.normpath(ckpt_dir))
    links = []
    for name in delta["chain"]:
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            raise CheckpointError(f"base {name} of this delta checkpoint is missing")
        try:
            links.append((path, read_manifest(path)))
        except CheckpointError as e:
            raise CheckpointError(f"base {name} of this delta checkpoint: {e}") from None
    if links[0][1].get("delta"):
        raise CheckpointError(f"base {delta['chain'][0]} of this delta checkpoint is not a "
                              "full checkpoint")
    return links + [(ckpt_dir, manifest)]


def load_chain_tables(ckpt_dir, manifest, tables):
    """Fill ``tables`` (as :func:`~mpitf.ckpt.tables.load_tables`) from the whole chain."""
    from ..tables.changes import reset_counts

    links = chain_of(ckpt_dir, manifest)
    load_tables(*links[0], tables)
    for path, m in links[1:]:
        for t in tables:
            if "dynamic" in t:
                reset_counts(t["dynamic"])  # a delta holds the pending counts whole
        for entry in m["shards"]:
            _load_delta_shard(os.path.join(path, entry["file"]), tables)


def _load_delta_shard(path, tables):
    import h5py

    from ..tables.changes import apply_delta

    try:
        with h5py.File(path, "r") as f:
            for t in tables:
                g = f.get(f"{GROUP}/{t['spec'].name}")
                if g is None:
                    continue
                data = _datasets(g, f"{path}: {GROUP}/{t['spec'].name}")
                placement, ps = t["placement"], t["ps"]
                mine = placement.owner(data["ids"]) == ps
                values = {k: v[mine] for k, v in data.items()
                          if not k.startswith(("slots/", "pending/")) and k != "evicted"}
                values["slots"] = {k[6:]: v[mine] for k, v in data.items()
                                   if k.startswith("slots/")}
                ids = values.pop("ids")
                if "dynamic" not in t:
                    local = placement.local(ids, ps)
                    t["rows"][local] = values["rows"]
                    for k, v in t["slots"].items():
                        if k in values["slots"]:
                            v[local] = values["slots"][k]
                    continue
                shard = t["dynamic"]
                evicted = data.get("evicted", np.empty(0, np.int64))
                apply_delta(shard, ids, values, evicted[placement.owner(evicted) == ps])
                if "pending/ids" in data:
                    owned = placement.owner(data["pending/ids"]) == ps
                    shard.restore_counts(data["pending/ids"][owned],
                                         data["pending/counts"][owned])
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from e


def _datasets(g, where):
    """Return every dataset of a table's group by key (``ids``, ``slots/m``, ...), checked."""
    import h5py

    out = {}
    for key in g:
        if isinstance(g[key], h5py.Group):
            out.update({f"{key}/{k}": _read(g[key][k], f"{where}/{key}/{k}") for k in g[key]})
        else:
            out[key] = _read(g[key], f"{where}/{key}")
    return out


def read_table_state(ckpt_dir, manifest=None):
    """Return {table: {key: array}} of every table at this checkpoint, rows ascending by id.

    Keys are ``ids``, ``rows``, ``slots/<slot>``, ``state/<name>`` (tables that grow) and
    ``pending/ids``, ``pending/counts``; a delta is read with its chain, so a delta and a
    full checkpoint of the same state give equal arrays. For export and comparison: every
    table is in memory.
    """
    import h5py

    manifest = manifest or read_manifest(ckpt_dir)
    state = {}
    for n, (path, m) in enumerate(chain_of(ckpt_dir, manifest)):
        parts = {t["name"]: [] for t in m["layout"].get("tables", [])}
        for entry in m["shards"]:
            file = os.path.join(path, entry["file"])
            try:
                with h5py.File(file, "r") as f:
                    for name in parts:
                        g = f.get(f"{GROUP}/{name}")
                        if g is not None:
                            parts[name].append(_datasets(g, f"{file}: {GROUP}/{name}"))
            except OSError as e:
                raise CheckpointError(f"{file}: cannot read ({e})") from e
        for name, shards in parts.items():
            state[name] = _merge(state.get(name) if n else None, shards)
    return state


def _merge(base, shards):
    """Return a table's arrays: ``base`` (None for a full checkpoint) updated by ``shards``."""
    keys = sorted({k for s in shards for k in s if not k.startswith("pending/")
                   and k != "evicted"})
    new = {k: np.concatenate([s[k] for s in shards]) for k in keys}
    pending = {k: np.concatenate([s[k] for s in shards]) for k in ("pending/ids",
                                                                   "pending/counts")
               if any(k in s for s in shards)}
    if base is not None:
        evicted = np.concatenate([np.empty(0, np.int64)]
                                 + [s["evicted"] for s in shards if "evicted" in s])
        keep = ~np.isin(base["ids"], evicted) & ~np.isin(base["ids"], new["ids"])
        new = {k: np.concatenate([base[k][keep], new[k]]) for k in keys}
        if not pending:
            pending = {k: v for k, v in base.items() if k.startswith("pending/")}
    order = np.argsort(new["ids"], kind="stable")
    out = {k: v[order] for k, v in new.items()}
    if pending:
        order = np.argsort(pending["pending/ids"], kind="stable")
        out.update({k: v[order] for k, v in pending.items()})
    return out


def read_whole_tables(ckpt_dir, manifest):
    """Return what :func:`~mpitf.ckpt.tables.read_tables` does, for a delta too."""
    if not manifest.get("delta"):
        return read_tables(ckpt_dir, manifest)
    state, out = read_table_state(ckpt_dir, manifest), {}
    for t in manifest["layout"].get("tables", []):
        ids, rows = state[t["name"]]["ids"], state[t["name"]]["rows"]
        if t["rows"] is None:
            out[t["name"] + "/ids"], out[t["name"]] = ids, rows
            continue
        if not np.array_equal(ids, np.arange(t["rows"])):
            raise CheckpointError(f"{ckpt_dir}: table {t['name']!r} does not hold each of its "
                                  f"{t['rows']} rows once with its chain; it is damaged")
        out[t["name"]] = rows
    return out
