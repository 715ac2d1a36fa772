"""Frameworks on mpitf: a torch step on 1 ps + 1 worker against torch alone + raw MPI.

Run: OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/frameworks.py --json fw.json
     (--quick: tiny models, a few steps, one repetition; for the tests).
     mpiexec -n 3 python benchmarks/frameworks.py --vs-ddp --json ddp.json: 1 ps + 2
     workers against torch DDP on a small language model (``vs_ddp.py``).

Two figures (issue 12's targets), all from one run:

* ``mlp`` and ``cnn``: a torch MLP and a torch CNN, SGD, batch B, trained through
  ``mpitf.torch.DistributedOptimizer`` (1 ps + 1 worker, sync). Each repetition measures,
  medians over ``--steps`` steps after warm-up: ``torch_ms``, the same step in plain torch
  (zero_grad, forward, backward, torch.optim.SGD.step); ``raw_ms``, a raw MPI round trip of
  the gradient's bytes (the worker sends them, the ps receives them all and sends them
  back); ``mpitf_ms``, the step through mpitf with its defaults (a model over 2 MiB in
  buckets that leave during backward). ``ratio = mpitf / (torch + raw)``, target <= 1.10.
* ``tiny``: the same three figures for a model of 72 parameters (Linear 8-8, sum of
  squares): ``session_us = mpitf - torch - raw``, what the session adds to a step beyond
  torch and the round trip (hooks, checks, logging, the alias checks, the ps's loop),
  target <= 100 us.
* ``overlap``: L dense H x H tanh layers, the batch chosen so that forward + backward take
  about the one-bucket round trip through mpitf (push, apply, pull; measured first); the
  mpitf step with one bucket against one bucket per layer (``bucket_bytes`` = a layer's
  bytes: the hooks push each layer's bucket as backward finishes it).
  ``ratio = buckets / one bucket``, target <= 0.8.

Every figure is the median over ``--repeats`` repetitions, which interleave the
measurements so that a change of load touches them alike. The ps waits between the phases
without spinning (Ibarrier and sleep), so the torch-alone step has the cores it would have.
This script imports torch, so it lives outside the package (mpitf.bench must not import
torch; see pyproject.toml's contracts). Rank 0 (the ps) is quiet; the worker prints and
writes the JSON.
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: one thread, as on 2 ranks

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpitf.bench.scaling import write_json  # noqa: E402
from mpitf.bench.timing import median_ms  # noqa: E402
from mpitf.ps.service import serve  # noqa: E402
from mpitf.runtime.exits import run_job  # noqa: E402
from mpitf.runtime.server import Server  # noqa: E402
from mpitf.torch import DistributedOptimizer  # noqa: E402

WARMUP = 3  # the first step learns whether gradients accumulate; hooks push from the 2nd
LR = 1e-3


def parse_args(argv=None):
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="timed steps per figure")
    p.add_argument("--repeats", type=int, default=5, help="repetitions (median taken)")
    p.add_argument("--batch", type=int, default=64, help="MLP and CNN examples per step")
    p.add_argument("--layers", type=int, default=8, help="overlap model: layers")
    p.add_argument("--width", type=int, default=1024, help="overlap model: units per layer")
    p.add_argument("--overlap-batch", type=int, default=None,
                   help="overlap model: examples per step (default: backward ~ round trip)")
    p.add_argument("--json", default=None)
    p.add_argument("--vs-ddp", action="store_true",
                   help="on 3 ranks: 1 ps + 2 workers against torch DDP (vs_ddp.py)")
    p.add_argument("--idle", type=float, default=2.0,
                   help="--vs-ddp: seconds the ps waits idle while its CPU is measured")
    p.add_argument("--quick", action="store_true", help="tiny models, few steps, 1 repeat")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.repeats, args.batch, args.layers, args.width = 4, 1, 16, 3, 128
        args.overlap_batch = args.overlap_batch or 32
    return args


def mlp(args):
    """A torch MLP on 28x28 inputs: 784-512-512-10, ReLU."""
    width = 64 if args.quick else 512
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, 10))
    return model, (args.batch, 1, 28, 28)


def tiny(args):
    """A torch model of 72 parameters (Linear 8-8): the session's own cost per step shows."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8)), (args.batch, 8)


def cnn(args):
    """A torch CNN on 28x28 inputs: two 3x3 conv + pool blocks, then two dense layers."""
    c = 8 if args.quick else 32
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, c, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(c, 2 * c, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(2 * c * 49, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 10))
    return model, (args.batch, 1, 28, 28)


def deep(args, batch):
    """The overlap model: ``layers`` dense width x width tanh layers, no biases."""
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width, bias=False), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers), (batch, args.width)


def _batch(shape):
    g = torch.Generator().manual_seed(1)
    return torch.randn(shape, generator=g), torch.randint(0, 10, (shape[0],), generator=g)


def _loss(model, x, y):
    out = model(x)
    if out.shape[1] != 10:  # the overlap model: sum of squares, as benchmarks/overlap.py
        return (out * out).sum() / 2
    return torch.nn.functional.cross_entropy(out, y)


def _nbytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _idle(comm):
    """Meet the other rank without spinning a core while it measures."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.001)


def torch_alone(build, steps):
    """Return the median ms of a plain torch SGD step."""
    model, shape = build()
    x, y = _batch(shape)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step():
        opt.zero_grad()
        _loss(model, x, y).backward()
        opt.step()

    return median_ms(step, steps)


def raw_round_trip(comm, nbytes, steps, ps):
    """Return the worker's median ms of ``nbytes`` there and back (the ps: None)."""
    buf, peer = np.zeros(nbytes, np.uint8), 1 - comm.Get_rank()
    if ps:
        for _ in range(WARMUP + steps):
            comm.Recv([buf, MPI.BYTE], peer, 1)
            comm.Send([buf, MPI.BYTE], peer, 2)
        return None

    def trip():
        reply = comm.Irecv([buf, MPI.BYTE], peer, 2)
        comm.Send([buf, MPI.BYTE], peer, 1)
        reply.Wait()

    return median_ms(trip, steps)


def mpitf_step(server, build, steps, bucket_bytes=None):
    """Return the median ms of a step through DistributedOptimizer (worker side).

    ``bucket_bytes`` None: what a user gets, the session's default buckets.
    """
    model, shape = build()
    x, y = _batch(shape)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    chosen = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    dist = DistributedOptimizer(opt, model, server, mode="sync", log_every=0, **chosen)

    def step():
        dist.zero_grad()
        loss = _loss(model, x, y)
        loss.backward()
        dist.step()

    try:
        return median_ms(step, steps)
    finally:
        dist.close()


def phases(args):
    """The measurements of one repetition, in order, as both ranks run them."""
    return [("mlp", lambda: mlp(args)), ("cnn", lambda: cnn(args)), ("tiny", lambda: tiny(args))]


def frameworks_repeat(server, raw, args, ps):
    """One repetition of the MLP and CNN figures; return {name: figures} (the ps: {})."""
    out = {}
    for name, build in phases(args):
        nbytes = _nbytes(build()[0])
        if ps:
            _idle(raw)  # the worker runs torch alone
            raw_round_trip(raw, nbytes, args.steps, ps=True)
            serve(server)
            continue
        row = dict(torch_ms=torch_alone(build, args.steps))
        _idle(raw)
        row["raw_ms"] = raw_round_trip(raw, nbytes, args.steps, ps=False)
        row["mpitf_ms"] = mpitf_step(server, build, args.steps)
        row.update(bytes=nbytes, ratio=row["mpitf_ms"] / (row["torch_ms"] + row["raw_ms"]),
                   session_us=1e3 * (row["mpitf_ms"] - row["torch_ms"] - row["raw_ms"]))
        out[name] = row
    return out


def overlap_repeat(server, raw, args, batch, ps):
    """One repetition of the bucket figure: one bucket, then one bucket per layer."""
    layer_bytes = args.width * args.width * 4
    if ps:
        _idle(raw)  # the worker times forward + backward alone
        serve(server)
        serve(server)
        return None
    model, _ = deep(args, batch)
    x = torch.randn(batch, args.width)
    compute = median_ms(lambda: _loss(model, x, None).backward(), args.steps)
    _idle(raw)
    build = lambda: deep(args, batch)  # noqa: E731
    one = mpitf_step(server, build, args.steps, bucket_bytes=0)
    many = mpitf_step(server, build, args.steps, bucket_bytes=layer_bytes)
    return dict(compute_ms=compute, one_bucket_ms=one, buckets_ms=many, ratio=many / one)


def calibrate(server, raw, args, ps):
    """Return the overlap batch: backward about as long as the one-bucket round trip.

    The round trip (push, apply, pull) is timed through DistributedOptimizer with zero
    gradients and no backward; backward at batch 64 scales to the batch that matches it.
    """
    if args.overlap_batch is not None:
        return args.overlap_batch
    worker = server.replica_ranks[0]
    if ps:
        serve(server)
        _idle(raw)  # the worker times backward
        return raw.bcast(None, root=worker)
    model, _ = deep(args, 64)
    dist = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model, server,
                                mode="sync", log_every=0, bucket_bytes=0)

    def trip():
        dist.zero_grad(set_to_none=False)  # no backward: the zero gradients go as they are
        dist.step()

    try:
        comm_ms = median_ms(trip, 5)
    finally:
        dist.close()
    x = torch.randn(64, args.width)
    per64 = median_ms(lambda: _loss(model, x, None).backward(), 5)
    _idle(raw)
    batch = int(min(8192, max(8, 64 * comm_ms / max(per64, 1e-3))))
    print(f"frameworks overlap: round trip {comm_ms:.2f} ms, forward + backward at batch 64 "
          f"{per64:.2f} ms: batch {batch}", flush=True)
    return raw.bcast(batch, root=worker)


def summarize(reps, key):
    """Return the median over repetitions of every number in ``reps[i][key]``."""
    rows = [r[key] for r in reps]
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main(argv=None):
    """Run on both ranks (1 ps, 1 worker); the worker prints and writes the JSON."""
    args = parse_args(argv)
    world = MPI.COMM_WORLD
    if args.vs_ddp:
        return versus_ddp(args, world)
    if world.Get_size() != 2:
        raise SystemExit(f"frameworks: run on 2 ranks (1 ps + 1 worker), got {world.Get_size()}")
    server = Server({"ps": 1, "worker": 1}, deadline=300)
    raw = world.Dup()  # raw traffic apart from mpitf's communicator
    ps = server.job_name == "ps"
    batch = calibrate(server, raw, args, ps)
    reps = []
    for _ in range(args.repeats):
        row = frameworks_repeat(server, raw, args, ps)
        row["overlap"] = overlap_repeat(server, raw, args, batch, ps)
        reps.append(row)
    if ps:
        return 0
    out = {name: summarize(reps, name) for name in ("mlp", "cnn", "tiny", "overlap")}
    for name in ("mlp", "cnn", "tiny"):
        out[name]["ratios"] = [r[name]["ratio"] for r in reps]
    out["overlap"].update(ratios=[r["overlap"]["ratio"] for r in reps], batch=batch,
                          layers=args.layers, width=args.width,
                          buckets=args.layers, bytes=args.layers * args.width ** 2 * 4)
    out.update(repeats=args.repeats, steps=args.steps, batch=args.batch,
               torch=torch.__version__, threads=torch.get_num_threads(),
               load_average=list(os.getloadavg()), command=" ".join(sys.argv))
    for name in ("mlp", "cnn"):
        r = out[name]
        print(f"frameworks {name}: {r['bytes'] / 2**20:.2f} MiB, batch {args.batch}: mpitf "
              f"{r['mpitf_ms']:.2f} ms, torch {r['torch_ms']:.2f} ms + raw MPI "
              f"{r['raw_ms']:.2f} ms; ratio {r['ratio']:.3f} (target <= 1.10)", flush=True)
    r = out["tiny"]
    print(f"frameworks tiny: {r['bytes'] // 4} parameters: mpitf {1e3 * r['mpitf_ms']:.0f} us, "
          f"torch {1e3 * r['torch_ms']:.0f} us + raw MPI {1e3 * r['raw_ms']:.0f} us; the "
          f"session's own cost {r['session_us']:.0f} us a step (target <= 100)", flush=True)
    r = out["overlap"]
    print(f"frameworks overlap: {args.layers} x {args.width}x{args.width} "
          f"({r['bytes'] / 2**20:.0f} MiB), batch {batch}: forward + backward "
          f"{r['compute_ms']:.2f} ms; one bucket "
          f"{r['one_bucket_ms']:.2f} ms, {args.layers} buckets {r['buckets_ms']:.2f} ms; "
          f"ratio {r['ratio']:.3f} (target <= 0.8)", flush=True)
    write_json(args.json, out)
    return 0


def versus_ddp(args, world):
    """Run ``vs_ddp.py``'s comparison on 3 ranks; worker 0 writes the JSON."""
    if world.Get_size() != 3:
        raise SystemExit(f"frameworks --vs-ddp: run on 3 ranks (1 ps + 2 workers), got "
                         f"{world.Get_size()}")
    import vs_ddp  # noqa: PLC0415 (torch.distributed only when asked)

    server = Server({"ps": 1, "worker": 2}, deadline=300)
    out = vs_ddp.run(args, server, world.Dup(), _idle)
    if out is not None:
        out.update(repeats=args.repeats, steps=args.steps, torch=torch.__version__,
                   threads=torch.get_num_threads(), load_average=list(os.getloadavg()),
                   command=" ".join(sys.argv))
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    run_job(main)
