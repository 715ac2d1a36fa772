"""A nanoGPT-style recipe under DDP (gloo) or mpitf.torch: the same loop, its losses printed.

``--under ddp``: every rank is a DDP rank (torch.distributed over gloo, a file store in
``--store``). ``--under mpitf``: ``--num-ps`` ps tasks and the rest workers, through
``mpitf.torch.DistributedOptimizer``. The recipe either way: a 2-layer GPT with tied
embedding and head, AdamW with decay and no-decay groups, a warmup + cosine LambdaLR, two
micro-batches of accumulation (the first inside ``no_sync()``), and
``torch.nn.utils.clip_grad_norm_`` of the parameters before the step, with a bound that
binds. Each rank prints ``rank R step S loss L norm N`` (N: what clip_grad_norm_ returned).
"""

from ps_first import flag, serve_if_ps

UNDER = flag("--under", "mpitf")
SERVER = serve_if_ps() if __name__ == "__main__" and UNDER == "mpitf" else None

import argparse  # noqa: E402 - a ps has served and left before torch is imported
import contextlib  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

VOCAB, BLOCK, EMBD, HEADS, LAYERS = 32, 16, 32, 2, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(EMBD), nn.LayerNorm(EMBD)
        self.qkv, self.proj = nn.Linear(EMBD, 3 * EMBD), nn.Linear(EMBD, EMBD)
        self.fc, self.out = nn.Linear(EMBD, 4 * EMBD), nn.Linear(4 * EMBD, EMBD)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(EMBD, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, EMBD), nn.Embedding(BLOCK, EMBD)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(EMBD)
        self.head = nn.Linear(EMBD, VOCAB, bias=False)
        self.head.weight = self.wte.weight  # tied, as nanoGPT's

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def groups(model):
    """nanoGPT's AdamW groups: weight decay on matrices, none on biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def warmup_cosine(warmup, total):
    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))
    return factor


def batch(step, rank, micro, size=8):
    """Rank ``rank``'s micro-batch ``micro`` of ``step``: a noisy counting sequence."""
    rng = np.random.default_rng([step, rank, micro])
    start = rng.integers(0, VOCAB, size=(size, 1))
    seq = (start + np.arange(BLOCK + 1)) % VOCAB
    noise = rng.random(seq.shape) < 0.1
    seq = np.where(noise, rng.integers(0, VOCAB, size=seq.shape), seq)
    seq = torch.from_numpy(seq)
    return seq[:, :-1], seq[:, 1:]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--under", choices=["ddp", "mpitf"], default="mpitf")
    p.add_argument("--num-ps", type=int, default=1)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--max-norm", type=float, default=0.5)
    p.add_argument("--bucket-bytes", type=int, default=None, help="default: the session's")
    p.add_argument("--store", default=None, help="ddp: the file of gloo's store")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT()
    opt = torch.optim.AdamW(groups(model), lr=3e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(5, args.steps))
    if args.under == "ddp":
        import torch.distributed as dist

        world = MPI.COMM_WORLD
        rank = world.Get_rank()
        dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank,
                                world_size=world.Get_size())
        ddp = nn.parallel.DistributedDataParallel(model)
        quiet, step = ddp.no_sync, opt.step
        forward, should_stop = ddp, None
    else:
        from mpitf.torch import DistributedOptimizer

        rank = SERVER.replica_index
        wrapped = DistributedOptimizer(opt, model, SERVER, lr_scheduler=sched,
                                       last_step=args.steps, log_every=0,
                                       bucket_bytes=args.bucket_bytes)
        quiet, step, forward = wrapped.no_sync, wrapped.step, model
        should_stop = wrapped.should_stop
    for s in range(args.steps):
        if should_stop is not None and should_stop():
            break
        opt.zero_grad(set_to_none=True) if args.under == "ddp" else wrapped.zero_grad()
        total = 0.0
        for micro in range(2):  # DDP's accumulation: the first micro-batch in no_sync()
            x, y = batch(s, rank, micro)
            with quiet() if micro == 0 else contextlib.nullcontext():
                loss = forward(x, y) / 2
                loss.backward()
            total += float(loss.detach())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        step()
        sched.step()
        sys.stdout.write(f"rank {rank} step {s} loss {total:.9g} norm {float(norm):.9g}\n")
        sys.stdout.flush()
    if args.under == "ddp":
        # DDP's reducer goes before its process group: freed after it, with main's frame,
        # it hung in gloo about one exit in ten
        del forward, quiet, ddp
        dist.destroy_process_group()
    else:
        sys.exit(wrapped.close())


if __name__ == "__main__":
    main()
