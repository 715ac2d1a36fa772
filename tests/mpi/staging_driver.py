"""Train a few sync steps with every rank on a given backend; the chief saves the params.

Run: mpiexec -n 4 python tests/mpi/staging_driver.py BACKEND OUT.npz [CHUNK_BYTES [BUCKET_BYTES]]
BACKEND is numpy, fake-aware (fake device arrays handed to MPI as they are),
fake-staged (fake device arrays staged through host buffers in chunks), or gpu (CuPy on
a real GPU per local rank, CUDA-aware or staged as the MPI library allows).
"""

import json
import sys

import numpy as np
from mpi4py import MPI

from mpitf.config import TrainingConfig
from mpitf.placement import min_max_variable_partitioner, replica_device_setter
from mpitf.runtime.backend import numpy_backend, select_backend, set_backend
from mpitf.runtime.exits import abort_on_error
from mpitf.runtime.server import Server
from mpitf.testing.fake_gpu import fake_gpu_backend
from mpitf.worker.client import Client

VARIABLES = [("dense/weights", (300, 4), "f4"), ("dense/biases", (4,), "f4"),
             ("out/weights", (37, 3), "f4")]


def main():
    kind, out = sys.argv[1], sys.argv[2]
    chunk = int(sys.argv[3]) if len(sys.argv) > 3 else 1024
    buckets = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    if kind == "gpu":
        from mpitf.cluster.device import local_rank

        be = select_backend("gpu", local_rank(MPI.COMM_WORLD)[0])
    else:
        be = numpy_backend() if kind == "numpy" else fake_gpu_backend(kind == "fake-aware")
    set_backend(be)
    server = Server({"ps": 2, "worker": 2}, deadline=30)
    if server.job_name == "ps":
        server.join()
        return
    part = min_max_variable_partitioner(2, min_slice_size=1024)
    placement = replica_device_setter(server.cluster, partitioner=part).place(VARIABLES)
    client = Client(server, placement, TrainingConfig(deterministic=True, bucket_bytes=buckets),
                    be, deadline=30, chunk_bytes=chunk)
    rng = np.random.default_rng(0)
    init = {n: rng.standard_normal(s).astype(t) for n, s, t in VARIABLES}
    client.start({"name": "momentum", "learning_rate": 0.05}, init)
    steps = []
    for step in range(5):
        for name, grad in client.grads.items():
            # A gradient that depends on the pulled parameters, so the pull is checked too.
            params = be.to_host(client.params[name])
            noise = np.random.default_rng((server.task_index, step)).standard_normal(
                params.shape).astype(np.float32)
            be.to_device(np.asarray(0.1 * params + noise, np.float32), out=grad)
        steps.append(client.push_pull().wait().global_step)
    client.done()
    if server.is_chief:
        np.savez(out, **{k: be.to_host(v) for k, v in client.params.items()})
        sys.stdout.write("steps " + json.dumps(steps) + "\n")
        sys.stdout.write(f"buckets {json.dumps([len(b) for b in client.buckets])}\n")
        if kind.startswith("fake"):
            events = be.events
            sys.stdout.write(f"events {json.dumps(sorted(set(events)))} "
                             f"synchronize_calls {be.synchronize_calls}\n")


if __name__ == "__main__":
    with abort_on_error():
        main()
