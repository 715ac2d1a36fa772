"""The dlrm job: DLRM's interaction as its reference code computes it, training, refusals."""

import json
import re
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch  # a test requirement: fail here, loudly, without it

from mpitf.data.ctr import synthetic_ctr
from mpitf.testing import kill_group, run_mpi
from tests.support import REPO


def _final(run):
    line = next(x for x in run.output.splitlines() if x.startswith("final: "))
    return json.loads(line[len("final: "):])


def test_the_interaction_is_every_pair_of_vectors_once_beside_the_bottom_output():
    from mpitf.jobs.dlrm import build

    torch.manual_seed(0)
    model = build([5, 7, 3], dense_dim=2, dim=4, bottom=(8,), top=(6,),
                  embedding_bag=torch.nn.EmbeddingBag)
    dense, ids = torch.randn(10, 2), torch.tensor([[i % 5, i % 7, i % 3] for i in range(10)])
    x = model.bottom(dense)
    vectors = [x] + [model.tables[f].weight[ids[:, f]] for f in range(3)]
    pairs = [(vectors[i] * vectors[j]).sum(1) for i in range(4) for j in range(i)]
    expected = model.top(torch.cat([x, torch.stack(pairs, 1)], 1)).squeeze(1)
    assert model.top[0].in_features == 4 + 6  # the bottom vector and C(4, 2) dot products
    assert torch.allclose(model(dense, ids), expected, rtol=1e-5, atol=1e-6)
    without = build([5, 7, 3], dense_dim=0, dim=4, bottom=(8,), top=(6,),
                    embedding_bag=torch.nn.EmbeddingBag)
    assert without.bottom is None and without.top[0].in_features == 3  # C(3, 2)
    assert without(torch.zeros(10, 0), ids).shape == (10,)


@pytest.mark.slow
@pytest.mark.mpi
def test_the_dlrm_job_comes_near_the_planted_auc_with_its_tables_on_the_ps(tmp_path):
    # Data of the generator's shape, smaller to stay quick (3 fields of 100 rows, 30 000
    # examples); the full command (8 fields of 1000 rows) is measured in benchmarks/README.md.
    data = str(tmp_path / "ctr.h5")
    ceiling = synthetic_ctr(data, train=30000, test=3000, fields=3, rows=100, dense=2, seed=4)
    run = run_mpi(3, ["-m", "mpitf.jobs.dlrm", "--data", data, "--num-ps", "1", "--steps",
                      "300", "--eval-every", "150", "--checkpoint-dir", tmp_path / "ck",
                      "--lr", "0.05"], timeout=150, cwd=str(REPO))
    assert not run.timed_out and run.returncode == 0, run.output
    assert re.findall(r"^step (\d+): test_auc = 0\.\d+, test_logloss = \d\.\d+$",
                      run.output, re.M) == ["150"], run.output
    final = _final(run)
    assert final["workers"] == 2 and final["step"] == 300
    assert final["test_auc"] > ceiling - 0.03, (final, ceiling)
    assert 0 < final["test_logloss"] < 0.7
    # every table is a table on the ps, named by its state_dict key
    show = run_mpi(1, ["-m", "mpitf.cli.main", "ckpt", "show", tmp_path / "ck"], timeout=60,
                   cwd=str(REPO))
    assert all(f"tables.{f}.weight" in show.output for f in range(3)), show.output


def logistic_regression_auc(path):
    """Return the test AUC of logistic regression on the one-hot ids and the dense features."""
    import scipy.sparse as sp
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import OneHotEncoder

    from mpitf.data.ctr import auc, load_ctr

    ids, dense, y, _ = load_ctr(path, "train")
    test_ids, test_dense, test_y, _ = load_ctr(path, "test")
    encoder = OneHotEncoder(handle_unknown="ignore").fit(ids)

    def features(i, d):
        return sp.hstack([encoder.transform(i), sp.csr_matrix(d)]).tocsr()

    fitted = LogisticRegression(max_iter=1000).fit(features(ids, dense), y)
    return auc(test_y, fitted.decision_function(features(test_ids, test_dense)))


@pytest.mark.slow
@pytest.mark.mpi
def test_the_dlrm_job_with_its_defaults_trains_one_epoch_to_logistic_regressions_auc(
        tmp_path):
    # `mpitf run -n 3 dlrm --data FILE` and nothing else: one epoch, 40 000 examples over 2
    # workers in batches of 256 = 78 steps. Logistic regression on the same file reaches
    # 0.886 (the planted model 0.889); dlrm's one epoch 0.883 when this was written.
    data = str(tmp_path / "ctr.h5")
    synthetic_ctr(data, train=40000, test=5000, fields=3, rows=100, dense=2, seed=4)
    baseline = logistic_regression_auc(data)
    assert 0.87 < baseline < 0.90, baseline
    proc = subprocess.Popen([sys.executable, "-m", "mpitf.cli.main", "run", "-n", "3", "dlrm",
                             "--data", data], cwd=str(REPO), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=150)
    finally:
        kill_group(proc)  # mpiexec's ranks too, on a timeout
    assert proc.returncode == 0, output
    final = _final(SimpleNamespace(output=output))
    assert final["step"] == 40000 // 2 // 256, final
    assert final["test_auc"] >= baseline - 0.01, (final, baseline)


@pytest.mark.mpi
@pytest.mark.parametrize("flags,message", [
    (["--optimizer", "adam"], "dlrm trains with --optimizer adagrad or sgd"),
    (["--bottom-mlp", "64,x"], "--bottom-mlp '64,x': expecting layer widths >= 1"),
    (["--steps", "10", "--epochs", "2"], "--steps 10 and --epochs 2 both say when training "
                                         "ends: give one"),
    (["--keep-best", "--eval-every", "0"], "--keep-best keeps the checkpoint of the best "
                                           "evaluation: give --checkpoint-dir DIR and "
                                           "--eval-every N (above 0)"),
])
def test_the_dlrm_job_refuses_what_it_cannot_train_on_every_rank(tmp_path, flags, message):
    data = str(tmp_path / "ctr.h5")
    synthetic_ctr(data, train=200, test=50, fields=2, rows=10, dense=1, seed=6)
    run = run_mpi(3, ["-m", "mpitf.jobs.dlrm", "--data", data, *flags, "--checkpoint-dir",
                      tmp_path / "ck"], timeout=60, cwd=str(REPO))
    assert not run.timed_out and run.returncode == 2, run.output
    assert run.output.count(message) == 1, run.output
    assert "Traceback" not in run.output and not (tmp_path / "ck").exists()


def test_build_sizes_each_table_from_the_file():
    from mpitf.jobs.dlrm import build

    model = build(np.array([11, 13]), dense_dim=1, dim=2, bottom=(), top=(),
                  embedding_bag=torch.nn.EmbeddingBag)
    assert [t.num_embeddings for t in model.tables] == [11, 13]


@pytest.mark.slow
@pytest.mark.mpi
def test_the_dlrm_job_trains_tables_that_grow_on_raw_ids(tmp_path):
    data = str(tmp_path / "raw.h5")
    ceiling = synthetic_ctr(data, train=20000, test=2000, fields=3, rows=50, dense=2, seed=3,
                            raw_ids=True)
    run = run_mpi(4, ["-m", "mpitf.jobs.dlrm", "--data", data, "--num-ps", "2", "--steps",
                      "200", "--eval-every", "0", "--dynamic-tables", "--lr", "0.05"],
                  timeout=120, cwd=str(REPO))
    assert not run.timed_out and run.returncode == 0, run.output
    final = _final(run)
    assert final["step"] == 200 and final["test_auc"] > 0.5 + (ceiling - 0.5) * 0.5, \
        (final, ceiling)
    # the first ps reports its rows of each table at the end: made as ids came
    held = {t: int(n) for t, n in re.findall(
        r"ps task 0, table 'tables\.(\d)\.weight': rows (\d+), admitted \2, evicted 0",
        run.output)}
    assert sorted(held) == ["0", "1", "2"] and all(n > 20 for n in held.values()), run.output
