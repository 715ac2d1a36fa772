"""Training throughput of the reference MLP and CNN over worker and ps counts.

Run: python -m mpitf.bench.scaling --json OUT.json [--quick] [--launcher "mpiexec"]
(or python benchmarks/scaling.py ... in a checkout)

Each point is one run of the built-in job ``mpitf.jobs.mnist_mlp`` under the launcher
(``mpiexec -n W+P``, or ``srun -n W+P`` inside a Slurm allocation); its examples/s is the
job's steady rate (mpitf/bench/jobrate.py: warm-up, start-up and evaluation left out).
Weak scaling
keeps the per-worker batch; strong scaling splits a fixed global batch over the workers.
Efficiency is ``examples/sec(W) / (W * examples/sec(1))`` at the same ps count.
Each point is the best of ``--repeats`` runs (another process can only slow a run).
"""

import argparse
import datetime
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time

from .jobrate import LOG_EVERY, job_env, measure

JOB = ["-m", "mpitf.jobs.mnist_mlp"]  # run by the launched Python, from the package


def default_launcher():
    """Return the launcher argv: srun inside Slurm when available, else the venv's mpiexec."""
    import shutil

    if os.environ.get("SLURM_JOB_ID") and shutil.which("srun"):
        return ["srun"]
    from mpitf.runtime.launch import find_mpiexec

    return [find_mpiexec()]


def run_job(ranks, job_args, launcher=None, timeout=300):
    """Run the training job on ``ranks`` ranks; return its ``final:`` dict (raises on failure)."""
    cmd = [*(launcher or default_launcher()), "-n", str(ranks), sys.executable, *JOB,
           *map(str, job_args)]
    env = job_env(ranks)
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL)
    wall = time.monotonic() - started
    for line in proc.stdout.splitlines():
        if line.startswith("final: "):
            final = json.loads(line[len("final: "):])
            final["wall_s"] = wall
            return final
    raise RuntimeError(f"{shlex.join(cmd)} exited {proc.returncode} without a final line:\n"
                       f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


def model_bytes(model):
    """Return the parameter bytes of a reference model on the digits set."""
    import numpy as np

    from mpitf.models import build_model

    shape = {"mlp": None, "cnn": (8, 8, 1)}[model]
    m = build_model(model, 64, 10, image_shape=shape)
    return sum(int(np.prod(s)) * np.dtype(t).itemsize for _, s, t in m.variables())


def machine():
    """Return a short description of where the figures were taken."""
    return dict(hostname=socket.gethostname(), cpus=os.cpu_count(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                python=sys.version.split()[0])


def write_json(path, out):
    """Write a benchmark's results as JSON (nothing when ``path`` is None)."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


def parse_args(argv=None):
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--quick", action="store_true", help="a small grid and short runs")
    p.add_argument("--models", default="mlp,cnn")
    p.add_argument("--workers", default=None, help="worker counts (default 1,2,3; quick 1,2)")
    p.add_argument("--ps", default=None, help="ps counts (default 1,2; quick 1)")
    p.add_argument("--batch", type=int, default=32, help="weak scaling: examples per worker")
    p.add_argument("--global-batch", type=int, default=96,
                   help="strong scaling: examples per global step, split over the workers")
    p.add_argument("--steps", type=int, default=None,
                   help="steps per run (default 1000; quick 400, a smoke test: runs this short "
                        "spread 2-3x here)")
    p.add_argument("--repeats", type=int, default=None,
                   help="runs per point, the best taken (default 3; quick 1)")
    p.add_argument("--launcher", default=None,
                   help='launcher command, e.g. "srun" or "mpiexec -bind-to core"')
    p.add_argument("--run-dir", default=None,
                   help="the runs' directories go here (default: a temporary directory)")
    args = p.parse_args(argv)
    args.models = args.models.split(",")
    args.workers = [int(x) for x in (args.workers or ("1,2" if args.quick else "1,2,3"))
                    .split(",")]
    args.ps = [int(x) for x in (args.ps or ("1" if args.quick else "1,2")).split(",")]
    args.steps = args.steps or (400 if args.quick else 1000)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.launcher = shlex.split(args.launcher) if args.launcher else default_launcher()
    return args


def main(argv=None):
    """Run the grid and write the JSON."""
    args = parse_args(argv)
    if args.run_dir is None:
        with tempfile.TemporaryDirectory(prefix="mpitf-scaling-") as tmp:
            args.run_dir = tmp
            return main_in(args)
    return main_in(args)


def main_in(args):
    """Run the grid with the runs' directories under ``args.run_dir``; write the JSON."""
    results = []
    for model in args.models:
        for scaling in ("weak", "strong"):
            for ps in args.ps:
                base = None
                for w in args.workers:
                    batch = args.batch if scaling == "weak" else max(1, args.global_batch // w)
                    finals = []
                    for i in range(args.repeats):
                        run_dir = os.path.join(args.run_dir, f"{model}-{scaling}-{w}-{ps}-{i}")
                        final = run_job(w + ps, ["--model", model, "--num-ps", ps, "--steps",
                                                 args.steps, "--batch-size", batch,
                                                 "--log-every", LOG_EVERY, "--run-dir",
                                                 run_dir], args.launcher)
                        finals.append(measure(final, run_dir, args.steps))
                    finals.sort(key=lambda f: f["examples_per_sec"])
                    final = finals[-1]  # the best run: other processes only slow a run
                    eps = final["examples_per_sec"]
                    base = eps if w == 1 else base
                    row = dict(model=model, scaling=scaling, workers=w, ps=ps, batch=batch,
                               examples_per_sec=eps, ranks=w + ps,
                               efficiency=eps / (w * base) if base else None,
                               oversubscribed=w + ps > (os.cpu_count() or 1),
                               loss=final["loss"], test_accuracy=final["test_accuracy"],
                               steps=final["step"], wall_s=final["wall_s"],
                               window_steps=final["window_steps"],
                               mean_examples_per_sec=final["mean_examples_per_sec"],
                               runs=[f["examples_per_sec"] for f in finals])
                    results.append(row)
                    print(f"{model} {scaling:<6} W={w} P={ps} batch={batch:<3} "
                          f"{eps:10.0f} ex/s  eff {row['efficiency'] or 0:.2f}", flush=True)
    out = dict(results=results, model_bytes={m: model_bytes(m) for m in args.models},
               metadata=dict(machine(), steps=args.steps, launcher=args.launcher,
                             quick=args.quick, argv=sys.argv[1:]))
    write_json(args.json, out)
    return 0


def run():
    """Run from the command line (``python -m``, benchmarks/) and exit with main's code."""
    sys.exit(main())


if __name__ == "__main__":
    run()
