"""Drive Server and Client directly under mpiexec, for tests/ps/test_ps.py.

Run: mpiexec -n N python tests/mpi/ps_driver.py SCENARIO OUT_DIR [options]

Every rank runs this script. ps ranks serve (``Server.join``) and write their counters and
receive-pool size to ``OUT_DIR/<phase>-ps<task>.json``; worker ranks run the scenario and
write ``OUT_DIR/<phase>-worker<task>.json``; the chief writes final parameters to
``OUT_DIR/<phase>-params.npz``. A scenario may run several phases (one fresh Server and
Client each), so one mpiexec start covers several optimizers or modes.

The model, its initial values and the gradients are functions of (worker, step) defined
here, so the test can recompute the same arithmetic in one process.
"""

import argparse
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import mpitf.ps.service as service_module
from mpitf.config import TrainingConfig
from mpitf.errors import ConfigurationError
from mpitf.placement import min_max_variable_partitioner, replica_device_setter
from mpitf.ps.optimizers import make_optimizer
from mpitf.runtime.exits import abort_on_error
from mpitf.runtime.server import Server
from mpitf.worker.client import Client
from mpitf.worker.node import NodeGroup

# Uneven sizes; with PARTITIONER, "embed" is cut in 3 row blocks and "wide" in 2.
SHAPES = [("embed", (40, 6)), ("bias", (7,)), ("kernel", (5, 3)), ("scalar", ()),
          ("wide", (4, 10)), ("out", (9, 2)), ("tail", (13,))]
PARTITION_BYTES = 64  # min_slice_size, in bytes, of the partitioner the drivers use
LEARNING_RATES = {"sgd": 0.05, "adam": 0.01, "momentum": 0.02, "adagrad": 0.1, "none": 0.0}
ASYNC_LR = 0.5  # a power of two: async sums of power-of-two steps stay exact
GRAD_SCALE = 0.1  # gradient = GRAD_SCALE * params + noise(worker, step)


def variables(dtype=np.float32):
    """Return the model's variables as ``[(name, shape, dtype)]`` in creation order."""
    return [(name, shape, np.dtype(dtype).str) for name, shape in SHAPES]


def partitioner():
    """Return the partitioner every driver uses (small, so several variables get cut)."""
    return min_max_variable_partitioner(3, min_slice_size=PARTITION_BYTES)


def initial_values(dtype=np.float32, seed=1234):
    """Return the starting parameters."""
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(dtype) for name, shape in SHAPES}


def noise(worker, step, dtype=np.float32):
    """Return the pseudo-random part of worker ``worker``'s gradient at step ``step``."""
    rng = np.random.default_rng([7, worker, step])
    return {name: rng.standard_normal(shape).astype(dtype) for name, shape in SHAPES}


def gradient(params, worker, step):
    """Return the gradient a worker pushes: it depends on the pulled parameters."""
    out = {}
    for name, value in noise(worker, step, params[SHAPES[0][0]].dtype).items():
        p = np.asarray(params[name])
        out[name] = p * p.dtype.type(GRAD_SCALE) + value
    return out


def pattern(dtype=np.float64):
    """Return small integers 1..4 per element, so sums of power-of-two steps stay exact."""
    return {name: (np.arange(int(np.prod(shape))) % 4 + 1).astype(dtype).reshape(shape)
            for name, shape in SHAPES}


# -- the ps side -----------------------------------------------------------------------

_SERVICES = []


class _RecordingService(service_module.Service):
    """The real Service, remembered so the ps can report its pool and counters."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _SERVICES.append(self)


service_module.Service = _RecordingService


def run_ps(server, out, phase):
    """Serve one phase, then write this ps's counters and receive-pool size."""
    server.join()
    svc = _SERVICES[-1]
    dump(out, f"{phase}-ps{server.task_index}.json", dict(
        counters=svc.state.counters, pool=len(svc.pool),
        pool_bytes=sum(int(f.bytes.nbytes) for f in svc.pool),
        shard_bytes=int(svc.shard.reply.bytes.nbytes), num_workers=svc.num_workers,
        exit_code=server.exit_code))


def dump(out, name, obj):
    """Write ``obj`` as JSON to ``out/name`` (atomically)."""
    path = os.path.join(out, name)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, default=_jsonable)
    os.replace(path + ".tmp", path)


def _jsonable(value):
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON-able: {value!r}")


# -- worker helpers --------------------------------------------------------------------

def start(server, args, optimizer, mode, values, lr=None, dtype=np.float32, **options):
    """Place the variables, make the client (--aggregate: over the node), configure the ps
    (chief) and pull; then switch to the client-side deadline. Return (client, reply).
    """
    setter = replica_device_setter(server.cluster, ps_strategy=args.strategy,
                                   partitioner=partitioner())
    placement = setter.place(variables(dtype))
    node = NodeGroup(server) if args.aggregate else None
    config = TrainingConfig(mode=mode, skip_nonfinite=args.skip_nonfinite, **options)
    client = Client(server, placement, config, deadline=args.deadline, node=node)
    opt = make_optimizer(optimizer, LEARNING_RATES[optimizer] if lr is None else lr)
    reply = client.start(opt.config(), values)
    if args.client_deadline is not None:
        client.deadline = args.client_deadline
    return client, reply


def write_grads(client, grads):
    """Write a gradient dict into the client's views (the zero-copy way)."""
    for name, value in grads.items():
        client.grads[name][...] = value


def export(client, out, phase):
    """Pull the newest parameters and save them (chief)."""
    client.pull()
    np.savez(os.path.join(out, f"{phase}-params.npz"),
             **{k: np.array(v) for k, v in client.params.items()})


def finish(server, client, out, phase, record):
    """Wait for every worker, let the chief export and read counters, then say done."""
    server.job_comm.Barrier()
    if server.is_chief:
        export(client, out, phase)
        record["counters"] = client.ps_counters()
    dump(out, f"{phase}-worker{server.task_index}.json", record)
    client.done()


# -- scenarios: each runs one phase on a worker ----------------------------------------

def scenario_sync(server, args, phase):
    """Sync replicas for ``--steps`` steps with gradients that depend on the pulled params."""
    optimizer = phase
    client, reply = start(server, args, optimizer, "sync", initial_values(),
                          deterministic=args.deterministic, aggregate_per_node=args.aggregate)
    w, steps = server.task_index, []
    for s in range(args.steps):
        write_grads(client, gradient(client.params, w, s))
        reply = client.push_pull().wait()
        steps.append(reply.global_step)
    finish(server, client, args.out, phase, dict(steps=steps))


def scenario_backup(server, args, phase):
    """Sync with backup workers: the last worker is slow and must not be waited for."""
    client, reply = start(server, args, args.optimizer, "sync", initial_values(),
                          replicas_to_aggregate=args.replicas)
    w = server.task_index
    slow = w == server.cluster.num_tasks("worker") - 1
    pause = args.slow if slow else args.fast
    t0, pushes, step = time.monotonic(), 0, reply.global_step
    while step < args.steps:
        write_grads(client, gradient(client.params, w, step))
        time.sleep(pause)
        step = client.push_pull().wait().global_step
        pushes += 1
    elapsed = time.monotonic() - t0
    finish(server, client, args.out, phase, dict(elapsed=elapsed, pushes=pushes, step=step,
                                                 slow=slow))


def scenario_async_exact(server, args, phase):
    """Async: worker w pushes 2**-w * pattern, 3 + 2w times; sums stay exact."""
    values = {k: np.full(v.shape, 100.0) for k, v in pattern().items()}
    client, _ = start(server, args, "sgd", "async", values, lr=ASYNC_LR, dtype=np.float64)
    w = server.task_index
    grads = {k: v * 2.0 ** -w for k, v in pattern().items()}
    for _ in range(3 + 2 * w):
        write_grads(client, grads)
        client.push_pull().wait()
    finish(server, client, args.out, phase, dict(pushes=3 + 2 * w))


def scenario_staleness(server, args, phase):
    """Async or bounded staleness (phase "ssp1", "ssp2", "async"): worker 1 is slow."""
    mode, staleness = ("async", 0) if phase == "async" else ("ssp", int(phase[3:]))
    client, _ = start(server, args, args.optimizer, mode, initial_values(), staleness=staleness)
    w = server.task_index
    pause = args.slow if w == 1 else 0.0
    lead, t0 = 0, time.monotonic()
    for i in range(1, args.steps + 1):
        write_grads(client, gradient(client.params, w, i))
        time.sleep(pause)
        reply = client.push_pull().wait()
        # With two workers the other's applied pushes are applied - i: its lead is i - that.
        lead = max(lead, i - (reply.applied - i))
    elapsed = time.monotonic() - t0
    finish(server, client, args.out, phase, dict(observed_lead=lead, elapsed=elapsed))


def scenario_badinput(server, args, phase):
    """set_gradients with wrong names, shapes, dtypes: each refused, nothing sent."""
    client, _ = start(server, args, "sgd", "sync", initial_values())
    good = gradient(client.params, server.task_index, 0)
    bad = {
        "name": dict(good, nope=np.zeros(3, np.float32)),
        "shape": dict(good, kernel=np.zeros((3, 5), np.float32)),
        "dtype": dict(good, bias=np.zeros(7, np.float64)),
        "missing": {k: v for k, v in good.items() if k != "tail"},
    }
    errors = {}
    for what, grads in bad.items():
        try:
            client.set_gradients(grads)
        except ConfigurationError as exc:
            errors[what] = str(exc)
    before = client.ps_counters()
    client.set_gradients(good)
    reply = client.push_pull().wait()
    finish(server, client, args.out, phase, dict(errors=errors, before=before,
                                                 step=reply.global_step))


class DriverModel:
    """The driver's model for TrainingSession: gradient() of (worker, step), maybe poisoned.

    A batch is ``(step, poison)``; with ``poison`` the last element of ``nan_variable``'s
    gradient is NaN.
    """

    def __init__(self, worker, nan_variable):
        self.worker, self.nan_variable = worker, nan_variable

    def variables(self):
        """Return the variables in creation order."""
        return variables()

    def init(self, rng):
        """Return the starting parameters (``rng`` is not needed)."""
        return initial_values()

    def loss_and_grads(self, params, batch, grads):
        """Write the gradient into ``grads`` in place; return a dummy loss."""
        step, poison = batch
        for name, value in gradient(params, self.worker, step).items():
            grads[name][...] = value
        if poison:
            grads[self.nan_variable].reshape(-1)[-1] = np.nan
        return 0.0


def scenario_nonfinite(server, args, phase):
    """TrainingSession where one gradient of ``--nan-worker`` has a NaN in ``--nan-variable``.

    It is the gradient of that worker's run number ``--nan-run`` (from 0); in async mode use
    run 0 of the chief, the only run sure to happen whatever the timing.
    """
    from mpitf.worker.session import TrainingSession

    w = server.task_index
    opt = make_optimizer("sgd", LEARNING_RATES["sgd"])
    sess = TrainingSession(server, DriverModel(w, args.nan_variable), opt, args.mode,
                           last_step=args.steps, deterministic=args.deterministic,
                           skip_nonfinite=args.skip_nonfinite, partitioner=partitioner(),
                           ps_strategy=args.strategy, log_every=0)
    runs = 0
    while not sess.should_stop():
        sess.run(batch=(sess.global_step, w == args.nan_worker and runs == args.nan_run))
        runs += 1
    finite = bool(all(np.isfinite(v).all() for v in sess.params.values()))
    record = dict(step=sess.global_step, runs=runs, finite=finite)
    server.job_comm.Barrier()
    if server.is_chief:
        export(sess.client, args.out, phase)
        record["counters"] = sess.client.ps_counters()
    dump(args.out, f"{phase}-worker{w}.json", record)
    sess.close()


def scenario_deadline(server, args, phase):
    """Worker 1 stops sending at step 2 (sleeps ``--slow`` s); the ps must name it."""
    client, _ = start(server, args, "sgd", "sync", initial_values())
    w = server.task_index
    for s in range(args.steps):
        if w == 1 and s == 2:
            print(f"worker 1 goes silent for {args.slow} s", flush=True)
            time.sleep(args.slow)
        write_grads(client, gradient(client.params, w, s))
        client.push_pull().wait()
    finish(server, client, args.out, phase, {})


def scenario_memory(server, args, phase):
    """Optimizer "none" in mode ``phase`` with many workers: the ps pool stays small."""
    client, _ = start(server, args, "none", phase, initial_values(), staleness=2)
    w = server.task_index
    for s in range(args.steps):
        write_grads(client, gradient(client.params, w, s))
        client.push_pull().wait()
    finish(server, client, args.out, phase, {})


SCENARIOS = {"sync": scenario_sync, "backup": scenario_backup,
             "async_exact": scenario_async_exact, "staleness": scenario_staleness,
             "badinput": scenario_badinput, "nonfinite": scenario_nonfinite,
             "deadline": scenario_deadline, "memory": scenario_memory}


def parse(argv=None):
    """Parse the driver's arguments."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scenario", choices=sorted(SCENARIOS))
    p.add_argument("out")
    p.add_argument("--num-ps", type=int, default=1)
    p.add_argument("--phases", default="sgd", help="comma-separated phases")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--mode", default="sync")
    p.add_argument("--strategy", default="round_robin")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--aggregate", action="store_true", help="sync: aggregate per node")
    p.add_argument("--replicas", type=int, default=None)
    p.add_argument("--slow", type=float, default=0.2, help="seconds the slow worker sleeps")
    p.add_argument("--fast", type=float, default=0.0, help="seconds the others sleep")
    p.add_argument("--skip-nonfinite", action="store_true")
    p.add_argument("--nan-variable", default="embed")
    p.add_argument("--nan-worker", type=int, default=1)
    p.add_argument("--nan-run", type=int, default=1)
    p.add_argument("--deadline", type=float, default=30.0)
    p.add_argument("--client-deadline", type=float, default=None,
                   help="worker-side deadline after start (default: --deadline)")
    return p.parse_args(argv)


def main(argv=None):
    """Run every phase of the scenario on this rank."""
    args = parse(argv)
    world = MPI.COMM_WORLD
    num_ps = args.num_ps
    for phase in args.phases.split(","):
        server = Server({"ps": num_ps, "worker": world.Get_size() - num_ps},
                        deadline=args.deadline)
        if server.job_name == "ps":
            run_ps(server, args.out, phase)
        else:
            SCENARIOS[args.scenario](server, args, phase)
    return 0


if __name__ == "__main__":
    with abort_on_error():
        code = main()
    sys.exit(code)
