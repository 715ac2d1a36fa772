"""Overlap of communication with backward: one bucket against several, on one model.

Run: mpiexec -n 2 python benchmarks/overlap.py --layers L --width H --json FILE
     (or python -m mpitf.bench.overlap ...); 1 ps + 1 worker, async SGD.

The model is L dense H x H layers (float32, tanh); backward runs layer by layer from the
last and, with buckets, hands each layer's gradient to ``BucketedPush.final`` as soon as it
is computed, so that bucket travels and is applied on the ps while the layers below are
still computing. The batch is chosen so that backward takes about as long as the
one-bucket round trip (push, apply, pull) measured first: backward is timed at two
batches (its weight gradients cost the same at any batch), and where its fixed part alone
outlasts the round trip the batch is the smallest, 8, and the output says so. Measured on
the worker, medians over ``--steps`` steps after warm-up:

* compute_ms: forward + backward alone (no communication);
* comm_ms: the push+pull round trip alone (one bucket, nothing computing);
* step_ms per bucket count: a whole step (forward, backward with the pushes, the wait;
  with buckets the forward waits for each layer's bucket as it comes, ``wait_params``);
* exposed_ms = step_ms - compute_ms; hidden = 1 - exposed_ms / comm_ms (the fraction of
  communication that overlapped compute);
* ratio: step_ms with buckets / step_ms with one bucket (target <= 0.75).

Set OPENBLAS_NUM_THREADS (or OMP_NUM_THREADS) to 1 so that the worker's matrix products
and the ps's apply do not fight over the cores. Rank 0 writes the JSON.
"""

import argparse

import numpy as np
from mpi4py import MPI

from mpitf.config import TrainingConfig
from mpitf.placement import replica_device_setter
from mpitf.ps.service import serve
from mpitf.runtime.exits import run_job
from mpitf.runtime.server import Server
from mpitf.worker.client import Client

from .scaling import write_json
from .timing import median_ms

LR = 1e-6
MIN_BATCH = 8  # where backward's fixed part alone outlasts the round trip


def parse_args(argv=None):
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=1024, help="units per layer (H)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per figure")
    p.add_argument("--batch", type=int, default=None,
                   help="examples per step (default: backward ~ the round trip)")
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true", help="a small model and a few steps")
    return p.parse_args(argv)


class Layers:
    """L dense tanh layers; backward writes each weight gradient as soon as it has it."""

    def __init__(self, layers, width):
        self.names = [f"layer{i}/weights" for i in range(layers)]
        self.width = width

    def variables(self):
        return [(n, (self.width, self.width), "float32") for n in self.names]

    def init(self, rng):
        scale = 1.0 / np.sqrt(self.width)
        return {n: (rng.standard_normal((self.width, self.width)) * scale).astype(np.float32)
                for n in self.names}

    def buffers(self, batch):
        """Allocate the activations and deltas once (nothing per step)."""
        shape = (batch, self.width)
        self.acts = [np.zeros(shape, np.float32) for _ in range(len(self.names) + 1)]
        self.delta = np.zeros(shape, np.float32)
        self.tmp = np.zeros(shape, np.float32)
        self.acts[0][...] = np.random.default_rng(1).standard_normal(shape)

    def forward(self, params, wait=None):
        """Forward; ``wait(name)`` first waits for that layer's parameters (its bucket)."""
        for i, name in enumerate(self.names):
            if wait is not None:
                wait(name)
            np.matmul(self.acts[i], params[name], out=self.acts[i + 1])
            np.tanh(self.acts[i + 1], out=self.acts[i + 1])

    def backward(self, params, grads, final=None):
        """Backward from the last layer; ``final([name])`` after each weight gradient."""
        np.copyto(self.delta, self.acts[-1])  # d(sum(a^2)/2)
        for i in reversed(range(len(self.names))):
            a = self.acts[i + 1]
            np.multiply(a, a, out=self.tmp)
            np.subtract(1.0, self.tmp, out=self.tmp)
            np.multiply(self.delta, self.tmp, out=self.tmp)  # through tanh
            np.matmul(self.acts[i].T, self.tmp, out=grads[self.names[i]])
            if final is not None:
                final((self.names[i],))
            if i:
                np.matmul(self.tmp, params[self.names[i]].T, out=self.delta)


def _session(server, model, bucket_bytes, init):
    placement = replica_device_setter(server.cluster).place(model.variables())
    client = Client(server, placement, TrainingConfig(mode="async", bucket_bytes=bucket_bytes),
                    deadline=300)
    client.start({"name": "sgd", "learning_rate": LR}, init)
    return client


def worker(server, args):
    """Measure on the worker; return the row of figures."""
    model = Layers(args.layers, args.width)
    init = model.init(np.random.default_rng(0))
    layer_bytes = args.width * args.width * 4
    row = dict(layers=args.layers, width=args.width, layer_bytes=layer_bytes,
               model_bytes=layer_bytes * args.layers)
    # 1. one bucket: the round trip alone, then the batch that makes backward ~ that long
    client = _session(server, model, 0, init)
    row["comm_ms"] = median_ms(lambda: client.push_pull().wait(), args.steps)
    batch = args.batch
    if batch is None:  # backward = fixed + per example x batch, from two batches
        times = {}
        for b in (16, 64):
            model.buffers(b)
            times[b] = median_ms(lambda: model.backward(client.params, client.grads), 5)
        per_example = max(1e-6, (times[64] - times[16]) / 48)
        row["backward_fixed_ms"] = fixed = max(0.0, times[16] - 16 * per_example)
        batch = int(min(8192, max(MIN_BATCH, (row["comm_ms"] - fixed) / per_example)))
    row["batch"] = batch
    model.buffers(batch)
    row["backward_ms"] = median_ms(lambda: model.backward(client.params, client.grads),
                                    args.steps)

    def compute():
        model.forward(client.params)
        model.backward(client.params, client.grads)

    row["compute_ms"] = median_ms(compute, args.steps)

    def one_bucket():
        model.forward(client.params)
        model.backward(client.params, client.grads)
        client.push_pull().wait()

    steps = {1: median_ms(one_bucket, args.steps)}
    client.done()
    # 2. one bucket per layer: each pushed as soon as backward has it
    client = _session(server, model, layer_bytes, init)

    pending = []

    def buckets():
        # the forward takes each layer's parameters as its bucket lands, then the Reply
        handle = pending.pop() if pending else None
        model.forward(client.params, handle and handle.wait_params)
        if handle is not None:
            handle.wait()
        handle = client.start_push()
        model.backward(client.params, client.grads, handle.final)
        pending.append(handle)

    steps[len(client.buckets[0])] = median_ms(buckets, args.steps)
    pending.pop().wait()
    client.done()
    row["step_ms"] = steps
    row["exposed_ms"] = {k: max(0.0, v - row["compute_ms"]) for k, v in steps.items()}
    row["hidden"] = {k: 1.0 - min(1.0, e / row["comm_ms"])
                     for k, e in row["exposed_ms"].items()}
    many = max(steps)
    row["buckets"] = many
    row["ratio"] = steps[many] / steps[1]
    return row


def main(argv=None):
    """Run on every rank (1 ps, 1 worker); the worker prints and writes the JSON."""
    args = parse_args(argv)
    if args.quick:
        args.layers, args.width, args.steps = 4, 256, 5
    server = Server({"ps": 1, "worker": MPI.COMM_WORLD.Get_size() - 1}, deadline=300)
    if server.job_name == "ps":
        serve(server)  # one bucket
        serve(server)  # buckets
        return 0
    row = worker(server, args)
    row["load_average"] = list(__import__("os").getloadavg())
    print(f"overlap: {args.layers} x {args.width}x{args.width} float32 layers "
          f"({row['model_bytes'] >> 20} MiB), batch {row['batch']}: compute "
          f"{row['compute_ms']:.2f} ms, round trip {row['comm_ms']:.2f} ms", flush=True)
    for k, v in row["step_ms"].items():
        print(f"  {k} bucket(s): step {v:.2f} ms, exposed {row['exposed_ms'][k]:.2f} ms, "
              f"hidden {100 * row['hidden'][k]:.0f} %", flush=True)
    if "backward_fixed_ms" in row and row["backward_ms"] > 1.5 * row["comm_ms"]:
        print(f"  note: backward takes {row['backward_ms']:.2f} ms at batch {row['batch']}, "
              f"more than the round trip; its part independent of the batch is "
              f"{row['backward_fixed_ms']:.2f} ms", flush=True)
    print(f"  ratio {row['ratio']:.3f} (target <= 0.75)", flush=True)
    write_json(args.json, row)
    return 0


def run():
    """Run from the command line (``python -m mpitf.bench.overlap``, benchmarks/)."""
    run_job(main)


if __name__ == "__main__":
    run()
