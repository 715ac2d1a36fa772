"""Click-through files: raw ids (Criteo's hashes, a drifting vocabulary), their fixed-table
twin, chunked writing, and CtrDataset streamed through its buffer."""

import h5py
import numpy as np
import pytest

import mpitf.data.ctr_convert as ctr
from mpitf.cli.main import main as mpitf
from mpitf.data.ctr import (
    CtrDataset,
    auc,
    convert_criteo,
    ctr_ids,
    hash_ctr,
    load_ctr,
    synthetic_ctr,
    write_ctr,
)
from mpitf.data.ctr_convert import MISSING_RAW
from mpitf.data.ctr_synthetic import planted_vectors
from mpitf.data.stream import BUFFER_ENV
from mpitf.errors import ConfigurationError, DataError
from mpitf.testing import run_mpi
from tests.support import REPO


def criteo_tsv(path, lines=10):
    rows = []
    for k in range(lines):
        ints = [str(k), "", "3"] + [str(k * j) for j in range(10)]
        cats = [f"{k % 3:08x}", ""] + [f"{(k * j * 2654435761) % 2**32:08x}" for j in range(24)]
        rows.append("\t".join([str(k % 2)] + ints + cats) + "\n")
    path.write_text("".join(rows))
    return str(path)


def test_criteo_raw_ids_keep_the_32_bit_hashes(tmp_path):
    tsv = criteo_tsv(tmp_path / "day.tsv")
    out = str(tmp_path / "raw.h5")
    assert convert_criteo(tsv, out, test_fraction=0.2, raw_ids=True) == 10
    with h5py.File(out) as f:
        assert (f.attrs["ids"], f.attrs["vocabulary"]) == ("raw", "dynamic")
        assert "table_rows" not in f.attrs
    assert ctr_ids(out) == ("raw", None)
    ids, dense, y, rows = load_ctr(out, "train", raw_ids=True)
    assert rows is None and ids.shape == (8, 26) and ids.dtype == np.int64
    assert ids[:, 0].tolist() == [k % 3 for k in range(8)]  # the hex hash itself, no modulo
    assert (ids[:, 1] == MISSING_RAW).all()  # a missing category: 2**32, no 32-bit hash's id
    assert ids[5, 7] == (5 * 5 * 2654435761) % 2**32 and ids.max() >= 2**31
    with pytest.raises(DataError, match=r"raw.h5 holds raw ids .* out of the range of a fixed "
                                        r"table's rows \(e.g. ids_test\[0, 0\] = 2\)"):
        load_ctr(out, "test")
    with pytest.raises(DataError, match="holds raw ids"):
        CtrDataset(out, 0, 1, 4)
    with pytest.raises(ConfigurationError, match="--rows-per-field .* or --raw-ids"):
        convert_criteo(tsv, out, 16, raw_ids=True)
    (tmp_path / "bad.tsv").write_text(open(tsv).read().replace("\t00000001\t", "\tzz\t", 1))
    with pytest.raises(DataError, match=r"bad.tsv:2: with --raw-ids .* hexadecimal .*'zz'"):
        convert_criteo(str(tmp_path / "bad.tsv"), out, raw_ids=True)


def test_criteo_is_converted_in_blocks_alike(tmp_path, monkeypatch):
    tsv = criteo_tsv(tmp_path / "day.tsv", lines=23)
    whole = str(tmp_path / "whole.h5")
    convert_criteo(tsv, whole, 16, test_fraction=0.3)
    monkeypatch.setattr(ctr, "_BLOCK", 4)  # blocks that straddle nothing: the cut is at 16
    blocks = str(tmp_path / "blocks.h5")
    convert_criteo(tsv, blocks, 16, test_fraction=0.3, compression="gzip")
    for split in ("train", "test"):
        for a, b in zip(load_ctr(whole, split), load_ctr(blocks, split)):
            np.testing.assert_array_equal(a, b)
    with h5py.File(blocks) as f:
        assert f["ids_train"].compression == "gzip" and f["ids_train"].chunks == (16, 26)
        assert f.attrs["ids"] == "index" and len(f["y_test"]) == 7
    assert ctr_ids(blocks) == ("index", [16] * 26)


def test_synthetic_raw_ids_drift_and_their_fixed_twin_collides(tmp_path):
    raw = str(tmp_path / "raw.h5")
    ceiling = synthetic_ctr(raw, train=20000, test=4000, fields=2, rows=50, dense=1, seed=3,
                            raw_ids=True, growth=0.05)
    ids, dense, y, rows = load_ctr(raw, "train", raw_ids=True)
    assert rows is None and ids.min() >= 0 and ids.max() > 2**60  # scattered int64
    early, late = set(ids[:2000, 0]), set(ids[-2000:, 0])
    assert len(early & late) == 0  # old ids faded, new ones appeared
    assert 0.9 * (50 + 1000) < len(set(ids[:, 0])) <= 50 + 1000  # live + 0.05 per example
    counts = np.unique(ids[:, 0], return_counts=True)[1]
    assert 10 < np.median(counts) < 40  # about 1 / growth examples per id
    # The planted model in the attributes gives the returned ceiling on the test split.
    with h5py.File(raw) as f:
        u, v, seed = f.attrs["planted_u"], f.attrs["planted_v"], int(f.attrs["planted_seed"])
    test_ids, test_dense, test_y, _ = load_ctr(raw, "test", raw_ids=True)

    def logit(vectors):
        return sum(vectors(f) @ u for f in range(2)) / np.sqrt(2) + test_dense @ v - 1.0

    assert auc(test_y, logit(lambda f: planted_vectors(test_ids[:, f], f, 4, seed))) \
        == pytest.approx(ceiling)
    # Its fixed-table twin: ids mod R. A table of R rows can at best hold, per row, the
    # mean vector of the ids that share it: collisions cost AUC, more the fewer the rows.
    aucs = {}
    for r in (32, 4096):
        fixed = str(tmp_path / f"fixed{r}.h5")
        hash_ctr(raw, fixed, r)
        hashed, hdense, hy, hrows = load_ctr(fixed, "train")
        assert hrows.tolist() == [r, r] and (hashed == ids % r).all()
        np.testing.assert_array_equal(hy, y)
        np.testing.assert_array_equal(hdense, dense)
        tables = []
        for f in range(2):
            sums = np.zeros((r, 4))
            np.add.at(sums, hashed[:, f], planted_vectors(ids[:, f], f, 4, seed))
            tables.append(sums / np.maximum(np.bincount(hashed[:, f], minlength=r), 1)[:, None])
        aucs[r] = auc(test_y, logit(lambda f, t=tables, r=r: t[f][test_ids[:, f] % r]))
    assert aucs[32] < aucs[4096] - 0.03 and aucs[4096] < ceiling


def test_ctr_dataset_streams_checks_each_window_and_resumes(tmp_path):
    path = str(tmp_path / "c.h5")
    n = 300
    ids = np.stack([np.arange(n) % 7, np.arange(n)], axis=1)
    ids[250, 1] = n  # outside [0, n): found when its window is read
    write_ctr(path, [7, n], {"train": (ids, np.arange(n)[:, None] * 0.5, np.arange(n) % 2),
                             "test": (ids[:10] % 7, np.zeros((10, 1)), np.zeros(10))})
    with h5py.File(path) as f:
        assert f["ids_train"].chunks == (300, 2)  # ~1 MiB of rows, at most the split
    kwargs = dict(shard_index=1, num_shards=2, batch_size=8, seed=1, buffer=40, prefetch=0)
    data = CtrDataset(path, **kwargs)
    assert (data.start, data.stop, data.dense_dim) == (150, 300, 1)
    assert data.table_rows.tolist() == [7, 300]
    with pytest.raises(DataError, match=r"id 300 of field 1 in split 'train' \(example 250\)"):
        for _ in range(40):
            data.next_batch()
    data.close()
    ids[250, 1] = 250
    write_ctr(path, [7, n], {"train": (ids, np.arange(n)[:, None] * 0.5, np.arange(n) % 2),
                             "test": (ids[:10] % 7, np.zeros((10, 1)), np.zeros(10))})
    with CtrDataset(path, **kwargs) as data:
        got = [data.next_batch() for _ in range(30)]  # 18 a epoch: into the second
        assert data.state() == {"epoch": 1, "cursor": 96} and data.peak_rows_held <= 40
    rows = np.concatenate([b[1][:, 0] for b in got[:18]]) * 2
    assert len(set(rows)) == 144 and set(rows) <= set(range(150, 300))  # each row once
    for ids_b, dense_b, y_b in got:
        np.testing.assert_array_equal(ids_b[:, 1], dense_b[:, 0] * 2)  # rows stay whole
        assert ids_b.dtype == np.int64 and dense_b.dtype == y_b.dtype == np.float32
    with CtrDataset(path, **dict(kwargs, prefetch=2)) as again:
        again.restore({"epoch": 0, "cursor": 120})
        for want in got[15:]:
            np.testing.assert_array_equal(again.next_batch()[0], want[0])


def test_the_cli_writes_raw_ids_and_refuses_bad_options(tmp_path, capsys):
    raw, fixed = str(tmp_path / "r.h5"), str(tmp_path / "f.h5")
    assert mpitf(["data", "synthetic-ctr", "--out", raw, "--train", "300", "--test", "50",
                  "--raw-ids", "--growth", "0.1", "--compression", "lzf"]) == 0
    assert "raw ids, 1000 live per field, 0.1 new per example" in capsys.readouterr().out
    assert mpitf(["data", "hash-ids", "--src", raw, "--out", fixed,
                  "--rows-per-field", "64"]) == 0
    assert load_ctr(fixed, "train")[3].tolist() == [64] * 8
    tsv = criteo_tsv(tmp_path / "d.tsv")
    assert mpitf(["data", "criteo", "--tsv", tsv, "--out", raw, "--raw-ids"]) == 0
    assert "26 fields of raw 32-bit hashes" in capsys.readouterr().out
    assert mpitf(["data", "criteo", "--tsv", tsv, "--out", raw, "--raw-ids",
                  "--rows-per-field", "9"]) == 2
    assert "not both" in capsys.readouterr().err
    assert mpitf(["data", "synthetic-ctr", "--out", raw, "--raw-ids", "--growth", "-1"]) == 2
    assert "growth (new ids per example) must be > 0" in capsys.readouterr().err


def refused_once(run, message):
    assert not run.timed_out and run.returncode == 2, run.output
    assert run.output.count(message) == 1, run.output  # rank 0 alone says it
    assert f"mpitf: error on rank 0: {message}" in run.stderr and "Traceback" not in run.output
    assert "final:" not in run.stdout


@pytest.mark.mpi
def test_jobs_refuse_raw_ids_for_fixed_tables_and_a_bad_buffer_on_every_rank(tmp_path):
    raw = str(tmp_path / "raw.h5")
    synthetic_ctr(raw, train=200, test=50, fields=2, rows=10, dense=1, seed=1, raw_ids=True)
    argv = ["-m", "mpitf.jobs.ctr", "--data", raw, "--num-ps", "1", "--steps", "5"]
    refused_once(run_mpi(3, argv, timeout=30, cwd=str(REPO)), f"data file {raw} holds raw ids")
    fixed = hash_ctr(raw, str(tmp_path / "fixed.h5"), 10)
    argv[3] = fixed
    refused_once(run_mpi(3, argv, timeout=30, cwd=str(REPO), env={BUFFER_ENV: "none"}),
                 f"${BUFFER_ENV}='none': expecting the shuffle buffer in MiB, a number > 0")
