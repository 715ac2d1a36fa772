"""TorchRec's DLRM through mpitf (1 ps + 1 worker) against plain TorchRec in the worker's process.

``torchrec.models.dlrm.DLRM`` over a TorchRec EmbeddingBagCollection (one table per field
of a ``mpitf data synthetic-ctr`` file) is built once under seed 0 and copied: the copy
trains in plain TorchRec, the model through :func:`mpitf.torch.distribute` and
DistributedOptimizer, on the same batches in order (deterministic sync). ``--optimizer
sgd``: torch.optim.SGD on both; ``rowwise``: the tables by row-wise Adagrad
(``torchrec.optim.RowWiseAdagrad`` on the plain copy) and the dense layers by Adagrad.
The worker prints each step's two losses' largest relative difference and the ps's
sparse request counts: ``worker 0: steps S tables T maxrel R pulls P pushes Q``.
"""

from ps_first import serve_if_ps

SERVER = serve_if_ps(deadline=80) if __name__ == "__main__" else None

import argparse  # noqa: E402 - a ps has served and left before torch is imported
import copy  # noqa: E402
import sys  # noqa: E402

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


def batches(path, steps):
    ids, dense, y, _ = load_ctr(path, "train", stop=steps * BATCH)
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
    tables = list(ref.sparse_arch.parameters())
    dense = [p for p in ref.parameters() if all(p is not t for t in tables)]
    return torch.optim.Adagrad(model.parameters(), lr=LR), [
        RowWiseAdagrad(tables, lr=LR), torch.optim.Adagrad(dense, lr=LR)]


def loss_of(model, batch):
    dense, kjt, y = batch
    return torch.nn.functional.binary_cross_entropy_with_logits(model(dense, kjt).squeeze(1),
                                                                y.float())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "rowwise"])
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args()
    with abort_on_error():
        _, _, _, rows = load_ctr(args.data, "test", stop=1)
        fields, dense = len(rows), load_ctr(args.data, "test", stop=1)[1].shape[1]
        model = build(fields, max(rows), dense)
        ref = copy.deepcopy(model)
        mt.distribute(model, max_ids=BATCH)
        opt, ref_opts = optimizers(model, ref, args.optimizer)
        dist = mt.DistributedOptimizer(opt, model, SERVER, deterministic=True,
                                       last_step=args.steps, log_every=0,
                                       rowwise_tables=args.optimizer == "rowwise")
        worst = 0.0
        for batch in batches(args.data, args.steps):
            dist.zero_grad()
            loss = loss_of(model, batch)
            loss.backward()
            dist.step(loss)
            for o in ref_opts:
                o.zero_grad()
            ref_loss = loss_of(ref, batch)
            ref_loss.backward()
            for o in ref_opts:
                o.step()
            a, b = loss.item(), ref_loss.item()
            worst = max(worst, abs(a - b) / abs(b))
        (counters,) = dist.client.ps_counters()
        sys.stdout.write(f"worker 0: steps {dist.global_step} tables {fields} maxrel {worst:.3g} "
                         f"last {a:.6f} {b:.6f} pulls "
                         f"{counters['sparse_pulls']} pushes {counters['sparse_pushes']}\n")
        sys.stdout.flush()
        sys.exit(dist.close())


if __name__ == "__main__":
    main()
