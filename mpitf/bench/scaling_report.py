"""The report of the scaling suite over links: ``report.md`` and its PNG plots.

Every plot and table says the compute is emulated (a fixed wait per step): the figures
measure communication, not arithmetic.
"""

import math
import os

EMULATED = "emulated compute (a fixed wait per step)"


def _mib(nbytes):
    return f"{nbytes / (1 << 20):g} MiB"


def _kib(nbytes):
    return f"{nbytes >> 10} KiB"


def _ms(seconds):
    return "" if seconds is None else f"{seconds * 1e3:.0f}"


def _fmt(value, spec=".2f"):
    return "" if value is None else format(value, spec)


def _series(r):
    """Return a point's line in the plots: its ps count, or "N" for one ps per worker beside.

    Beside the workers the grid's ps count grows with them (P = N), one point per count.
    """
    return "N" if r["placement"] == "beside" and r["num_ps"] == r["workers"] else r["num_ps"]


def plots(results, out):
    """Draw the plots; return their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["points"]
    names = []
    for size in results["sizes"]:
        for with_compute in (False, True):  # joined runs' computes differ by their fabric
            sel = [r for r in rows if r["bytes"] == size and (r["compute_s"] > 0) == with_compute]
            if not sel:
                continue
            tag = f"{size >> 20}mib-{'cpp' if with_compute else 'c0'}"
            computes = sorted({f"{r['compute_s'] * 1e3:.0f}" for r in sel})
            what = (f"{_mib(size)}, {EMULATED}: "
                    f"{'/'.join(computes) + ' ms' if with_compute else 'none'}")
            fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
            for placement, style in (("own", "-"), ("beside", ":")):
                for ps in sorted({_series(r) for r in sel}, key=str):
                    pts = _best_bucket([r for r in sel if r["system"] == "mpitf"
                                        and r["placement"] == placement
                                        and _series(r) == ps])
                    if len(pts) < 1:
                        continue
                    xs = [r["workers"] for r in pts]
                    label = f"mpitf, {ps} ps {'on own nodes' if placement == 'own' else 'beside'}"
                    line, = ax1.plot(xs, [r["step_s"] * 1e3 for r in pts], style, marker="o",
                                     label=label)
                    if with_compute:
                        ax2.plot(xs, [r["efficiency"] or math.nan for r in pts], style,
                                 marker="o", color=line.get_color(), label=label)
                    if placement == "own":
                        ax1.plot(xs, [r["projected_s"] * 1e3 for r in pts], "x",
                                 color=line.get_color())
            peer = {}
            for r in sel:
                if r["system"] == "allreduce":
                    peer.setdefault(r["workers"], []).append(r)
            xs = sorted(peer)
            if xs:
                steps = [min(p["step_s"] for p in peer[x]) for x in xs]
                ax1.plot(xs, [s * 1e3 for s in steps], "k--", marker="s",
                         label="MPI_Iallreduce (MPICH), same workers")
                ax1.plot(xs, [peer[x][0]["projected_s"] * 1e3 for x in xs], "k+")
                if with_compute:
                    ax2.plot(xs, [max(p["efficiency"] or 0 for p in peer[x]) for x in xs],
                             "k--", marker="s", label="MPI_Iallreduce")
            ax1.set_xlabel("workers (one node each)")
            ax1.set_ylabel("step time, ms (median; x, +: cost model)")
            ax1.set_xscale("log", base=2)
            ax1.set_title(f"step time: {what}", fontsize=9)
            ax1.legend(fontsize=7)
            if not with_compute:
                ax2.text(0.5, 0.5, "no compute: one worker's rate is its link's alone,\n"
                         "so efficiency is not defined", ha="center",
                         transform=ax2.transAxes)
            ax2.set_xlabel("workers")
            ax2.set_ylabel("scaling efficiency (examples/s at N / N x at 1)")
            ax2.set_xscale("log", base=2)
            ax2.set_ylim(0, 1.1)
            ax2.set_title(f"efficiency: {what}", fontsize=9)
            fig.tight_layout()
            name = f"scaling-{tag}.png"
            fig.savefig(os.path.join(out, name), dpi=90)
            plt.close(fig)
            names.append(name)
    fig, ax = plt.subplots(figsize=(6, 6))
    for system, marker in (("mpitf", "o"), ("allreduce", "s")):
        sel = [r for r in rows if r["system"] == system]
        ax.scatter([r["step_s"] * 1e3 for r in sel], [r["projected_s"] * 1e3 for r in sel],
                   marker=marker, s=14, label=system)
    top = max([r["step_s"] * 1e3 for r in rows] + [1])
    ax.plot([0, top], [0, top], "k-", lw=0.5)
    ax.plot([0, top], [0, top * 1.15], "k:", lw=0.5)
    ax.plot([0, top], [0, top * 0.85], "k:", lw=0.5)
    ax.set_xlabel("measured step, ms (median)")
    ax.set_ylabel("cost model's step, ms")
    ax.set_title(f"projected against measured ({EMULATED}); dotted: 15 %", fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "projected-vs-measured.png"), dpi=90)
    plt.close(fig)
    names.append("projected-vs-measured.png")
    return names


def _best_bucket(points):
    """Return, per worker count, the point of the faster bucket size, by workers."""
    best = {}
    for r in points:
        if r["workers"] not in best or r["step_s"] < best[r["workers"]]["step_s"]:
            best[r["workers"]] = r
    return [best[w] for w in sorted(best)]


def write_report(results, out):
    """Write ``out/report.md`` (and the plots) from the suite's results."""
    names = plots(results, out)
    fab, rc = results["fabric"], results["rate_check"]
    lines = [
        "# mpitf scaling report: parameter servers against MPI_Iallreduce over links",
        "",
        f"**Compute is emulated** (a fixed wait per step, a third of it forward, then "
        f"backward in eight parts): the figures measure communication. Weak scaling, "
        f"{results['batch']} examples per worker per step; sync SGD.",
        "",
        f"- nodes: {results['nodes']} "
        + (f"(a cluster in a box: network namespaces, links shaped to {results['rate']} "
           "with tc tbf)" if results["box"] else f"(hosts {', '.join(results['hosts'])})"),
        f"- fabric between two nodes: latency {fab['latency_s'] * 1e6:.0f} us, "
        f"{fab['bytes_per_s'] * 8 / 1e6:.0f} Mbit/s of payload (its largest message's "
        "rate; what the cost model and the emulated compute use)",
        f"- model sizes: {', '.join(_mib(s) for s in results['sizes'])}; mpitf buckets "
        f"{', '.join(_kib(b) for b in results['buckets'])} per ps; MPI_Iallreduce in "
        "1024 KiB buckets",
        f"- each figure: the median over {results['rounds']} alternated rounds of the "
        f"median of {results['steps']} steps (the slowest worker's step)",
        f"- load average during the run: {min(a[0] for a in results['loadavg']):.1f} to "
        f"{max(a[0] for a in results['loadavg']):.1f} (1 minute)",
    ]
    if rc is not None:
        state = ("**link-bound**" if rc["link_bound"] else
                 "**NOT link-bound: the CPU, not the links, set these figures' pace**")
        lines.append(f"- rate check: one worker and one ps, {_mib(rc['bytes'])}: at "
                     f"{rc['half_rate']} the step took {_fmt(rc['ratio'])} x its time at "
                     f"{rc['rate']} ({state}; a link-bound step takes about 2 x)")
    lines += ["", "## Targets", "", "| target | measured | met |", "| --- | --- | --- |"]
    for t in results["targets"]:
        m = t["measured"]
        lines.append(f"| {t['target']} | {_fmt(m) if isinstance(m, float) else (m or '')} "
                     f"| {'' if t['met'] is None else ('yes' if t['met'] else 'no')} |")
    lines += ["", "## Plots", ""] + [f"![{n}]({n})" for n in names]
    lines += ["", "## Every point", "",
              "Step times in ms. *ratio*: mpitf's step over allreduce's in the same run; "
              "*limit*: the ratio the links allow (the ps design's busiest link over "
              "allreduce's); *model*: the cost model's step; *err*: (model - measured) / "
              "measured, counted in the 15 % target where *lb* (link-bound: no compute, "
              "over links); *eff*: examples/s at W over W x at 1 worker (the same ps count "
              "on its own node, the same bucket size), with compute only.", "",
              "| W | P | ps | size | compute ms | bucket | mpitf | allreduce | ratio | limit "
              "| model | err % | lb | ex/s | eff |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
              "| --- | --- |"]
    rows = sorted(results["points"], key=lambda r: (r["system"] != "mpitf", r["bytes"],
                                                    r["compute_s"], r["placement"],
                                                    r["workers"], r["num_ps"],
                                                    r["bucket_bytes"]))
    for r in rows:
        if r["system"] != "mpitf":
            continue
        lines.append(
            f"| {r['workers']} | {r['num_ps']} | {r['placement']} | {_mib(r['bytes'])} | "
            f"{r['compute_s'] * 1e3:.0f} | {_kib(r['bucket_bytes'])} | {_ms(r['step_s'])} | "
            f"{_ms(r.get('allreduce_step_s'))} | {_fmt(r.get('ratio_to_allreduce'))} | "
            f"{_fmt(r.get('limit_ratio'))} | {_ms(r['projected_s'])} | "
            f"{r['error_percent']:+.0f} | {'lb' if r['link_bound'] else ''} | "
            f"{r['examples_per_sec']:.0f} | "
            f"{_fmt(r['efficiency'])} |")
    lines += ["", "MPI_Iallreduce (each worker count measured in every run of it; the median "
              "of those runs):", "", "| W | size | compute ms | step | model | err % | eff |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    peer = {}
    for r in rows:
        if r["system"] == "allreduce":
            peer.setdefault((r["workers"], r["bytes"], r["compute_s"]), []).append(r)
    for (w, size, compute), sel in sorted(peer.items()):
        steps = sorted(r["step_s"] for r in sel)
        step = steps[len(steps) // 2]
        err = 100.0 * (sel[0]["projected_s"] - step) / step
        effs = sorted(r["efficiency"] for r in sel if r["efficiency"] is not None)
        eff = f"{effs[len(effs) // 2]:.2f}" if effs else ""
        lines.append(f"| {w} | {_mib(size)} | {compute * 1e3:.0f} | {_ms(step)} | "
                     f"{_ms(sel[0]['projected_s'])} | {err:+.0f} | {eff} |")
    lines += ["", "## The planner against the measurement", "",
              "Best: the most examples/s per node used (W + P nodes with ps of their own, W "
              "beside). The planner places the ps on nodes of their own or beside the "
              "workers, whichever its model finds best per node; its point is the measured one of "
              "its ps count and placement at the bucket size nearest its own.", "",
              "| W | size | compute ms | planner: ps, placement, bucket | measured best in "
              "that placement: ps, bucket | planner's point / that best | best of all: ps, "
              "placement, bucket | planner's / it | within 10 % |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in results["planner"]:
        b, o = c["best"], c["best_same"]
        within = "" if c["planner_over_best"] is None else \
            ("yes" if c["within_10_percent"] else "no")
        lines.append(
            f"| {c['workers']} | {_mib(c['bytes'])} | {c['compute_s'] * 1e3:.0f} | "
            f"{c['planner_ps']}, {c['planner_placement']}, "
            f"{_kib(c['planner_bucket_bytes'])} | {o['ps']}, {_kib(o['bucket_bytes'])} | "
            f"{_fmt(c['planner_over_best_same'])} | "
            f"{b['ps']}, {b['placement']}, {_kib(b['bucket_bytes'])} | "
            f"{_fmt(c['planner_over_best'])} | {within} |")
    if results["errors"]:
        lines += ["", "## Failed points", ""] + [f"- {e}" for e in results["errors"]]
    lines += ["", "## Commands", "", "```sh"] + results["commands"] + ["```", ""]
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(lines))
