"""ps/table_copy.py: a ps's tables written into its copy and read back by another ps's."""

import numpy as np

from mpitf.models.embedding import EmbeddingTable
from mpitf.ps import table_copy
from mpitf.ps.copies import Image
from mpitf.ps.optimizers import make_optimizer
from mpitf.ps.sparse import SparseTables
from mpitf.tables.growth import Growth

SPECS = [EmbeddingTable("fixed", 50, 4),
         EmbeddingTable("grows", None, 3, dynamic=Growth(admit_min_count=2,
                                                         evict_after_steps=3, evict_every=2))]


def _tables():
    return SparseTables({"tables": SPECS, "batch_size": 8}, 0, 1, make_optimizer("adagrad", 0.1),
                        7, 2)


def _train(tables, seed, steps, start=1):
    """Apply ``steps`` steps of random row gradients to both tables."""
    rng = np.random.default_rng(seed)
    opt = tables.optimizer
    for step in range(start, start + steps):
        fixed, grows = tables.tables
        ids = np.unique(rng.integers(0, 50, 12)).astype(np.int64)
        fixed.apply(opt, ids, rng.standard_normal((len(ids), 4)).astype(np.float32), step)
        ids = np.unique(rng.integers(-40, 40, 12) * 1_000_003).astype(np.int64)
        grows.apply(opt, ids, rng.standard_normal((len(ids), 3)).astype(np.float32), step)


def _state(tables, step):
    saved = tables.saved(step)
    out = [saved[0]["rows"].copy(), *(v.copy() for v in saved[0]["slots"].values())]
    grows = saved[1]
    out += [grows["ids"], grows["rows"], *grows["slots"].values(), *grows["extra"].values()]
    return out, tables.stats()


def _same(a, b, step):
    (xs, sa), (ys, sb) = _state(a, step), _state(b, step)
    assert sa == sb
    assert len(xs) == len(ys) and all(np.array_equal(x, y) for x, y in zip(xs, ys))


def test_a_copy_read_by_another_ps_holds_the_same_rows_slots_ages_and_counts():
    a, b = _tables(), _tables()
    _train(a, 1, 9)
    buffer = np.empty(table_copy.nbytes(a), np.uint8)
    assert table_copy.write(a, buffer) == len(buffer)
    table_copy.read(b, buffer)
    _same(a, b, 9)
    # both go on alike: the id map the reader rebuilt finds every row, the free list reused
    _train(a, 2, 6, start=10)
    _train(b, 2, 6, start=10)
    _same(a, b, 15)


def test_a_copy_replaces_what_the_reader_held_and_grows_its_storage():
    a, b = _tables(), _tables()
    _train(b, 3, 5)  # b served a copy before (an earlier adoption) and moved on
    _train(a, 4, 40)  # a grew past b's storage
    assert a.tables[1].capacity_rows >= b.tables[1].capacity_rows
    table_copy.read(b, table_copy.snapshot(a))
    _same(a, b, 40)
    assert table_copy.nbytes(None) == 0 and table_copy.write(None, None) == 0


def test_an_image_is_made_once_and_grows_only_with_its_tables():
    tables = _tables()
    dense = [np.arange(10, dtype=np.float32), np.ones(3)]
    image = Image(dense, tables)  # made for the tables as they are: no rows admitted yet
    made = image.buffer
    assert image.take(dense, 0) == len(made) and image.buffer is made
    _train(tables, 5, 3)  # rows admitted: the buffer doubles once
    used = image.take(dense, 3)
    grown = image.buffer
    assert grown is not made and len(grown) == 2 * len(made)
    assert used == 8 + 64 + table_copy.nbytes(tables) <= len(grown)
    for step in range(4, 8):  # copies of tables that hold as many rows: the same buffer
        assert image.take(dense, step) == used and image.buffer is grown
    other, theirs = _tables(), [np.empty(10, np.float32), np.empty(3)]
    received = Image(theirs)  # a ward's: its tail grows to the copy received
    received.fit(used)
    received.buffer[:used] = grown[:used]
    assert received.give(theirs, other) == 7
    assert all(np.array_equal(a, b) for a, b in zip(dense, theirs))
    _same(tables, other, 7)
