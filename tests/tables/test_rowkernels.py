"""The compiled loops over embedding rows (mpitf/rowkernels.py, behind mpitf.tables.rows), in one
process, against the numpy they replace: deduplication equal to ``np.unique`` (sorted
unique ids or keys, and the inverse) on both of its paths, the sum per id bit for bit
``np.bincount``'s, the gather and scatter of rows, the ps's check of the ids it holds and
the finiteness check of row gradients.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpitf.tables.rowkernels import first_outside, local_rows, row_words
from mpitf.tables.rows import Dedup, RowPlacement, all_finite, put_rows, segment_sum, take_rows

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# a bound and ids below it: small bounds take the bitmap, huge ones the hash table
bounded_ids = st.sampled_from([1, 5, 64, 65, 1000, 70_000, 10**7, 2**40, 2**62]).flatmap(
    lambda bound: st.tuples(st.just(bound), st.lists(
        st.integers(0, bound - 1) | st.integers(0, min(bound - 1, 40)), max_size=300)))


@FAST
@given(bounded_ids, st.booleans())
def test_dedup_is_numpys_unique_on_both_paths(case, give_bound):
    bound, ids = case
    ids = np.array(ids, np.int64)
    dedup = Dedup(len(ids) + 3)
    u, inv = dedup(ids, bound if give_bound else None)  # None: the hash table
    nu, ninv = np.unique(ids, return_inverse=True)
    assert u.dtype == np.int64 and np.array_equal(u, nu)
    assert np.array_equal(inv, ninv.reshape(-1))


@FAST
@given(bounded_ids, st.integers(1, 5), st.sampled_from(["mod", "range"]))
def test_route_gives_the_sorted_keys_of_the_ids_grouped_by_owner(case, num_ps, kind):
    rows, ids = case
    ids = np.array(ids, np.int64)
    pl = RowPlacement(rows, num_ps, kind)
    keys, inv, bad = Dedup(len(ids)).route(ids, pl)
    nk, ninv = np.unique(pl.keys(ids), return_inverse=True)
    assert bad == -1 and np.array_equal(keys, nk) and np.array_equal(inv, ninv.reshape(-1))


@pytest.mark.parametrize("bound", [100, None])  # the bitmap, the hash table
def test_a_dedup_is_reused_step_after_step_and_after_a_bad_id(bound):
    rng = np.random.default_rng(5)
    dedup = Dedup(500)
    pl = RowPlacement(100, 3)
    for step in range(20):
        ids = rng.integers(0, 100, rng.integers(0, 501))
        if step % 5 == 4 and len(ids):  # a bad id in the middle leaves nothing behind
            bad = ids.copy()
            bad[len(bad) // 2] = -3 if bound is None or step % 10 == 4 else 100
            with pytest.raises(ValueError, match=f"id {bad[len(bad) // 2]} is "):
                dedup(bad, bound)
            assert dedup.route(bad, pl)[2] == len(bad) // 2
        if step % 3 == 1:  # a start whose inverse is never asked for leaves nothing behind
            assert np.array_equal(dedup.start(ids, pl)[0], np.unique(pl.keys(ids)))
        u, inv = dedup(ids, bound)
        nu, ninv = np.unique(ids, return_inverse=True)
        assert np.array_equal(u, nu) and np.array_equal(inv, ninv.reshape(-1)), step
    with pytest.raises(ValueError, match=r"id 100 is outside \[0, 100\)"):
        dedup(np.array([1, 100, 2]), 100)
    with pytest.raises(ValueError, match="at most 500"):
        dedup(np.zeros(501, np.int64))


def test_the_first_bad_id_is_found_below_and_above():
    dedup = Dedup(10)
    pl = RowPlacement(37, 1)
    assert dedup.route(np.array([3, 37, -1, 5]), pl)[2] == 1
    assert dedup.route(np.array([3, -1, 37, 5]), pl)[2] == 1
    keys, inv, bad = dedup.route(np.array([36, 0, 36]), pl)
    assert bad == -1 and keys.tolist() == [0, 36] and inv.tolist() == [1, 0, 1]


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_segment_sum_is_bincount_bit_for_bit(dtype):
    rng = np.random.default_rng(2)
    values = (rng.standard_normal((3000, 5)) * 10 ** rng.uniform(-4, 4, (3000, 1)))
    values = values.astype(dtype)
    segments = rng.integers(0, 40, 3000)
    expect = np.empty((40, 5), dtype)
    for d in range(5):  # the numpy it replaces: float64 sums in row order
        expect[:, d] = np.bincount(segments, weights=values[:, d], minlength=40)
    got = segment_sum(values, segments, np.full((40, 5), 7, dtype),
                      np.empty(400) if dtype != "float16" else None)
    assert np.array_equal(got, expect)


@pytest.mark.parametrize("dtype,dim", [("float32", 16), ("float32", 3), ("float64", 5),
                                       ("float16", 3), ("float16", 1)])
def test_rows_are_gathered_and_scattered_whole_whatever_their_width(dtype, dim):
    rng = np.random.default_rng(3)
    table = rng.standard_normal((50, dim)).astype(dtype)
    index = np.array([7, 0, 49, 3], np.int64)
    out = np.empty((4, dim), dtype)
    assert take_rows(table, index, out) is out and np.array_equal(out, table[index])
    expect = table.copy()
    expect[index] = -out
    put_rows(table, index, -out)
    assert np.array_equal(table, expect)
    words = row_words(table)  # whole rows as the widest words that fill them
    assert words.shape[0] == 50 and words.itemsize == min(8, (dim * table.itemsize) & -(
        dim * table.itemsize))


@pytest.mark.parametrize("kind", ["mod", "range"])
def test_local_rows_are_the_placements_and_foreign_ids_are_named(kind):
    pl = RowPlacement(20, 3, kind)
    for ps in range(3):
        mine = pl.global_ids(ps)
        lo, hi = int(pl.starts[ps]), int(pl.starts[ps + 1])
        out = np.empty(len(mine), np.int64)
        assert local_rows(mine, 20, 3, ps, kind == "mod", lo, hi, out) == -1
        assert np.array_equal(out, pl.local(mine, ps))
        other = pl.global_ids((ps + 1) % 3)[:1]
        for bad in (np.r_[mine[:2], other], np.r_[mine[:1], [20]], np.array([-1])):
            where = local_rows(bad, 20, 3, ps, kind == "mod", lo, hi, np.empty(3, np.int64))
            assert where == len(bad) - 1
    ids = np.array([4, 0, 19, 7])  # one ps: the ids are the local rows, only checked
    assert first_outside(ids, 0, 20) == -1 and first_outside(ids[:0], 0, 20) == -1
    assert first_outside(np.r_[ids, 20, -1], 0, 20) == 4
    assert first_outside(np.r_[ids, -1, 20], 0, 20) == 4


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_all_finite_finds_every_nan_and_inf_and_nothing_else(dtype):
    a = np.full((37, 5), np.finfo(dtype).max, dtype)
    a[::2] = np.finfo(dtype).tiny
    a[1, 1] = -np.finfo(dtype).max
    assert all_finite(a) and all_finite(a[:0])
    for bad in (np.nan, np.inf, -np.inf):
        b = a.copy()
        b[36, 4] = bad
        assert not all_finite(b)
        assert not all_finite(b[:, 4])  # not contiguous: numpy's isfinite
