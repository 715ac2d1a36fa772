"""A torch click model's step with its table on the ps by rows against the table as a dense
parameter, both through ``mpitf.torch.DistributedOptimizer`` (1 ps + 1 worker, sync Adagrad).

Run: mpiexec -n 2 python benchmarks/torch_tables.py --json tt.json [--quick]

The model: one ``EmbeddingBag(R, D, mode="sum")`` over F ids per example (a 2-D batch of
B x F ids, drawn Zipf(A) with a fixed seed, ``(zipf - 1) % R``) and a ``Linear(D, 1)``, a
logistic loss. ``tables_ms``: the step (zero_grad, forward, backward, step) with
``mpitf.torch.EmbeddingBag``: the batch's unique rows pulled in forward, their gradients
pushed with the dense push, the ps's Adagrad on them. ``dense_ms``: the same step with
``torch.nn.EmbeddingBag`` (sparse=False), the whole table a dense parameter pushed and
pulled every step. Each figure is the median over ``--steps`` steps after warm-up; the
repetitions interleave the two, and the JSON holds the median over them and each
repetition's ratio ``dense_ms / tables_ms`` (target >= 10). Imports torch, so it lives
outside the package. Rank 0 (the ps) is quiet; the worker prints and writes the JSON.
"""

import os
import statistics
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: one thread, as on 2 ranks

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpitf.torch as mt  # noqa: E402
from mpitf.bench.scaling import write_json  # noqa: E402
from mpitf.bench.sparse import add_model_arguments, table_parser  # noqa: E402
from mpitf.bench.timing import median_ms  # noqa: E402
from mpitf.ps.service import serve  # noqa: E402
from mpitf.runtime.server import Server  # noqa: E402

WARMUP = 3
BATCHES = 8


def parse_args(argv=None):
    """Parse the command line."""
    p = table_parser(__doc__.splitlines()[0], steps=20)
    add_model_arguments(p, "a small table, few steps, 1 repeat")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.batch, args.steps, args.repeats = 10_000, 256, 4, 1
    return args


class Click(torch.nn.Module):
    """A sum of F rows per example, then a logistic unit."""

    def __init__(self, bag):
        super().__init__()
        self.bag, self.out = bag, torch.nn.Linear(bag.embedding_dim, 1)

    def forward(self, ids):
        return self.out(self.bag(ids)).squeeze(1)


def build(args, tables):
    """Return the click model with ``mpitf.torch.EmbeddingBag`` or torch's own."""
    torch.manual_seed(0)
    if tables:
        bag = mt.EmbeddingBag(args.rows, args.dim, mode="sum",
                              max_ids=args.batch * args.fields)
    else:
        bag = torch.nn.EmbeddingBag(args.rows, args.dim, mode="sum")
    return Click(bag)


def step_ms(server, args, tables, batches):
    """Return the median ms of a training step of the click model (worker side)."""
    model = build(args, tables)
    dist = mt.DistributedOptimizer(torch.optim.Adagrad(model.parameters(), lr=args.lr),
                                   model, server, mode="sync", log_every=0)
    k = [0]

    def step():
        ids, y = batches[k[0] % len(batches)]
        k[0] += 1
        dist.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(ids), y)
        loss.backward()
        dist.step(loss)

    try:
        for _ in range(WARMUP):
            step()
        return median_ms(step, args.steps)
    finally:
        dist.close()


def main(argv=None):
    """Run on both ranks (1 ps, 1 worker); the worker prints and writes the JSON."""
    args = parse_args(argv)
    world = MPI.COMM_WORLD
    if world.Get_size() != 2:
        raise SystemExit(f"torch_tables: run on 2 ranks (1 ps + 1 worker), got "
                         f"{world.Get_size()}")
    server = Server({"ps": 1, "worker": 1}, deadline=300)
    if server.job_name == "ps":
        for _ in range(2 * args.repeats):
            serve(server)
        return 0
    rng = np.random.default_rng(0)
    batches = [(torch.from_numpy((rng.zipf(args.zipf, (args.batch, args.fields)) - 1)
                                 % args.rows),
                torch.from_numpy(rng.integers(0, 2, args.batch).astype(np.float32)))
               for _ in range(BATCHES)]
    unique = statistics.median(len(np.unique(ids.numpy())) for ids, _ in batches)
    reps = []
    for _ in range(args.repeats):
        row = dict(tables_ms=step_ms(server, args, True, batches),
                   dense_ms=step_ms(server, args, False, batches))
        row["ratio"] = row["dense_ms"] / row["tables_ms"]
        print(" ".join(f"{k}={v:.2f}" for k, v in row.items()), flush=True)
        reps.append(row)
    out = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
    out.update(ratios=[r["ratio"] for r in reps], unique_ids=unique, rows=args.rows,
               dim=args.dim, batch=args.batch, fields=args.fields, zipf=args.zipf,
               steps=args.steps, repeats=args.repeats, optimizer="Adagrad",
               load=os.getloadavg()[0])
    print(f"torch_tables: tables {out['tables_ms']:.2f} ms, dense {out['dense_ms']:.2f} ms, "
          f"ratio {out['ratio']:.1f} (target >= 10); {unique:.0f} unique ids a step",
          flush=True)
    write_json(args.json, {"results": [out]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
