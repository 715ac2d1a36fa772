"""A small DLRM (mpitf.jobs.dlrm's) trains under mpiexec with delta checkpoints, for
tests/ckpt/test_export.py: ``DATA CKPT OUT``. The chief writes mpitf's own predictions
(the model's forward, rows pulled from the ps) on the test split's first batch to
``OUT``; the last checkpoint, at the last step, is then a delta on a delta on a full one."""

from ps_first import serve_if_ps

SERVER = serve_if_ps() if __name__ == "__main__" else None  # a ps serves, exits: no framework

import sys

import numpy as np
import torch

import mpitf.torch as mt
from mpitf import abort_on_error
from mpitf.data.ctr import CtrDataset, load_ctr
from mpitf.jobs.dlrm import build

BATCH, STEPS, DIM = 64, 12, 4


def model_for(table_rows, dense_dim, embedding_bag):
    """Return the DLRM both sides build (mpitf's tables, or torch.nn.EmbeddingBag)."""
    return build(table_rows, dense_dim, DIM, (8,), (8,), embedding_bag)


def main():
    data, ckpt, out = sys.argv[1:4]
    with abort_on_error():
        server = SERVER
        ds = CtrDataset(data, server.replica_index, server.num_replicas, BATCH, 0)
        torch.manual_seed(0)
        model = model_for(ds.table_rows, ds.dense_dim, mt.EmbeddingBag)
        opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
        dist = mt.DistributedOptimizer(opt, model, server, deterministic=True,
                                       last_step=STEPS, checkpoint_dir=ckpt,
                                       save_checkpoint_steps=4, full_checkpoint_every=3)
        loss_fn = torch.nn.functional.binary_cross_entropy_with_logits
        while not dist.should_stop():
            ids, dense, y = ds.next_batch()
            dist.zero_grad()
            loss = loss_fn(model(torch.from_numpy(dense), torch.from_numpy(ids)),
                           torch.from_numpy(y).to(torch.float32))
            loss.backward()
            dist.step(loss)
        if server.is_chief:
            ids, dense, _, _ = load_ctr(data, "test")
            with torch.no_grad():
                z = model(torch.from_numpy(dense[:BATCH]), torch.from_numpy(ids[:BATCH]))
            np.save(out, z.numpy())
        dist.close()


if __name__ == "__main__":
    main()
