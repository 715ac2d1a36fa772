"""The torch DLRM step through mpitf against plain single-process torch on the same batches.

Run: mpiexec -n 2 python benchmarks/recsys.py --json rs.json [--quick]

The model is the ``dlrm`` job's (``mpitf.jobs.dlrm.build``): a bottom MLP, one
``EmbeddingBag(R, D, mode="sum")`` per field, pairwise dot interactions, a top MLP; batches
of B examples with F Zipf(A) ids each (``(zipf - 1) % R``) and 13 dense features, Adagrad.
Three figures per repetition, the repetitions interleaving them (the machine is shared):

- ``mpitf_ms``: the step (zero_grad, forward, backward, step) with ``mpitf.torch.EmbeddingBag``
  on 1 ps + 1 worker, sync: each table's unique rows pulled in forward, their gradients and
  the dense ones pushed at step, the ps's Adagrad;
- ``torch_ms``: the same model in plain torch on the worker alone, ``nn.EmbeddingBag(sparse=True)``
  and ``torch.optim.Adagrad`` (its sparse update of the rows a batch touched);
- ``raw_ms``: one raw MPI round trip of the bytes an mpitf step moves (to the ps: each table's
  unique ids twice, for the pull and the push, their row gradients and the dense gradient;
  back: the rows and the dense parameters), ``Send``/``Recv`` between the same ranks.

The JSON holds the medians and ``ratio = mpitf_ms / (torch_ms + raw_ms)`` per repetition
(target <= 1.3). Imports torch, so it lives outside the package; the worker prints and writes.
"""

import functools
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: one thread, as on 2 ranks

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpitf.torch as mt  # noqa: E402
from mpitf.bench.scaling import write_json  # noqa: E402
from mpitf.bench.sparse import add_model_arguments, table_parser  # noqa: E402
from mpitf.bench.timing import median_ms  # noqa: E402
from mpitf.jobs.dlrm import build  # noqa: E402
from mpitf.ps.service import serve  # noqa: E402
from mpitf.runtime.server import Server  # noqa: E402

WARMUP = 3
BATCHES = 8
DENSE = 13  # Criteo's integer features
RAW_TAG = 77
# torch's sparse Adagrad asks, once, whether to check its sparse gradients: not here
warnings.filterwarnings("ignore", message="Sparse invariant checks")


def parse_args(argv=None):
    """Parse the command line."""
    p = table_parser(__doc__.splitlines()[0], rows=100_000, batch=2048, steps=20)
    add_model_arguments(p, "small tables, few steps, 1 repeat")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.fields, args.batch, args.steps, args.repeats = 1000, 4, 256, 4, 1
    return args


def model(args, tables):
    """Return the DLRM with mpitf's tables (``tables``) or torch's sparse ones."""
    torch.manual_seed(0)
    bag = functools.partial(mt.EmbeddingBag, max_ids=args.batch) if tables else \
        functools.partial(torch.nn.EmbeddingBag, sparse=True)
    return build([args.rows] * args.fields, DENSE, args.dim, (64,), (64,), bag)


def stepper(net, optimizer, batches):
    """Return a function that runs one training step on the next batch."""
    k = [0]
    loss_fn = torch.nn.functional.binary_cross_entropy_with_logits

    def step():
        dense, ids, y = batches[k[0] % len(batches)]
        k[0] += 1
        optimizer.zero_grad()
        loss = loss_fn(net(dense, ids), y)
        loss.backward()
        optimizer.step(loss) if isinstance(optimizer, mt.DistributedOptimizer) \
            else optimizer.step()

    return step


def timed(step, steps):
    for _ in range(WARMUP):
        step()
    return median_ms(step, steps)


def mpitf_ms(server, args, batches):
    """Return the median ms of the mpitf step (worker side; the ps serves meanwhile)."""
    net = model(args, True)
    dist = mt.DistributedOptimizer(torch.optim.Adagrad(net.parameters(), lr=args.lr), net,
                                   server, mode="sync", log_every=0)
    try:
        return timed(stepper(net, dist, batches), args.steps)
    finally:
        dist.close()


def torch_ms(args, batches):
    """Return the median ms of the plain torch step, on this rank alone."""
    net = model(args, False)
    return timed(stepper(net, torch.optim.Adagrad(net.parameters(), lr=args.lr), batches),
                 args.steps)


def moved_bytes(args, batches):
    """Return (bytes to the ps, bytes back) of one mpitf step on the median batch."""
    unique = statistics.median(sum(len(np.unique(ids[:, f].numpy()))
                                   for f in range(args.fields)) for _, ids, _ in batches)
    net = model(args, False)
    dense = sum(p.numel() for name, p in net.named_parameters()
                if not name.startswith("tables.")) * 4
    row = args.dim * 4
    return int(unique * (8 + 8 + row) + dense), int(unique * row + dense)


def raw_ms(comm, sizes, steps, worker):
    """Time ``steps`` raw round trips of ``sizes`` (the worker's median ms; the ps echoes)."""
    out, back = (np.zeros(n, np.uint8) for n in sizes)
    times = []
    for _ in range(WARMUP + steps):
        start = time.perf_counter()
        if worker:
            comm.Send(out, 0, RAW_TAG)
            comm.Recv(back, 0, RAW_TAG)
        else:
            comm.Recv(out, 1, RAW_TAG)
            comm.Send(back, 1, RAW_TAG)
        times.append(time.perf_counter() - start)
    return statistics.median(times[WARMUP:]) * 1e3


def main(argv=None):
    """Run on both ranks (rank 0 the ps, rank 1 the worker); the worker writes the JSON."""
    args = parse_args(argv)
    world = MPI.COMM_WORLD
    if world.Get_size() != 2:
        raise SystemExit(f"recsys: run on 2 ranks (1 ps + 1 worker), got {world.Get_size()}")
    worker = world.Get_rank() == 1
    rng = np.random.default_rng(0)
    batches = [(torch.from_numpy(rng.normal(size=(args.batch, DENSE)).astype(np.float32)),
                torch.from_numpy((rng.zipf(args.zipf, (args.batch, args.fields)) - 1)
                                 % args.rows),
                torch.from_numpy(rng.integers(0, 2, args.batch).astype(np.float32)))
               for _ in range(BATCHES)]
    sizes = moved_bytes(args, batches)  # the same on both ranks: the same seeded batches
    server = Server({"ps": 1, "worker": 1}, deadline=300)
    reps = []
    for _ in range(args.repeats):
        row = dict(torch_ms=torch_ms(args, batches)) if worker else {}
        world.Barrier()
        row["raw_ms"] = raw_ms(world, sizes, args.steps, worker)
        if not worker:
            serve(server)
            continue
        row["mpitf_ms"] = mpitf_ms(server, args, batches)
        row["ratio"] = row["mpitf_ms"] / (row["torch_ms"] + row["raw_ms"])
        print(" ".join(f"{k}={v:.2f}" for k, v in row.items()), flush=True)
        reps.append(row)
    if not worker:
        return 0
    out = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
    out.update(ratios=[r["ratio"] for r in reps], bytes_to_ps=sizes[0],
               bytes_back=sizes[1], rows=args.rows, fields=args.fields, dim=args.dim,
               batch=args.batch, zipf=args.zipf, steps=args.steps, repeats=args.repeats,
               optimizer="Adagrad", load=os.getloadavg()[0])
    print(f"recsys: mpitf {out['mpitf_ms']:.2f} ms, torch {out['torch_ms']:.2f} ms + raw "
          f"{out['raw_ms']:.2f} ms; ratio {out['ratio']:.2f} (target <= 1.3); "
          f"{sizes[0] / 2**20:.1f} MiB to the ps, {sizes[1] / 2**20:.1f} MiB back", flush=True)
    write_json(args.json, {"results": [out]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
