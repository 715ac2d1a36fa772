"""mpitf.torch under mpiexec: 1 ps + W workers train a small torch MLP; each worker also
trains the same model with plain torch on the W batches' mean gradient and prints how far
the two are apart (``maxrel: X``). ``--break`` breaks the parameter alias one way;
``--model bn`` puts a BatchNorm layer in (its buffers are checkpointed and shared);
``--optimizer a,b`` trains with each in turn (each result line ends with its name)."""

from ps_first import flag, serve_if_ps

# ``--optimizer a,b,...``: one training each, in turn, in one launch (the ps serves each)
SESSIONS = len(flag("--optimizer", "adamw").split(","))
SERVER = serve_if_ps(sessions=SESSIONS) if __name__ == "__main__" else None  # a ps serves,
#   exits: it never imports a framework

import argparse
import contextlib
import copy
import hashlib
import io
import sys
import time

import numpy as np
import torch

from mpitf import abort_on_error
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
# Param groups (built from the model): nanoGPT's AdamW, decay on matrices and none on
# biases; layer-wise rates with momentum per group (the last layer without).
GROUPED = {
    "adamw_groups": lambda m: torch.optim.AdamW(
        [{"params": [p for p in m.parameters() if p.dim() >= 2], "weight_decay": 0.1},
         {"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0,
          "betas": (0.8, 0.99)}], lr=0.01),
    "layerwise": lambda m: torch.optim.SGD(
        [{"params": m[0].parameters(), "lr": 0.02},
         {"params": m[-1].parameters(), "lr": 0.1, "momentum": 0.0, "weight_decay": 1e-3}],
        lr=0.05, momentum=0.9),
    "sparse": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
}


def say(line):
    """Print ``line`` in one write: ranks share mpiexec's stdout, and print() writes the
    text and its newline apart, so another rank's line could land between them."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Bag(torch.nn.Module):
    """An EmbeddingBag(sparse=True) before the MLP: its gradient is a sparse tensor."""

    def __init__(self):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(20, 8, sparse=True)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.out(self.bag((x.abs() * 5).long().clamp(max=19)))


def build(kind="mlp", hidden=16):
    torch.manual_seed(0)
    if kind == "bag":
        return Bag()
    if kind == "bn":
        # No bias before BatchNorm: its gradient is rounding noise, which Adam would amplify.
        return torch.nn.Sequential(torch.nn.Linear(8, hidden, bias=False),
                                   torch.nn.BatchNorm1d(hidden),
                                   torch.nn.Tanh(), torch.nn.Linear(hidden, 3))
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(),
                                torch.nn.Linear(hidden, 3))
    if kind == "half":  # one float16 layer among float32 ones
        model[2].half()
    return model


def untrained(model):
    trained = dict(model.named_parameters())
    return [v for name, v in model.state_dict().items() if name not in trained]


def digest(tensors):
    return hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in tensors)).hexdigest()


def batches(step, workers):
    rng = np.random.default_rng(1000 + step)
    x = torch.from_numpy(rng.normal(size=(workers, 10, 8)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 3, size=(workers, 10)))
    return x, y


def scheduler(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5) * 0.97**s)


def group_scheduler(opt):
    # each group's rate on its own curve: the first decays, the second warms up
    return torch.optim.lr_scheduler.LambdaLR(
        opt, [lambda s: 0.95**s, lambda s: min(1.0, (s + 1) / 10)])


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
    p.add_argument("--bucket-bytes", type=int, default=None, help="default: the session's")
    p.add_argument("--clip-grad-norm", type=float, default=None,
                   help="torch.nn.utils.clip_grad_norm_ between backward() and step()")
    p.add_argument("--clip-from", type=int, default=0, help="... from this step on")
    p.add_argument("--nan-at", type=int, default=None, help="a NaN loss at this step")
    p.add_argument("--accumulate-from", type=int, default=None,
                   help="from this step on, two backward calls (half batches) per step")
    p.add_argument("--model", default="mlp", choices=["mlp", "bn", "half", "bag"])
    p.add_argument("--group-schedule", action="store_true",
                   help="LambdaLR with one lambda per param group (two groups)")
    p.add_argument("--reset-optimizer-state", action="store_true")
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--run-dir", default=None, help="the chief's metrics.jsonl goes there")
    p.add_argument("--no-sync", action="store_true",
                   help="with --accumulate-from: the first backward inside dist.no_sync()")
    p.add_argument("--copies", action="store_true",
                   help="deepcopy and torch.save the model after wrapping (see wrapped_copies)")
    args = p.parse_args()
    with abort_on_error():
        for name in args.optimizer.split(","):
            code = train(SERVER, args, name)
            if code:
                break
        sys.exit(code)


def train(server, args, optimizer):
    """Train with ``optimizer`` beside plain torch; print the results; return the exit code."""
    workers = server.num_replicas
    k = server.replica_index
    model, ref = build(args.model, args.hidden), build(args.model, args.hidden)
    if k != 0:  # the chief's values must win
        with torch.no_grad():
            for q in model.state_dict().values():
                q.add_(1)  # parameters and buffers: the chief's win
    if optimizer in GROUPED:
        opt, ref_opt = GROUPED[optimizer](model), GROUPED[optimizer](ref)
    else:
        opt = OPTIMIZERS[optimizer](model.parameters())
        ref_opt = OPTIMIZERS[optimizer](ref.parameters())
    make = group_scheduler if args.group_schedule else scheduler
    sched = make(opt) if args.schedule or args.group_schedule else None
    ref_sched = make(ref_opt) if args.schedule or args.group_schedule else None
    dist = DistributedOptimizer(opt, model, server, mode=args.mode,
                                deterministic=args.mode == "sync",
                                last_step=args.steps, checkpoint_dir=args.checkpoint_dir,
                                save_checkpoint_steps=args.save_steps, log_every=1,
                                clip_norm=args.clip, bucket_bytes=args.bucket_bytes,
                                reset_optimizer_state=args.reset_optimizer_state,
                                run_dir=args.run_dir)
    if args.brk == "to":
        model.to(torch.float64)
    elif args.brk == "load":
        model.load_state_dict(ref.state_dict())
    elif args.brk == "twice":
        DistributedOptimizer(opt, model, server)
    if args.copies:
        model.to("cpu")  # where it is already: nothing moves, and training goes on
    copies = wrapped_copies(model) if args.copies else None
    start, early, clipped = dist.global_step, 0, 0
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
                # DDP's way: every micro-batch but the last inside no_sync()
                quiet = dist.no_sync() if args.no_sync and half.start == 0 else \
                    contextlib.nullcontext()
                with quiet:
                    loss = torch.nn.functional.cross_entropy(model(x[k, half]),
                                                             y[k, half]) / 2
                    loss.backward()
        else:
            out = model(x[k].to(next(model.parameters()).dtype))
            if args.brk == "unused" and s == 3:
                out = out.detach() + model[2].bias  # the first layer gets no gradient
            loss = torch.nn.functional.cross_entropy(out, y[k])
            if s == args.nan_at:
                loss = loss * float("nan")
            loss.backward()
        clip = args.clip_grad_norm if s >= args.clip_from else None
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        bucketed = dist.client.bucketed_push
        if bucketed is not None and bucketed.reply_value is None:  # a step under way
            early += sum(bucketed.next)  # buckets the hooks pushed during backward
        if args.brk == "torch_step" and s == 2:
            opt.step()  # torch's own: refused, naming dist.step
        dist.step(loss)
        time.sleep(args.sleep)
        if sched is not None:
            sched.step()
        clipped += ref_step(ref, ref_opt, ref_sched, s, workers, args.clip or clip)
    dist.close()
    # Per parameter: |mpitf - torch| / |torch| (norms), the worst of them.
    worst = max(float((a.detach() - b.detach()).norm() / b.detach().norm())
                for a, b in zip(model.parameters(), ref.parameters()))
    moved = max(float((a.detach() - b.detach()).abs().max())
                for a, b in zip(ref.parameters(), build(args.model, args.hidden).parameters()))
    say(f"worker {k}: step {dist.global_step} maxrel: {worst:.3g} moved: {moved:.3g} "
        f"lr: {opt.param_groups[0]['lr']:.6g} optimizer: {optimizer}")
    if copies is not None:
        # the copies made after wrapping are plain torch models holding the chief's values
        # at wrapping: training moved neither, and loading into one leaves the wrapped
        # model's check alone (close() has run, so compare on the chief only)
        for copy_ in copies:
            copy_.load_state_dict(copy_.state_dict())
        start = build(args.model, args.hidden).state_dict()
        still = [all(torch.equal(a, b) for a, b in zip(c.state_dict().values(),
                                                       start.values())) for c in copies]
        if k == 0:
            say(f"worker {k}: copies unchanged: {still} outputs: "
                f"{[tuple(c(x[k]).shape) for c in copies]}")
    state = model.state_dict()
    buffers, ref_buffers = untrained(model), untrained(ref)
    if buffers:  # every worker holds the chief's at close; one worker: near torch's own
        rel = max(float((a.double() - b.double()).norm() / b.double().norm())
                  for a, b in zip(buffers, ref_buffers))
        say(f"worker {k}: buffers {digest(buffers)[:16]} bufrel: {rel:.3g}")
    if k == 0:
        say(f"keys: {','.join(state)} digest: {digest(state.values())[:16]}")
        say(f"buckets pushed during backward: {early}")
    if args.clip or args.clip_grad_norm:  # how often the norm bound changed the gradient
        say(f"worker {k}: the reference clipped {clipped} of {dist.global_step - start} steps")
    return dist.exit_code


def wrapped_copies(model):
    """Return a deepcopy (an EMA's) and a torch.save/torch.load round trip of the model."""
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return [copy.deepcopy(model), torch.load(buffer, weights_only=False)]


def ref_step(ref, opt, sched, s, workers, clip):
    """One step of plain torch on the mean gradient; return True when ``clip`` bound it."""
    x, y = batches(s, workers)
    opt.zero_grad()
    loss = sum(torch.nn.functional.cross_entropy(ref(x[w]), y[w]) for w in range(workers))
    (loss / workers).backward()
    norm = None if clip is None else float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip))
    opt.step()
    if sched is not None:
        sched.step()
    return norm is not None and norm > clip


if __name__ == "__main__":
    main()
