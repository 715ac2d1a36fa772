"""TorchRec models through mpitf (1 ps + 1 worker) against plain TorchRec in the worker's process.

``torchrec.models.dlrm.DLRM`` over a TorchRec EmbeddingBagCollection (one table per field
of the ``mpitf data synthetic-ctr`` file ``--data``), or :class:`Mixed` (every kind of
TorchRec collection, on random KeyedJaggedTensors), is built under seed 0 and copied: the copy
trains in plain TorchRec, the model through :func:`mpitf.torch.distribute` and
DistributedOptimizer, on the same batches in order (deterministic sync). ``--runs``, in
turn in one launch: ``dlrm-sgd`` (torch.optim.SGD on both), ``dlrm-rowwise`` (the tables
by row-wise Adagrad, ``torchrec.optim.RowWiseAdagrad`` on the plain copy, the dense
layers by Adagrad), ``mixed`` (SGD). The worker prints, per run, the steps' losses'
largest relative difference and the ps's sparse request counts: ``worker 0: run N steps S
fields F maxrel R last L L' tables T moved M pulls P pushes Q`` (T: the tables' largest
relative difference at the end, read back from the ps; M: the least any table's largest
change from its start; P, Q: each ps's, by commas). ``--num-ps 2``: the tables' rows split
over two ps.
"""

from ps_first import flag, serve_if_ps

RUNS = "dlrm-sgd,dlrm-rowwise,mixed"
# the ps serves each run in turn (one launch: the worker imports torch once)
SERVER = serve_if_ps(deadline=80, sessions=len(flag("--runs", RUNS).split(","))) \
    if __name__ == "__main__" else None

import argparse  # noqa: E402 - a ps has served and left before torch is imported
import copy  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torchrec  # noqa: E402
from torchrec.models.dlrm import DLRM  # noqa: E402
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad  # noqa: E402

import mpitf.torch as mt  # noqa: E402
from mpitf import abort_on_error  # noqa: E402
from mpitf.data.ctr import load_ctr  # noqa: E402

DIM, BATCH, LR = 4, 128, 0.05


def build(fields, rows, dense):
    torch.manual_seed(0)
    tables = [torchrec.EmbeddingBagConfig(name=f"t{f}", embedding_dim=DIM,
                                          num_embeddings=rows, feature_names=[f"f{f}"])
              for f in range(fields)]
    ebc = torchrec.EmbeddingBagCollection(tables=tables)
    return DLRM(embedding_bag_collection=ebc, dense_in_features=dense,
                dense_arch_layer_sizes=[8, DIM], over_arch_layer_sizes=[8, 1])


def batches(path, steps, split="train"):
    ids, dense, y, _ = load_ctr(path, split, stop=steps * BATCH)
    fields = ids.shape[1]
    for s in range(steps):
        lo = s * BATCH
        kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{f}" for f in range(fields)],
            values=torch.from_numpy(ids[lo:lo + BATCH].T.reshape(-1).astype("int64")),
            lengths=torch.ones(fields * BATCH, dtype=torch.int32))
        yield torch.from_numpy(dense[lo:lo + BATCH]), kjt, torch.from_numpy(y[lo:lo + BATCH])


def optimizers(model, ref, kind):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=LR), [torch.optim.SGD(ref.parameters(),
                                                                             lr=LR)]
    tables = [p for n, p in ref.named_parameters() if "embedding" in n]
    dense = [p for p in ref.parameters() if all(p is not t for t in tables)]
    return torch.optim.Adagrad(model.parameters(), lr=LR), [
        RowWiseAdagrad(tables, lr=LR), torch.optim.Adagrad(dense, lr=LR)]


class Mixed(torch.nn.Module):
    """Every kind of collection: a shared sum table and a mean one, weighted bags, rows."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        cfg = torchrec.EmbeddingBagConfig
        self.bags = torchrec.EmbeddingBagCollection(tables=[
            cfg(name="shared", embedding_dim=DIM, num_embeddings=40, feature_names=["a", "b"]),
            cfg(name="mean", embedding_dim=3, num_embeddings=30, feature_names=["c"],
                pooling=torchrec.PoolingType.MEAN)])
        self.weighted = torchrec.EmbeddingBagCollection(is_weighted=True, tables=[
            cfg(name="weighted", embedding_dim=DIM, num_embeddings=20, feature_names=["d"])])
        self.rows = torchrec.EmbeddingCollection(tables=[torchrec.EmbeddingConfig(
            name="rows", embedding_dim=DIM, num_embeddings=25, feature_names=["e", "f"])])
        self.out = torch.nn.Linear(5 * DIM + 3, 1)

    def forward(self, kjt, weighted):
        pooled = [self.bags(kjt).values(), self.weighted(weighted).values()]
        for _, jt in sorted(self.rows(kjt).items()):  # each example's rows, summed
            bag = torch.repeat_interleave(torch.arange(len(jt.lengths())), jt.lengths())
            pooled.append(torch.zeros(len(jt.lengths()), DIM).index_add(0, bag, jt.values()))
        return self.out(torch.cat(pooled, 1))


def mixed_batches(steps, bad=False):
    keys, rows = ["a", "b", "c", "e", "f"], [40, 40, 30, 25, 25]
    for s in range(steps):
        rng = np.random.default_rng(s)
        lengths = rng.integers(0, 4, (len(keys), BATCH))
        values = np.concatenate([rng.integers(0, n, k.sum()) for n, k in zip(rows, lengths)])
        if bad and s == 3:  # feature b's third id: past its table's 40 rows
            values[lengths[0].sum() + 2] = 40
        kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=torch.from_numpy(values),
            lengths=torch.from_numpy(lengths.reshape(-1)))
        n = rng.integers(1, 4, BATCH)
        weighted = torchrec.KeyedJaggedTensor.from_lengths_sync(
            keys=["d"], values=torch.from_numpy(rng.integers(0, 20, n.sum())),
            lengths=torch.from_numpy(n),
            weights=torch.from_numpy(rng.uniform(0.5, 1.5, n.sum()).astype(np.float32)))
        yield kjt, weighted, torch.from_numpy(rng.integers(0, 2, BATCH))


def loss_of(model, batch):
    if isinstance(model, Mixed):
        kjt, weighted, y = batch
        return torch.nn.functional.binary_cross_entropy_with_logits(
            model(kjt, weighted).squeeze(1), y.float())
    dense, kjt, y = batch
    return torch.nn.functional.binary_cross_entropy_with_logits(model(dense, kjt).squeeze(1),
                                                                y.float())


def step_plain(ref, ref_opts, batch):
    """Train the plain TorchRec copy one step; return its loss."""
    for o in ref_opts:
        o.zero_grad()
    loss = loss_of(ref, batch)
    loss.backward()
    for o in ref_opts:
        o.step()
    return loss.item()


def train(run, args):
    """Train one run (``dlrm-sgd``, ``dlrm-rowwise`` or ``mixed``) both ways; say how close."""
    kind = run.split("-")[-1] if run.startswith("dlrm") else "sgd"
    if run == "mixed":
        model, fields, data = Mixed(), 5, mixed_batches(args.steps, args.bad)
    else:
        _, dense, _, rows = load_ctr(args.data, "test", stop=1)
        fields, data = len(rows), batches(args.data, args.steps)
        model = build(fields, max(rows), dense.shape[1])
    ref = copy.deepcopy(model)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    mt.distribute(model, max_ids=8 * BATCH)
    opt, ref_opts = optimizers(model, ref, kind)
    dist = mt.DistributedOptimizer(opt, model, SERVER, deterministic=True,
                                   last_step=args.steps, log_every=0,
                                   rowwise_tables=kind == "rowwise",
                                   checkpoint_dir=args.checkpoint_dir)
    worst, a, b = 0.0, float("nan"), float("nan")
    for s, batch in enumerate(data):
        if s < dist.global_step:  # restored past it: the plain copy catches up
            step_plain(ref, ref_opts, batch)
            continue
        dist.zero_grad()
        loss = loss_of(model, batch)
        loss.backward()
        dist.step(loss)
        a, b = loss.item(), step_plain(ref, ref_opts, batch)
        worst = max(worst, abs(a - b) / abs(b))
    if args.predictions and run.startswith("dlrm"):  # the first test batch, for an export
        dense, kjt, _ = next(batches(args.data, 1, "test"))
        with torch.no_grad():
            np.save(args.predictions, model(dense, kjt).numpy())
    counters = dist.client.ps_counters()
    theirs = {n: p.detach() for n, p in ref.named_parameters()}
    rows = {name: dist.table_rows(name, torch.arange(len(theirs[name])))
            for name, _ in model.named_parameters() if "embedding" in name}
    tables = max(float((r - theirs[n]).norm() / theirs[n].norm()) for n, r in rows.items())
    moved = min(float((r - start[n]).abs().max()) for n, r in rows.items())
    sys.stdout.write(f"worker 0: run {run} steps {dist.global_step} fields {fields} maxrel "
                     f"{worst:.3g} last {a:.6f} {b:.6f} tables {tables:.3g} moved {moved:.3g} "
                     f"pulls {','.join(str(c['sparse_pulls']) for c in counters)} pushes "
                     f"{','.join(str(c['sparse_pushes']) for c in counters)}\n")
    sys.stdout.flush()
    return dist.close()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default=None, help="a click file (for the dlrm runs)")
    p.add_argument("--runs", default=RUNS, help="dlrm-sgd, dlrm-rowwise, mixed (commas)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--num-ps", type=int, default=1, help="(read by serve_if_ps)")
    p.add_argument("--bad", action="store_true", help="mixed: an id out of range at step 3")
    p.add_argument("--checkpoint-dir", default=None, help="checkpoint at the end, resume")
    p.add_argument("--predictions", default=None,
                   help="dlrm: save the model's outputs on the first test batch (.npy)")
    args = p.parse_args()
    with abort_on_error():
        for run in args.runs.split(","):
            code = train(run, args)
            if code:
                sys.exit(code)


if __name__ == "__main__":
    main()
