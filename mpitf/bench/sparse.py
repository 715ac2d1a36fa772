"""Sparse step against raw MPI and against the dense push+pull of the whole table.

Run: mpiexec -n P+1 python benchmarks/sparse.py --rows R --dim D --batch B --fields F
     --zipf A --num-ps P --json FILE     (or python -m mpitf.bench.sparse ...)

One table of R x D float32 on P ps tasks (rows i mod P); batches of B x F ids drawn
Zipf(A) with a fixed seed (``(zipf - 1) % R``). Measured in one run, on the worker:

* step_us: ``TrainingSession.run``: deduplication, routing, the sparse pull, the
  gradient of the pulled rows (the rows themselves: d(sum(r^2)/2), written per pulled row
  into ``Lookup.unique_grad``), the sparse push and the ps's SGD apply (answered with the
  one-float dense push the step carries). Median over ``--steps`` steps after warm-up.
* step_occurrences_us: the same step with the model reading each occurrence's row and
  writing each occurrence's gradient (``Lookup.rows``/``.grad``: B x F rows gathered,
  then summed per id), as a model whose layers take one row per id looked up does.
* dedup_us: :class:`mpitf.tables.rows.Dedup` of one batch's B x F ids (the worker's, compiled).
* raw_us: a raw MPI exchange of the same bytes with every ps, in the same two round
  trips (pull request -> rows; push + dense push -> dense reply).
* dense_us: ``Client.push_pull`` of the whole table as one dense variable (SGD).
* gather_scatter_us: numpy's gather of the step's unique rows and SGD scatter into a
  table of R x D (on ps task 0; ``np.take``/``np.put`` of whole rows, the fastest numpy
  way measured), the memory work a step cannot avoid. The table is numpy's own
  allocation (``np.zeros``: 16 bytes past a cache line, as every earlier run);
  gather_scatter_aligned_us is the same on a table that starts on a cache line, as the
  ps's tables do (:func:`mpitf.tables.rows.cache_aligned`).
* segment_sum_us: summing B x F row gradients per unique id, with ``np.add.at`` and with
  :func:`mpitf.tables.rows.segment_sum` (compiled, the one used; the same bits as a
  ``np.bincount`` per column).

With ``--dynamic`` the table grows (``rows=None``, every id admitted; the same ids): the
step and dedup figures are a dynamic table's, after every batch has been seen once (its
rows made); ``rows_held`` and ``ps_bytes_per_row`` (the ps's storage, map included, per
row held) come from the ps's report, and the dense figure is left out (no table to push).

``bytes_per_step`` counts both directions (headers included); rank 0 writes the JSON.
Each time is the median over its repetitions; ``*_min_us`` (step, raw, dense) are the
fastest repetition, the figure least moved by other processes on a shared machine.
"""

import argparse

import numpy as np
from mpi4py import MPI

from mpitf.config import TrainingConfig
from mpitf.models.embedding import EmbeddingTable
from mpitf.placement import Placement
from mpitf.ps.optimizers import make_optimizer
from mpitf.ps.service import serve
from mpitf.runtime.exits import run_job
from mpitf.runtime.server import Server
from mpitf.tables.rows import Dedup, cache_aligned, row_view, segment_sum
from mpitf.worker.client import Client
from mpitf.worker.session import TrainingSession

from .scaling import write_json
from .timing import WARMUP, median_us, timed

LR = 1e-4
BATCHES = 8  # distinct batches, drawn once and cycled


def table_parser(description, rows=1_000_000, batch=4096, steps=30):
    """Return a parser with the table benchmarks' shared flags (tables, batch, steps, JSON)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--rows", type=int, default=rows, help="rows of each table")
    p.add_argument("--dim", type=int, default=16, help="each row's width")
    p.add_argument("--batch", type=int, default=batch, help="examples per step")
    p.add_argument("--fields", type=int, default=26, help="ids per example, one per field")
    p.add_argument("--zipf", type=float, default=1.2, help="the ids' Zipf exponent")
    p.add_argument("--steps", type=int, default=steps, help="timed steps per figure")
    p.add_argument("--json", default=None, help="write the results here (rank 0)")
    return p


def add_model_arguments(parser, quick_help):
    """Add the flags of the benchmarks that train a torch model: rate, repeats, --quick."""
    parser.add_argument("--lr", type=float, default=0.01, help="learning rate")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions (median taken)")
    parser.add_argument("--quick", action="store_true", help=quick_help)


def parse_args(argv=None):
    """Parse the command line (the flag names are the issue's)."""
    p = table_parser(__doc__.splitlines()[0])
    p.add_argument("--num-ps", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dynamic", action="store_true",
                   help="a table that grows (any int64 id) in place of R fixed rows")
    return p.parse_args(argv)


class TableModel:
    """One table looked up ``fields`` times per example, and one dense float."""

    def __init__(self, rows, dim, fields):
        self.table = EmbeddingTable("table", rows, dim, lookups=fields)  # rows None: grows
        self.per_occurrence = False

    def variables(self):
        return [("bias", (1,), "float32")]

    def init(self, rng):
        return {"bias": np.zeros(1, np.float32)}

    def tables(self):
        return [self.table]

    def ids(self, batch):
        return {"table": batch}

    def loss_and_grads(self, params, batch, grads, lookups):
        lookup = lookups["table"]
        if self.per_occurrence:
            lookup.grad[...] = lookup.rows  # d(sum(rows^2)/2), per id looked up
        else:
            lookup.unique_grad[...] = lookup.unique_rows  # the same, per pulled row
        grads["bias"][...] = 0
        return 0.0


def _segment_sums(values, inverse, n):
    out = np.zeros((n, values.shape[1]), values.dtype)

    def add_at():
        out[...] = 0
        np.add.at(out, inverse, values)

    scratch = np.empty(out.size)

    def bincount():
        segment_sum(values, inverse, out, scratch)

    return {"add_at": median_us(timed(add_at, 10)),
            "segment_sum": median_us(timed(bincount, 10))}


def main(argv=None):
    """Run every phase on every rank; rank 0 prints and writes the JSON."""
    args = parse_args(argv)
    world = MPI.COMM_WORLD
    server = Server({"ps": args.num_ps, "worker": world.Get_size() - args.num_ps},
                    deadline=300)
    raw = world.Dup()
    ps_ranks = server.ranks_of("ps")
    is_ps = server.job_name == "ps"
    rng = np.random.default_rng(args.seed)
    batches = [(rng.zipf(args.zipf, (args.batch, args.fields)) - 1) % args.rows
               for _ in range(BATCHES)]
    row = {}
    # -- the sparse step -------------------------------------------------------------
    if is_ps:
        serve(server)
    else:
        model = TableModel(None if args.dynamic else args.rows, args.dim, args.fields)
        session = TrainingSession(server, model, make_optimizer("sgd", LR), mode="sync",
                                  batch_size=args.batch, log_every=0)
        emb = session.embeddings
        k = iter(range(10**9))
        for b in batches[:BATCHES if args.dynamic else 1]:  # a dynamic table: rows made
            session.run(b)
        b0, r0 = emb.bytes_sent, emb.bytes_received
        times = timed(lambda: session.run(batches[next(k) % BATCHES]), args.steps)
        steps = WARMUP + args.steps
        dense_bytes = 2 * (64 + 4) * len(ps_ranks)
        row["step_us"], row["step_min_us"] = median_us(times), min(times) * 1e6
        row["bytes_per_step"] = (emb.bytes_sent - b0 + emb.bytes_received - r0) / steps \
            + dense_bytes
        model.per_occurrence = True
        row["step_occurrences_us"] = median_us(
            timed(lambda: session.run(batches[next(k) % BATCHES]), args.steps))
        uniques = [len(np.unique(b)) for b in batches]
        row["unique_ids"] = float(np.mean(uniques))
        table = emb.tables[0]
        n = table.offsets[-1]
        dedup, flat = Dedup(batches[0].size), batches[0].reshape(-1)
        if args.dynamic:  # grouped by a hash owner, any int64
            def dedup_once():
                dedup.group(flat, args.num_ps)
                dedup.finish()
        else:
            def dedup_once():
                dedup(flat, args.rows)
        row["dedup_us"] = median_us(timed(dedup_once, args.steps))
        if args.dynamic:
            stats = [c["tables"]["table"] for c in session.client.ps_counters()]
            row["rows_held"] = sum(s["rows"] for s in stats)
            row["ps_bytes_per_row"] = sum(s["bytes"] for s in stats) / row["rows_held"]
        row["segment_sum_us"] = _segment_sums(table.occ_grads[:len(table.inverse)],
                                              table.inverse, n)
        # per ps, the sizes of the last step's messages, for the raw exchange
        lay = emb.layout
        sizes = [(lay.ids_end(c), lay.reply_end(c), lay.end(c) + 64 + 4, 64 + 4)
                 for c in emb.counts]
        session.close()
    # -- raw MPI exchange of the same bytes --------------------------------------------
    sizes = raw.bcast(sizes if server.is_chief else None, root=server.ranks_of("worker")[0])
    worker = server.ranks_of("worker")[0]
    if is_ps:
        a, b, c, d = sizes[server.task_index]
        bufs = [np.zeros(x, np.uint8) for x in (a, b, c, d)]
        for _ in range(WARMUP + args.steps):
            raw.Recv([bufs[0], MPI.BYTE], worker, 1)
            raw.Send([bufs[1], MPI.BYTE], worker, 2)
            raw.Recv([bufs[2], MPI.BYTE], worker, 3)
            raw.Send([bufs[3], MPI.BYTE], worker, 4)
    elif server.is_chief:
        bufs = [[np.zeros(x, np.uint8) for x in s] for s in sizes]

        def exchange():
            for send_tag, recv_tag, i in ((1, 2, 0), (3, 4, 2)):
                reqs = [raw.Irecv([bb[i + 1], MPI.BYTE], r, recv_tag)
                        for bb, r in zip(bufs, ps_ranks)]
                reqs += [raw.Isend([bb[i], MPI.BYTE], r, send_tag)
                         for bb, r in zip(bufs, ps_ranks)]
                MPI.Request.Waitall(reqs)

        times = timed(exchange, args.steps)
        row["raw_us"], row["raw_min_us"] = median_us(times), min(times) * 1e6
    # -- numpy's gather and scatter of the same rows (ps task 0) -------------------------
    ids = raw.bcast(np.unique(batches[0]) if server.is_chief else None, root=worker)
    if is_ps and server.task_index == 0:
        grad = np.ones((len(ids), args.dim), np.float32)
        rows = np.empty_like(grad)

        def gather_scatter(full):
            np.take(full, ids, axis=0, out=rows)
            np.subtract(rows, LR * grad, out=rows)
            np.put(row_view(full), ids, row_view(rows))

        gs = []
        for aligned in (False, True):  # one table at a time
            shape = (args.rows, args.dim)
            full = cache_aligned(shape, np.float32, 0) if aligned else np.zeros(shape, np.float32)
            gs.append(median_us(timed(lambda t=full: gather_scatter(t), args.steps)))
            del full
        raw.send(gs, dest=worker, tag=5)
    elif server.is_chief:
        row["gather_scatter_us"], row["gather_scatter_aligned_us"] = raw.recv(
            source=ps_ranks[0], tag=5)
    # -- dense push+pull of the whole table ----------------------------------------------
    if args.dynamic:
        pass
    elif is_ps:
        serve(server)
    else:
        n = args.rows * args.dim // len(ps_ranks)
        placement = Placement([(f"w{p}", (n,), "float32") for p in range(len(ps_ranks))],
                              len(ps_ranks))
        client = Client(server, placement, TrainingConfig(mode="sync"), deadline=300)
        client.grads_flat[...] = 0
        client.start(make_optimizer("sgd", LR).config(), initial_values=client.params)
        times = timed(lambda: client.push_pull().wait(), max(3, args.steps // 5))
        row["dense_us"], row["dense_min_us"] = median_us(times), min(times) * 1e6
        client.done()
    if not server.is_chief:
        return 0
    row.update(rows=args.rows, dim=args.dim, batch=args.batch, fields=args.fields,
               zipf=args.zipf, num_ps=args.num_ps, dynamic=args.dynamic)
    row["lookups_per_sec"] = args.batch * args.fields / row["step_us"] * 1e6
    row["bytes_bound"] = 1.1 * row["unique_ids"] * (8 + 2 * args.dim * 4)
    print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                   for k, v in row.items()), flush=True)
    write_json(args.json, {"results": [row]})
    return 0


def run():
    """Run from the command line (``python -m``, benchmarks/); every rank ends on an error."""
    run_job(main)


if __name__ == "__main__":
    run()
