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

from ..errors import MpitfError
from . import costmodel as cm
from .report import write_report
from .scaling import default_launcher

SUITES = ("pushpull", "scaling", "modes", "kernels")


def require_matplotlib():
    """Raise MpitfError naming the extra to install when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MpitfError("mpitf bench draws its plots with matplotlib, which is not "
                         "installed: pip install 'mpitf[bench]'") from None


def _run(cmd, log, timeout):
    """Run ``cmd``, appending its output to ``log``; raise on failure."""
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    with open(log, "a") as f:
        f.write(f"$ {shlex.join(cmd)}\n{proc.stdout}{proc.stderr}"
                f"# exit {proc.returncode} after {time.monotonic() - started:.1f} s\n\n")
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited {proc.returncode}; see {log}")
    return time.monotonic() - started


def _load(path):
    with open(path) as f:
        return json.load(f)


def run_suites(args, out, log):
    """Run the chosen suites; return (results dict, commands run, errors)."""
    launch = default_launcher()
    suites = SUITES if args.suite in (None, "all") else (args.suite,)
    quick = ["--quick"] if args.quick else []
    n = args.n or 2
    res, commands, errors = {}, [], []

    def step(name, cmd, timeout=1800):
        commands.append(shlex.join(cmd))
        try:
            _run(cmd, log, timeout)
            return True
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            errors.append(f"{name}: {exc}")
            return False

    py = sys.executable
    if "pushpull" in suites:
        runs = [("main", n, 1), ("workers3", 4, 1)] + ([] if args.quick else [("ps2", 3, 2)])
        for tag, ranks, ps in runs:
            path = os.path.join(out, f"pushpull-{tag}.json")
            if tag != "main" and ranks == n and ps == 1:
                continue
            if step(f"pushpull {tag}", [*launch, "-n", str(ranks), py,
                                        "-m", "mpitf.bench.pushpull", "--num-ps", str(ps),
                                        "--json", path, *quick]):
                res[f"pushpull_{tag}"] = _load(path)
    common = [*quick, "--launcher", shlex.join(launch)]
    if "scaling" in suites:
        path = os.path.join(out, "scaling.json")
        workers = [] if args.n is None else ["--workers", ",".join(
            str(w) for w in range(1, max(2, args.n - 1) + 1))]
        if step("scaling", [py, "-m", "mpitf.bench.scaling", "--json", path, *common,
                            *workers]):
            res["scaling"] = _load(path)
    if "modes" in suites:
        path = os.path.join(out, "modes.json")
        workers = [] if args.n is None else ["--workers", str(max(2, args.n - 1))]
        if step("modes", [py, "-m", "mpitf.bench.modes", "--json", path, *common,
                          *workers]):
            res["modes"] = _load(path)
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


# -- the cost model over the measurements ---------------------------------------------------

def fit_link(pushpull):
    """Return (raw-MPI fit with the apply cost, mpitf fit) from a pushpull result."""
    rows = [r for r in pushpull["results"] if r["optimizer"] == "none"] or pushpull["results"]
    sizes = [r["bytes"] for r in rows]
    raw = cm.fit_alpha_beta(sizes, [r["raw_mpi_us"] * 1e-6 for r in rows])
    raw = cm.with_apply_cost(raw, [b // r["num_ps"] for b, r in zip(sizes, rows)],
                             [r["axpy_us"] * 1e-6 for r in rows])
    ours = cm.fit_alpha_beta(sizes, [r["mpitf_us"] * 1e-6 for r in rows])
    return raw, ours


def project_scaling(fit, scaling):
    """Add the projected examples/sec and its error to each scaling row; return the rows."""
    rows = scaling["results"]
    for r in rows:
        base = next((b for b in rows if b["model"] == r["model"] and
                     b["scaling"] == r["scaling"] and b["ps"] == r["ps"] and b["workers"] == 1),
                    None)
        if base is None:
            continue
        mbytes = scaling["model_bytes"][r["model"]]
        per_ex = cm.compute_per_example(fit, mbytes, base["batch"], base["examples_per_sec"],
                                        r["ps"])
        p = cm.project(fit, "sync", r["workers"], r["ps"], mbytes, r["batch"], per_ex)
        r["projected_examples_per_sec"] = p["examples_per_sec"]
        r["projected_efficiency"] = p["efficiency"]
        r["error_percent"] = cm.error_percent(r["examples_per_sec"], p["examples_per_sec"])
        r["per_example_s"] = per_ex
    return rows


def project_modes(fit, modes, scaling):
    """Add projected throughput to sync/backup/async rows (ssp has no model)."""
    mbytes = scaling["model_bytes"].get("mlp") if scaling else None
    base = next((r for r in (scaling or {}).get("results", []) if r["model"] == "mlp" and
                 r["scaling"] == "weak" and r["workers"] == 1 and r["ps"] == 1), None)
    if base is None or mbytes is None:
        return modes["results"]
    per_ex = cm.compute_per_example(fit, mbytes, base["batch"], base["examples_per_sec"])
    for r in modes["results"]:
        if r["mode"] in cm.MODES:
            p = cm.project(fit, r["mode"], r["workers"], r["ps"], mbytes, base["batch"], per_ex)
            r["projected_examples_per_sec"] = p["examples_per_sec"]
            r["error_percent"] = cm.error_percent(r["examples_per_sec"],
                                                  p["examples_per_sec"])
    return modes["results"]



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
                                system=platform.platform(), python=platform.python_version()))
    pp = res.get("pushpull_main")
    if pp:
        raw, ours = fit_link(pp)
        results["fit"] = dict(raw=raw.__dict__, mpitf=ours.__dict__)
        if "scaling" in res:
            project_scaling(raw, res["scaling"])
        if "modes" in res:
            project_modes(raw, res["modes"], res.get("scaling"))
    results["seconds"] = time.monotonic() - started
    write_report(results, out)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(f"mpitf bench: wrote {out}/report.md and results.json in "
          f"{results['seconds']:.0f} s" + (f"; {len(errors)} suite(s) failed" if errors else ""))
    for e in errors:
        print(f"mpitf bench: {e}", file=sys.stderr)
    return 1 if errors else 0
