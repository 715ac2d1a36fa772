"""The ``mpitf bench`` report: PNG plots (matplotlib, Agg) and ``report.md``.

Measured and projected figures stand side by side, so the cost model's error is visible.
"""

import os

from ..config import DEFAULT_BUCKET_BYTES
from .validation import claim


def _fmt(x, digits=3):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e5 else f"{x:.3e}"
    return str(x)


def _buckets(bucket_bytes):
    """Return how a push+pull row cut its push: "one bucket" or "2 MiB buckets"."""
    if not bucket_bytes:
        return "one bucket"
    size = f"{bucket_bytes >> 20} MiB" if bucket_bytes % (1 << 20) == 0 else \
        f"{bucket_bytes >> 10} KiB"
    return f"{size} buckets"


def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def plot_all(results, out):
    """Draw the PNGs; return their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    pp = results.get("pushpull_main")
    if pp:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        configs = sorted({(r["optimizer"], r.get("bucket_bytes") or 0) for r in pp["results"]},
                         key=lambda c: (c[0], -c[1]))
        for opt, bucket in configs:
            rows = [r for r in pp["results"]
                    if (r["optimizer"], r.get("bucket_bytes") or 0) == (opt, bucket)]
            ax.plot([r["bytes"] for r in rows], [r["mpitf_gbps"] for r in rows],
                    ("o-" if opt == "none" else "s-") if bucket else
                    ("o:" if opt == "none" else "s:"),
                    label=f"mpitf push+pull, ps optimizer {opt}, {_buckets(bucket)}")
        rows = [r for r in pp["results"] if (r["optimizer"], r.get("bucket_bytes") or 0) ==
                configs[0]]
        ax.plot([r["bytes"] for r in rows], [r["raw_mpi_gbps"] for r in rows], "k--",
                label="raw mpi4py Isend/Irecv round trip")
        ax.set(xscale="log", xlabel="model bytes (each way)", ylabel="GB/s (both directions)",
               title=f"push+pull, {rows[0]['num_workers']} worker / {rows[0]['num_ps']} ps")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        made.append(_save(fig, out, "pushpull.png"))
    sc = results.get("scaling")
    if sc:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
        keys = sorted({(r["model"], r["scaling"], r["ps"]) for r in sc["results"]})
        for model, kind, ps in keys:
            rows = [r for r in sc["results"] if (r["model"], r["scaling"], r["ps"]) ==
                    (model, kind, ps)]
            w = [r["workers"] for r in rows]
            line, = a1.plot(w, [r["examples_per_sec"] for r in rows], "o-",
                            label=f"{model} {kind} P={ps}")
            a2.plot(w, [r["efficiency"] for r in rows], "o-", color=line.get_color())
            if all("projected_examples_per_sec" in r for r in rows):
                a1.plot(w, [r["projected_examples_per_sec"] for r in rows], ":",
                        color=line.get_color())
                a2.plot(w, [r["projected_efficiency"] for r in rows], ":",
                        color=line.get_color())
        a1.set(xlabel="workers", ylabel="examples/sec", title="throughput (dotted: model)")
        a2.set(xlabel="workers", ylabel="efficiency vs 1 worker", ylim=(0, 1.3),
               title="efficiency (dotted: model)")
        for a in (a1, a2):
            a.grid(True, alpha=0.3)
        a1.legend(fontsize=8)
        made.append(_save(fig, out, "scaling.png"))
    md = results.get("modes")
    if md:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in md["results"]:
            if r["curve"]:
                ax.plot([c[0] for c in r["curve"]], [c[2] for c in r["curve"]], "-",
                        label=f"{r['mode']} ({r['examples_per_sec']:.0f} ex/s)")
        ax.axvline(md["wall_seconds"], color="grey", ls="--", lw=1)
        ax.set(xlabel="seconds since the first logged step", ylabel="training loss",
               yscale="log", title=f"consistency modes, {md['results'][0]['workers']} workers")
        ax.grid(True, alpha=0.3)
        ax.legend()
        made.append(_save(fig, out, "modes.png"))
    return made


def _save(fig, out, name):
    fig.tight_layout()
    fig.savefig(os.path.join(out, name), dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return name


def write_report(results, out):
    """Write ``OUT/report.md`` (and the PNGs it shows) from the gathered results."""
    m = results["machine"]
    parts = ["# mpitf benchmark report", "",
             f"Host `{m['host']}`, {m['cpus']} CPU cores, {m['system']}, Python {m['python']}. "
             f"{'Quick run (short lists, few repetitions). ' if results['quick'] else ''}"
             f"Took {results.get('seconds', 0):.0f} s."
             + (f" Ranks spread over the hosts {m['hosts']} (the fabric line below gives "
                "their link's rate)." if m.get("hosts") else ""), "",
             f"**Oversubscription:** this machine has {m['cpus']} cores; any run with more "
             f"ranks than that shares cores, so those figures show correctness and relative "
             f"costs, not speed a cluster would see. Every figure is a median over "
             f"repetitions on a shared, noisy machine.", ""]
    pp = results.get("pushpull_main")
    if pp:
        meta = pp["metadata"]
        parts += ["## Push+pull round trip", "",
                  f"MPI: {meta['mpi_library']}; {meta['ranks']} ranks; mode {meta['mode']}; "
                  f"warm-up {meta['warmup']}, medians of the repetitions listed.", "",
                  "![push+pull GB/s](pushpull.png)", "",
                  _table(["bytes", "ps optimizer", "buckets", "mpitf us", "mpitf GB/s",
                          "raw MPI us", "raw GB/s", "ratio", "axpy us", "reps"],
                         [[r["bytes"], r["optimizer"], _buckets(r.get("bucket_bytes")),
                           r["mpitf_us"], r["mpitf_gbps"], r["raw_mpi_us"],
                           r["raw_mpi_gbps"], r["ratio"], r["axpy_us"], r["repetitions"]]
                          for r in pp["results"]]), ""]
        parts += _targets(results)
    parts += model_section(results)
    sc = results.get("scaling")
    if sc:
        parts += ["## Scaling", "", "![scaling](scaling.png)", "",
                  _table(["model", "scaling", "W", "P", "batch", "measured ex/s",
                          "efficiency", "runs"],
                         [[r["model"], r["scaling"], r["workers"], r["ps"], r["batch"],
                           r["examples_per_sec"], r["efficiency"], len(r["runs"])]
                          for r in sc["results"]]), ""]
    md = results.get("modes")
    if md:
        parts += ["## Consistency modes", "",
                  f"Loss compared at {md['wall_seconds']:.2f} s of training (the shortest "
                  "run).", "", "![modes](modes.png)", "",
                  _table(["mode", "W", "measured ex/s",
                          f"loss at {md['wall_seconds']:.2f} s", "final loss",
                          "test accuracy", "stale dropped", "max staleness"],
                         [[r["mode"], r["workers"], r["examples_per_sec"],
                           r["loss_at_wall"], r["final_loss"], r["test_accuracy"],
                           r["stale_dropped"], r["max_staleness"]] for r in md["results"]]),
                  ""]
    kn = results.get("kernels")
    if kn:
        parts += ["## ps optimizer kernels", "",
                  f"{kn['mib']} MiB of float32 parameters; memcpy of the same traffic on the "
                  "same threads, same run.", "",
                  _table(["optimizer", "threads", "params GB/s", "traffic GB/s",
                          "memcpy GB/s", "ratio to memcpy", "numpy passes GB/s"],
                         [[r["optimizer"], r["threads"], r["params_gbps"], r["traffic_gbps"],
                           r["copy_gbps"], r["ratio_to_copy"], r["reference_params_gbps"]]
                          for r in kn["results"]]), ""]
    plot_all(results, out)
    if results.get("timeline"):
        parts += ["## Timeline", "",
                  "`timeline.json` is a Chrome trace of a 20-step run (1 ps, 2 workers): "
                  "compute and push_pull spans per step on each worker, apply spans on the "
                  "ps. Open it at <https://ui.perfetto.dev> (\"Open trace file\"), or in "
                  "chrome://tracing; one track per rank.", ""]
    parts += ["## Commands", "", "```"] + results["commands"] + ["```", ""]
    if results["errors"]:
        parts += ["## Failures", ""] + [f"- {e}" for e in results["errors"]] + [""]
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(parts))


def _targets(results):
    """Return report lines checking the push+pull targets (reported, never asserted)."""
    rows = results["pushpull_main"]["results"]
    sizes = {r.get("bucket_bytes") or 0 for r in rows}
    default = DEFAULT_BUCKET_BYTES if DEFAULT_BUCKET_BYTES in sizes else max(sizes)
    trained = [r for r in rows if (r.get("bucket_bytes") or 0) == default]
    lines = [f"Targets (issue 26), measured with {_buckets(default)} (what training "
             "pushes in by default); ratio = mpitf GB/s / raw GB/s:", ""]

    def check(name, picked, goal, slowest):
        """One target line: the slowest of ``picked``, and one bucket's beside it."""
        if not picked:
            return
        keys = {(p["bytes"], p["optimizer"]) for p in picked}
        one = [r["ratio"] for r in rows if not r.get("bucket_bytes") and
               (r["bytes"], r["optimizer"]) in keys]
        worst = min(picked, key=lambda r: r["ratio"])
        text, met = slowest(worst["ratio"])
        if worst.get("limit") is not None:  # what one core per rank allows (pushpull.py)
            text += f" (limit {worst['limit']:.2f})"
        beside = f"; one bucket: {slowest(min(one))[0]}" if one and default else ""
        lines.append(f"- {name} {goal}: {text}{beside} ({'met' if met else 'MISSED'})")

    small = min(r["bytes"] for r in rows)
    for opt in dict.fromkeys(r["optimizer"] for r in trained):  # each: SGD adds its apply
        check(f"push+pull of {small} B ({opt})",
              [r for r in trained if r["bytes"] == small and r["optimizer"] == opt],
              "<= 1.5 x raw MPI's time", lambda ratio: (f"{1 / ratio:.2f} x", 1 / ratio <= 1.5))
    for opt, goal in (("sgd", 0.85), ("none", 0.95)):
        check(f"ps {opt} from 16 MiB", [r for r in trained if r["optimizer"] == opt and
                                        r["bytes"] >= 16 << 20], f">= {goal} x raw GB/s",
              lambda ratio, goal=goal: (f"worst {ratio:.2f}", ratio >= goal))
    one, three = results.get("pushpull_main"), results.get("pushpull_workers3")
    if one and three:
        a = max(one["ps_peak_rss"].values())
        b = max(three["ps_peak_rss"].values())
        share = three["largest_ps_share_bytes"]
        lines.append(f"- ps peak RSS ({one['ps_peak_rss_scope']}): {a / 2**20:.0f} MiB with "
                     f"{one['results'][0]['num_workers']} worker(s), {b / 2**20:.0f} MiB with "
                     f"{three['results'][0]['num_workers']}; difference "
                     f"{(b - a) / share:+.2f} x the largest shard ({share / 2**20:.0f} MiB)")
    return lines + [""]


def model_section(results):
    """Return the report lines of the cost model: its measured inputs and the validation."""
    lines = []
    f, profiles = results.get("fabric"), results.get("profiles") or {}
    if f:
        lines += ["## Cost model inputs", "",
                  f"Fabric (ping-pong between {f['hosts'][0]} and {f['hosts'][1]}"
                  + (", one node: shared memory, not a network" if f["same_node"] else "")
                  + f"): latency {f['latency_s'] * 1e6:.2f} us, "
                  f"{f['bytes_per_s'] / 1e9:.2f} GB/s per direction (fit error "
                  f"{f['max_fit_error'] * 100:.0f} %).", ""]
    if profiles:
        lines += [_table(["profiled job", "model bytes", "batch", "compute ms",
                          "compute us/example", "push+pull ms", "overhead ms", "steps"],
                         [[m, p["model_bytes"], p["batch_size"], p["compute_s"] * 1e3,
                           p["compute_s_per_example"] * 1e6, p["push_pull_s"] * 1e3,
                           p["overhead_s"] * 1e3, p["steps"]]
                          for m, by_batch in profiles.items() for p in by_batch.values()]),
                  ""]
    inputs = results.get("model_inputs") or {}
    if inputs:
        lines += ["Every point of a model is projected from these (docs/costmodel.md):", "",
                  _table(["model", "compute fixed ms", "compute us/example", "overhead O ms",
                          "ps per message o us", "apply GB/s", "from batches"],
                         [[m, i["compute_fixed_s"] * 1e3, i["compute_per_example_s"] * 1e6,
                           i["overhead_s"] * 1e3, i["msg_overhead_s"] * 1e6,
                           i["apply_rate"] / 1e9, ",".join(map(str, i["batches"]))]
                          for m, i in inputs.items()]), ""]
    val = results.get("validation") or []
    if not val:
        return lines
    counted, worst, ok = claim(val)
    lines += ["## Validation: the cost model against every measured point", "",
              "Projected from inputs measured elsewhere (`predicted`: the fabric suite, a "
              "separate `--profile-steps` run of the job, the kernels suite; see "
              "docs/costmodel.md) or from a fit that used the point (`fitted`). Points "
              "marked `*` have more ranks than cores and are left out of the error claim, "
              "as are fitted points. Load average at the end: "
              + " ".join(f"{x:.2f}" for x in results.get("loadavg", ())) + ".", "",
              _table(["suite", "point", "ranks", "cores", "measured", "projected", "unit",
                      "error %", "basis"],
                     [[e["suite"], e["point"] + ("" if e["ranks"] <= e["cores"] else " *"),
                       e["ranks"], e["cores"], e["measured"], e["projected"], e["unit"],
                       f"{e['error_pct']:+.1f}", e["basis"]] for e in val]), "",
              f"Counted points: {len(counted)}; worst error "
              + ("-" if worst is None else f"{worst:.1f} %")
              + f" ({'within' if ok else 'NOT within'} the 15 % target). Plan a cluster "
              "with `mpitf bench --plan` (docs/costmodel.md).", ""]
    return lines
