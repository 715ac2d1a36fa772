"""Embedding tables on the ps: row placement, initial values, the sparse messages, the ps's
sparse apply, and training under mpiexec checked bit for bit against one process.

The multi-rank tests run ``tests/mpi/sparse_driver.py`` and compare every ps's rows, and
the chief's dense parameters, with the same arithmetic done here in one process.
"""

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

from mpitf.errors import ConfigurationError, DataError, PeerError
from mpitf.models.embedding import EmbeddingTable, initial_rows
from mpitf.ps.optimizers import make_optimizer
from mpitf.ps.sparse import SparseTables
from mpitf.tables.rows import RowPlacement, segment_sum, unique_inverse
from mpitf.testing import run_mpi
from mpitf.wire.header import HEADER_BYTES
from mpitf.wire.sparse import SparseLayout
from mpitf.worker.embedding import Lookup
from tests.support import REPO

DRIVER = REPO / "tests" / "mpi" / "sparse_driver.py"
_spec = importlib.util.spec_from_file_location("sparse_driver", DRIVER)
driver = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(driver)
SEED = 3  # the driver's


# -- row placement (pure) ----------------------------------------------------------------

@pytest.mark.parametrize("kind", ["mod", "range"])
@pytest.mark.parametrize("rows,num_ps", [(1, 1), (10, 3), (7, 7), (5, 8), (1000, 4)])
def test_every_row_has_exactly_one_home(kind, rows, num_ps):
    pl = RowPlacement(rows, num_ps, kind)
    ids = np.arange(rows, dtype=np.int64)
    owner = pl.owner(ids)
    assert sum(pl.rows_on(p) for p in range(num_ps)) == rows
    seen = np.concatenate([pl.global_ids(p) for p in range(num_ps)])
    assert sorted(seen.tolist()) == list(range(rows))
    for p in range(num_ps):
        mine = pl.global_ids(p)
        assert len(mine) == pl.rows_on(p)
        assert (owner[mine] == p).all()
        assert (pl.local(mine, p) == np.arange(len(mine))).all()


def test_mod_and_range_place_as_documented():
    assert RowPlacement(10, 3).owner(np.arange(10)).tolist() == [0, 1, 2] * 3 + [0]
    # range: TensorFlow's slice sizes, the first rows % P ps one row more: 4, 3, 3
    assert RowPlacement(10, 3, "range").owner(np.arange(10)).tolist() == \
        [0] * 4 + [1] * 3 + [2] * 3
    with pytest.raises(ConfigurationError, match="row placement must be one of"):
        RowPlacement(10, 3, "hash")


@pytest.mark.parametrize("kind", ["mod", "range"])
def test_keys_group_ids_by_owner_so_one_sort_routes_them(kind):
    pl = RowPlacement(50, 3, kind)
    ids = np.array([49, 0, 2, 3, 7, 8, 20, 33, 2, 49], np.int64)
    keys, inverse = unique_inverse(pl.keys(ids))
    offsets = np.searchsorted(keys, pl.starts)
    routed = []
    for p in range(3):
        part = keys[offsets[p]:offsets[p + 1]]
        mine = pl.ids_of_keys(part, p, np.empty(len(part), np.int64))
        assert (pl.owner(mine) == p).all() and (np.diff(mine) > 0).all()
        assert (pl.local(mine, p) == part - pl.starts[p]).all()
        routed.append(mine)
    assert np.array_equal(np.concatenate(routed)[inverse], ids)
    assert sorted(pl.keys(np.arange(50)).tolist()) == list(range(50))


# -- initial values ----------------------------------------------------------------------

def test_a_row_starts_from_seed_table_and_index_alone():
    t = EmbeddingTable("t", 10000, 5, scale=0.1)
    whole = initial_rows(t, 7, np.arange(10000, dtype=np.int64))
    assert whole.dtype == np.float32 and np.abs(whole).max() <= 0.1
    for p in range(3):  # any split of the rows gives the same values
        ids = RowPlacement(10000, 3).global_ids(p)
        assert np.array_equal(initial_rows(t, 7, ids), whole[ids])
    assert not np.array_equal(initial_rows(t, 8, np.arange(10)), whole[:10])
    other = EmbeddingTable("u", 10000, 5, scale=0.1)
    assert not np.array_equal(initial_rows(other, 7, np.arange(10)), whole[:10])
    assert not initial_rows(EmbeddingTable("z", 3, 2, initializer="zeros"), 7,
                            np.arange(3)).any()


def test_a_bad_table_is_refused_by_name():
    with pytest.raises(ConfigurationError, match="table 'x' dim"):
        EmbeddingTable("x", 10, 0)
    with pytest.raises(ConfigurationError, match="floating dtype"):
        EmbeddingTable("x", 10, 2, dtype="int32")
    with pytest.raises(ConfigurationError, match="placement"):
        EmbeddingTable("x", 10, 2, placement="hash")


# -- the messages ------------------------------------------------------------------------

def test_messages_hold_counts_ids_and_rows_where_both_sides_read_them():
    lay = SparseLayout([(3, "float32"), (2, "float64")], [5, 4])
    buf = lay.allocate()
    counts = [2, 3]
    lay.counts(buf)[...] = counts
    for ids, src in zip(lay.ids(buf, counts), ([4, 9], [1, 2, 3])):
        ids[...] = src
    for rows, k in zip(lay.rows(buf, counts), (1.5, 2.5)):
        rows[...] = k
    assert lay.ids_end(counts) == HEADER_BYTES + 16 + 8 * 5
    assert lay.end(counts) == lay.ids_end(counts) + 2 * 3 * 4 + 3 * 2 * 8
    assert lay.counts(buf).tolist() == counts
    assert [i.tolist() for i in lay.ids(buf, counts)] == [[4, 9], [1, 2, 3]]
    assert [r.shape for r in lay.rows(buf, counts)] == [(2, 3), (3, 2)]
    assert lay.rows(buf, counts)[1].dtype == np.float64
    assert lay.capacity == lay.end([5, 4]) and len(buf) >= lay.capacity


@pytest.mark.parametrize("n,high", [(0, 5), (1, 5), (50, 7), (70000, 70000), (5000, 10**9),
                                    (5000, 2**40)])
def test_unique_inverse_is_numpys(n, high):
    ids = np.random.default_rng(n).integers(0, high, n)
    u, inv = unique_inverse(ids)
    nu, ninv = np.unique(ids, return_inverse=True)
    assert np.array_equal(u, nu) and np.array_equal(inv, ninv.reshape(-1))
    assert np.array_equal(u[inv], ids)


def test_segment_sum_adds_every_occurrence():
    values = np.arange(12, dtype=np.float32).reshape(6, 2)
    out = np.full((3, 2), 99, np.float32)
    segment_sum(values, np.array([2, 0, 2, 1, 0, 2]), out)
    assert out.tolist() == [[10, 12], [6, 7], [14, 17]]


def test_a_lookup_takes_gradients_per_occurrence_or_per_pulled_row_alike():
    ids = np.array([[3, 1], [3, 3], [0, 1]])
    uids, inv = np.unique(ids, return_inverse=True)
    pulled = np.arange(len(uids) * 2, dtype=np.float32).reshape(-1, 2)
    per_occurrence = Lookup(ids, pulled, inv)
    assert np.array_equal(per_occurrence.rows, pulled[inv.reshape(ids.shape)])
    per_occurrence.grad[...] = per_occurrence.rows
    per_row = Lookup(ids, pulled, inv)
    per_row.unique_grad[...] = pulled * np.bincount(inv.reshape(-1))[:, None]
    assert np.array_equal(per_occurrence.summed(), per_row.summed())
    with pytest.raises(DataError, match="the model wrote no gradient for table 'users'"):
        Lookup(ids, pulled, inv).summed("users")


# -- the ps's sparse apply ---------------------------------------------------------------

def _tables(optimizer, num_ps=1, ps=0, workers=2):
    spec = EmbeddingTable("t", 20, 3, scale=0.5)
    opt = make_optimizer(optimizer, 0.1)
    return spec, opt, SparseTables({"tables": [spec], "batch_size": 4}, ps, num_ps, opt,
                                   SEED, workers)


def _push(tables, worker, ids, grads):
    lay = tables.layout
    buf = lay.allocate()
    counts = [len(ids)]
    lay.counts(buf)[...] = counts
    lay.ids(buf, counts)[0][...] = ids
    lay.rows(buf, counts)[0][...] = grads
    tables.stash(worker, buf, {})


def test_ftrl_follows_tensorflows_formula():
    opt = make_optimizer("ftrl", 0.3, l1=0.05, l2=0.1)
    rng = np.random.default_rng(1)
    var = rng.standard_normal(50)
    accum, linear = np.full(50, 0.1), np.zeros(50)
    slots = opt.make_slots(50, np, np.float64)
    p = var.copy()
    for step in range(3):
        g = rng.standard_normal(50)
        new = accum + g * g
        linear += g - (np.sqrt(new) - np.sqrt(accum)) / 0.3 * var
        quadratic = np.sqrt(new) / 0.3 + 2 * 0.1
        var = np.where(np.abs(linear) > 0.05, (np.sign(linear) * 0.05 - linear) / quadratic, 0)
        accum = new
        opt.apply(p, g.copy(), slots, step)
    np.testing.assert_allclose(p, var, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(slots["accum"], accum, rtol=1e-12)
    np.testing.assert_allclose(slots["linear"], linear, rtol=1e-12, atol=1e-15)
    assert (p == 0).any() and (p != 0).any()  # l1 zeroed some weights, not all
    assert make_optimizer(**opt.config()) == opt


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adagrad", "adam", "ftrl"])
def test_sparse_apply_is_the_dense_kernel_on_the_rows_present(optimizer):
    spec, opt, tables = _tables(optimizer)
    table = tables.tables[0]
    start = table.params.copy()
    rng = np.random.default_rng(0)
    g0, g1 = (rng.standard_normal((2, 3)).astype(np.float32) for _ in range(2))
    _push(tables, 1, [3, 7], g1)
    _push(tables, 0, [7, 11], g0)
    tables.apply([1, 0], 2, step=4)
    # worker order: id 7 gets g0[0] + g1[1] (exact in float64, then rounded: the float32
    # sum); then the mean over the two workers
    summed = {3: g1[0] / 2, 7: (g0[0] + g1[1]) / 2, 11: g0[1] / 2}
    ids = np.array(sorted(summed))
    dense_p = start[ids].reshape(-1).copy()
    slots = {k: np.full(dense_p.size, v[0], np.float32)
             for k, v in opt.make_slots(1, np, np.float32).items()}
    opt.apply(dense_p, np.stack([summed[i] for i in ids]).reshape(-1).copy(), slots, 4)
    expect = start.copy()
    expect[ids] = dense_p.reshape(-1, 3)
    assert np.array_equal(table.params, expect)  # absent rows untouched, bit for bit
    for k, v in table.slots.items():  # lazy: only present rows' slots moved
        others = np.setdiff1d(np.arange(20), ids)
        assert np.array_equal(v[ids].reshape(-1), slots[k])
        assert (v[others] == opt.make_slots(1, np, np.float32)[k][0]).all()
    assert not any(tables.has_pending)


def test_a_stale_sparse_push_is_forgotten_and_foreign_rows_are_refused():
    _, _, tables = _tables("sgd", num_ps=2, ps=0)
    start = tables.tables[0].params.copy()
    _push(tables, 0, [2, 4], np.ones((2, 3), np.float32))
    tables.discard(0)
    tables.apply([0], 1, 0)
    assert np.array_equal(tables.tables[0].params, start)
    with pytest.raises(PeerError, match="rows this ps does not hold"):
        _push(tables, 0, [3], np.ones((1, 3), np.float32))  # row 3 is ps 1's


# -- training under mpiexec, against one process -----------------------------------------

def reference(optimizer, num_workers, steps):
    """Return (tables, slots, dense params) after sync training in one process."""
    opt = make_optimizer(optimizer, driver.LEARNING_RATES[optimizer])
    model = driver.TinySparse()
    specs = {t.name: t for t in model.tables()}
    full = {n: initial_rows(t, SEED, np.arange(t.rows, dtype=np.int64))
            for n, t in specs.items()}
    start = {k: v[0] for k, v in opt.make_slots(1, np, np.float32).items()}
    slots = {n: {k: np.full(full[n].shape, v, np.float32) for k, v in start.items()
                 if not k.startswith("_")} for n in full}
    params = model.init(None)
    dense_slots = {k: opt.make_slots(v.size, np, v.dtype) for k, v in params.items()}
    for step in range(steps):
        dense, sparse = [], []
        for w in range(num_workers):
            b = driver.batch(w, step)
            lookups, uniq = {}, {}
            for n, ids in b.items():
                uids, inv = np.unique(ids.reshape(-1), return_inverse=True)
                lookups[n] = Lookup(ids, full[n][uids], inv)
                uniq[n] = uids
            grads = {k: np.zeros_like(v) for k, v in params.items()}
            model.loss_and_grads(params, b, grads, lookups)
            dense.append(grads)
            summed = {}
            for n, uids in uniq.items():
                summed[n] = (uids, lookups[n].summed(n))
            sparse.append(summed)
        for k, v in params.items():
            acc = dense[0][k].reshape(-1).copy()
            for g in dense[1:]:
                acc += g[k].reshape(-1)
            if num_workers > 1:
                np.divide(acc, num_workers, out=acc)
            opt.apply(v.reshape(-1), acc, dense_slots[k], step)
        for n, spec in specs.items():
            if num_workers == 1:
                uids, g = sparse[0][n]
                g = g.copy()
            else:
                cat = np.concatenate([s[n][0] for s in sparse])
                uids, inv = np.unique(cat, return_inverse=True)
                g = np.zeros((len(uids), spec.dim), np.float32)
                segment_sum(np.concatenate([s[n][1] for s in sparse]), inv, g)
                np.divide(g, num_workers, out=g)
            p = full[n][uids].reshape(-1)
            gathered = {k: v[uids].reshape(-1) for k, v in slots[n].items()}
            gathered.update((k, np.empty_like(p)) for k in start if k.startswith("_"))
            opt.apply(p, g.reshape(-1), gathered, step)
            full[n][uids] = p.reshape(-1, spec.dim)
            for k in slots[n]:
                slots[n][k][uids] = gathered[k].reshape(-1, spec.dim)
    return full, slots, params


def run_driver(out, num_ps, num_workers, *args, timeout=60):
    run = run_mpi(num_ps + num_workers, [str(DRIVER), str(out), "--num-ps", str(num_ps),
                                         *map(str, args)], timeout=timeout, cwd=str(REPO))
    assert not run.timed_out, f"timed out after {run.seconds:.0f} s:\n{run.output}"
    assert run.returncode == 0, run.output
    return run


def tables_of(out, num_ps):
    """Assemble every table from the ps tasks' rows."""
    full, slots = {}, {}
    for p in range(num_ps):
        with np.load(Path(out) / f"ps{p}.npz") as f:
            for n, spec in ((t.name, t) for t in driver.tables()):
                full.setdefault(n, np.full((spec.rows, spec.dim), np.nan, np.float32))
                full[n][f[f"{n}/ids"]] = f[f"{n}/rows"]
                for key in f.files:
                    if key.startswith(f"{n}/") and key not in (f"{n}/ids", f"{n}/rows"):
                        k = key.split("/", 1)[1]
                        slots.setdefault(n, {}).setdefault(
                            k, np.full((spec.rows, spec.dim), np.nan, np.float32))
                        slots[n][k][f[f"{n}/ids"]] = f[key]
    return full, slots


@pytest.mark.mpi
@pytest.mark.parametrize("optimizer,num_ps,placement,flag", [
    ("sgd", 1, "mod", "--deterministic"),
    ("adagrad", 3, "range", "--deterministic"),
    # (the fast tier keeps three of the six: 3-4 s each)
    pytest.param("adam", 2, "mod", "--deterministic", marks=pytest.mark.slow),
    pytest.param("momentum", 2, "range", "--deterministic", marks=pytest.mark.slow),
    pytest.param("ftrl", 2, "mod", "--deterministic", marks=pytest.mark.slow),
    # plain sync: with two workers the dense sum g0 + g1 == g1 + g0, and the ps sums the
    # sparse pushes in worker order in every sync mode
    ("adam", 2, "mod", "--mode=sync")])
def test_deterministic_sync_is_one_process_bit_for_bit_under_any_ps_count(
        tmp_path, optimizer, num_ps, placement, flag):
    steps, workers = 4, 2
    run_driver(tmp_path, num_ps, workers, "--mode", "sync", flag, "--optimizer",
               optimizer, "--placement", placement, "--steps", steps)
    full, slots, params = reference(optimizer, workers, steps)
    got, got_slots = tables_of(tmp_path, num_ps)
    for n in full:
        assert np.array_equal(got[n], full[n]), n
        for k in slots[n]:
            assert np.array_equal(got_slots[n][k], slots[n][k]), (n, k)
    with np.load(tmp_path / "params.npz") as f:
        for k, v in params.items():
            assert np.array_equal(f[k], v), k
    assert any(not np.array_equal(full[n], initial_rows(t, SEED, np.arange(t.rows)))
               for n, t in ((t.name, t) for t in driver.tables()))


def _message_bytes(num_ps, workers, steps):
    """Return the bytes each worker sends and receives in sparse messages."""
    specs = driver.tables()
    sent, received = [0] * workers, [0] * workers
    for w in range(workers):
        for step in range(steps):
            b = driver.batch(w, step)
            for p in range(num_ps):
                counts = []
                for t in specs:
                    u = np.unique(b[t.name])
                    counts.append(int((RowPlacement(t.rows, num_ps).owner(u) == p).sum()))
                ids = 8 * sum(counts)
                rows = sum(c * t.dim * 4 for c, t in zip(counts, specs))
                head = HEADER_BYTES + 8 * len(specs)
                sent[w] += (head + ids) + (head + ids + rows)
                received[w] += HEADER_BYTES + rows
    return sent, received


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["async", pytest.param("ssp", marks=pytest.mark.slow)])
def test_async_and_ssp_apply_every_push_and_send_only_the_rows_used(tmp_path, mode):
    steps, workers, num_ps = 6, 2, 2
    # adagrad: its steps are bounded, where plain SGD at the driver's lr 0.5 on stale
    # gradients sits at the edge of stability (NaN on some interleavings of the workers)
    run_driver(tmp_path, num_ps, workers, "--mode", mode, "--steps", steps,
               "--optimizer", "adagrad")
    sent, received = _message_bytes(num_ps, workers, steps)
    for w in range(workers):
        report = json.loads((tmp_path / f"worker{w}.json").read_text())
        assert (report["bytes_sent"], report["bytes_received"]) == (sent[w], received[w])
    for p in range(num_ps):
        counters = json.loads((tmp_path / f"ps{p}.json").read_text())
        assert counters["pushes_applied"] == workers * steps
    got, _ = tables_of(tmp_path, num_ps)
    assert all(np.isfinite(v).all() for v in got.values())


@pytest.mark.mpi
def test_async_with_one_worker_is_the_sequential_computation(tmp_path):
    run_driver(tmp_path, 2, 1, "--mode", "async", "--optimizer", "adam", "--steps", 5)
    full, _, params = reference("adam", 1, 5)
    got, _ = tables_of(tmp_path, 2)
    for n in full:
        assert np.array_equal(got[n], full[n]), n


# -- checkpoints --------------------------------------------------------------------------

def run_driver_raw(out, num_ps, num_workers, *args, timeout=60):
    return run_mpi(num_ps + num_workers, [str(DRIVER), str(out), "--num-ps", str(num_ps),
                                          *map(str, args)], timeout=timeout, cwd=str(REPO))


def _assert_reference(out, num_ps, optimizer, workers, steps):
    full, slots, params = reference(optimizer, workers, steps)
    got, got_slots = tables_of(out, num_ps)
    for n in full:
        assert np.array_equal(got[n], full[n]), n
        for k in slots[n]:
            assert np.array_equal(got_slots[n][k], slots[n][k]), (n, k)
    with np.load(Path(out) / "params.npz") as f:
        for k, v in params.items():
            assert np.array_equal(f[k], v), k


@pytest.mark.slow
@pytest.mark.mpi
def test_tables_restore_under_another_ps_count_bit_for_bit(tmp_path):
    ckpt = tmp_path / "ckpt"
    common = ["--mode", "sync", "--deterministic", "--optimizer", "adam",
              "--checkpoint-dir", ckpt]
    run_driver(tmp_path, 3, 2, *common, "--steps", 3)  # final checkpoint at step 3
    from mpitf.ckpt.verify import verify_checkpoint
    assert verify_checkpoint(ckpt / "ckpt-00000003") == []
    run_driver(tmp_path, 2, 2, *common, "--steps", 6, "--placement", "range")  # 2 ps, ranges
    _assert_reference(tmp_path, 2, "adam", 2, 6)


@pytest.mark.slow
@pytest.mark.mpi
def test_kill_and_resume_of_a_sparse_job_is_bit_for_bit(tmp_path):
    ckpt = tmp_path / "ckpt"
    common = ["--mode", "sync", "--deterministic", "--optimizer", "adagrad", "--steps", 6,
              "--checkpoint-dir", ckpt, "--save-steps", 2]
    run = run_driver_raw(tmp_path, 2, 2, *common, "--kill-at", 5)
    assert not run.timed_out and run.returncode != 0, run.output
    assert (ckpt / "latest").read_text().strip() == "ckpt-00000004"
    run_driver(tmp_path, 2, 2, *common)
    _assert_reference(tmp_path, 2, "adagrad", 2, 6)


@pytest.mark.mpi
def test_a_damaged_table_fails_verification(tmp_path):
    import h5py

    from mpitf.ckpt.verify import verify_checkpoint
    ckpt = tmp_path / "ckpt"
    run_driver(tmp_path, 2, 1, "--steps", 2, "--checkpoint-dir", ckpt)
    shard = ckpt / "ckpt-00000002" / "shard-00001-of-00002.h5"
    with h5py.File(shard, "r+") as f:
        f["tables/users/rows"][0, 0] += 1
    problems = verify_checkpoint(ckpt / "ckpt-00000002")
    assert any("checksum mismatch in tables/users/rows" in p for p in problems), problems


@pytest.mark.slow
@pytest.mark.mpi
def test_a_checkpoint_whose_table_has_other_rows_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    run_driver(tmp_path, 1, 1, "--steps", 2, "--checkpoint-dir", ckpt)
    before = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()
              and p.name != ".mpitf-lock"}
    run = run_driver_raw(tmp_path, 1, 1, "--steps", 4, "--checkpoint-dir", ckpt,
                         "--rows-scale", 2, timeout=30)
    assert not run.timed_out and run.returncode != 0, run.output
    assert "table 'users' is 74 x 4 float32 in the model but 37 x 4 float32 in" in run.output
    after = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()
             and p.name != ".mpitf-lock"}
    assert after == before  # nothing on disk touched


@pytest.mark.mpi
@pytest.mark.parametrize("bad,message", [
    ("high", r"table 'users': id \d+ is outside \[0, 37\) \(ids are never wrapped"),
    # the fast tier keeps one of the three (3 s each)
    pytest.param("negative", r"table 'users': id -\d+ is outside \[0, 37\)",
                 marks=pytest.mark.slow),
    pytest.param("float", r"table 'users': ids must be integers, got float64",
                 marks=pytest.mark.slow)])
def test_a_bad_id_ends_every_rank_with_one_clear_message(tmp_path, bad, message):
    import re
    run = run_driver_raw(tmp_path, 2, 2, "--steps", 5, "--bad-ids", bad, timeout=30)
    assert not run.timed_out, run.output
    assert run.returncode != 0
    assert re.search(message, run.output), run.output


@pytest.mark.slow
@pytest.mark.mpi
def test_a_table_larger_than_a_ps_memory_limit_trains_split_over_more_ps(tmp_path):
    # 37e5 x 4 + 23e5 x 3 float32 = 87 MB of tables (+ their ids while a ps draws them);
    # each ps may map 64 MiB more than at start (RLIMIT_AS): one ps cannot hold them, two
    # can (the driver lifts the limit after serving, to write its report).
    big = ["--rows-scale", 100000, "--ps-memory-mb", 64, "--steps", 2]
    run = run_driver_raw(tmp_path, 1, 1, *big, timeout=120)
    assert not run.timed_out and run.returncode != 0, run.output
    assert "ps task 0 cannot hold its 3700000 rows of table 'users' (56 MiB with the " \
        "optimizer's slots): split the table over more ps tasks (--num-ps)" in run.output
    run_driver(tmp_path, 2, 1, *big, timeout=120)
    counters = json.loads((tmp_path / "ps1.json").read_text())
    assert counters["pushes_applied"] == 2
    with np.load(tmp_path / "ps0.npz") as f:
        assert f["users/rows"].shape == (37 * 100000 // 2, 4)


@pytest.mark.slow
@pytest.mark.mpi
def test_ckpt_show_lists_the_tables_and_export_assembles_them_from_every_shard(
        tmp_path, capsys):
    from mpitf.ckpt.commands import cmd_export, cmd_show
    ckpt = tmp_path / "ckpt"
    run_driver(tmp_path, 2, 1, "--steps", 2, "--checkpoint-dir", ckpt)
    assert cmd_show(str(ckpt)) == 0
    shown = capsys.readouterr().out
    assert "tables (2):" in shown
    assert re.search(r"^  users +37 x 4 +float32 +rows ps0:19 ps1:18$", shown, re.M), shown
    out = tmp_path / "export.npz"
    assert cmd_export(str(ckpt), str(out)) == 0
    assert "and 2 tables of ckpt-00000002" in capsys.readouterr().out
    got, _ = tables_of(tmp_path, 2)
    with np.load(out) as f:
        for t in driver.tables():
            assert f[t.name].shape == (t.rows, t.dim) and f[t.name].dtype == np.float32
            assert np.array_equal(f[t.name], got[t.name]), t.name
        assert "w_users" in f.files  # the dense variables are there too
    import h5py
    with h5py.File(ckpt / "ckpt-00000002" / "shard-00000-of-00002.h5", "r+") as f:
        f["tables/users/rows"][0, 0] += 1
    assert cmd_export(str(ckpt), str(tmp_path / "bad.npz")) == 1
    assert "tables/users/rows" in capsys.readouterr().out
    assert not (tmp_path / "bad.npz").exists()


@pytest.mark.slow
@pytest.mark.mpi
def test_a_restart_passes_over_a_checkpoint_whose_table_is_damaged(tmp_path):
    import h5py
    ckpt = tmp_path / "ckpt"
    common = ["--mode", "sync", "--deterministic", "--optimizer", "adagrad",
              "--checkpoint-dir", ckpt, "--save-steps", 2]
    run_driver(tmp_path, 2, 2, *common, "--steps", 4)  # ckpt-2, ckpt-4
    with h5py.File(ckpt / "ckpt-00000004" / "shard-00001-of-00002.h5", "r+") as f:
        f["tables/items/rows"][0, 0] += 1
    run = run_driver(tmp_path, 2, 2, *common, "--steps", 6)
    assert re.search(r"skipping ckpt-00000004: .*checksum mismatch in tables/items/rows.*; "
                     r"using ckpt-00000002", run.output), run.output
    _assert_reference(tmp_path, 2, "adagrad", 2, 6)  # resumed from step 2, bit for bit
