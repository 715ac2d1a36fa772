"""Stand-in training job for the Slurm tests, following the jobs/ contract without a model.

Each rank counts steps (0.5 s each) up to --steps. The "checkpoint" is a JSON step counter in
--checkpoint-dir (default: $MPITF_CHECKPOINT_DIR, else ./checkpoints), restored at start. On
SIGUSR1 or SIGTERM every rank finishes its step, rank 0 writes the counter, and every rank exits
with 75 (mpitf.runtime.exits.EXIT_REQUEUE). Rank 0 prints `step N, loss = ...` and `final: {json}`.
"""

import argparse
import json
import os
import signal
import sys
import time

from mpi4py import MPI

EXIT_REQUEUE = 75  # mpitf.runtime.exits.EXIT_REQUEUE; not imported so the test runs without mpitf

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--checkpoint-dir",
                    default=os.environ.get("MPITF_CHECKPOINT_DIR", "./checkpoints"))
args = parser.parse_args()
comm = MPI.COMM_WORLD
path = os.path.join(args.checkpoint_dir, "fake_ckpt.json")
restarts = os.environ.get("SLURM_RESTART_COUNT")  # unset on a job's first run
restarts = int(restarts) if restarts else None

stop = []
for sig in (signal.SIGUSR1, signal.SIGTERM):
    signal.signal(sig, lambda signum, frame: stop.append(signal.Signals(signum).name))

step = 0
if comm.rank == 0 and os.path.exists(path):
    with open(path) as f:
        step = json.load(f)["step"]
    print(f"restored from step {step} ({path})", flush=True)
step = comm.bcast(step)

while step < args.steps:
    time.sleep(0.5)
    step += 1
    if comm.rank == 0:
        print(f"step {step}, loss = {1.0 / step:.4f} (size {comm.size})", flush=True)
    # A signal reaches the ranks at slightly different moments: agree on it once per step.
    if comm.allreduce(len(stop), op=MPI.MAX):
        if comm.rank == 0:
            os.makedirs(args.checkpoint_dir, exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump({"step": step}, f)
            os.replace(path + ".tmp", path)
            print(f"checkpoint written at step {step} on {stop or 'a peer signal'}", flush=True)
        comm.Barrier()  # nobody exits before the checkpoint is on disk
        sys.exit(EXIT_REQUEUE)

if comm.rank == 0:
    print("final: " + json.dumps({"step": step, "restart_count": restarts}), flush=True)
