"""Tables that grow: the id -> slot map, routing and initial rows by hash, admission,
eviction, and training under mpiexec (fixed and dynamic give the same bits; kill, resume
onto another ps count; capacity; a refused negative id).
"""

import importlib.util
import logging
import re
from pathlib import Path

import numpy as np
import pytest

from mpitf.errors import ConfigurationError
from mpitf.models.embedding import EmbeddingTable, initial_rows
from mpitf.ps.optimizers import make_optimizer
from mpitf.tables import dynkernels
from mpitf.tables.dynamic import DynamicShard
from mpitf.tables.growth import Growth
from mpitf.tables.hashing import HashPlacement, owners
from mpitf.tables.idmap import IdMap
from mpitf.tables.rows import Dedup
from mpitf.testing import run_mpi
from tests.support import REPO

DRIVER = REPO / "tests" / "mpi" / "sparse_driver.py"
_spec = importlib.util.spec_from_file_location("sparse_driver", DRIVER)
driver = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(driver)


# -- the map -------------------------------------------------------------------------------

def test_the_map_finds_puts_deletes_and_grows_like_a_dict():
    rng = np.random.default_rng(0)
    m, ref = IdMap(4), {}
    assert m.entries == 16
    for round_ in range(30):
        ids = np.unique(rng.integers(-2**62, 2**62, 200) // 977 * 977)  # clustered probes
        ids = np.concatenate([ids, rng.integers(-50, 50, 20)])
        ids = np.unique(ids)
        held = sum(int(x) in ref for x in ids)
        values = np.arange(len(ids), dtype=np.int64) + 1000 * round_  # values are >= 0
        assert m.put(ids, values) == held
        ref.update(zip(ids.tolist(), values.tolist()))
        gone = np.array(list(ref)[::3], np.int64)
        assert m.delete(gone) == len(gone)
        for x in gone:
            del ref[int(x)]
        assert m.delete(gone[:5]) == 0
        assert len(m) == len(ref) and 2 * len(m) <= m.entries
        probe = np.concatenate([np.array(list(ref), np.int64), gone])
        out = np.empty(len(probe), np.int64)
        assert m.find(probe, out) == len(ref)
        assert out.tolist() == [ref.get(int(x), -1) for x in probe]
    ids, values = m.items()
    assert ids.tolist() == sorted(ref) and values.tolist() == [ref[k] for k in sorted(ref)]
    assert m.entries >= 2 * len(ref) and m.entries < 8 * len(ref)  # grew by doubling


def test_ids_group_by_a_hash_owner_with_their_inverse():
    ids = np.array([5, -3, 2**62, 5, 7, -3, 0, 11, 2**62 + 1], np.int64)
    d = Dedup(len(ids))
    unique, offsets, bad = d.group(ids, 3)
    unique, offsets, inverse = unique.copy(), offsets.copy(), d.finish()
    assert bad == -1 and sorted(unique.tolist()) == sorted(set(ids.tolist()))
    assert np.array_equal(unique[inverse], ids)
    for p in range(3):
        part = unique[offsets[p]:offsets[p + 1]]
        assert (owners(part, 3) == p).all()
    assert all(dynkernels.owner_of(x, 3) == o for x, o in zip(ids, owners(ids, 3)))
    assert np.bincount(owners(np.arange(30000), 3), minlength=3).min() > 9500  # spread
    _, _, bad = d.group(ids, 3, negatives=False)
    assert bad == 1


def test_a_dynamic_table_refuses_rows_and_half_floats():
    with pytest.raises(ConfigurationError, match="leave its rows None"):
        EmbeddingTable("t", 10, 4, dynamic=True)
    with pytest.raises(ConfigurationError, match="float32 or float64"):
        EmbeddingTable("t", None, 4, dtype="float16")
    with pytest.raises(ConfigurationError, match="admit_min_count"):
        Growth(admit_min_count=0)
    t = EmbeddingTable("t", None, 4)
    assert t.dynamic == Growth() and t.placement == "hash" and t.max_ids(8) == 8


# -- initial rows and the ps's shard ---------------------------------------------------------

def test_a_row_starts_from_seed_table_and_id_alone_in_any_order():
    t = EmbeddingTable("t", None, 5, scale=0.1)
    ids = np.array([3, -7, 2**63 - 1, -2**63, 12345678901], np.int64)
    whole = initial_rows(t, 7, ids)
    assert whole.dtype == np.float32 and np.abs(whole).max() <= 0.1 and len(np.unique(whole)) == 25
    perm = [4, 2, 0, 3, 1]
    assert np.array_equal(initial_rows(t, 7, ids[perm]), whole[perm])
    assert np.array_equal(initial_rows(EmbeddingTable("t", 10**9, 5, scale=0.1), 7,
                                       ids[:1]), whole[:1])  # a fixed table's row too
    assert not np.array_equal(initial_rows(t, 8, ids), whole)
    assert not np.array_equal(initial_rows(EmbeddingTable("u", None, 5, scale=0.1), 7, ids),
                              whole)
    n = initial_rows(EmbeddingTable("n", None, 4, initializer="normal", scale=2.0), 1,
                     np.arange(20000))
    assert abs(n.mean()) < 0.05 and abs(n.std() - 2.0) < 0.05


def _shard(growth, ps=0, num_ps=1, optimizer="adagrad", dim=3):
    spec = EmbeddingTable("t", None, dim, dynamic=growth, scale=0.5)
    return spec, DynamicShard(spec, HashPlacement(num_ps), ps, make_optimizer(optimizer, 0.1),
                              1024, 5)


def test_a_pull_reads_initial_rows_without_making_them_and_a_push_makes_them():
    spec, shard = _shard(Growth())
    ids = np.array([9, -4, 2**40], np.int64)
    out = np.empty((3, 3), np.float32)
    shard.gather(ids, out, {})
    assert np.array_equal(out, initial_rows(spec, 5, ids)) and shard.stats()["rows"] == 0
    shard.apply(make_optimizer("sgd", 1.0), ids, np.ones((3, 3), np.float32), 1)
    shard.gather(ids, out, {})
    assert np.array_equal(out, initial_rows(spec, 5, ids) - 1)
    assert shard.stats()["rows"] == 3 and shard.stats()["admitted"] == 3


def test_an_id_is_admitted_once_its_count_is_reached_and_reads_zeros_until_then():
    spec, shard = _shard(Growth(admit_min_count=3))
    sgd = make_optimizer("sgd", 1.0)
    ids, out = np.array([1, 2], np.int64), np.empty((2, 3), np.float32)
    for step in (1, 2):
        shard.apply(sgd, ids[:1] if step == 2 else ids, np.ones((2 - (step == 2), 3),
                                                                np.float32), step)
        shard.gather(ids, out, {})
        assert not out.any()  # not admitted: zeros
    assert shard.stats() | {"bytes": 0} == dict(rows=0, admitted=0, evicted=0, skipped=3,
                                                 pending=2, bytes=0)
    shard.apply(sgd, ids[:1], np.ones((1, 3), np.float32), 3)  # count 3: the row is made
    shard.gather(ids, out, {})
    assert np.array_equal(out[0], initial_rows(spec, 5, ids[:1])[0]) and not out[1].any()
    shard.apply(sgd, ids[:1], np.ones((1, 3), np.float32), 4)  # now applied
    shard.gather(ids[:1], out[:1], {})
    assert np.array_equal(out[0], initial_rows(spec, 5, ids[:1])[0] - 1)
    assert (shard.stats()["rows"], shard.stats()["skipped"], shard.stats()["pending"]) == (1, 4, 1)


def test_admission_by_probability_is_a_draw_of_the_id_and_its_count():
    a, b = (_shard(Growth(admit_probability=0.3))[1] for _ in range(2))
    ids = np.arange(1000, dtype=np.int64)
    grads = np.zeros((1000, 3), np.float32)
    a.apply(make_optimizer("sgd", 1.0), ids, grads, 1)
    b.apply(make_optimizer("sgd", 1.0), ids[::-1].copy(), grads, 1)
    assert 250 < a.stats()["rows"] < 350
    assert np.array_equal(a.map.items()[0], b.map.items()[0])


def test_rows_unused_for_n_steps_and_beyond_capacity_are_evicted_and_slots_reused(caplog):
    spec, shard = _shard(Growth(evict_after_steps=2, evict_every=1, capacity=3))
    sgd = make_optimizer("sgd", 1.0)
    g = np.zeros((4, 3), np.float32)
    shard.apply(sgd, np.array([1, 2], np.int64), g[:2], 1)
    shard.apply(sgd, np.array([1, 3], np.int64), g[:2], 2)
    shard.apply(sgd, np.array([1, 3], np.int64), g[:2], 3)  # 2 unused for 2 steps: evicted
    assert shard.map.items()[0].tolist() == [1, 3] and shard.evicted == 1
    with caplog.at_level(logging.WARNING, logger="mpitf"):
        shard.apply(sgd, np.array([4, 5, 6], np.int64), g[:3], 4)
    # 5 rows held, capacity 3: the least used go (4, 5: once each, the smaller ids first)
    assert shard.map.items()[0].tolist() == [1, 3, 6]
    assert "ps task 0, table 't': capacity of 3 rows reached at step 4: evicted the 2 least " \
        "used (held 3, admitted 6, evicted 3 in all)" in caplog.text
    assert shard.high <= 5  # evicted slots were reused, not new ones
    out = np.empty((1, 3), np.float32)
    shard.gather(np.array([4], np.int64), out, {})
    assert np.array_equal(out, initial_rows(spec, 5, np.array([4])))  # starts afresh


def test_memory_follows_the_rows_held_not_the_id_range():
    _, small = _shard(Growth(), optimizer="sgd", dim=16)
    _, wide = _shard(Growth(), optimizer="sgd", dim=16)
    sgd = make_optimizer("sgd", 1.0)
    for lo in range(0, 20000, 64):
        ids = np.arange(lo, lo + 64, dtype=np.int64)
        small.apply(sgd, ids, np.zeros((64, 16), np.float32), 1)
        wide.apply(sgd, ids * 10**12 - 5 * 10**15, np.zeros((64, 16), np.float32), 1)
    assert small.stats()["bytes"] == wide.stats()["bytes"]
    assert small.stats()["bytes"] / small.stats()["rows"] < 2 * (64 + 32 + 16 * 2)


# -- under mpiexec ---------------------------------------------------------------------------

def run_driver(out, num_ps, num_workers, *args, timeout=90, ok=True):
    Path(out).mkdir(parents=True, exist_ok=True)
    run = run_mpi(num_ps + num_workers, [str(DRIVER), str(out), "--num-ps", str(num_ps),
                                         *map(str, args)], timeout=timeout, cwd=str(REPO))
    assert not run.timed_out, f"timed out after {run.seconds:.0f} s:\n{run.output}"
    if ok:
        assert run.returncode == 0, run.output
    return run


def held(out, num_ps):
    """Return {table: {key: array by id ascending}} over every ps's rows (and extras)."""
    got = {}
    for p in range(num_ps):
        with np.load(Path(out) / f"ps{p}.npz") as f:
            for key in f.files:
                table, part = key.split("/", 1)
                name = table.removeprefix("extra:")
                ids = f[f"{name}/ids"] if not part.startswith("pending/") else \
                    f[f"{table}/pending/ids"]
                got.setdefault(table, {}).setdefault(part, []).append((ids, f[key]))
    tables = {}
    for table, parts in got.items():
        tables[table] = {}
        for part, pieces in parts.items():
            ids = np.concatenate([i for i, _ in pieces])
            tables[table][part] = np.concatenate([v for _, v in pieces])[np.argsort(ids)]
    return tables


@pytest.mark.slow
@pytest.mark.mpi
def test_a_dynamic_table_admitting_every_id_trains_the_bits_of_a_fixed_one(tmp_path):
    # One init for both kinds ((seed, table, id) -> values), so the fixed table's rows
    # start as the dynamic table's: every row the dynamic table holds (the ids a gradient
    # reached) equals the fixed table's, and so do the dense parameters.
    common = ["--mode", "sync", "--deterministic", "--optimizer", "adagrad", "--steps", 4]
    run_driver(tmp_path / "fixed", 2, 2, *common)
    run_driver(tmp_path / "dyn", 2, 2, *common, "--dynamic")
    fixed, dyn = held(tmp_path / "fixed", 2), held(tmp_path / "dyn", 2)
    for name in driver.ROWS:
        ids = dyn[name]["ids"]
        assert 5 < len(ids) < driver.ROWS[name]
        for part in ("rows", "accumulator"):
            assert np.array_equal(dyn[name][part], fixed[name][part][ids]), (name, part)
        untouched = np.setdiff1d(np.arange(driver.ROWS[name]), ids)
        assert np.array_equal(fixed[name]["rows"][untouched],
                              initial_rows(driver.tables()[0 if name == "users" else 1], 3,
                                           untouched))
    with np.load(tmp_path / "fixed" / "params.npz") as a, \
            np.load(tmp_path / "dyn" / "params.npz") as b:
        for k in a.files:
            assert np.array_equal(a[k], b[k]), k


@pytest.mark.slow
@pytest.mark.mpi
def test_kill_and_resume_onto_three_ps_from_one_is_the_uninterrupted_run(tmp_path, capsys):
    # Raw int64 ids (some negative), admission by count, eviction of rows unused for 2
    # steps at each checkpoint: the resumed run restores rows, slots, ages, uses and the
    # counts of ids not yet admitted, each routed to its owner among 3 ps.
    common = ["--mode", "sync", "--deterministic", "--optimizer", "adagrad", "--steps", 6,
              "--save-steps", 2, "--dynamic", "--raw-ids", "--admit-min-count", 3,
              "--evict-after-steps", 2]
    run_driver(tmp_path / "whole", 1, 2, *common, "--checkpoint-dir", tmp_path / "c1")
    ckpt = tmp_path / "c2"
    run = run_driver(tmp_path / "cut", 1, 2, *common, "--checkpoint-dir", ckpt,
                     "--kill-at", 5, ok=False)
    assert run.returncode != 0, run.output
    assert (ckpt / "latest").read_text().strip() == "ckpt-00000004"
    from mpitf.ckpt.verify import verify_checkpoint
    assert verify_checkpoint(ckpt / "ckpt-00000004") == []
    run = run_driver(tmp_path / "cut", 3, 2, *common, "--checkpoint-dir", ckpt)
    assert "restored" in run.output
    whole, cut = held(tmp_path / "whole", 1), held(tmp_path / "cut", 3)
    assert whole.keys() == cut.keys()
    for table, parts in whole.items():
        for k, v in parts.items():
            got = cut[table][k]
            assert np.array_equal(got, v), (table, k)
    for name in driver.ROWS:
        assert (whole[name]["ids"] < 0).any() and len(whole[name]["ids"]) > 3
    assert any(len(whole[f"extra:{name}"]["pending/ids"]) for name in driver.ROWS)
    from mpitf.ckpt.commands import cmd_export, cmd_show
    assert cmd_show(str(ckpt)) == 0
    assert re.search(r"^  users +dynamic x 4 +float32 +rows ps0:\d+ ps1:\d+ ps2:\d+$",
                     capsys.readouterr().out, re.M)
    assert cmd_export(str(ckpt), str(tmp_path / "e.npz")) == 0
    with np.load(tmp_path / "e.npz") as f:  # the last checkpoint: the final rows, by id
        assert np.array_equal(f["users/ids"], whole["users"]["ids"])
        assert np.array_equal(f["users"], whole["users"]["rows"])


@pytest.mark.mpi
def test_a_table_at_capacity_evicts_keeps_training_and_says_so(tmp_path):
    run = run_driver(tmp_path, 2, 1, "--steps", 4, "--dynamic", "--table-capacity", 3,
                     "--raw-ids")
    assert re.search(r"ps task \d, table 'users': capacity of 3 rows reached at step \d: "
                     r"evicted the \d+ least used \(held 3, admitted \d+, evicted \d+ in all\)",
                     run.output), run.output
    import json
    stats = [json.loads((tmp_path / f"ps{p}.json").read_text()) for p in range(2)]
    assert all(s["pushes_applied"] == 4 for s in stats)
    assert all(s["tables"]["users"]["rows"] <= 3 for s in stats)
    assert sum(s["tables"]["users"]["evicted"] for s in stats) > 0


@pytest.mark.mpi
@pytest.mark.slow  # the fast tier refuses bad ids in test_sparse.py
def test_a_negative_id_where_the_table_takes_none_ends_every_rank(tmp_path):
    run = run_driver(tmp_path, 2, 2, "--steps", 5, "--dynamic", "--no-negative-ids",
                     "--bad-ids", "negative", timeout=60, ok=False)
    assert run.returncode != 0
    message = "table 'users': id -"
    assert run.output.count(message) == 1, run.output
    assert re.search(r"table 'users': id -\d+ is negative, and this table takes ids >= 0 only",
                     run.output), run.output
