"""``mpitf bench``: run the benchmark suites, fit the cost model, write plots and a report.

The suites are modules of this package, run as ``python -m`` (``mpitf.bench.pushpull``
under the launcher itself; ``scaling`` and ``modes`` launch the built-in job
``mpitf.jobs.mnist_mlp`` once per point), so an installed mpitf needs no source tree. Each
writes JSON; this module gathers them into ``OUT/results.json``, draws PNGs with
matplotlib's Agg backend, and writes ``OUT/report.md`` with measured and projected figures
side by side.
"""

import json
import os
import platform
import shlex
import subprocess
import sys
import time

from ..config import DEFAULT_BUCKET_BYTES
from ..errors import MpitfError
from .jobrate import LOG_EVERY, job_env
from .report import write_report
from .scaling import default_launcher
from .validation import model_inputs, validate

SUITES = ("fabric", "pushpull", "scaling", "modes", "kernels")
PROFILE_STEPS = 800  # steps a profile run times (after its warm-up): as long as a scaling run


def require_matplotlib():
    """Raise MpitfError naming the extra to install when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MpitfError("mpitf bench draws its plots with matplotlib, which is not "
                         "installed: pip install 'mpitf[bench]'") from None


def _run(cmd, log, timeout, env=None):
    """Run ``cmd``, appending its output to ``log``; raise on failure."""
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL,
                          env=env or dict(os.environ, PYTHONUNBUFFERED="1"))
    with open(log, "a") as f:
        f.write(f"$ {shlex.join(cmd)}\n{proc.stdout}{proc.stderr}"
                f"# exit {proc.returncode} after {time.monotonic() - started:.1f} s\n\n")
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited {proc.returncode}; see {log}")
    return time.monotonic() - started


def _load(path):
    with open(path) as f:
        return json.load(f)


def best_profile(runs):
    """Return the profile round with the shortest step (its figures, all from one run).

    Another process can only slow a run down, so the fastest round is the nearest to the
    machine's undisturbed speed, the one the cost model describes (as ``timeit`` takes the
    best); the job points take their best run likewise.
    """
    return dict(min(runs, key=lambda r: r["step_s"]), rounds=len(runs),
                step_s_rounds=[r["step_s"] for r in runs])


def best_scaling(runs):
    """Return one scaling result whose every point is its best over ``runs`` (rounds).

    Efficiency is recomputed against the best 1-worker figure of the same model, scaling
    and ps count.
    """
    def key(row):
        return row["model"], row["scaling"], row["ps"], row["workers"], row["batch"]

    out = dict(runs[0], results=[])
    for row in runs[0]["results"]:
        seen = [r for run in runs for r in run["results"] if key(r) == key(row)]
        best = max(seen, key=lambda r: r["examples_per_sec"])
        out["results"].append(dict(best, runs=[r["examples_per_sec"] for r in seen]))
    base = {key(r)[:3]: r["examples_per_sec"] for r in out["results"] if r["workers"] == 1}
    for row in out["results"]:
        b = base.get(key(row)[:3])
        row["efficiency"] = row["examples_per_sec"] / (row["workers"] * b) if b else None
    return out


def best_modes(runs):
    """Return one modes result whose examples/sec per mode is the best over ``runs``."""
    out = dict(runs[0], results=[dict(r) for r in runs[0]["results"]])
    for row in out["results"]:
        seen = [x["examples_per_sec"] for run in runs for x in run["results"]
                if x["mode"] == row["mode"]]
        row["examples_per_sec"], row["runs"] = max(seen), seen
    return out


def run_suites(args, out, log):
    """Run the chosen suites; return (results dict, commands run, errors)."""
    launch = default_launcher()
    if getattr(args, "hosts", None):  # across machines: every suite's mpiexec gets them
        from ..runtime.launch import is_hydra

        launch += ["-hosts" if is_hydra(launch[0]) else "--host", args.hosts]
    suites = SUITES if args.suite in (None, "all") else (args.suite,)
    quick = ["--quick"] if args.quick else []
    n = args.n or 2
    res, commands, errors = {}, [], []

    def step(name, cmd, timeout=1800, env=None):
        commands.append(shlex.join(cmd))
        try:
            _run(cmd, log, timeout, env)
            return True
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            errors.append(f"{name}: {exc}")
            return False

    py = sys.executable
    if "fabric" in suites:
        path = os.path.join(out, "fabric.json")
        if step("fabric", [*launch, "-n", "2", py, "-m", "mpitf.bench.fabric", "--json", path,
                           *quick]):
            res["fabric"] = _load(path)
    if "pushpull" in suites:
        # the ps's memory with 3 workers and with 2 ps: figures, not a smoke test
        runs = [("main", n, 1)] + ([] if args.quick else [("workers3", 4, 1), ("ps2", 3, 2)])
        for tag, ranks, ps in runs:
            path = os.path.join(out, f"pushpull-{tag}.json")
            if tag != "main" and ranks == n and ps == 1:
                continue
            # main: the default buckets, then one bucket; the others (the ps's memory)
            # the default buckets only
            buckets = [] if tag == "main" else ["--bucket-bytes", str(DEFAULT_BUCKET_BYTES)]
            if step(f"pushpull {tag}", [*launch, "-n", str(ranks), py,
                                        "-m", "mpitf.bench.pushpull", "--num-ps", str(ps),
                                        "--json", path, *buckets, *quick]):
                res[f"pushpull_{tag}"] = _load(path)
    common = [*quick, "--launcher", shlex.join(launch)]
    models = args.models
    profiles = {(m, b): [] for m in models for b in (32, 96)}  # the W=1 batches

    def profile_round(i):  # the cost model's compute per model
        for (model, batch), runs in profiles.items():
            run_dir = os.path.join(out, f"profile-{model}-{batch}-{i}")
            if step(f"profile {model}", [*launch, "-n", "2", py, "-m", "mpitf.jobs.mnist_mlp",
                                         "--model", model, "--num-ps", "1", "--steps",
                                         str(PROFILE_STEPS * 5 // 4 + 30),  # + its warm-up
                                         "--profile-steps", str(PROFILE_STEPS),
                                         "--log-every", str(LOG_EVERY), "--batch-size",
                                         str(batch), "--run-dir", run_dir], env=job_env(2)):
                runs.append(_load(os.path.join(run_dir, "profile.json")))

    # Rounds: each runs the profiles, one run of every scaling point and of the 1-worker
    # modes, so the profiles and the points they project share the machine's slow and
    # fast spells (minutes long here); every figure is then the best of its rounds.
    jobs = "scaling" in suites or "modes" in suites
    scaling, w1 = [], []
    workers = [] if args.n is None else ["--workers", ",".join(
        str(w) for w in range(1, max(2, args.n - 1) + 1))]
    for i in range(args.repeats or (1 if args.quick else 3)) if jobs else ():
        profile_round(i)
        if "scaling" in suites:
            path = os.path.join(out, f"scaling-{i}.json")
            if step("scaling", [py, "-m", "mpitf.bench.scaling", "--json", path, *common,
                                "--run-dir", os.path.join(out, "scaling-runs", str(i)),
                                "--models", ",".join(models), *workers, "--repeats", "1"]):
                scaling.append(_load(path))
        if "modes" in suites:
            path = os.path.join(out, f"modes-w1-{i}.json")  # 2 ranks: what the cores hold
            if step("modes 1 worker", [py, "-m", "mpitf.bench.modes", "--json", path,
                                       *common, "--workers", "1", "--modes", "sync,async,ssp"]):
                w1.append(_load(path))
    if scaling:
        res["scaling"] = best_scaling(scaling)
    if w1:
        res["modes_w1"] = best_modes(w1)
    if "modes" in suites:
        path = os.path.join(out, "modes.json")
        workers = [] if args.n is None else ["--workers", str(max(2, args.n - 1))]
        if step("modes", [py, "-m", "mpitf.bench.modes", "--json", path, *common,
                          *workers]):
            res["modes"] = _load(path)
    if any(profiles.values()):
        res["profiles"] = {}
        for (model, batch), runs in profiles.items():
            if runs:
                res["profiles"].setdefault(model, {})[str(batch)] = best_profile(runs)
    if "kernels" in suites:
        path = os.path.join(out, "kernels.json")
        if step("kernels", [py, "-m", "mpitf.bench.kernels", "--json", path, *quick]):
            res["kernels"] = _load(path)
    trace = os.path.join(out, "timeline.json")
    if step("timeline", [*launch, "-n", "3", py, "-m", "mpitf.jobs.mnist_mlp",
                         "--num-ps", "1", "--steps", "20",
                         "--log-every", "10", "--run-dir", os.path.join(out, "timeline-run"),
                         "--timeline", trace]):
        res["timeline"] = trace
    return res, commands, errors


def main(args):
    """Run ``mpitf bench``: the suites, the model, the plots and the report; return 0 or 1."""
    require_matplotlib()  # before any suite runs, not after minutes of measuring
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    log = os.path.join(out, "bench.log")
    open(log, "w").close()
    started = time.monotonic()
    res, commands, errors = run_suites(args, out, log)
    results = dict(res, commands=commands, errors=errors, quick=bool(args.quick),
                   machine=dict(host=platform.node(), cpus=os.cpu_count(),
                                system=platform.platform(), python=platform.python_version(),
                                hosts=getattr(args, "hosts", None)))
    results["loadavg"] = os.getloadavg()
    results["model_inputs"] = model_inputs(results)
    results["validation"] = validate(results)
    results["seconds"] = time.monotonic() - started
    write_report(results, out)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(f"mpitf bench: wrote {out}/report.md and results.json in "
          f"{results['seconds']:.0f} s" + (f"; {len(errors)} suite(s) failed" if errors else ""))
    for e in errors:
        print(f"mpitf bench: {e}", file=sys.stderr)
    return 1 if errors else 0
