"""1 ps + 2 workers through mpitf against torch DDP (gloo) on the same 2 workers.

Run: mpiexec -n 3 python benchmarks/frameworks.py --vs-ddp --json ddp.json [--quick]

The model is a small GPT-style language model as users write one: tied input and output
embeddings, pre-norm transformer blocks, AdamW with one param group, and
``clip_grad_norm_`` before each step. Both sides train it from the same seed with the same
global batch (each worker its own half) and one torch thread per worker rank:

* ``ddp_ms``: ``DistributedDataParallel`` over gloo on the two worker ranks (the ps rank
  sleeps meanwhile, in a 1 ms poll, as an idle process on the same cores);
* ``mpitf_ms``: ``mpitf.torch.DistributedOptimizer``, sync, the AdamW update on the ps.
  Here the gradient is clipped on each worker before the push (DDP clips the average):
  the same work, a different rule;
* ``ratio = mpitf / ddp``, target <= 1.05;
* ``ps_busy``: the ps's CPU seconds over wall seconds while the workers train through it,
  and ``ps_idle`` / ``worker_wait_idle`` while nothing comes for ``--idle`` seconds (one
  worker sleeps before its push: the ps waits for that push, the other worker for its
  reply); target ``ps_idle`` <= 0.05. CPU time is read from ``/proc/PID/schedstat``
  (``stat`` where schedstat is off) of the ranks on this node.

Each figure is the median over ``--repeats`` repetitions, which run DDP and mpitf in
turn; a step time is the slower worker's median over ``--steps`` steps after warm-up.
"""

import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mpitf.ps.service import serve
from mpitf.torch import DistributedOptimizer

WARMUP = 3


class Block(torch.nn.Module):
    """A pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.fc, self.out = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(torch.nn.Module):
    """Token and position embeddings, pre-norm blocks, a final norm, the tied output layer."""

    def __init__(self, vocab, dim, layers, heads, context):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, dim), torch.nn.Embedding(context, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def lm_shape(quick):
    """Return (vocab, dim, layers, heads, context, batch per worker)."""
    return (128, 32, 1, 2, 16, 4) if quick else (512, 128, 2, 4, 64, 4)


def build(quick):
    """Return the model, built from one seed on every rank and side."""
    vocab, dim, layers, heads, context, _ = lm_shape(quick)
    torch.manual_seed(0)
    return TinyGPT(vocab, dim, layers, heads, context)


def batch(quick, worker):
    """Return this worker's tokens and targets (its half of the global batch)."""
    vocab, _, _, _, context, per_worker = lm_shape(quick)
    g = torch.Generator().manual_seed(100 + worker)
    tokens = torch.randint(0, vocab, (per_worker, context + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def cpu_seconds(pid):
    """Return the CPU seconds process ``pid`` has used (all its threads)."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _timed_steps(step, steps):
    for _ in range(WARMUP):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def ddp_phase(args, group, worker):
    """Return this worker's median ms of a DDP step."""
    model = torch.nn.parallel.DistributedDataParallel(build(args.quick), process_group=group)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    x, y = batch(args.quick, worker)

    def step():
        opt.zero_grad()
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return _timed_steps(step, args.steps)


def mpitf_phase(args, server, worker, pids, comm):
    """Return this worker's median ms of an mpitf step, and the CPU shares it measured."""
    model = build(args.quick)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    d = DistributedOptimizer(opt, model, server, mode="sync", log_every=0)
    x, y = batch(args.quick, worker)

    def step():
        d.zero_grad()
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        d.step()

    try:
        for _ in range(WARMUP):
            step()
        comm.Barrier()
        cpu0, t0 = cpu_seconds(pids["ps"]), time.monotonic()
        ms = _timed_steps(step, args.steps)
        busy = (cpu_seconds(pids["ps"]) - cpu0) / (time.monotonic() - t0)
        comm.Barrier()
        shares = dict(ps_busy=busy)
        if worker == 1:  # sleep before the push: the ps and worker 0 wait for it
            time.sleep(0.2)  # worker 0 is inside its wait by now
            before = {k: cpu_seconds(pids[k]) for k in ("ps", "worker0")}
            t0 = time.monotonic()
            time.sleep(args.idle)
            wall = time.monotonic() - t0
            shares.update(ps_idle=(cpu_seconds(pids["ps"]) - before["ps"]) / wall,
                          worker_wait_idle=(cpu_seconds(pids["worker0"]) -
                                            before["worker0"]) / wall)
        step()
        return ms, shares
    finally:
        d.close()


def run(args, server, raw, idle):
    """Run on 3 ranks (1 ps, 2 workers); worker 0 returns the results, the others None.

    ``idle(comm)`` meets the other ranks on ``comm`` without spinning (frameworks.py's).
    """
    ps = server.job_name == "ps"
    pids = raw.allgather((server.job_name, server.task_index, server.host_of(server.rank),
                          os.getpid()))
    if len({h for _, _, h, _ in pids}) != 1:
        raise SystemExit("frameworks --vs-ddp: run the 3 ranks on one node (CPU shares are "
                         "read from /proc)")
    pids = {("ps" if j == "ps" else f"worker{i}"): pid for j, i, _, pid in pids}
    workers = raw.Split(0 if ps else 1, raw.Get_rank())
    group, worker = None, None
    if not ps:
        worker = server.task_index
        store = workers.bcast(tempfile.mkdtemp(prefix="mpitf-ddp-") if worker == 0 else None)
        path = os.path.join(store, "store")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", store=dist.FileStore(path, 2), rank=worker,
                                world_size=2)
        group = dist.group.WORLD
    reps = []
    for _ in range(args.repeats):
        if ps:
            idle(raw)  # DDP on the workers
            serve(server)
            continue
        row = dict(ddp_ms=ddp_phase(args, group, worker))
        idle(raw)
        row["mpitf_ms"], shares = mpitf_phase(args, server, worker, pids, workers)
        rows = workers.allgather(row)  # a sync step waits for the slower worker
        row = {k: max(r[k] for r in rows) for k in row}
        row.update(workers.bcast(shares, root=1))
        row["ratio"] = row["mpitf_ms"] / row["ddp_ms"]
        reps.append(row)
    if ps:
        return None
    dist.destroy_process_group()
    workers.Barrier()
    if worker != 0:
        return None
    shutil.rmtree(store, ignore_errors=True)
    out = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
    model = build(args.quick)
    vocab, dim, layers, heads, context, per_worker = lm_shape(args.quick)
    out.update(ratios=[r["ratio"] for r in reps], parameters=sum(p.numel() for p in
                                                                 model.parameters()),
               vocab=vocab, dim=dim, layers=layers, heads=heads, context=context,
               global_batch=2 * per_worker, idle_seconds=args.idle)
    print(f"frameworks vs DDP: LM of {out['parameters']:,} parameters, global batch "
          f"{2 * per_worker} x {context}: mpitf {out['mpitf_ms']:.2f} ms, DDP "
          f"{out['ddp_ms']:.2f} ms; ratio {out['ratio']:.3f} (target <= 1.05); ps CPU "
          f"{100 * out['ps_busy']:.1f} % of a core training, {100 * out['ps_idle']:.1f} % "
          f"idle (target <= 5 %); a waiting worker {100 * out['worker_wait_idle']:.1f} %",
          flush=True)
    return out
