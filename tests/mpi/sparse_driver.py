"""Train a small model with embedding tables under mpiexec, for tests/tables/test_sparse.py.

Run: mpiexec -n N python tests/mpi/sparse_driver.py OUT_DIR --num-ps P --mode M ...

Every rank runs this script. A worker trains :class:`TinySparse` (two tables, one dense
layer) on batches that are a function of (worker, step) for ``--steps`` steps; each ps
writes its rows of every table (with their global ids) and counters to
``OUT_DIR/ps<task>.npz`` / ``.json`` after serving; the chief writes the dense parameters
to ``OUT_DIR/params.npz``. The test recomputes the same arithmetic in one process.
"""

import argparse
import dataclasses
import json
import os
import resource
import signal

import numpy as np
from mpi4py import MPI

import mpitf.ps.service as service_module
from mpitf.models.embedding import EmbeddingTable
from mpitf.options import add_flags, values_from_args
from mpitf.ps.kernels import warm_up
from mpitf.ps.optimizers import make_optimizer
from mpitf.runtime.exits import abort_on_error
from mpitf.runtime.server import Server
from mpitf.tables.growth import Growth
from mpitf.worker.session import TrainingSession

ROWS = {"users": 37, "items": 23}
DIM = {"users": 4, "items": 3}
BATCH = 6
LOOKUPS = {"users": 1, "items": 2}  # items: two ids per example (a shared table)
LEARNING_RATES = {"sgd": 0.5, "momentum": 0.1, "adagrad": 0.3, "adam": 0.05, "ftrl": 0.2}


def tables(placement="mod", rows_scale=1, growth=None):
    """Return the model's tables (``growth``: tables that grow, with these options)."""
    if growth is not None:
        return [EmbeddingTable(name, None, DIM[name], lookups=LOOKUPS[name], scale=0.5,
                               dynamic=growth) for name in ROWS]
    return [EmbeddingTable(name, ROWS[name] * rows_scale, DIM[name], lookups=LOOKUPS[name],
                           placement=placement, scale=0.5) for name in ROWS]


RAW = 7919 * 10**9  # --raw-ids: id i becomes i * RAW - 5 * RAW (any int64, some negative)


def batch(worker, step):
    """Return worker ``worker``'s batch at ``step``: ids per table (repeats included)."""
    rng = np.random.default_rng([11, worker, step])
    return {name: rng.integers(0, ROWS[name] // 2 + 3 * worker + 1, (BATCH, LOOKUPS[name]))
            for name in ROWS}


def row_gradient(rows, weights):
    """Return d loss/d row of each occurrence: the gradient of sum((rows * w) ** 2) / 2."""
    return rows * weights * weights


class TinySparse:
    """Dense variable ``w`` (per table, dim) and two tables; loss sum((row * w)^2) / 2."""

    def __init__(self, placement="mod", rows_scale=1, growth=None):
        self._tables = tables(placement, rows_scale, growth)

    def variables(self):
        return [(f"w_{name}", (DIM[name],), "float32") for name in ROWS]

    def init(self, rng):
        return {f"w_{name}": np.linspace(0.5, 1.5, DIM[name]).astype(np.float32)
                for name in ROWS}

    def tables(self):
        return self._tables

    def ids(self, b):
        return b

    def loss_and_grads(self, params, b, grads, lookups):
        loss = 0.0
        for name in ROWS:
            rows, w = lookups[name].rows, params[f"w_{name}"]
            lookups[name].grad[...] = row_gradient(rows, w)
            grads[f"w_{name}"][...] = (rows * rows * w).reshape(-1, DIM[name]).sum(axis=0)
            loss += float(((rows * w) ** 2).sum() / 2)
        return loss


_SERVICES = []


class _RecordingService(service_module.Service):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _SERVICES.append(self)


service_module.Service = _RecordingService


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--num-ps", type=int, default=1)
    parser.add_argument("--mode", default="sync")
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--placement", default="mod")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--staleness", type=int, default=1)
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--save-steps", type=int)
    parser.add_argument("--full-every", type=int, default=1,
                        help="full_checkpoint_every: deltas between full checkpoints")
    parser.add_argument("--kill-at", type=int, help="the chief SIGKILLs itself at this step")
    parser.add_argument("--rows-scale", type=int, default=1, help="a model with other rows")
    parser.add_argument("--ps-memory-mb", type=int,
                        help="a ps may map this many MiB more than it has at start (RLIMIT_AS)")
    parser.add_argument("--bad-ids", choices=("high", "negative", "float"),
                        help="the last worker's batch at step 2 holds a bad id")
    parser.add_argument("--dynamic", action="store_true", help="tables that grow")
    parser.add_argument("--raw-ids", action="store_true", help="ids spread over int64")
    parser.add_argument("--no-negative-ids", action="store_true")
    add_flags(parser, Growth)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    with abort_on_error():
        server = Server({"ps": args.num_ps, "worker": world.Get_size() - args.num_ps},
                        deadline=60)
        if server.job_name == "ps":
            if args.ps_memory_mb:
                # numba's compiler cannot run in the 64 MiB this leaves: compile the kernel
                # first, as a ps does at start-up (ps/kernels.py warm_up), then limit.
                warm_up(make_optimizer(args.optimizer, LEARNING_RATES[args.optimizer]),
                        np.float32)
                with open("/proc/self/statm") as f:
                    now = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
                hard = resource.getrlimit(resource.RLIMIT_AS)[1]
                resource.setrlimit(resource.RLIMIT_AS, (now + (args.ps_memory_mb << 20), hard))
            server.join()
            if args.ps_memory_mb:  # the report below is the test's, not the ps's
                resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
            svc = _SERVICES[-1]
            arrays = {}
            for saved in svc.tables.saved(svc.state.global_step):
                name = saved["spec"].name
                arrays[f"{name}/ids"], arrays[f"{name}/rows"] = saved["ids"], saved["rows"]
                for k, v in saved["slots"].items():
                    arrays[f"{name}/{k}"] = v
                for k, v in saved.get("extra", {}).items():
                    arrays[f"extra:{name}/{k}"] = v
            np.savez(os.path.join(args.out, f"ps{svc.ps_task}.npz"), **arrays)
            with open(os.path.join(args.out, f"ps{svc.ps_task}.json"), "w") as f:
                json.dump(dict(svc.state.counters, tables=svc.tables.stats()), f)
            return
        opt = make_optimizer(args.optimizer, LEARNING_RATES[args.optimizer])
        # sync: train to global step --steps; async, ssp: --steps steps of each worker
        sync = args.mode == "sync"
        options = dict(mode=args.mode, batch_size=BATCH, seed=3,
                       last_step=args.steps if sync else None,
                       checkpoint_dir=args.checkpoint_dir,
                       save_checkpoint_steps=args.save_steps,
                       full_checkpoint_every=args.full_every)
        if args.mode == "sync":
            options["deterministic"] = args.deterministic
        if args.mode == "ssp":
            options["staleness"] = args.staleness
        growth = None
        if args.dynamic:
            growth = dataclasses.replace(Growth(**values_from_args(Growth, args)),
                                         negative_ids=not args.no_negative_ids)
        model = TinySparse(args.placement, args.rows_scale, growth)
        session = TrainingSession(server, model, opt, **options)
        w = server.task_index
        with session:
            while not session.should_stop() and (sync or session.steps_run < args.steps):
                if server.is_chief and session.global_step == args.kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                b = batch(w, session.global_step if sync else session.steps_run)
                if args.raw_ids:
                    b = {k: v * RAW - 5 * RAW for k, v in b.items()}
                if args.bad_ids and w == server.cluster.num_tasks("worker") - 1 \
                        and session.steps_run == 2:
                    b = dict(b, users={"high": b["users"] + ROWS["users"],
                                       "negative": b["users"] - 40,
                                       "float": b["users"] * 1.0}[args.bad_ids])
                session.run(b)
        with open(os.path.join(args.out, f"worker{w}.json"), "w") as f:
            json.dump(dict(bytes_sent=session.embeddings.bytes_sent,
                           bytes_received=session.embeddings.bytes_received,
                           global_step=session.global_step), f)
        if server.is_chief:
            np.savez(os.path.join(args.out, "params.npz"),
                     **{k: np.asarray(v) for k, v in session.params.items()})


if __name__ == "__main__":
    main()
