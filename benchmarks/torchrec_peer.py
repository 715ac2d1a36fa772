"""TorchRec's DLRM trained by TorchRec itself and by mpitf, the systems alternating.

Run: python benchmarks/torchrec_peer.py --data ctr.h5 --json tp.json [--quick]
(write the file with ``mpitf data synthetic-ctr --out ctr.h5``; needs the torchrec extra).

One model, ``torchrec.models.dlrm.DLRM`` over an EmbeddingBagCollection of one table per
field (dim 4; bottom MLP 16-4, top MLP 16-1), one global batch, the same optimizer:
row-wise Adagrad on the tables (TorchRec's fused ``EXACT_ROWWISE_ADAGRAD``; mpitf's
``rowwise_tables=True``) and Adagrad on the dense layers, one learning rate. Four systems,
each launched in turn per repetition (the machine is shared, so they alternate):

- ``torchrec``: one process, DistributedModelParallel over a gloo group of one (every table
  fused, checked in the plan), the whole batch;
- ``torchrec-dmp2``: DistributedModelParallel, 2 ranks, gloo: half the batch a rank;
- ``mpitf-1+1``: :func:`mpitf.torch.distribute` and DistributedOptimizer (sync), 1 ps + 1 worker;
- ``mpitf-1+2``: the same, 1 ps + 2 workers, half the batch a worker.

Each reports examples/s (the global batch over the median of its steady intervals of
``--interval`` steps, the first left out; evaluation not timed), test AUC at its best
evaluation (every ``--eval-every`` steps, on the first ``--test`` test examples, by rank 0
or the chief), and each rank's peak RSS. A launch is this script with ``--system`` (each
rank writes its figures into ``--results``).
"""

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

SYSTEMS = ("torchrec", "torchrec-dmp2", "mpitf-1+1", "mpitf-1+2")
RANKS = {"torchrec": 1, "torchrec-dmp2": 2, "mpitf-1+1": 2, "mpitf-1+2": 3}
DIM, LR = 4, 0.02


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True)
    p.add_argument("--json", default=None)
    p.add_argument("--system", choices=SYSTEMS, default=None, help="(one launch)")
    p.add_argument("--results", default=None, help="(one launch: where each rank writes)")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--batch", type=int, default=512, help="global batch")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--interval", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--test", type=int, default=5000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="few steps, 1 repeat")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.interval, args.eval_every, args.repeats = 60, 20, 60, 1
    return args


def rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def model(fields, rows, dense, device):
    import torch
    import torchrec
    from torchrec.models.dlrm import DLRM

    torch.manual_seed(0)
    tables = [torchrec.EmbeddingBagConfig(name=f"t{f}", embedding_dim=DIM,
                                          num_embeddings=int(rows[f]),
                                          feature_names=[f"f{f}"]) for f in range(fields)]
    ebc = torchrec.EmbeddingBagCollection(tables=tables, device=device)
    return DLRM(embedding_bag_collection=ebc, dense_in_features=dense,
                dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[16, 1])


def batch_of(ids, dense, y, lo, n):
    import torch
    import torchrec

    rows = (lo + np.arange(n)) % len(y)
    fields = ids.shape[1]
    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{f}" for f in range(fields)],
        values=torch.from_numpy(ids[rows].T.reshape(-1).astype("int64")),
        lengths=torch.ones(fields * n, dtype=torch.int32))
    return torch.from_numpy(dense[rows]), kjt, torch.from_numpy(y[rows].astype("float32"))


def evaluate(net, test):
    import torch

    from mpitf.data.ctr import auc

    ids, dense, y = test
    scores = []
    with torch.no_grad():
        for lo in range(0, len(y), 1000):
            n = min(1000, len(y) - lo)
            d, kjt, _ = batch_of(ids, dense, y, lo, n)
            scores.append(net(d, kjt).squeeze(1).numpy())
    return auc(y, np.concatenate(scores))


def train(args, net, step, rank, size, best_of):
    """Run the steps; return (examples/s of the steady intervals' median, best AUC)."""
    from mpitf.data.ctr import load_ctr

    ids, dense, y, _ = load_ctr(args.data, "train")
    test = load_ctr(args.data, "test", stop=args.test)[:3]
    share = args.batch // size
    times, best, start = [], 0.0, time.perf_counter()
    for s in range(args.steps):
        step(batch_of(ids, dense, y, s * args.batch + rank * share, share))
        if (s + 1) % args.interval == 0:
            now = time.perf_counter()
            times.append(now - start)
            start = now
        if (s + 1) % args.eval_every == 0:
            best = max(best, best_of(lambda: evaluate(net, test)))
            start = time.perf_counter()
    steady = times[1:] or times
    return args.batch * args.interval / statistics.median(steady), best


def run_torchrec(args, size):
    """One rank of TorchRec's DistributedModelParallel (gloo) over ``size`` ranks."""
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import _apply_optimizer_in_backward
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from mpitf.data.ctr import load_ctr

    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", 0)))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=rank, world_size=size)
    _, dense, _, rows = load_ctr(args.data, "test", stop=1)
    net = model(len(rows), rows, dense.shape[1], torch.device("meta"))
    _apply_optimizer_in_backward(RowWiseAdagrad, net.sparse_arch.parameters(), {"lr": LR})
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=size, compute_device="cpu"))
    plan = planner.collective_plan(net, [EmbeddingBagCollectionSharder()], dist.group.WORLD)
    kernels = {p.compute_kernel for v in plan.plan.values() for p in v.values()}
    if kernels != {"fused"}:  # a "dense" kernel would never train its table (no error)
        raise SystemExit(f"torchrec_peer: the plan's kernels are {kernels}, not fused")
    net = DistributedModelParallel(net, device=torch.device("cpu"), plan=plan)
    opt = torch.optim.Adagrad([p for n, p in net.named_parameters()
                               if "embedding_bags" not in n], lr=LR)
    loss_fn = torch.nn.functional.binary_cross_entropy_with_logits

    def step(batch):
        d, kjt, y = batch
        opt.zero_grad()
        loss_fn(net(d, kjt).squeeze(1), y).backward()
        opt.step()

    def best_of(score):  # every rank runs the forward (its collectives); rank 0's counts
        return score()

    speed, auc = train(args, net, step, rank, size, best_of)
    dist.destroy_process_group()
    return rank, speed, auc


def run_mpitf(args):
    """One rank of mpitf: 1 ps, the rest workers; returns (role, examples/s, AUC)."""
    from mpi4py import MPI

    from mpitf import ClusterSpec, Server

    workers = MPI.COMM_WORLD.Get_size() - 1
    server = Server(ClusterSpec({"ps": 1, "worker": workers}), deadline=300)
    if server.job_name == "ps":
        server.join()
        return "ps", None, None
    import torch

    import mpitf.torch as mt
    from mpitf.data.ctr import load_ctr

    _, dense, _, rows = load_ctr(args.data, "test", stop=1)
    net = model(len(rows), rows, dense.shape[1], None)
    mt.distribute(net, max_ids=args.batch // workers)
    dist = mt.DistributedOptimizer(torch.optim.Adagrad(net.parameters(), lr=LR), net, server,
                                   rowwise_tables=True, mode="sync", log_every=0,
                                   last_step=args.steps)
    loss_fn = torch.nn.functional.binary_cross_entropy_with_logits

    def step(batch):
        d, kjt, y = batch
        dist.zero_grad()
        loss = loss_fn(net(d, kjt).squeeze(1), y)
        loss.backward()
        dist.step(loss)

    chief = server.replica_index == 0

    def best_of(score):  # the chief evaluates after step(); the others go on
        return score() if chief else 0.0

    speed, auc = train(args, net, step, server.replica_index, workers, best_of)
    dist.close()
    return f"worker{server.replica_index}", speed, auc


def one_launch(args):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.system.startswith("torchrec"):
        rank, speed, auc = run_torchrec(args, RANKS[args.system])
        role = f"rank{rank}"
    else:
        role, speed, auc = run_mpitf(args)
    with open(os.path.join(args.results, f"{role}.json"), "w") as f:  # one file a rank
        json.dump({"system": args.system, "role": role, "examples_s": speed, "auc": auc,
                   "rss_mib": rss_mib()}, f)


def launch(args, system):
    """Run ``system`` once (its ranks under mpiexec); return its ranks' RESULT lines."""
    from mpitf.runtime.launch import find_mpiexec

    results = tempfile.mkdtemp(prefix="torchrec_peer")
    argv = [sys.executable, __file__, "--system", system, "--results", results,
            "--data", args.data,
            "--batch", str(args.batch), "--steps", str(args.steps), "--interval",
            str(args.interval), "--eval-every", str(args.eval_every), "--test", str(args.test)]
    n = RANKS[system]
    cmd = argv if n == 1 else [find_mpiexec(), "-n", str(n), *argv]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    found = []
    for name in sorted(os.listdir(results)):
        with open(os.path.join(results, name)) as f:
            found.append(json.load(f))
    shutil.rmtree(results)
    if out.returncode or len(found) != n:
        raise SystemExit(f"torchrec_peer: {system} failed ({out.returncode}):\n"
                         f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return found


def main(argv=None):
    args = parse_args(argv)
    if args.system:
        return one_launch(args)
    systems = args.systems.split(",")
    runs = {s: [] for s in systems}
    for r in range(args.repeats):
        for system in systems:
            ranks = launch(args, system)
            head = next(x for x in ranks if x["role"] in ("rank0", "worker0"))
            runs[system].append({"examples_s": head["examples_s"], "auc": head["auc"],
                                 "rss_mib": {x["role"]: round(x["rss_mib"]) for x in ranks}})
            print(f"repeat {r + 1} {system}: {head['examples_s']:.0f} examples/s, AUC "
                  f"{head['auc']:.4f}, RSS {runs[system][-1]['rss_mib']} MiB", flush=True)
    summary = {s: {"examples_s_median": statistics.median(x["examples_s"] for x in v),
                   "examples_s": [x["examples_s"] for x in v],
                   "auc": [x["auc"] for x in v], "rss_mib": [x["rss_mib"] for x in v]}
               for s, v in runs.items()}
    for s, v in summary.items():
        print(f"{s}: median {v['examples_s_median']:.0f} examples/s "
              f"(range {min(v['examples_s']):.0f}-{max(v['examples_s']):.0f})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": summary, "batch": args.batch, "steps": args.steps,
                       "load": os.getloadavg()[0]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
