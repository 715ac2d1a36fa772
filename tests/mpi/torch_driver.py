"""mpitf.torch under mpiexec: 1 ps + W workers train a small torch MLP; each worker also
trains the same model with plain torch on the W batches' mean gradient and prints how far
the two are apart (``maxrel: X``). ``--break`` breaks the parameter alias one way."""

import argparse
import hashlib
import sys
import time

import numpy as np
import torch

from mpitf import ClusterSpec, Server, abort_on_error
from mpitf.torch import DistributedOptimizer

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1,
                                      weight_decay=1e-3),
    "nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05, lr_decay=1e-3),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.003, momentum=0.5, weight_decay=1e-3),
    "amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
    "lbfgs": lambda ps: torch.optim.LBFGS(ps),
}


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batches(step, workers):
    rng = np.random.default_rng(1000 + step)
    x = torch.from_numpy(rng.normal(size=(workers, 10, 8)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 3, size=(workers, 10)))
    return x, y


def scheduler(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5) * 0.97**s)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--schedule", action="store_true")
    p.add_argument("--break", dest="brk", default="none")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--save-steps", type=int, default=None)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--num-ps", type=int, default=1)
    p.add_argument("--clip", type=float, default=None)
    p.add_argument("--mode", default="sync")
    p.add_argument("--bucket-bytes", type=int, default=0)
    p.add_argument("--accumulate-from", type=int, default=None,
                   help="from this step on, two backward calls (half batches) per step")
    args = p.parse_args()
    with abort_on_error():
        import mpi4py.MPI as MPI

        workers = MPI.COMM_WORLD.Get_size() - args.num_ps
        server = Server(ClusterSpec({"ps": args.num_ps, "worker": workers}), deadline=30)
        if server.job_name == "ps":
            server.join()
            sys.exit(server.exit_code)
        k = server.replica_index
        model, ref = build(), build()
        if k != 0:  # the chief's values must win
            with torch.no_grad():
                for q in model.parameters():
                    q.add_(1.0)
        opt = OPTIMIZERS[args.optimizer](model.parameters())
        ref_opt = OPTIMIZERS[args.optimizer](ref.parameters())
        sched = scheduler(opt) if args.schedule else None
        ref_sched = scheduler(ref_opt) if args.schedule else None
        dist = DistributedOptimizer(opt, model, server, mode=args.mode,
                                    deterministic=args.mode == "sync",
                                    last_step=args.steps, checkpoint_dir=args.checkpoint_dir,
                                    save_checkpoint_steps=args.save_steps, log_every=1,
                                    clip_norm=args.clip, bucket_bytes=args.bucket_bytes)
        if args.brk == "to":
            model.to(torch.float64)
        elif args.brk == "load":
            model.load_state_dict(ref.state_dict())
        start, early = dist.global_step, 0
        for s in range(start):  # a resumed run: bring the reference to the same step
            ref_step(ref, ref_opt, ref_sched, s, workers, args.clip)
        while not dist.should_stop():
            s = dist.global_step
            x, y = batches(s, workers)
            if args.brk == "torch_zero_grad":
                opt.zero_grad()  # torch's: sets every .grad to None
            else:
                dist.zero_grad()
            if args.accumulate_from is not None and s >= args.accumulate_from:
                for half in (slice(0, 5), slice(5, 10)):  # gradient accumulation
                    loss = torch.nn.functional.cross_entropy(model(x[k, half]), y[k, half]) / 2
                    loss.backward()
            else:
                out = model(x[k].to(next(model.parameters()).dtype))
                if args.brk == "unused" and s == 3:
                    out = out.detach() + model[2].bias  # the first layer gets no gradient
                loss = torch.nn.functional.cross_entropy(out, y[k])
                loss.backward()
            bucketed = dist.client.bucketed_push
            if bucketed is not None and bucketed.reply_value is None:  # a step under way
                early += sum(bucketed.next)  # buckets the hooks pushed during backward
            dist.step(loss)
            time.sleep(args.sleep)
            if sched is not None:
                sched.step()
            ref_step(ref, ref_opt, ref_sched, s, workers, args.clip)
        dist.close()
        # Per parameter: |mpitf - torch| / |torch| (norms), the worst of them.
        worst = max(float((a.detach() - b.detach()).norm() / b.detach().norm())
                    for a, b in zip(model.parameters(), ref.parameters()))
        moved = max(float((a.detach() - b.detach()).abs().max())
                    for a, b in zip(ref.parameters(), build().parameters()))
        print(f"worker {k}: step {dist.global_step} maxrel: {worst:.3g} moved: {moved:.3g} "
              f"lr: {opt.param_groups[0]['lr']:.6g}", flush=True)
        if k == 0:
            digest = hashlib.sha256(b"".join(q.detach().numpy().tobytes()
                                             for q in model.parameters())).hexdigest()
            print("keys:", ",".join(model.state_dict()), "digest:", digest[:16], flush=True)
            print(f"buckets pushed during backward: {early}", flush=True)
        sys.exit(dist.exit_code)


def ref_step(ref, opt, sched, s, workers, clip):
    x, y = batches(s, workers)
    opt.zero_grad()
    loss = sum(torch.nn.functional.cross_entropy(ref(x[w]), y[w]) for w in range(workers))
    (loss / workers).backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
    opt.step()
    if sched is not None:
        sched.step()


if __name__ == "__main__":
    main()
