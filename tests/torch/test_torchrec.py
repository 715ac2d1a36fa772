"""TorchRec's collections on mpitf's tables (mpitf.torch.keyed) and row-wise Adagrad on the ps.

The multi-rank runs are 1 ps + 1 worker (tests/mpi/torchrec_driver.py): the worker trains
a TorchRec model through mpitf.torch.distribute and DistributedOptimizer and a copy of it
in plain TorchRec on the same batches, and prints the losses' largest relative difference,
the tables' at the end, and the ps's sparse request counts.
"""

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

torchrec = pytest.importorskip("torchrec")  # the torchrec extra; run.sh test installs it

import mpitf.torch as mt  # noqa: E402
from mpitf.data.ctr import load_ctr  # noqa: E402
from mpitf.data.ctr_synthetic import synthetic_ctr  # noqa: E402
from mpitf.errors import ConfigurationError  # noqa: E402
from mpitf.ps.rowwise import RowwiseAdagrad  # noqa: E402
from mpitf.testing import run_mpi  # noqa: E402
from mpitf.torch import keyed  # noqa: E402
from tests.support import REPO  # noqa: E402

DRIVER = "tests/mpi/torchrec_driver.py"
RESULT = re.compile(r"worker 0: run (\S+) steps (\d+) fields (\d+) maxrel (\S+) last \S+ \S+ "
                    r"tables (\S+) moved (\S+) pulls ([\d,]+) pushes ([\d,]+)")


@pytest.mark.mpi
@pytest.mark.slow
def test_torchrec_models_through_mpitf_equal_plain_torchrec_in_one_request_a_step(tmp_path):
    # a planted click file of 26 fields (DLRM's Criteo count); one launch trains DLRM with
    # SGD, then with row-wise Adagrad, then every kind of collection (shared, mean, weighted
    # and unpooled), each through mpitf and in plain TorchRec on the same batches
    clicks = tmp_path / "ctr.h5"
    synthetic_ctr(str(clicks), train=6400, test=100, fields=26, rows=200)
    run = run_mpi(2, [DRIVER, "--data", str(clicks)], timeout=200, cwd=str(REPO))
    assert not run.timed_out and run.returncode == 0, run.output
    found = {r[0]: [float(v) for v in r[1:-2]] + list(r[-2:]) for r in
             RESULT.findall(run.stdout)}
    assert sorted(found) == ["dlrm-rowwise", "dlrm-sgd", "mixed"], run.output
    for name, (steps, fields, maxrel, tables, moved, pulls, pushes) in found.items():
        pulls, pushes = int(pulls), int(pushes)  # one ps
        assert maxrel < 1e-5 and tables < 1e-5, name  # every step's loss; tables at the end
        assert moved > 1e-5, name  # every table trained (its rows read back from the ps)
        if name.startswith("dlrm"):  # 26 tables: one pull and one push a step
            assert (steps, fields, pulls, pushes) == (50, 26, 50, 50), name
        else:  # three collections: a pull each, and one push of all their tables
            assert (steps, pulls, pushes) == (50, 3 * 50, 50), name


@pytest.mark.mpi
@pytest.mark.slow
def test_two_ps_answer_one_pull_each_for_all_of_dlrm_s_tables(tmp_path):
    clicks = tmp_path / "ctr.h5"
    synthetic_ctr(str(clicks), train=2560, test=100, fields=26, rows=200)
    run = run_mpi(3, [DRIVER, "--data", str(clicks), "--runs", "dlrm-rowwise", "--num-ps", "2",
                      "--steps", "20"], timeout=150, cwd=str(REPO))
    assert not run.timed_out and run.returncode == 0, run.output
    ((_, steps, fields, maxrel, tables, _, pulls, pushes),) = RESULT.findall(run.stdout)
    assert float(maxrel) < 1e-5 and float(tables) < 1e-5
    assert (steps, fields, pulls, pushes) == ("20", "26", "20,20", "20,20")  # per ps


@pytest.mark.mpi
@pytest.mark.slow
def test_row_wise_adagrad_resumes_its_accumulators_from_a_checkpoint(tmp_path):
    # 25 steps, checkpointed at the end; a second launch restores them and trains to 50:
    # the tables still equal plain TorchRec's 50 steps (fresh accumulators would not)
    clicks, ckpt, preds = tmp_path / "ctr.h5", tmp_path / "ckpt", tmp_path / "mpitf.npy"
    synthetic_ctr(str(clicks), train=6400, test=200, fields=26, rows=200)
    args = [DRIVER, "--data", str(clicks), "--runs", "dlrm-rowwise", "--checkpoint-dir",
            str(ckpt), "--predictions", str(preds)]
    for steps in (25, 50):
        run = run_mpi(2, [*args, "--steps", str(steps)], timeout=150, cwd=str(REPO))
        assert not run.timed_out and run.returncode == 0, run.output
        ((_, done, _, maxrel, tables, moved, _, _),) = RESULT.findall(run.stdout)
        assert int(done) == steps and float(maxrel) < 1e-5 and float(tables) < 1e-5
    assert "restored" in run.stdout and "at step 25" in run.stdout, run.output
    # export for serving: the checkpoint as a state_dict that TorchRec's DLRM, built
    # without mpitf, loads whole and predicts with as mpitf did
    out = tmp_path / "model.pt"
    export = run_mpi(1, ["-m", "mpitf.cli.main", "ckpt", "export", str(ckpt), "--out",
                         str(out)], timeout=60, cwd=str(REPO))
    assert export.returncode == 0, export.output
    sys.path.insert(0, str(REPO / "tests" / "mpi"))
    try:
        from torchrec_driver import batches, build
    finally:
        sys.path.pop(0)
    _, dense, _, _ = load_ctr(str(clicks), "test", stop=1)
    plain = build(26, 200, dense.shape[1])
    plain.load_state_dict(torch.load(out))  # strict: TorchRec's keys, every shape
    dense, kjt, _ = next(batches(str(clicks), 1, "test"))
    with torch.no_grad():
        z = plain(dense, kjt).numpy()
    want = np.load(preds)
    assert z.shape == want.shape and float(np.abs(want).max()) > 0
    assert float(np.abs(z - want).max()) <= 1e-6


@pytest.mark.mpi
@pytest.mark.slow
def test_the_peer_benchmark_runs_torchrec_and_mpitf_in_turn(tmp_path):
    clicks = tmp_path / "ctr.h5"
    synthetic_ctr(str(clicks), train=20000, test=1000)
    out = tmp_path / "tp.json"
    run = subprocess.run(
        [sys.executable, "benchmarks/torchrec_peer.py", "--data", str(clicks), "--quick",
         "--systems", "torchrec,mpitf-1+1", "--json", str(out)],
        cwd=str(REPO), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads(out.read_text())["results"]
    for system, roles in (("torchrec", {"rank0"}), ("mpitf-1+1", {"ps", "worker0"})):
        (speed,), (auc,), (rss,) = (results[system][k] for k in ("examples_s", "auc",
                                                                 "rss_mib"))
        assert speed > 0 and 0.5 < auc <= 1 and set(rss) == roles, results


@pytest.mark.mpi
@pytest.mark.slow  # a whole job under mpiexec
def test_an_id_out_of_its_table_ends_every_rank_naming_the_feature_and_the_id():
    run = run_mpi(2, [DRIVER, "--runs", "mixed", "--bad"], timeout=120, cwd=str(REPO))
    assert not run.timed_out and run.returncode == 2, run.output
    assert "feature 'b': table 'bags.embedding_bags.shared.weight': id 40 at position 2 is " \
           "outside [0, 40)" in run.output, run.output
    assert "Traceback" not in run.output, run.output


def test_a_missing_feature_is_refused_by_name():
    ebc = mt.EmbeddingBagCollection(_configs())
    with pytest.raises(ConfigurationError, match="no feature 'zz'.*'a', 'b', 'c'"):
        keyed._joined(_kjt(), ["a", "zz"], ebc.embedding_bags["shared"], False)


def _configs():
    cfg = torchrec.EmbeddingBagConfig
    return [cfg(name="shared", embedding_dim=3, num_embeddings=20, feature_names=["a", "b"]),
            cfg(name="mean", embedding_dim=2, num_embeddings=10, feature_names=["c"],
                pooling=torchrec.PoolingType.MEAN)]


def _kjt():
    return torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b", "c"], values=torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9]),
        lengths=torch.tensor([2, 1, 0, 3, 2, 1]))


def test_unbound_collections_are_torchrec_s_with_its_values_and_state_dict_keys():
    torch.manual_seed(0)
    theirs = torchrec.EmbeddingBagCollection(tables=_configs())
    torch.manual_seed(0)
    ours = mt.EmbeddingBagCollection(_configs())
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert all(isinstance(m, mt.EmbeddingBag) for m in ours.embedding_bags.values())
    a, b = theirs(_kjt()), ours(_kjt())
    assert a.keys() == b.keys() == ["a", "b", "c"]
    assert torch.equal(a.values(), b.values())


def test_distribute_swaps_a_dlrm_s_collection_keeping_its_values_and_the_random_stream():
    from torchrec.models.dlrm import DLRM

    ebc = torchrec.EmbeddingBagCollection(tables=[torchrec.EmbeddingBagConfig(
        name=f"t{i}", embedding_dim=3, num_embeddings=10, feature_names=[f"f{i}"])
        for i in range(2)])
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=2,
                 dense_arch_layer_sizes=[3], over_arch_layer_sizes=[4, 1])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(5)
    assert mt.distribute(model) is model
    drawn = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(drawn, torch.rand(3))  # distribute drew nothing from the user's stream
    swapped = model.sparse_arch.embedding_bag_collection
    assert isinstance(swapped, mt.EmbeddingBagCollection)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert isinstance(mt.distribute(torchrec.EmbeddingCollection(tables=[
        torchrec.EmbeddingConfig(name="e", embedding_dim=2, num_embeddings=4)])),
        mt.EmbeddingCollection)


def test_what_the_ps_tables_cannot_hold_is_refused_by_name():
    half = torchrec.EmbeddingBagConfig(name="half", embedding_dim=2, num_embeddings=4,
                                       feature_names=["h"], data_type=torchrec.DataType.FP16)
    with pytest.raises(ConfigurationError, match="'half'.*FP32"):
        mt.EmbeddingBagCollection([half])

    class ShardedEmbeddingBagCollection(torch.nn.Module):
        pass

    model = torch.nn.Sequential(ShardedEmbeddingBagCollection())
    with pytest.raises(ConfigurationError, match="ShardedEmbeddingBagCollection.*unsharded"):
        mt.distribute(model)

    from torch.distributed.optim import _apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    fused = torchrec.EmbeddingBagCollection(tables=_configs())
    _apply_optimizer_in_backward(RowWiseAdagrad, fused.parameters(), {"lr": 0.1})
    with pytest.raises(ConfigurationError, match="'shared'.*RowWiseAdagrad.*rowwise_tables"):
        mt.distribute(fused)


def test_rowwise_adagrad_on_rows_is_torchrec_s():
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    rng = np.random.default_rng(0)
    weight = torch.nn.Parameter(torch.from_numpy(rng.normal(size=(6, 4)).astype(np.float32)))
    theirs = RowWiseAdagrad([weight], lr=0.1, lr_decay=0.01, eps=1e-8)
    ours = RowwiseAdagrad(0.1, lr_decay=0.01, eps=1e-8)
    rows = weight.detach().numpy().copy()
    slots = ours.make_slots(rows.size, np, rows.dtype)
    for step in range(3):
        grad = rng.normal(size=(6, 4)).astype(np.float32)
        grad[step] = 0  # a row without gradient: TorchRec's moves nothing either
        weight.grad = torch.from_numpy(grad.copy())
        theirs.step()
        ours.apply_rows(rows, grad, slots, step)
    np.testing.assert_allclose(rows, weight.detach().numpy(), rtol=1e-6, atol=1e-7)
    acc = slots["sum"].reshape(6, 4)
    assert np.all(acc == acc[:, :1])  # one accumulator per row, held by each element


def test_a_keyed_jagged_tensor_first_counts_its_batch_as_the_step_s_examples():
    from mpitf.torch.model import examples_in

    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b"], values=torch.arange(6), lengths=torch.ones(6, dtype=torch.int32))
    assert examples_in(kjt) == 3  # 2 features x 3 examples
    assert examples_in(torch.zeros(5, 2)) == 5 and examples_in(torch.tensor(1.0)) == 0
    assert examples_in([1, 2]) == 0
