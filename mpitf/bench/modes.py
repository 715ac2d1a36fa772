"""Consistency modes compared: throughput, and the loss each reaches in a fixed wall time.

Run: python -m mpitf.bench.modes --json OUT.json [--quick] [--workers W] [--launcher CMD]
(or python benchmarks/modes.py ... in a checkout)

Modes: sync (all W gradients per step), backup (sync with ``--replicas-to-aggregate W-1``),
async, and bounded staleness (ssp, ``--staleness 2``). Each runs the built-in job
``mpitf.jobs.mnist_mlp`` for many steps, logging every few steps; the loss curve is read
from ``RUN_DIR/metrics.jsonl`` (time measured from the chief's first logged step) and the
loss reached by the fixed wall time is the last logged loss at or before it. Examples/s
is the job's steady rate over every worker's examples (mpitf/bench/jobrate.py).
"""

import argparse
import json
import os
import shlex
import sys
import tempfile

from .jobrate import LOG_EVERY, measure
from .scaling import default_launcher, machine, run_job, write_json

MODES = {
    "sync": lambda w: ["--mode", "sync"],
    "backup": lambda w: ["--mode", "sync", "--replicas-to-aggregate", max(1, w - 1)],
    "async": lambda w: ["--mode", "async"],
    "ssp": lambda w: ["--mode", "ssp", "--staleness", 2],
}


def read_curve(path):
    """Return [(seconds since the first record, step, loss)] from a metrics.jsonl file."""
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    if not records:
        return []
    t0 = records[0]["time"]
    return [(r["time"] - t0, r["step"], r["loss"]) for r in records]


def loss_at(curve, seconds):
    """Return the last loss logged at or before ``seconds`` (None if nothing was logged)."""
    seen = [loss for t, _, loss in curve if t <= seconds]
    return seen[-1] if seen else None


def parse_args(argv=None):
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--quick", action="store_true", help="short runs")
    p.add_argument("--workers", type=int, default=None, help="workers (default 3; quick 2)")
    p.add_argument("--ps", type=int, default=1)
    p.add_argument("--model", default="mlp")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--steps", type=int, default=None,
                   help="global steps per run (default 3000; quick 1000)")
    p.add_argument("--wall", type=float, default=None,
                   help="compare losses at this many seconds (default: the shortest run)")
    p.add_argument("--launcher", default=None, help='launcher command, e.g. "srun"')
    args = p.parse_args(argv)
    args.workers = args.workers or (2 if args.quick else 3)
    # quick: 1000, not fewer: in async a 2-worker run of 400 steps can leave the chief's
    # metrics one record past the warm-up (a fresh-clone run), too few for a rate
    args.steps = args.steps or (1000 if args.quick else 3000)
    args.modes = args.modes.split(",")
    args.launcher = shlex.split(args.launcher) if args.launcher else default_launcher()
    return args


def main(argv=None):
    """Run every mode and write the JSON."""
    args = parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="mpitf-modes-") as tmp:
        for mode in args.modes:
            run_dir = os.path.join(tmp, mode)
            final = measure(run_job(args.workers + args.ps,
                                    ["--model", args.model, "--num-ps", args.ps, "--steps",
                                     args.steps, "--log-every", LOG_EVERY, "--run-dir",
                                     run_dir, *MODES[mode](args.workers)], args.launcher),
                            run_dir, args.steps)
            curve = read_curve(os.path.join(run_dir, "metrics.jsonl"))
            runs.append(dict(mode=mode, workers=args.workers, ps=args.ps,
                             examples_per_sec=final["examples_per_sec"], final_loss=final["loss"],
                             test_accuracy=final["test_accuracy"], steps=final["step"],
                             stale_dropped=final["stale_dropped"],
                             max_staleness=final["max_staleness"], max_lead=final["max_lead"],
                             wall_s=final["wall_s"], window_steps=final["window_steps"],
                             mean_examples_per_sec=final["mean_examples_per_sec"],
                             final_examples_per_sec=final["final_examples_per_sec"],
                             curve=curve))
    wall = args.wall or min(r["curve"][-1][0] for r in runs if r["curve"])
    for r in runs:
        r["loss_at_wall"] = loss_at(r["curve"], wall)
        print(f"{r['mode']:<7} {r['examples_per_sec']:10.0f} ex/s  loss@{wall:.2f}s "
              f"{r['loss_at_wall']}  final {r['final_loss']:.3f}", flush=True)
    out = dict(results=runs, wall_seconds=wall,
               metadata=dict(machine(), model=args.model, steps=args.steps,
                             launcher=args.launcher, quick=args.quick, argv=sys.argv[1:]))
    write_json(args.json, out)
    return 0


def run():
    """Run from the command line (``python -m``, benchmarks/) and exit with main's code."""
    sys.exit(main())


if __name__ == "__main__":
    run()
