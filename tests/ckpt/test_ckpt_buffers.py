"""A model's buffers in checkpoints (ckpt/buffers.py): written, verified, restored, exported.

Single-process: the chief's side of a cut by hand, with a BatchNorm layer's statistics
(float32 and a 0-d int64 count) beside one ps shard.
"""

import os

import numpy as np
import pytest

from mpitf.ckpt import commands as cmds
from mpitf.ckpt.buffers import check_model_buffers, read_buffers, write_buffers
from mpitf.ckpt.names import checkpoint_name, read_manifest
from mpitf.ckpt.verify import find_restorable, verify_checkpoint
from mpitf.ckpt.write import write_manifest, write_shard
from mpitf.errors import CheckpointError
from mpitf.placement import Placement

VARIABLES = [("0.weight", (4, 3), "float32")]


def buffers_at(step):
    return {"1.running_mean": np.full(4, step / 10, np.float32),
            "1.running_var": np.arange(4, dtype=np.float32) + step,
            "1.num_batches_tracked": np.array(step, dtype=np.int64)}


def save(root, step):
    placement = Placement(VARIABLES, 1)
    ckpt_dir = os.path.join(root, checkpoint_name(step))
    entry = write_shard(ckpt_dir, 0, 1, step, placement.slices_for_ps(0),
                        np.full(12, step, np.float32))
    buffers = write_buffers(ckpt_dir, buffers_at(step))
    layout = {"num_ps": 1, "num_workers": 1, "cluster": "ps:1,worker:1", "mode": "sync"}
    return write_manifest(root, step, [entry], placement.variables, layout,
                          {0: {"epoch": 0, "cursor": 0}}, buffers=buffers)


def test_buffers_round_trip_verify_and_export(tmp_path):
    root = str(tmp_path / "ckpt")
    for step in (10, 20):
        save(root, step)
    path = os.path.join(root, "ckpt-00000020")
    assert verify_checkpoint(path) == []
    manifest = read_manifest(path)
    assert manifest["buffers"]["buffers"][2] == {"name": "1.num_batches_tracked",
                                                  "shape": [], "dtype": "<i8"}
    got = read_buffers(path, manifest)
    for name, want in buffers_at(20).items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape
        assert np.array_equal(got[name], want)
    out = str(tmp_path / "export.npz")
    assert cmds.cmd_export(root, out) == 0
    exported = dict(np.load(out))
    assert sorted(exported) == ["0.weight", "1.num_batches_tracked", "1.running_mean",
                                "1.running_var"]
    assert exported["1.num_batches_tracked"].shape == () and exported["0.weight"][0, 0] == 20
    assert "1.num_batches_tracked  ()" in cmds.describe_checkpoint(path)


def test_a_damaged_buffers_file_is_named_and_skipped(tmp_path):
    root = str(tmp_path)
    for step in (10, 20):
        save(root, step)
    bad = os.path.join(root, "ckpt-00000020", "buffers.h5")
    data = bytearray(open(bad, "rb").read())
    pos = data.rindex(np.arange(4, dtype=np.float32).__add__(20).tobytes())
    data[pos] ^= 0xFF
    open(bad, "wb").write(bytes(data))
    assert verify_checkpoint(os.path.dirname(bad)) == [
        "buffers.h5: sha256 mismatch", "buffers.h5: checksum mismatch in buffer "
        "'1.running_var'"]
    lines = []
    path, _ = find_restorable(root, log=lines.append)
    assert path.endswith("ckpt-00000010")
    assert lines[0].startswith("skipping ckpt-00000020: buffers.h5: sha256 mismatch")


def test_a_model_whose_buffers_differ_is_refused_by_name(tmp_path):
    path = save(str(tmp_path), 10)
    manifest = read_manifest(path)
    model = buffers_at(0)
    check_model_buffers(path, manifest, model)  # the same names, shapes and dtypes
    with pytest.raises(CheckpointError, match=r"buffer '1.running_var' is float32 \(8,\) in "
                                              r"the model but float32 \(4,\) in "):
        check_model_buffers(path, manifest, dict(model, **{"1.running_var": np.ones(8)
                                                           .astype(np.float32)}))
    with pytest.raises(CheckpointError, match=r"buffer '2.running_mean' of the model is not "
                                              r"in .*: the model differs"):
        check_model_buffers(path, manifest, dict(model, **{"2.running_mean": np.ones(2)}))
    del model["1.running_mean"]
    with pytest.raises(CheckpointError, match=r"holds buffer\(s\) \['1.running_mean'\] that "
                                              r"the model does not have"):
        check_model_buffers(path, manifest, model)
