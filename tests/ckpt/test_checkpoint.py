import json
import os
import tempfile

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI

from mpitf.ckpt import commands as cmds
from mpitf.ckpt import cut
from mpitf.ckpt.names import checkpoint_name, list_checkpoints, read_manifest
from mpitf.ckpt.pieces import Piece, cover
from mpitf.ckpt.restore import load_shard, read_variables
from mpitf.ckpt.verify import find_restorable, verify_checkpoint
from mpitf.ckpt.write import prepare_save, write_manifest, write_shard
from mpitf.errors import CheckpointError, PeerError
from mpitf.placement import MinMaxVariablePartitioner, Placement, VariableSlice
from mpitf.runtime.backend import numpy_backend
from mpitf.testing.fake_gpu import fake_gpu_backend

VARIABLES = [
    ("hidden1/weights", (8, 6), "float32"),
    ("hidden1/biases", (6,), "float32"),
    ("softmax/weights", (6, 3), "float32"),
    ("global_scale", (), "float32"),
]
SPLIT = MinMaxVariablePartitioner(max_partitions=2, min_slice_size=64)


def values_at(step, variables=VARIABLES, salt=0.0):
    rng = np.random.default_rng(step)
    return {n: (rng.standard_normal(s) + salt).astype(t) for n, s, t in variables}


def shard_of(placement, ps, full):
    buf = np.zeros(placement.shard_sizes[ps], dtype=placement.dtype)
    for s in placement.slices_for_ps(ps):
        buf[s.offset:s.offset + s.size] = full[s.name].reshape(-1)[s.start:s.stop]
    return buf


def gather(placement, buffers):
    out = {n: np.zeros(int(np.prod(s)), dtype=t) for n, s, t in placement.variables}
    for s in placement.slices:
        out[s.name][s.start:s.stop] = buffers[s.ps_task][s.offset:s.offset + s.size]
    return {n: out[n].reshape(s) for n, s, _ in placement.variables}


def save(root, step, placement=None, slots=("m", "v"), average=True, max_to_keep=5):
    placement = placement or Placement(VARIABLES, 2, partitioner=SPLIT)
    ckpt_dir = os.path.join(root, checkpoint_name(step))
    entries = []
    for ps in range(placement.num_ps):
        slot_bufs = {n: shard_of(placement, ps, values_at(step, salt=k + 1))
                     for k, n in enumerate(slots)}
        slot_bufs["_scratch"] = np.full(placement.shard_sizes[ps], np.nan, np.float32)
        avg = shard_of(placement, ps, values_at(step, salt=10)) if average else None
        entries.append(write_shard(ckpt_dir, ps, placement.num_ps, step,
                                   placement.slices_for_ps(ps),
                                   shard_of(placement, ps, values_at(step)), slot_bufs, avg))
    layout = {"num_ps": placement.num_ps, "num_workers": 2, "cluster": "ps:2,worker:2",
              "mode": "sync", "optimizer": {"name": "adam", "learning_rate": 0.001}}
    workers = {0: {"epoch": 1, "cursor": step * 10}, 1: {"epoch": 1, "cursor": step * 10 + 5}}
    return write_manifest(root, step, entries, placement.variables, layout, workers,
                          extra={"note": "test"}, max_to_keep=max_to_keep)


def restore(ckpt_dir, placement, slots=("m", "v"), average=True):
    manifest = read_manifest(ckpt_dir)
    params, slot_bufs, avgs, results = {}, {n: {} for n in slots}, {}, []
    for ps in range(placement.num_ps):
        params[ps] = np.full(placement.shard_sizes[ps], -1.0, np.float32)
        mine = {n: np.zeros(placement.shard_sizes[ps], np.float32) for n in slots}
        mine["_scratch"] = np.zeros(placement.shard_sizes[ps], np.float32)
        avgs[ps] = np.zeros(placement.shard_sizes[ps], np.float32) if average else None
        results.append(load_shard(ckpt_dir, manifest, placement.slices_for_ps(ps),
                                  params[ps], mine, avgs[ps]))
        for n in slots:
            slot_bufs[n][ps] = mine[n]
    return params, slot_bufs, avgs, results


def assert_same(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def flip_byte(ckpt_dir, fname, dataset):
    path = os.path.join(ckpt_dir, fname)
    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_offset()
    with open(path, "r+b") as f:
        f.seek(offset + 1)
        byte = f.read(1)
        f.seek(offset + 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_placement_spreads_one_variable_over_both_ps():
    placement = Placement(VARIABLES, 2, partitioner=SPLIT)
    assert {s.ps_task for s in placement.owner("hidden1/weights")} == {0, 1}


def test_write_verify_and_read_back(tmp_path):
    ckpt_dir = save(str(tmp_path), 100)
    assert os.path.basename(ckpt_dir) == "ckpt-00000100"
    assert (tmp_path / "latest").read_text().strip() == "ckpt-00000100"
    assert sorted(os.listdir(ckpt_dir)) == ["manifest.json", "shard-00000-of-00002.h5",
                                            "shard-00001-of-00002.h5"]
    assert verify_checkpoint(ckpt_dir) == []
    assert_same(read_variables(ckpt_dir), values_at(100))
    manifest = read_manifest(ckpt_dir)
    assert manifest["global_step"] == 100
    assert manifest["workers"]["1"] == {"epoch": 1, "cursor": 1005}
    assert [e["file"] for e in manifest["shards"]] == ["shard-00000-of-00002.h5",
                                                       "shard-00001-of-00002.h5"]
    with h5py.File(os.path.join(ckpt_dir, "shard-00001-of-00002.h5"), "r") as f:
        assert dict(f.attrs) == {"global_step": 100, "ps_task": 1, "num_ps": 2,
                                 "format_version": 1}
        ds = f["params/hidden1/weights/part1"]
        assert (ds.attrs["start"], ds.attrs["stop"]) == (24, 48)
        assert list(ds.attrs["shape"]) == [8, 6]
        assert "slots/m/hidden1/weights/part1" in f
        assert "average/hidden1/weights/part1" in f
        assert "slots/_scratch" not in f


@pytest.mark.parametrize("num_ps, partitioner, strategy", [
    (1, None, None),
    (3, MinMaxVariablePartitioner(max_partitions=3, min_slice_size=16), "greedy"),
    (2, None, None),
])
def test_restore_under_another_placement(tmp_path, num_ps, partitioner, strategy):
    ckpt_dir = save(str(tmp_path), 100)
    target = Placement(VARIABLES, num_ps, strategy, partitioner)
    params, slots, avgs, results = restore(ckpt_dir, target)
    assert_same(gather(target, params), values_at(100))
    assert_same(gather(target, slots["m"]), values_at(100, salt=1))
    assert_same(gather(target, slots["v"]), values_at(100, salt=2))
    assert_same(gather(target, avgs), values_at(100, salt=10))
    assert results[0] == {"missing_slots": [], "missing_average": False, "global_step": 100}


def test_missing_slots_and_average_are_reported(tmp_path):
    ckpt_dir = save(str(tmp_path), 100, slots=("momentum",), average=False)
    target = Placement(VARIABLES, 3)
    params, slots, avgs, results = restore(ckpt_dir, target, slots=("m", "momentum"))
    assert_same(gather(target, params), values_at(100))
    assert_same(gather(target, slots["momentum"]), values_at(100, salt=1))
    assert not any(buf.any() for buf in slots["m"].values())
    assert results[0] == {"missing_slots": ["m"], "missing_average": True, "global_step": 100}


def test_shape_mismatch_and_unknown_variable_raise(tmp_path):
    ckpt_dir = save(str(tmp_path), 100)
    manifest = read_manifest(ckpt_dir)
    wrong = Placement([("hidden1/weights", (8, 7), "float32")], 1)
    with pytest.raises(CheckpointError, match=r"'hidden1/weights'.*\(8, 7\).*\(8, 6\)"):
        load_shard(ckpt_dir, manifest, wrong.slices, np.zeros(56, np.float32))
    extra = Placement([("hidden2/weights", (3,), "float32")], 1)
    with pytest.raises(CheckpointError, match="'hidden2/weights'"):
        load_shard(ckpt_dir, manifest, extra.slices, np.zeros(3, np.float32))


def test_corrupt_byte_is_named_and_skipped(tmp_path):
    root = str(tmp_path)
    for step in (100, 200, 300):
        save(root, step)
    bad = os.path.join(root, "ckpt-00000300")
    flip_byte(bad, "shard-00001-of-00002.h5", "params/hidden1/weights/part1")
    problems = verify_checkpoint(bad)
    assert ("shard-00001-of-00002.h5: checksum mismatch in params/hidden1/weights/part1"
            in problems)
    lines = []
    path, manifest = find_restorable(root, log=lines.append)
    assert os.path.basename(path) == "ckpt-00000200" and manifest["global_step"] == 200
    assert len(lines) == 1
    assert lines[0].startswith("skipping ckpt-00000300: shard-00001-of-00002.h5: checksum "
                               "mismatch in params/hidden1/weights/part1")
    assert lines[0].endswith("; using ckpt-00000200")
    target = Placement(VARIABLES, 1)
    with pytest.raises(CheckpointError, match="checksum mismatch in params/hidden1/weights"):
        restore(bad, target)
    assert cmds.cmd_verify(bad) == 1
    assert cmds.cmd_verify(root) == 1
    assert cmds.cmd_verify(path) == 0


def test_truncated_shard_is_skipped(tmp_path):
    root = str(tmp_path)
    save(root, 100)
    save(root, 200)
    shard = os.path.join(root, "ckpt-00000200", "shard-00000-of-00002.h5")
    os.truncate(shard, os.path.getsize(shard) // 2)
    problems = verify_checkpoint(os.path.dirname(shard))
    assert problems[0].startswith("shard-00000-of-00002.h5: unreadable HDF5")
    assert all(p.startswith("shard-00000-of-00002.h5: ") for p in problems)
    lines = []
    path, _ = find_restorable(root, log=lines.append)
    assert os.path.basename(path) == "ckpt-00000100"
    assert lines[0].startswith("skipping ckpt-00000200: shard-00000-of-00002.h5: ")


def test_missing_shard_and_missing_manifest(tmp_path):
    root = str(tmp_path)
    save(root, 100)
    save(root, 200)
    save(root, 300)
    os.remove(os.path.join(root, "ckpt-00000300", "manifest.json"))
    os.remove(os.path.join(root, "ckpt-00000200", "shard-00001-of-00002.h5"))
    assert [c["complete"] for c in list_checkpoints(root)] == [True, True, False]
    assert verify_checkpoint(os.path.join(root, "ckpt-00000300")) == [
        "incomplete (no manifest.json)"]
    lines = []
    path, _ = find_restorable(root, log=lines.append)
    assert os.path.basename(path) == "ckpt-00000100"
    assert lines == [
        "skipping ckpt-00000300: incomplete (no manifest.json); using ckpt-00000100",
        "skipping ckpt-00000200: shard-00001-of-00002.h5: missing; using ckpt-00000100"]


def test_latest_naming_a_missing_dir_falls_back(tmp_path):
    root = str(tmp_path)
    save(root, 100)
    save(root, 200)
    (tmp_path / "latest").write_text("ckpt-00000900\n")
    lines = []
    path, _ = find_restorable(root, log=lines.append)
    assert os.path.basename(path) == "ckpt-00000200"
    assert lines == ["skipping ckpt-00000900: named by `latest` but does not exist; "
                     "using ckpt-00000200"]


def test_no_checkpoint_and_nothing_restorable(tmp_path):
    assert find_restorable(str(tmp_path / "absent")) is None
    assert find_restorable(str(tmp_path)) is None
    root = str(tmp_path)
    save(root, 100)
    os.remove(os.path.join(root, "ckpt-00000100", "shard-00000-of-00002.h5"))
    with pytest.raises(CheckpointError, match="ckpt-00000100: shard-00000-of-00002.h5"):
        find_restorable(root, log=lambda line: None)


def test_max_to_keep_prunes_oldest(tmp_path):
    root = str(tmp_path)
    os.makedirs(os.path.join(root, "ckpt-00000050"))  # a save cut short, long ago
    for step in range(100, 800, 100):
        save(root, step, max_to_keep=3)
    assert [c["global_step"] for c in list_checkpoints(root)] == [500, 600, 700]
    assert (tmp_path / "latest").read_text().strip() == "ckpt-00000700"
    for step in range(800, 1000, 100):
        save(root, step, max_to_keep=None)
    assert len(list_checkpoints(root)) == 5


def test_crash_mid_write_leaves_previous_whole(tmp_path):
    root = str(tmp_path)
    save(root, 100)
    save(root, 200)
    placement = Placement(VARIABLES, 2, partitioner=SPLIT)
    partial = os.path.join(root, "ckpt-00000300")
    write_shard(partial, 0, 2, 300, placement.slices_for_ps(0),
                shard_of(placement, 0, values_at(300)))
    (tmp_path / "ckpt-00000300" / "shard-00001-of-00002.h5.tmp").write_bytes(b"\x89HDF half")
    (tmp_path / "latest.tmp").write_text("ckpt-00000300")
    assert (tmp_path / "latest").read_text().strip() == "ckpt-00000200"
    assert verify_checkpoint(os.path.join(root, "ckpt-00000200")) == []
    lines = []
    path, _ = find_restorable(root, log=lines.append)
    assert os.path.basename(path) == "ckpt-00000200"
    assert lines == ["skipping ckpt-00000300: newer than ckpt-00000200, which `latest` "
                     "names; using ckpt-00000200"]
    assert cmds.cmd_verify(root) == 0
    # The restarted job saves step 300 again: the leftovers are cleared first.
    assert prepare_save(root, 300) is True
    assert not os.path.exists(partial)
    save(root, 300)
    assert find_restorable(root, log=lines.append)[0] == partial
    assert_same(read_variables(partial), values_at(300))


def test_save_twice_at_one_step(tmp_path):
    root = str(tmp_path)
    ckpt_dir = save(root, 100)
    assert prepare_save(root, 100) is False
    with pytest.raises(CheckpointError, match="prepare_save"):
        save(root, 100)
    assert verify_checkpoint(ckpt_dir) == []


def test_manifest_refuses_a_changed_shard(tmp_path):
    root = str(tmp_path)
    save(root, 100)
    placement = Placement(VARIABLES, 2, partitioner=SPLIT)
    ckpt_dir = os.path.join(root, "ckpt-00000200")
    entries = [write_shard(ckpt_dir, ps, 2, 200, placement.slices_for_ps(ps),
                           shard_of(placement, ps, values_at(200))) for ps in range(2)]
    first = placement.slices_for_ps(1)[0]
    flip_byte(ckpt_dir, entries[1]["file"], f"params/{first.name}/part{first.part}")
    with pytest.raises(CheckpointError, match="sha256"):
        write_manifest(root, 200, entries, placement.variables, {"num_ps": 2}, {})
    with pytest.raises(CheckpointError, match="expecting one shard from each of 2"):
        write_manifest(root, 200, entries[:1], placement.variables, {"num_ps": 2}, {})
    assert (tmp_path / "latest").read_text().strip() == "ckpt-00000100"
    assert not os.path.exists(os.path.join(ckpt_dir, "manifest.json"))


def test_commands(tmp_path, capsys):
    root = str(tmp_path)
    save(root, 100)
    save(root, 200)
    assert cmds.cmd_verify(root) == 0
    assert capsys.readouterr().out == "ckpt-00000100: OK\nckpt-00000200: OK\n"
    assert cmds.cmd_ls(root) == 0
    out = capsys.readouterr().out
    assert "ckpt-00000200" in out and "<- latest" in out
    assert cmds.cmd_show(root) == 0
    out = capsys.readouterr().out
    assert "global step 200" in out and "hidden1/weights" in out and "ps1[24:48]" in out
    assert "worker 1: epoch 1, cursor 2005" in out and "slots: m, v" in out
    assert cmds.cmd_show(root, step=100) == 0
    assert "global step 100" in capsys.readouterr().out
    out_npz = str(tmp_path / "vars.npz")
    assert cmds.cmd_export(root, out_npz) == 0
    with np.load(out_npz) as z:
        assert_same({k: z[k] for k in z.files}, values_at(200))
    assert cmds.cmd_export(root, out_npz, step=100) == 0
    with np.load(out_npz) as z:
        assert_same({k: z[k] for k in z.files}, values_at(100))
    capsys.readouterr()
    for cmd in (cmds.cmd_ls, cmds.cmd_show, cmds.cmd_verify):
        assert cmd(str(tmp_path / "nowhere")) == 1
        assert "no checkpoints" in capsys.readouterr().out
    assert cmds.cmd_show(root, step=300) == 1
    assert "no checkpoint at step 300" in capsys.readouterr().out


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(1, 5)), min_size=1, max_size=4),
       st.integers(1, 4), st.integers(1, 4), st.integers(1, 4), st.integers(1, 4))
def test_any_placement_restores_under_any_other(shapes, ps_a, parts_a, ps_b, parts_b):
    variables = [(f"layer{i}/w", shape, "float32") for i, shape in enumerate(shapes)]
    a = Placement(variables, ps_a, partitioner=MinMaxVariablePartitioner(parts_a, 4))
    b = Placement(variables, ps_b, "greedy", MinMaxVariablePartitioner(parts_b, 4))
    want = values_at(7, variables)
    with tempfile.TemporaryDirectory() as root:
        ckpt_dir = os.path.join(root, checkpoint_name(7))
        entries = [write_shard(ckpt_dir, p, ps_a, 7, a.slices_for_ps(p), shard_of(a, p, want))
                   for p in range(ps_a)]
        write_manifest(root, 7, entries, variables, {"num_ps": ps_a}, {})
        assert verify_checkpoint(ckpt_dir) == []
        params, _, _, _ = restore(ckpt_dir, b, slots=(), average=False)
        assert_same(gather(b, params), want)


def test_cover_names_a_gap_an_overlap_and_a_short_end():
    def pieces(*ranges):
        return [Piece("f", 0, f"params/x/part{i}", "params", None, "x", lo, hi, (10,), "<f4", 0)
                for i, (lo, hi) in enumerate(ranges)]

    whole = pieces((0, 4), (4, 10))
    assert cover(whole, 0, 10) == (whole, None)
    assert cover(whole, 2, 6) == (whole, None)  # a slice may need part of a piece
    assert cover(whole, 5, 9) == (whole[1:], None)
    assert cover(pieces((0, 4), (5, 10)), 0, 10) == (None, "gap at element 4")
    assert cover(pieces((0, 5), (4, 10)), 0, 10) == (None, "overlap at element 5")
    assert cover(pieces((0, 4), (4, 8)), 0, 10) == (None, "covered up to element 8 of 10")
    assert cover(pieces((0, 4), (5, 10)), 5, 10)[1] is None


def test_a_piece_beyond_its_variable_is_damage(tmp_path):
    root = str(tmp_path)
    ckpt_dir = os.path.join(root, checkpoint_name(5))
    variables = [("x", (4,), "float32")]
    beyond = [VariableSlice("x", (4,), "float32", 0, 0, 6, 0)]
    entry = write_shard(ckpt_dir, 0, 1, 5, beyond, np.arange(6, dtype=np.float32))
    write_manifest(root, 5, [entry], variables, {"num_ps": 1}, {})
    assert verify_checkpoint(ckpt_dir) == [
        "shard-00000-of-00001.h5: params/x/part0 holds elements [0:6] of a variable of 4"]
    with pytest.raises(CheckpointError, match=r"elements \[0:6\] of a variable of 4"):
        read_variables(ckpt_dir)


class _Outbox:
    """A communicator that keeps what is sent to it."""

    def __init__(self):
        self.sent = []

    def send(self, obj, dest, tag):
        self.sent.append((obj, dest, tag))


def test_the_cut_saves_and_restores_a_gpu_shard_through_host_memory(tmp_path):
    root = str(tmp_path)
    placement = Placement(VARIABLES, 2, partitioner=SPLIT)
    outbox = _Outbox()
    for ps in range(2):
        be = fake_gpu_backend()
        dev = {k: be.to_device(shard_of(placement, ps, values_at(3, salt=s)))
               for k, s in (("params", 0), ("m", 1), ("average", 10))}
        cut.save_shard(outbox, 7, root, ps, 2, 3, placement.slices_for_ps(ps), be,
                       dev["params"], {"m": dev["m"]}, dev["average"], {0: (1, 30)}, {0},
                       {"pushes_applied": 3})
    reports = [obj for obj, dest, _ in outbox.sent if dest == 7]
    assert [r["paused"] for r in reports] == [[0], [0]]
    assert cut.commit(root, reports, placement.variables, {"num_ps": 2}, max_to_keep=5) == 3
    ckpt_dir = os.path.join(root, checkpoint_name(3))
    assert verify_checkpoint(ckpt_dir) == []
    assert cut.data_position(ckpt_dir, 0) == {"epoch": 1, "cursor": 30}
    assert cut.data_position(ckpt_dir, 1) == {"epoch": 1, "cursor": 0}
    target = Placement(VARIABLES, 1)
    be = fake_gpu_backend()
    params, m, v, average = (be.zeros(target.shard_sizes[0], np.float32) for _ in range(4))
    restored = cut.restore_shard(ckpt_dir, target.slices_for_ps(0), be, params,
                                 {"m": m, "v": v}, average)
    assert restored == {"missing_slots": ["v"], "missing_average": False, "global_step": 3,
                        "positions": {0: (1, 30)}}
    assert be.events[-3:] == ["to_device"] * 3
    for buf, salt in ((params, 0), (m, 1), (average, 10)):
        np.testing.assert_array_equal(buf.get(), shard_of(target, 0, values_at(3, salt=salt)))
    assert not v.get().any()


def test_max_to_keep_0_keeps_all(tmp_path):
    for step in range(100, 900, 100):
        save(str(tmp_path), step, max_to_keep=0)
    assert [c["global_step"] for c in list_checkpoints(str(tmp_path))] == \
        list(range(100, 900, 100))


def test_pruning_leaves_what_it_cannot_identify(tmp_path):
    root = str(tmp_path)
    (tmp_path / "ckpt-notastep").mkdir()
    (tmp_path / "ckpt-00000100.skipped-1").mkdir()
    save(root, 100)
    save(root, 200)
    (tmp_path / "ckpt-00000200" / "manifest.json").write_bytes(b"\x00 not json")
    mislabelled = save(root, 300)
    manifest = json.loads((tmp_path / "ckpt-00000300" / "manifest.json").read_text())
    os.rename(mislabelled, tmp_path / "ckpt-00000250")  # its manifest says step 300
    for step in (400, 500):
        save(root, step, max_to_keep=1)
    assert manifest["global_step"] == 300
    assert sorted(os.listdir(root)) == sorted(
        ["ckpt-00000200", "ckpt-00000250", "ckpt-00000500", "ckpt-notastep",
         "ckpt-00000100.skipped-1", "latest"])


def test_pruning_never_deletes_a_checkpoint_newer_than_the_restored_one(tmp_path):
    root = str(tmp_path)
    for step in (100, 200, 300, 400):
        save(root, step)
    (tmp_path / "latest").write_text("ckpt-00000200\n")  # 300 and 400 are past `latest`
    lines = []
    path, _ = find_restorable(root, log=lines.append)
    assert os.path.basename(path) == "ckpt-00000200"
    newer = {n: sorted(os.listdir(tmp_path / n)) for n in ("ckpt-00000300", "ckpt-00000400")}
    for step in (210, 220, 230):  # a library caller that did not set the newer ones aside
        save(root, step, max_to_keep=1)
    assert [c["global_step"] for c in list_checkpoints(root)] == [230, 300, 400]
    assert {n: sorted(os.listdir(tmp_path / n)) for n in newer} == newer
    assert verify_checkpoint(str(tmp_path / "ckpt-00000400")) == []


class _DeadPeer:
    """A communicator whose peer died: every call fails as ULFM's do (MPI_ERR_PROC_FAILED)."""

    def _fail(self, *args, **kwargs):
        raise MPI.Exception(MPI.ERR_PROC_FAILED)

    send = Iprobe = _fail


def _peer(rank, operation):
    return dict(rank=rank, job="worker" if rank == 1 else "ps", task=0, host="h",
                operation=operation)


def test_a_rank_dead_in_the_middle_of_a_cut_is_one_error_naming_it(tmp_path):
    # Not survived (docs/reliability.md): the chief's release, the ps's report to it and the
    # chief's collection of the reports each end the job naming the dead rank.
    dead, tail = _DeadPeer(), "loss is survived between cuts, not in one: resume from the latest"
    with pytest.raises(PeerError, match=rf"^died during the checkpoint cut at step 9; the "
                       rf"chief's {tail} checkpoint \(rank 1, /job:worker/task:0, on h, "
                       rf"during checkpoint\)$"):
        cut.wait_for_release(dead, 1, 5.0, _peer, 9)
    placement = Placement(VARIABLES, 1)
    params = shard_of(placement, 0, values_at(3))
    with pytest.raises(PeerError, match=rf"^died during the checkpoint cut at step 3; the "
                       rf"chief's {tail}"):
        cut.save_shard(dead, 1, str(tmp_path), 0, 1, 3, placement.slices_for_ps(0),
                       numpy_backend(), params, {}, None, {}, set(), {}, peer=_peer)
    with pytest.raises(PeerError, match=rf"^died during the checkpoint cut; a ps's {tail} "
                       rf"checkpoint \(rank 0, /job:ps/task:0, on h, during checkpoint write\)$"):
        cut.collect(dead, [0], 5.0, lambda rank: "h")
