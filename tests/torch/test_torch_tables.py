"""mpitf.torch.EmbeddingBag / Embedding: a weight on the ps by rows, equal to plain torch.

The multi-rank runs are 1 ps + W workers (tests/mpi/torch_tables_driver.py): an
EmbeddingBag (or Embedding) and a Linear layer, trained 50 steps in deterministic sync
mode; each worker also trains the same model in plain torch (``sparse=True``, the same
optimizer) on the W batches' mean gradient and prints the largest relative difference of
the dense parameters and the table's rows (read back from the ps).
"""

import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import mpitf.torch as mt
from mpitf.errors import ConfigurationError
from mpitf.testing import run_mpi
from mpitf.torch.ids import check_ids
from mpitf.torch.model import table_modules, trainable
from mpitf.torch.translate import check_table_rule
from tests.support import REPO

DRIVER = "tests/mpi/torch_tables_driver.py"
RESULT = re.compile(r"worker (\d+): step (\d+) maxrel: (\S+) moved: (\S+) digest: (\w+)")


def drive(n, *args, timeout=90):
    run = run_mpi(n, [DRIVER, *map(str, args)], timeout=timeout, cwd=str(REPO))
    assert not run.timed_out, run.output
    return run


def results(run, workers, steps=50):
    assert run.returncode == 0, run.output
    found = RESULT.findall(run.stdout)
    assert sorted(int(w) for w, *_ in found) == list(range(workers)), run.output
    for _, step, _, moved, _ in found:
        assert int(step) == steps
        assert float(moved) > 0.01  # the table's rows moved
    return [float(r[2]) for r in found], [r[4] for r in found]


@pytest.mark.mpi
@pytest.mark.slow
def test_one_worker_equals_torch_with_a_sparse_gradient():
    # steps 3 and 7 do not use the table: nothing of it is pushed (torch: its grad None)
    (maxrel,), _ = results(drive(2, "--optimizer", "sgd", "--mode", "mean", "--skip", 3, 7), 1)
    assert maxrel < 1e-5


@pytest.mark.mpi
@pytest.mark.slow
def test_an_embedding_with_adagrad_equals_torch_and_resumes_bit_for_bit(tmp_path):
    args = ["--optimizer", "adagrad", "--kind", "embedding"]  # padding_idx 0 too
    (maxrel,), whole = results(drive(2, *args), 1)
    assert maxrel < 1e-5
    ckpt = ["--checkpoint-dir", tmp_path, "--save-steps", 10]
    results(drive(2, *args, *ckpt, "--steps", 25), 1, steps=25)
    resumed = drive(2, *args, *ckpt)
    assert "restored" in resumed.stdout and "at step 25" in resumed.stdout, resumed.output
    (maxrel,), digest = results(resumed, 1)
    assert maxrel < 1e-5
    assert digest == whole  # the dense parameters and the table's rows, bit for bit


@pytest.mark.mpi
@pytest.mark.slow
def test_a_dlrm_batch_past_max_ids_grows_the_buffers_once_and_trains_as_sized_by_hand():
    # 4,096 x 26 ids a worker (82k unique of 200k rows) with max_ids left at 65,536:
    # every rank's buffers grow at the first step (the ps's too: its messages and receive
    # frames), said once per worker, and the run is bit for bit one sized by hand
    run = run_mpi(3, ["tests/mpi/torch_grow_driver.py"], timeout=150, cwd=str(REPO))
    assert not run.timed_out and run.returncode == 0, run.output
    found = dict(((int(w), r), d) for w, r, d in
                 re.findall(r"worker (\d): run (\w+) step 3 digest (\w+)", run.stdout))
    assert sorted(found) == [(w, r) for w in (0, 1) for r in ("default", "sized")], run.output
    assert all(found[w, "default"] == found[w, "sized"] for w in (0, 1)), run.output
    for w in (0, 1):
        said = f"worker {w}: table 'emb.weight' looked up 106496 ids in a step, more than " \
               "its buffers held (65536): they grow to 131072 ids"
        assert run.output.count(said) == 1, run.output
    assert run.output.count("they grow to") == 2, run.output  # the sized run: none


@pytest.mark.mpi
@pytest.mark.slow
def test_two_workers_and_two_tables_on_two_ps_equal_torch_on_the_mean_gradient():
    # sum mode with per_sample_weights and a second (mean) table, looked up after the
    # first; each table's rows split over 2 ps; Adagrad with lr_decay
    run = drive(4, "--optimizer", "adagrad", "--mode", "sum", "--kind", "two", "--num-ps", 2)
    maxrels, digests = results(run, 2)
    assert max(maxrels) < 1e-5
    assert digests[0] == digests[1]  # both workers read the same rows and parameters


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("bad,words", [
    ("id", "table 'emb.weight': id 53 at position 7 is outside [0, 50)"),
    ("twice", "table 'emb.weight' was looked up twice before step() at step 3: call each "
              "mpitf.torch table once per step"),
    ("copy", "DistributedOptimizer cannot be copied or pickled (it holds this rank's MPI "
             "session), and a model with mpitf.torch tables holds it: save "
             "model.state_dict() instead")], ids=["id", "twice", "copy"])
def test_bad_input_ends_every_rank_naming_the_table(bad, words):
    run = drive(3 if bad == "id" else 2, "--bad", bad)  # 2 workers, or 1
    assert run.returncode == 2, run.output
    assert run.output.count(words) == 1, run.output  # one line, no traceback
    assert "Traceback" not in run.output and "worker 0: step" not in run.output


def test_a_torch_embedding_bag_with_sparse_gradients_points_to_mpitf_torch():
    model = torch.nn.Sequential(torch.nn.EmbeddingBag(20, 3, sparse=True))
    with pytest.raises(ConfigurationError) as exc:
        trainable(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert "parameter '0.weight' gets a sparse gradient" in str(exc.value)
    assert "use mpitf.torch.EmbeddingBag or mpitf.torch.Embedding" in str(exc.value)
    ours = torch.nn.Sequential(mt.EmbeddingBag(20, 3), torch.nn.Linear(3, 1))
    named = trainable(ours, torch.optim.SGD(ours.parameters(), lr=0.1), table_modules(ours))
    assert [n for n, _ in named] == ["1.weight", "1.bias"]  # the table is no dense parameter
    assert list(table_modules(ours)) == ["0.weight"]


def _ids(*values):
    return torch.tensor(values)


@pytest.mark.parametrize("call,words", [
    (lambda: check_ids("t", 10, _ids(1, 2, 10, 3), _ids(0, 2)),
     "table 't': id 10 at position 2 is outside [0, 10)"),
    (lambda: check_ids("t", 10, torch.tensor([[1, 2], [-1, 3]])),
     "table 't': id -1 at position (1, 0) is outside [0, 10)"),
    (lambda: check_ids("t", 10, _ids(1, 2, 3), _ids(0, 2, 1)),
     "table 't': offsets are not monotone: offsets[2] = 1 < offsets[1] = 2"),
    (lambda: check_ids("t", 10, _ids(1, 2, 3), _ids(0, 4)),
     "table 't': offsets[1] = 4 is past the 3 ids"),
    (lambda: check_ids("t", 10, _ids(1, 2, 3), _ids(1, 2)),
     "table 't': offsets[0] is 1: the first bag starts at position 0"),
    (lambda: check_ids("t", 10, _ids(1.0, 2.0), _ids(0)),
     "table 't': ids must be an integer tensor (torch.long or torch.int), got torch.float32"),
    (lambda: check_ids("t", 10, _ids(1, 2, 3), _ids(0), torch.ones(2)),
     "table 't': per_sample_weights has shape (2,), the ids (3,): one weight per id"),
    (lambda: check_ids("t", 10, _ids(1, 2, 3)), "table 't': 1-D ids need offsets"),
], ids=["id", "id-2d", "offsets-down", "offsets-past", "offsets-start", "float", "weights",
        "no-offsets"])
def test_bad_ids_offsets_and_weights_are_named_with_their_position(call, words):
    with pytest.raises(ConfigurationError) as exc:
        call()
    assert words in str(exc.value)
    check_ids("t", 10, _ids(0, 9, 9), _ids(0, 1, 3), include_last_offset=True)  # good ones
    with pytest.raises(ConfigurationError, match="the last offset is the number of ids, 3"):
        check_ids("t", 10, _ids(0, 9, 9), _ids(0, 1, 2), include_last_offset=True)


def test_only_what_torch_runs_on_a_sparse_gradient_updates_a_table():
    w = torch.nn.Parameter(torch.zeros(2))
    check_table_rule(torch.optim.SGD([w], lr=0.1), ["emb.weight"])
    check_table_rule(torch.optim.Adagrad([w], lr=0.1, lr_decay=0.1), ["emb.weight"])
    for opt in (torch.optim.Adam([w]), torch.optim.SGD([w], lr=0.1, momentum=0.9),
                torch.optim.Adagrad([w], weight_decay=0.1)):
        with pytest.raises(ConfigurationError, match=r"table 'emb.weight' cannot be updated "
                                                     r"by .*torch.optim.SGD without momentum"):
            check_table_rule(opt, ["emb.weight"])


def test_before_wrapping_the_modules_are_torch_s_own():
    torch.manual_seed(0)
    bag = mt.EmbeddingBag(20, 3, mode="sum", padding_idx=2)
    torch.manual_seed(0)
    ref = torch.nn.EmbeddingBag(20, 3, mode="sum", padding_idx=2)
    assert torch.equal(bag.weight, ref.weight)  # torch's init, the padding row zero
    ids, offsets = _ids(1, 2, 5, 5, 19), _ids(0, 3)
    assert torch.equal(bag(ids, offsets), ref(ids, offsets))
    emb = mt.Embedding(20, 3)
    assert emb(ids).shape == (5, 3)
    assert list(dict(torch.nn.Sequential(bag).state_dict())) == ["0.weight"]
    with pytest.raises(ConfigurationError, match="max_norm or scale_grad_by_freq"):
        mt.EmbeddingBag(20, 3, max_norm=1.0)
    assert np.all(bag.weight.detach().numpy()[2] == 0)


def test_numba_is_loaded_for_a_table_s_backward_only():
    # numba's import is 0.5 s of every torch process's start: a model without tables
    # never loads it; a table's backward pass compiles on its first use (or its binding).
    code = """if True:
        import sys
        import numpy as np
        import mpitf.torch
        from mpitf.torch import rowgrad
        print("numba" in sys.modules)
        grad, out, acc = np.ones((2, 3)), np.zeros((1, 3)), np.zeros(3)
        rowgrad.bag_grad_rows(grad, np.zeros(0, np.int64), np.zeros(0), np.zeros(2, np.int64),
                              acc.reshape(1, 3), out)
        compiled = getattr(rowgrad.bag_grad_rows, "py_func", None) is rowgrad._sum_rows
        print("numba" in sys.modules, compiled, out.tolist())
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True, cwd=str(REPO)).stdout.split("\n")
    assert out[0] == "False"
    assert out[1] == "True True [[2.0, 2.0, 2.0]]", out


@pytest.mark.parametrize("mode,last,pad,weighted", [
    ("sum", False, None, False), ("mean", False, 1, False), ("mean", True, 1, False),
    ("sum", True, 1, True), ("embedding", False, 1, False)])
def test_the_backward_over_pulled_rows_is_torch_s(mode, last, pad, weighted):
    # RowGather against torch's autograd on the whole weight: each pulled row's gradient
    # (what the push carries) and the per_sample_weights' gradient.
    from mpitf.torch.rowgrad import RowGather, bag_weights
    from mpitf.worker.embedding import Lookup

    rng = np.random.default_rng(3)
    ids = torch.from_numpy(np.minimum(rng.zipf(1.3, 40) - 1, 19))
    offsets = torch.tensor([0, 3, 3, 10, 25] + ([40] if last else []))
    weight = torch.randn(20, 4, dtype=torch.float64, requires_grad=True)
    psw = torch.rand(40, dtype=torch.float64, requires_grad=True) if weighted else None
    unique, inverse = np.unique(ids.numpy(), return_inverse=True)
    lookup = Lookup(ids.numpy(), weight.detach().numpy()[unique].copy(), inverse)
    rows = torch.from_numpy(lookup.unique_rows).requires_grad_(True)
    inv = torch.from_numpy(lookup.inverse)
    at = None if pad is None or pad not in unique else int(np.searchsorted(unique, pad))
    if mode == "embedding":
        ref = torch.nn.functional.embedding(ids, weight, pad)
        bag, w = None, (ids.numpy() != pad) * 1.0
        run = lambda r, _: torch.nn.functional.embedding(inv, r, at)  # noqa: E731
    else:
        ref = torch.nn.functional.embedding_bag(ids, weight, offsets, mode=mode,
                                                per_sample_weights=psw,
                                                include_last_offset=last, padding_idx=pad)
        bag, w = bag_weights(ids.numpy(), offsets, last, mode, psw, pad)
        run = lambda r, s: torch.nn.functional.embedding_bag(  # noqa: E731
            inv, r, offsets, mode=mode, per_sample_weights=s, include_last_offset=last,
            padding_idx=at)
    padded = ids.numpy() == pad if weighted and pad is not None else None
    out = RowGather.apply(rows, psw, run, lookup, bag, w, np.empty(20 * 4), padded)
    assert torch.allclose(out, ref)
    g = torch.randn(ref.shape, dtype=torch.float64)
    want = torch.autograd.grad(ref, [weight] + ([psw] if weighted else []), g)
    got = torch.autograd.grad(out, [rows] + ([psw] if weighted else []), g,
                              allow_unused=True)
    assert got[0] is None  # the rows' gradient went into the push buffer instead
    assert np.allclose(lookup.unique_grad, want[0].numpy()[unique], rtol=1e-12, atol=1e-12)
    if weighted:
        assert torch.allclose(got[1], want[1])


def test_a_table_that_grows_has_no_local_rows_and_refuses_what_it_cannot_take():
    from mpitf import Growth
    from mpitf.errors import ConfigurationError
    from mpitf.torch import EmbeddingBag

    bag = EmbeddingBag(None, 4, mode="sum", dynamic=Growth(admit_min_count=2))
    assert bag.dynamic == Growth(admit_min_count=2) and tuple(bag.weight.shape) == (0, 4)
    assert EmbeddingBag(None, 4).dynamic == Growth()  # None alone: it grows
    assert "dynamic, 4" in repr(bag)
    with pytest.raises(ConfigurationError, match="wrap the model"):
        bag(torch.tensor([[2**40]]))
    with pytest.raises(ConfigurationError, match="give num_embeddings=None, not 10"):
        EmbeddingBag(10, 4, dynamic=True)
    with pytest.raises(ConfigurationError, match="no padding_idx"):
        EmbeddingBag(None, 4, padding_idx=0)
    with pytest.raises(ConfigurationError, match="dynamic must be True or a mpitf.Growth"):
        EmbeddingBag(None, 4, dynamic="yes")
