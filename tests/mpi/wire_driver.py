"""Train a small model over a 16-bit wire under mpiexec, phase after phase, for test_wire_dtype.

Run: mpiexec -n N python tests/mpi/wire_driver.py OUT_DIR PHASE [PHASE ...]

One ps (rank 0) and N - 1 workers. A phase is ``wire:optimizer:mode:bucket_bytes`` (mode
"det" is deterministic sync); each starts a fresh Server and Client. The chief writes the
final parameters to ``OUT_DIR/<phase>.npz`` and the ps counters to ``OUT_DIR/<phase>.json``.
The gradients are functions of the pulled parameters, the worker and the step (see
:func:`gradient`), so the test recomputes every phase in one process.
"""

import json
import os
import sys

import numpy as np
from mpi4py import MPI

from mpitf.config import TrainingConfig
from mpitf.placement import replica_device_setter
from mpitf.ps.optimizers import make_optimizer
from mpitf.runtime.exits import abort_on_error
from mpitf.runtime.server import Server
from mpitf.worker.client import Client

SHAPES = [("w1", (24, 8)), ("b1", (8,)), ("w2", (8, 5)), ("b2", (5,))]
STEPS = 6
LEARNING_RATES = {"sgd": 0.1, "momentum": 0.05, "adam": 0.01, "rmsprop": 0.01}


def initial_values():
    rng = np.random.default_rng(5)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES}


def gradient(params, worker, step):
    """Return worker ``worker``'s gradient at ``step``: it depends on the parameters read."""
    rng = np.random.default_rng([11, worker, step])
    return {n: params[n] * np.float32(0.5) + rng.standard_normal(s).astype(np.float32)
            for n, s in SHAPES}


def parse(phase):
    wire, optimizer, mode, buckets = phase.split(":")
    return wire, optimizer, mode, int(buckets)


def config_of(phase):
    wire, _, mode, buckets = parse(phase)
    return TrainingConfig(mode="sync" if mode == "det" else mode, deterministic=mode == "det",
                          bucket_bytes=buckets, wire_dtype=wire)


def optimizer_of(phase):
    name = parse(phase)[1]
    return make_optimizer(name, LEARNING_RATES[name])


def run_worker(server, out, phase):
    config = config_of(phase)
    placement = replica_device_setter(server.cluster).place(
        [(n, s, np.dtype(np.float32).str) for n, s in SHAPES])
    client = Client(server, placement, config, deadline=60)
    client.start(optimizer_of(phase).config(), initial_values())
    w = server.replica_index
    for step in range(STEPS):
        for name, g in gradient(client.params, w, step).items():
            client.grads[name][...] = g
        client.push_pull().wait()
    server.job_comm.Barrier()
    if server.is_chief:
        client.pull()
        np.savez(os.path.join(out, f"{phase}.npz"),
                 **{k: np.array(v) for k, v in client.params.items()})
        counters = client.ps_counters()
        with open(os.path.join(out, f"{phase}.json"), "w") as f:
            json.dump(dict(counters=counters, wire=str(client.param_frames[0].bytes.nbytes),
                           dtype=str(client.params_flat.dtype)), f)
    client.done()


def main():
    out, phases = sys.argv[1], sys.argv[2:]
    world = MPI.COMM_WORLD
    for phase in phases:
        server = Server({"ps": 1, "worker": world.Get_size() - 1}, deadline=60)
        if server.job_name == "ps":
            server.join()
        else:
            run_worker(server, out, phase)
    return 0


if __name__ == "__main__":
    with abort_on_error():
        code = main()
    sys.exit(code)
