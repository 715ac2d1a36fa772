"""mpitf.torch tables under mpiexec: 1 ps + W workers train an EmbeddingBag (or Embedding)
and a Linear layer; each worker also trains the same model in plain torch (nn.EmbeddingBag
with sparse=True, the same optimizer) on the W batches' mean gradient and prints how far
the two are apart (``maxrel``: the dense parameters and the table's rows). ``--bad`` feeds
one kind of bad input at step 3."""

from ps_first import serve_if_ps

SERVER = serve_if_ps() if __name__ == "__main__" else None  # a ps serves, exits: no framework

import argparse
import copy
import hashlib
import sys

import numpy as np
import torch

import mpitf.torch as mt
from mpitf import abort_on_error

ROWS, DIM, BAGS = 50, 4, 10
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.5),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01,
                                              initial_accumulator_value=0.1),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
}


def say(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Model(torch.nn.Module):
    def __init__(self, bag, mode, kind):
        super().__init__()
        if kind == "embedding":
            self.emb = bag(ROWS, DIM, padding_idx=0) if bag is mt.Embedding else \
                torch.nn.Embedding(ROWS, DIM, padding_idx=0, sparse=True)
        elif bag is mt.EmbeddingBag:
            self.emb = bag(ROWS, DIM, mode=mode, max_ids=64, padding_idx=1)
        else:
            # torch's max mode takes no sparse gradient: a dense one is the same update here
            self.emb = torch.nn.EmbeddingBag(ROWS, DIM, mode=mode, sparse=mode != "max",
                                             padding_idx=1)
        self.kind = kind
        if kind == "two":  # a second table, looked up after the first: table by table
            self.emb2 = mt.EmbeddingBag(30, DIM, mode="mean") if bag is mt.EmbeddingBag \
                else torch.nn.EmbeddingBag(30, DIM, mode="mean", sparse=True)
        self.out = torch.nn.Linear(DIM, 3)

    def forward(self, ids, offsets, weights):
        if ids is None:  # a step that does not use the tables
            return self.out(torch.ones(BAGS, DIM))
        if self.kind == "embedding":
            return self.out(self.emb(ids[:2 * BAGS].reshape(BAGS, 2)).sum(1))
        bags = self.emb(ids, offsets, per_sample_weights=weights)
        if self.kind == "two":
            bags = bags + self.emb2(ids % 30, offsets)
        return self.out(bags)


def batch(step, w, bad=None):
    rng = np.random.default_rng(100 * step + w)
    n = int(rng.integers(20, 41))
    ids = np.minimum(rng.zipf(1.3, n) - 1, ROWS - 1)
    cuts = np.sort(rng.choice(np.arange(1, n), BAGS - 1, replace=False))
    offsets = np.concatenate([[0], cuts])
    weights = torch.from_numpy(rng.uniform(0.5, 1.5, n).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 3, BAGS))
    ids, offsets = torch.from_numpy(ids), torch.from_numpy(offsets)
    if bad == "id":
        ids[7] = ROWS + 3
    elif bad == "offsets":
        offsets[4] = offsets[2] - 1
    elif bad == "float":
        ids = ids.float()
    elif bad == "weights":
        weights = weights[:-1]
    return ids, offsets, weights, y


def loss_of(model, b, mode, skip=False):
    ids, offsets, weights, y = b
    ids = None if skip else ids
    out = model(ids, offsets, weights if mode == "sum" else None)
    return torch.nn.functional.cross_entropy(out, y)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--mode", default="mean")
    p.add_argument("--kind", default="bag", choices=["bag", "embedding", "two"])
    p.add_argument("--num-ps", type=int, default=1)
    p.add_argument("--skip", type=int, nargs="*", default=[],
                   help="steps whose loss does not use the tables")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--bad", default=None)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--save-steps", type=int, default=None)
    args = p.parse_args()
    with abort_on_error():
        server = SERVER
        workers = server.num_replicas
        k = server.replica_index
        torch.manual_seed(0)
        cls = mt.Embedding if args.kind == "embedding" else mt.EmbeddingBag
        model, ref = Model(cls, args.mode, args.kind), Model(None, args.mode, args.kind)
        ref.load_state_dict(model.state_dict())
        start = model.emb.weight.detach().clone()
        if k != 0:  # the chief's values must win
            with torch.no_grad():
                for q in model.parameters():
                    q.add_(1)
        opt, ref_opt = OPTIMIZERS[args.optimizer](model.parameters()), \
            OPTIMIZERS[args.optimizer](ref.parameters())
        dist = mt.DistributedOptimizer(opt, model, server, deterministic=True,
                                       last_step=args.steps, checkpoint_dir=args.checkpoint_dir,
                                       save_checkpoint_steps=args.save_steps)
        for s in range(dist.global_step):  # a resumed run: bring the reference along
            ref_step(ref, ref_opt, s, workers, args.mode)
        while not dist.should_stop():
            s = dist.global_step
            dist.zero_grad()
            b = batch(s, k, args.bad if s == 3 else None)
            if args.bad == "twice" and s == 3:
                model.emb(b[0], b[1])  # a second lookup of the table before step()
            if args.bad == "copy" and s == 3:
                copy.deepcopy(model)  # its table holds the wrapper: refused, naming the fix
            loss = loss_of(model, b, args.mode, s in args.skip)
            loss.backward()
            dist.step(loss)
            ref_step(ref, ref_opt, s, workers, args.mode, s in args.skip)
        rows = dist.table_rows("emb.weight", torch.arange(ROWS))
        dense = [(a, b) for (n, a), b in zip(model.named_parameters(), ref.parameters())
                 if n != "emb.weight"]
        pairs = dense + [(rows, ref.emb.weight)]
        if args.kind == "two":
            pairs = [(a, b) for (n, a), b in zip(model.named_parameters(), ref.parameters())
                     if "emb" not in n]
            pairs += [(rows, ref.emb.weight),
                      (dist.table_rows("emb2.weight", torch.arange(30)), ref.emb2.weight)]
        worst = max(float((a.detach() - b.detach()).norm() / b.detach().norm())
                    for a, b in pairs)
        moved = float((rows - start).abs().max())
        digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t, _ in pairs))
        dist.close()
        say(f"worker {k}: step {dist.global_step} maxrel: {worst:.3g} moved: {moved:.3g} "
            f"digest: {digest.hexdigest()[:16]}")
        sys.exit(dist.exit_code)


def ref_step(ref, opt, s, workers, mode, skip=False):
    opt.zero_grad()
    loss = sum(loss_of(ref, batch(s, w), mode, skip) for w in range(workers))
    (loss / workers).backward()
    opt.step()


if __name__ == "__main__":
    main()
