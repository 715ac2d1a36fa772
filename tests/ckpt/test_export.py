"""``mpitf ckpt export --format torch``: a state_dict that plain torch loads for serving."""

import numpy as np
import pytest
import torch  # a test requirement: fail here, loudly, without it

from mpitf.ckpt.names import read_manifest
from mpitf.data.ctr import load_ctr, synthetic_ctr
from mpitf.testing import run_mpi
from tests.support import REPO

DRIVER = REPO / "tests" / "mpi" / "torch_export_driver.py"


def _driver():
    import importlib.util
    import sys

    sys.path.insert(0, str(DRIVER.parent))
    spec = importlib.util.spec_from_file_location("torch_export_driver", DRIVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.mpi
@pytest.mark.slow  # a whole job under mpiexec
def test_an_exported_state_dict_loads_into_plain_torch_and_predicts_as_mpitf(tmp_path):
    data, ckpt, preds = tmp_path / "ctr.h5", tmp_path / "ck", tmp_path / "mpitf.npy"
    synthetic_ctr(str(data), train=2000, test=200, fields=3, rows=50, dense=2, seed=4)
    run = run_mpi(3, [str(DRIVER), str(data), str(ckpt), str(preds)], timeout=120,
                  cwd=str(REPO))
    assert not run.timed_out and run.returncode == 0, run.output
    latest = ckpt / (ckpt / "latest").read_text().strip()
    assert latest.name == "ckpt-00000012"
    assert read_manifest(latest)["delta"]["chain"] == ["ckpt-00000004", "ckpt-00000008"]
    out = tmp_path / "model.pt"
    export = run_mpi(1, ["-m", "mpitf.cli.main", "ckpt", "export", str(ckpt), "--out",
                         str(out)], timeout=60, cwd=str(REPO))
    assert export.returncode == 0, export.output
    driver = _driver()
    ids, dense, _, _ = load_ctr(str(data), "test")
    plain = driver.model_for([50, 50, 50], 2, torch.nn.EmbeddingBag)  # no mpitf in it
    state = torch.load(out)
    assert state["tables.0.weight"].shape == (50, driver.DIM)
    plain.load_state_dict(state)  # strict: every key, every shape
    with torch.no_grad():
        z = plain(torch.from_numpy(dense[:driver.BATCH]), torch.from_numpy(ids[:driver.BATCH]))
    want = np.load(preds)
    assert z.shape == want.shape == (driver.BATCH,)
    worst = float(np.abs(z.numpy() - want).max())
    print(f"max |plain torch - mpitf| on the first test batch: {worst:.3g}")
    assert worst <= 1e-6
    assert float(np.abs(want).max()) > 0  # a trained model's outputs, not zeros


@pytest.mark.mpi
@pytest.mark.slow  # a whole job under mpiexec
def test_a_growing_table_exports_as_its_rows_and_their_ids_from_a_delta(tmp_path):
    from mpitf.ckpt.commands import cmd_export
    from mpitf.ckpt.deltas import read_table_state
    from mpitf.torch.export import write_state_dict

    ckpt = tmp_path / "ck"
    run = run_mpi(2, [str(REPO / "tests" / "mpi" / "sparse_driver.py"), str(tmp_path),
                      "--num-ps", "1", "--dynamic", "--optimizer", "adagrad", "--steps", "4",
                      "--save-steps", "2", "--full-every", "2", "--checkpoint-dir", str(ckpt)],
                  timeout=90, cwd=str(REPO))
    assert not run.timed_out and run.returncode == 0, run.output
    latest = ckpt / "ckpt-00000004"
    assert read_manifest(latest)["delta"]["base"] == "ckpt-00000002"
    out = tmp_path / "m.pt"
    assert cmd_export(str(ckpt), str(out), write=write_state_dict) == 0
    state, want = torch.load(out), read_table_state(latest)
    for name in ("users", "items"):
        assert state[f"{name}/ids"].dtype == torch.int64
        assert np.array_equal(state[f"{name}/ids"].numpy(), want[name]["ids"])
        assert np.array_equal(state[name].numpy(), want[name]["rows"])
    assert sorted(state) == ["items", "items/ids", "users", "users/ids", "w_items", "w_users"]
