"""A torch CNN with BatchNorm on the digits set (8x8), trained on mpitf's ps with AdamW.

    mpiexec -n 3 python jobs/torch_mnist.py --num-ps 1 --steps 300   (or --epochs 5)

The loop is a plain torch loop; mpitf's part is the ``DistributedOptimizer`` around
torch's AdamW (its update runs on the ps) and a LambdaLR warmup + cosine schedule, whose
rate travels with every push (``lr_scheduler=``: advanced to the step on resume). The
BatchNorm running statistics are the chief's: checkpointed with the model and every
worker's at the end. The chief prints the test accuracy (eval mode: the running
statistics) at the end. Rerun with the same ``--checkpoint-dir`` and it
resumes; SIGTERM/SIGUSR1 checkpoint and exit 75.
"""

import argparse
import math
import sys

from mpi4py import MPI

from mpitf import ClusterSpec, Server, ShardedDataset, abort_on_error, ensure_digits
from mpitf.data.sharded import load_split
from mpitf.errors import ConfigurationError
from mpitf.runtime.exits import collective


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-ps", type=int, default=1)
    p.add_argument("--steps", type=int, default=None, help="default: 300, or by --epochs")
    p.add_argument("--epochs", type=float, default=None,
                   help="passes over the training split instead of --steps (an epoch is "
                        "every worker's pass over its shard)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.003)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--mode", default="sync", choices=["sync", "async"])
    p.add_argument("--data", default=None, help="the digits file (made if missing)")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--save-checkpoint-steps", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deterministic", action="store_true",
                   help="sync mode: sum gradients in worker order (bit for bit on resume)")
    return p.parse_args()


def build(num_classes):
    """Two 3x3 convolutions with BatchNorm, a 2x2 max-pool and a linear layer (10k weights)."""
    from torch import nn
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, num_classes))


def last_step(args, total_samples, workers):
    """Return the global step to stop at: ``--steps``, else ``--epochs`` (default 300 steps).

    An epoch is each worker's pass over its shard, ``total // workers // batch`` batches:
    in sync mode a global step takes a batch of every worker, in async one batch.
    """
    if args.epochs is None:
        return 300 if args.steps is None else args.steps
    per_epoch = total_samples // workers // args.batch_size
    return max(1, math.ceil(args.epochs * per_epoch * (1 if args.mode == "sync" else workers)))


def warmup_cosine(warmup, total):
    """LambdaLR factor: linear warmup over ``warmup`` steps, then cosine decay to 0."""
    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))
    return factor


def main():
    args = parse_args()
    world = MPI.COMM_WORLD
    with abort_on_error():
        if args.steps is not None and args.epochs is not None:  # one line, every rank exits 2
            raise collective(ConfigurationError(
                f"--steps {args.steps} and --epochs {args.epochs:g} both say when training "
                "ends: give one"))
        server = Server(ClusterSpec({"ps": args.num_ps, "worker": world.Get_size() - args.num_ps}))
        path = ensure_digits(args.data) if world.Get_rank() == 0 else None
        path = world.bcast(path)
        if server.job_name == "ps":
            server.join()
            sys.exit(server.exit_code)
        # Imported once the ps has left: a ps never loads torch (~2 s of a core at start-up,
        # which its node's workers would share).
        import torch

        from mpitf.torch import DistributedOptimizer

        data = ShardedDataset(path, "train", server.replica_index, server.num_replicas,
                              batch_size=args.batch_size, seed=args.seed)
        steps = last_step(args, data.total_samples, server.num_replicas)
        torch.manual_seed(args.seed)
        model = build(data.num_classes)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.warmup, steps))
        # lr_scheduler: a resumed run brings the schedule to the restored step
        dist = DistributedOptimizer(opt, model, server, mode=args.mode, dataset=data,
                                    lr_scheduler=sched, deterministic=args.deterministic,
                                    last_step=steps, checkpoint_dir=args.checkpoint_dir,
                                    save_checkpoint_steps=args.save_checkpoint_steps,
                                    log_every=50)
        while not dist.should_stop():
            x, y = data.next_batch()
            dist.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)),
                                                     torch.from_numpy(y).long())
            loss.backward()
            dist.step(loss)
            sched.step()
        dist.close()
        data.close()
        if server.is_chief:
            x, y = load_split(path, "test")
            model.eval()
            with torch.no_grad():
                pred = model(torch.from_numpy(x)).argmax(1).numpy()
            print(f"step {dist.global_step}: test accuracy {(pred == y).mean():.4f}", flush=True)
        sys.exit(dist.exit_code)


if __name__ == "__main__":
    main()
