"""Delta checkpoints of embedding tables (ckpt/deltas.py, tables/changes.py).

A job killed (SIGKILL, under mpiexec) between deltas restores from its full checkpoint
plus deltas to the same bits as a job that wrote full checkpoints, under another ps
count; a delta of a step that touched 1 % of a table's rows is small; ``mpitf ckpt``
lists and verifies the chain, and a delta whose base is gone is refused by name.
"""

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from mpitf.ckpt.commands import cmd_export
from mpitf.ckpt.deltas import read_table_state
from mpitf.ckpt.names import read_manifest
from mpitf.ckpt.restore import read_variables
from mpitf.ckpt.tables import table_shards
from mpitf.ckpt.verify import find_restorable, verify_checkpoint
from mpitf.testing import run_mpi

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "tests" / "mpi" / "sparse_driver.py"


def driver(out, num_ps, *args, workers=2):
    os.makedirs(out, exist_ok=True)
    return run_mpi(num_ps + workers, [str(DRIVER), str(out), "--num-ps", str(num_ps),
                                      "--mode", "sync", "--deterministic",
                                      "--optimizer", "adagrad", *map(str, args)],
                   timeout=90, cwd=str(REPO))


def ok(run):
    assert not run.timed_out and run.returncode == 0, run.output
    return run


def assert_same_checkpoint(got, want):
    """Every table's ids, rows, slots and state, and every dense variable: equal bits."""
    a, b = read_table_state(got), read_table_state(want)
    assert sorted(a) == sorted(b)
    for name in a:
        assert sorted(a[name]) == sorted(b[name]), name
        for key in a[name]:
            assert a[name][key].dtype == b[name][key].dtype, (name, key)
            assert np.array_equal(a[name][key], b[name][key]), (name, key)
    va, vb = read_variables(got), read_variables(want)
    assert sorted(va) == sorted(vb)
    for k in va:
        assert np.array_equal(va[k], vb[k]), k


GROWING = ["--dynamic", "--evict-after-steps", 2, "--evict-every", 1]


@pytest.mark.mpi
@pytest.mark.parametrize("tables", [[], GROWING], ids=["fixed", "growing-with-evictions"])
@pytest.mark.slow  # a whole job under mpiexec
def test_a_job_killed_between_deltas_restores_full_plus_deltas_bit_for_bit(tmp_path, tables):
    a, b = tmp_path / "a", tmp_path / "b"
    common = [*tables, "--save-steps", 2]
    # full at 2, deltas at 4 and 6; the chief SIGKILLs itself at step 7
    placement = [] if tables else ["--placement", "range"]  # then mod on restore, and in b
    run = driver(a, 2, *common, *placement, "--steps", 9, "--full-every", 3,
                 "--checkpoint-dir", a / "ckpt", "--kill-at", 7)
    assert not run.timed_out and run.returncode != 0, run.output
    assert "ckpt-00000006 at step 6 (delta on ckpt-00000004)" in run.output
    assert (a / "ckpt" / "latest").read_text().strip() == "ckpt-00000006"
    ok(driver(b, 2, *common, "--steps", 6, "--checkpoint-dir", b / "ckpt"))  # all full
    assert verify_checkpoint(a / "ckpt" / "ckpt-00000006") == []
    for root in (a, b):  # export reads a chain as it reads a full checkpoint
        assert cmd_export(str(root / "ckpt"), str(root / "e.npz"), step=6) == 0
    with np.load(a / "e.npz") as got, np.load(b / "e.npz") as want:
        assert sorted(got.files) == sorted(want.files)
        assert all(np.array_equal(got[k], want[k]) for k in got.files)
    manifest = read_manifest(a / "ckpt" / "ckpt-00000004")
    saved = table_shards(a / "ckpt" / "ckpt-00000004", manifest)
    held = read_table_state(a / "ckpt" / "ckpt-00000004")
    for name, per_ps in saved.items():  # the delta holds the changed rows, not all
        if not tables:  # (growing tables evict what no step touched: they hold few more)
            assert 0 < sum(n for _, n in per_ps) < len(held[name]["ids"]), (name, per_ps)
    assert_same_checkpoint(a / "ckpt" / "ckpt-00000006", b / "ckpt" / "ckpt-00000006")
    # restore the chain under 3 ps, train to 8 (its first checkpoint: full), against 2 ps
    # that never stopped
    ok(driver(a, 3, *common, "--steps", 8, "--full-every", 3, "--checkpoint-dir",
              a / "ckpt"))
    ok(driver(b, 2, *common, "--steps", 8, "--checkpoint-dir", b / "ckpt"))
    assert_same_checkpoint(a / "ckpt" / "ckpt-00000008", b / "ckpt" / "ckpt-00000008")
    if tables:  # the deltas carried evictions: some id lost its row between 2 and 6
        full = read_table_state(a / "ckpt" / "ckpt-00000002")
        late = read_table_state(b / "ckpt" / "ckpt-00000006")
        assert any(np.isin(full[n]["ids"], late[n]["ids"], invert=True).any() for n in full)


@pytest.mark.mpi
def test_ckpt_ls_and_verify_show_the_chain_and_a_delta_without_its_base_is_refused(tmp_path):
    from mpitf.ckpt.commands import cmd_ls, cmd_show, cmd_verify

    root = tmp_path / "ckpt"
    ok(driver(tmp_path, 1, "--steps", 6, "--save-steps", 2, "--full-every", 3,
              "--checkpoint-dir", root, workers=1))
    lines = []
    import builtins
    real = builtins.print
    builtins.print = lambda *a, **k: lines.append(" ".join(map(str, a)))
    try:
        assert cmd_ls(str(root)) == 0
        assert cmd_verify(str(root)) == 0
        assert cmd_show(str(root)) == 0
    finally:
        builtins.print = real
    text = "\n".join(lines)
    assert "ckpt-00000002" in text and "full" in text.split("ckpt-00000004")[0]
    assert "delta on ckpt-00000004 (chain ckpt-00000002, ckpt-00000004)" in text, text
    assert "ckpt-00000006: OK" in text
    assert "delta on ckpt-00000004: its tables hold the rows changed since" in text  # show
    import h5py

    shard = root / "ckpt-00000004" / "shard-00000-of-00001.h5"
    saved = shard.read_bytes()
    with h5py.File(shard, "r+") as f:
        f["tables/users/rows"][0, 0] += 1
    assert any(p.startswith("base ckpt-00000004 of this delta checkpoint: shard-00000-of-00001"
                            ".h5: checksum mismatch in tables/users/rows")
               for p in verify_checkpoint(root / "ckpt-00000006")), \
        verify_checkpoint(root / "ckpt-00000006")
    shard.write_bytes(saved)
    assert verify_checkpoint(root / "ckpt-00000006") == []
    shutil.rmtree(root / "ckpt-00000004")
    problems = verify_checkpoint(root / "ckpt-00000006")
    assert problems == ["base ckpt-00000004 of this delta checkpoint is missing"]
    logged = []
    path, _ = find_restorable(str(root), log=logged.append)
    assert path.endswith("ckpt-00000002")
    assert "skipping ckpt-00000006: base ckpt-00000004 of this delta checkpoint is missing" \
        in logged[0]


def test_a_delta_of_a_step_that_touched_1_percent_of_rows_is_under_5_percent_of_a_full(
        tmp_path):
    from mpitf.ckpt.write import write_shard
    from mpitf.models.embedding import EmbeddingTable
    from mpitf.placement import VariableSlice
    from mpitf.ps.optimizers import make_optimizer
    from mpitf.tables.changes import delta_rows
    from mpitf.tables.shard import TableShard

    rows, dim = 100_000, 16
    spec = EmbeddingTable("emb", rows, dim)
    opt = make_optimizer("adagrad", 0.1)
    shard = TableShard(spec, spec.row_placement(1), 0, opt, 4096,
                       lambda ids: np.full((len(ids), dim), 0.5, np.float32))
    dense = np.ones(256, np.float32)
    slices = [VariableSlice("w", (256,), "float32", 0, 0, 256, 0)]
    slots = {k: np.zeros(256, np.float32) for k in opt.make_slots(1, np, np.float32)
             if not k.startswith("_")}
    shard.apply(opt, np.arange(0, rows, 10_000), np.ones((10, dim), np.float32), 0)
    full = write_shard(str(tmp_path / "full"), 0, 1, 1, slices, dense, slots,
                       tables=[shard.saved(1)])
    shard.changes.clear()
    touched = np.random.default_rng(0).choice(rows, rows // 100, replace=False)
    touched.sort()
    shard.apply(opt, touched, np.ones((len(touched), dim), np.float32), 1)
    delta = write_shard(str(tmp_path / "delta"), 0, 1, 2, slices, dense, slots,
                        tables=[delta_rows(shard, 2)])
    full_bytes = os.path.getsize(tmp_path / "full" / full["file"])
    delta_bytes = os.path.getsize(tmp_path / "delta" / delta["file"])
    print(f"full {full_bytes} bytes, delta {delta_bytes} bytes")
    assert full_bytes > rows * dim * 4 * 2  # rows and Adagrad's accumulator
    assert delta_bytes <= 0.05 * full_bytes, (delta_bytes, full_bytes)


def test_the_options_refuse_what_deltas_cannot_work_with():
    from mpitf.config import JobFacts, TrainingConfig
    from mpitf.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="neither is given"):
        TrainingConfig(full_checkpoint_every=3)
    with pytest.raises(ConfigurationError, match=r"does not support heal \(--heal\)"):
        TrainingConfig(full_checkpoint_every=3, save_checkpoint_steps=10, heal=True)
    config = TrainingConfig(full_checkpoint_every=3, save_checkpoint_steps=10)
    with pytest.raises(ConfigurationError, match="not support a model without embedding"):
        config.check_job(JobFacts(num_ps=1, num_replicas=1, tables=False))
    config.check_job(JobFacts(num_ps=1, num_replicas=1, tables=True))
    TrainingConfig(full_checkpoint_every=1)  # all full: the default, refused by nothing


def test_pruning_keeps_the_bases_of_the_deltas_it_keeps(tmp_path):
    import json

    from mpitf.ckpt.names import FORMAT_VERSION
    from mpitf.ckpt.write import _prune

    def make(step, chain=None):
        path = tmp_path / f"ckpt-{step:08d}"
        path.mkdir()
        manifest = {"format_version": FORMAT_VERSION, "global_step": step}
        if chain:
            manifest["delta"] = {"base": chain[-1], "chain": chain}
        (path / "manifest.json").write_text(json.dumps(manifest))

    make(2)
    make(4, ["ckpt-00000002"])
    make(6, ["ckpt-00000002", "ckpt-00000004"])
    make(8)
    make(10, ["ckpt-00000008"])
    _prune(str(tmp_path), "ckpt-00000010", max_to_keep=1)  # 10 kept, and its base 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000008", "ckpt-00000010"]


def test_marking_a_step_s_rows_allocates_nothing():
    import tracemalloc

    from mpitf.tables.changes import Changes

    changes = Changes(1_000_000)
    rows = np.random.default_rng(0).choice(1_000_000, 40_000, replace=False)
    changes.mark(rows)
    tracemalloc.start()
    try:
        changes.mark(rows)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024, peak  # 40,000 rows marked: no array made (a bool each would be 40 kB)
    assert int(changes.marks.sum()) == 40_000


@pytest.mark.parametrize("kind", ["mod", "range"])
@pytest.mark.parametrize("num_ps", [1, 2, 3])
def test_a_delta_names_the_table_rows_of_its_local_rows(kind, num_ps):
    from mpitf.tables.changes import _global_ids
    from mpitf.tables.rows import RowPlacement

    placement = RowPlacement(37, num_ps, kind)
    for ps in range(num_ps):
        every = placement.global_ids(ps)
        local = np.arange(len(every))[::2]
        assert np.array_equal(_global_ids(placement, ps, local), every[local])
