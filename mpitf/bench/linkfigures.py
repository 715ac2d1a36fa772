"""The figures of the scaling suite over links, derived from its measured points.

Per point: examples/s, scaling efficiency, the cost model's projection and its error, the
ratio to the peer and the ratio the links allow; per (workers, size, compute) the
planner's pick against the measured best; the issue's targets. :func:`rewrite` derives
them again from a run's files (``mpitf.bench.boxscaling`` runs the points).
"""

import json
import math
import os

from ..config import LINK_BUCKET_BYTES, LINK_MIN_BUCKET_BYTES
from ..errors import ConfigurationError
from . import costmodel as cm
from . import planner

BATCH = 32  # examples per worker per step (weak scaling): the examples/s the report gives
# training's buckets across nodes, and the smallest it takes there (a shard of 2 MiB or less)
BUCKETS = (LINK_BUCKET_BYTES, LINK_MIN_BUCKET_BYTES)
LINK_BOUND = 1.8  # at half the rate a link-bound step takes at least this many times as long


def rate_bytes(rate):
    """Return a tc rate (``200mbit``) in bytes per second."""
    units = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
    for unit in sorted(units, key=len, reverse=True):
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * units[unit] / 8
    raise ConfigurationError(f"--rate {rate!r}: expecting a rate such as 200mbit or 1gbit")


def link_rate(fab):
    """Return the fabric with the largest message's rate as its bandwidth.

    The fit weighs small messages most, and tbf's burst lets them through faster than the
    rate: the largest message's own rate is the link's (over a real network too).
    """
    if "fitted_bytes_per_s" not in fab:
        big = max(fab["results"], key=lambda r: r["bytes"])
        fab["fitted_bytes_per_s"] = fab["bytes_per_s"]
        fab["bytes_per_s"] = big["bytes"] / max(big["one_way_s"] - fab["latency_s"], 1e-9)
    return fab


def project(row, fab, placement):
    """Return the cost model's step for a measured row (mpitf or the peer)."""
    fabric = cm.Fabric(fab["latency_s"], fab["bytes_per_s"])
    work = cm.Workload(row["bytes"], max(row["compute_s"], 1e-9), BATCH)  # > 0: a rate
    if row["system"] == "allreduce":
        return cm.allreduce_step(fabric, work, row["workers"], row["bucket_bytes"])
    layout = cm.Layout(row["workers"], 1, row["num_ps"], row["bucket_bytes"],
                       beside=placement == "beside")
    return cm.project(fabric, work, cm.PsNode(threads=1), layout).step_time


def crosses_links(r):
    """Return True when a row's step moves bytes over links (not one node's own)."""
    if r["system"] == "allreduce":
        return r["workers"] > 1
    return r["placement"] == "own" or r["workers"] > 1


def annotate(rows, fab):
    """Add examples/s, efficiency, the projection and its error to every row.

    Efficiency needs compute (without it one worker's rate is the link's alone); a row
    is ``link_bound`` (counted in the cost model's check) when it has no compute and
    crosses links.
    """
    base = {}
    for r in rows:
        r["examples_per_sec"] = r["workers"] * BATCH / r["step_s"]
        r["projected_s"] = project(r, fab, r["placement"])
        r["error_percent"] = cm.error_percent(r["step_s"], r["projected_s"])
        r["link_bound"] = r["compute_s"] == 0 and crosses_links(r)
        if r["workers"] == 1 and (r["system"] == "allreduce" or r["placement"] == "own"):
            base[_base_key(r)] = r["examples_per_sec"]
    for r in rows:
        b = base.get(_base_key(r))
        r["efficiency"] = r["examples_per_sec"] / (r["workers"] * b) \
            if b and r["compute_s"] > 0 and (crosses_links(r) or r["system"] == "allreduce") \
            else None
    peers = {(r["workers"], r["num_ps"], r["placement"], r["bytes"], r["compute_s"]): r
             for r in rows if r["system"] == "allreduce"}
    for r in rows:
        peer = peers.get((r["workers"], r["num_ps"], r["placement"], r["bytes"],
                          r["compute_s"]))
        if r["system"] == "mpitf" and peer is not None and r["workers"] > 1:
            r["allreduce_step_s"] = peer["step_s"]
            r["ratio_to_allreduce"] = r["step_s"] / peer["step_s"]
            r["limit_ratio"] = limit_ratio(r)


def _base_key(r):
    """The 1-worker point a row's efficiency divides by: the same ps count on own nodes."""
    ps = 0 if r["system"] == "allreduce" else r["num_ps"]
    return r["system"], r["bucket_bytes"], ps, r["bytes"], r["compute_s"]


def limit_ratio(r):
    """Return the links' best ps step over allreduce's (busiest link's bytes, both ways)."""
    n, p, m = r["workers"], r["num_ps"], r["bytes"]
    if r["placement"] == "own":
        ps_bytes = max(m, n * m / p)
    else:
        ps_bytes = max((p - 1) * m / p + (n - 1) * m / p, m if p < n else 0)
    return ps_bytes / (2 * m * (n - 1) / n)


def planner_check(rows, fab, nodes):
    """Return per (workers, size, compute) the planner's choice against the measured best.

    Best: the most examples/s per node used (W + P nodes with ps of their own, W beside),
    the planner's own measure; the planner may place the ps either way.
    """
    fabric = cm.Fabric(fab["latency_s"], fab["bytes_per_s"])
    groups = {}
    for r in rows:
        if r["system"] == "mpitf" and r["compute_s"] > 0:  # the planner plans a compute
            # one configuration: each placement's run calibrates its own emulated compute
            # to about the push+pull time, within a few per cent of the other's
            key = next((k for k in groups if k[:2] == (r["workers"], r["bytes"])
                        and abs(k[2] - r["compute_s"]) <= 0.05 * k[2]),
                       (r["workers"], r["bytes"], r["compute_s"]))
            groups.setdefault(key, []).append(r)
    checks = []
    for (w, size, compute), points in sorted(groups.items()):
        for r in points:
            used = w + r["num_ps"] if r["placement"] == "own" else w
            r["examples_per_sec_per_node"] = r["examples_per_sec"] / used
        best = max(points, key=lambda r: r["examples_per_sec_per_node"])
        placements = tuple(sorted({r["placement"] for r in points}))
        max_ps = max(r["num_ps"] for r in points)
        work = cm.Workload(size, compute, BATCH)
        plan = planner.plan(fabric, work, cm.PsNode(threads=1), w, 1, max_ps=max_ps,
                            placements=placements)
        lay = plan["layout"]
        placement = "beside" if lay.beside else "own"
        same = [r for r in points if r["placement"] == placement]
        best_same = max(same, key=lambda r: r["examples_per_sec_per_node"])
        measured = [r for r in same if r["num_ps"] == lay.num_ps]
        pick = min(measured, key=lambda r: abs(math.log2(max(r["bucket_bytes"], 1)) -
                                               math.log2(max(lay.bucket_bytes, 1))),
                   default=None)
        ratio = (pick["examples_per_sec_per_node"] / best_same["examples_per_sec_per_node"]
                 if pick else None)
        overall = (pick["examples_per_sec_per_node"] / best["examples_per_sec_per_node"]
                   if pick else None)
        checks.append(dict(workers=w, bytes=size, compute_s=compute, planner_ps=lay.num_ps,
                           planner_placement=placement, planner_bucket_bytes=lay.bucket_bytes,
                           measured_bucket_bytes=pick and pick["bucket_bytes"],
                           best=_brief(best), best_same=_brief(best_same),
                           planner_over_best_same=ratio, planner_over_best=overall,
                           within_10_percent=overall is not None and overall >= 0.9))
    return checks


def _brief(r):
    return dict(ps=r["num_ps"], placement=r["placement"], bucket_bytes=r["bucket_bytes"],
                step_s=r["step_s"])


def targets(rows, rate_facts):
    """Return the issue's targets with the measured figures (met: True, False or None)."""
    def worst_of_best(sel):  # over (workers, size, compute), each at its best bucket size
        best = {}
        for r in sel:
            key = (r["workers"], r["bytes"], r["compute_s"])
            best[key] = min(best.get(key, math.inf), r["ratio_to_allreduce"])
        return max(best.values(), default=None)

    own = [r for r in rows if r["system"] == "mpitf" and r.get("ratio_to_allreduce")
           and r["placement"] == "own" and r["num_ps"] == r["workers"]]
    beside = [r for r in rows if r["system"] == "mpitf" and r.get("ratio_to_allreduce")
              and r["placement"] == "beside" and r["num_ps"] == r["workers"]]
    out = []
    for n, bound in ((4, 0.73), (8, 0.63)):
        value = worst_of_best([r for r in own if r["workers"] == n])
        out.append(dict(target=f"P = N = {n} ps on own nodes: step <= {bound} x allreduce "
                               "(worst size/compute, best bucket size)",
                        measured=value, met=None if value is None else value <= bound))
    value = worst_of_best([r for r in beside if r["workers"] > 1])
    out.append(dict(target="P = N beside the workers: step <= 1.05 x allreduce (worst "
                           "workers/size/compute, best bucket size)",
                    measured=value, met=None if value is None else value <= 1.05))
    effs = [r["efficiency"] for r in rows if r["system"] == "mpitf" and r["workers"] == 8
            and r["compute_s"] > 0 and r["efficiency"] is not None
            and r["placement"] == "own"]
    value = max(effs) if effs else None
    out.append(dict(target="efficiency at 8 workers with enough ps >= 0.9 (compute about a "
                           "push+pull)", measured=value, met=None if value is None
                    else value >= 0.9))
    linkish = [r for r in rows if r["link_bound"] and r["system"] == "mpitf"]
    worst_err = max((abs(r["error_percent"]) for r in linkish), default=None)
    within = sum(abs(r["error_percent"]) <= 15 for r in linkish)
    out.append(dict(target="cost model within 15 % of every link-bound mpitf point (no "
                           "compute, over links)",
                    measured=f"{within} of {len(linkish)} points; worst {worst_err:.0f} %"
                    if worst_err is not None else None,
                    met=None if worst_err is None else worst_err <= 15))
    out.append(dict(target="link-bound: the step moves with the rate",
                    measured=None if rate_facts is None else rate_facts["ratio"],
                    met=None if rate_facts is None else rate_facts["link_bound"]))
    return out


def finish(results, out):
    """Add the figures derived from the points; write results.json and the report."""
    rows = results["points"]
    annotate(rows, results["fabric"])
    results["planner"] = planner_check(rows, results["fabric"], results["nodes"])
    results["targets"] = targets(rows, results["rate_check"])
    from .scaling_report import write_report

    write_report(results, out)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)


def rewrite(out, **facts):
    """Derive the figures again and rewrite the report.

    From ``out/results.json``, or (a run that was stopped) from the files its points
    wrote, with ``facts`` (rate, nodes, rounds, steps, loadavg, quick, seconds).
    """
    path = os.path.join(out, "results.json")
    if os.path.exists(path):
        with open(path) as f:
            return finish(json.load(f), out)
    import glob
    import re

    with open(os.path.join(out, "fabric.json")) as f:
        fab = link_rate(json.load(f))
    rows = []
    for point in sorted(glob.glob(os.path.join(out, "point-*.json"))):
        placement = re.search(r"-(own|beside)\.json$", point).group(1)
        with open(point) as f:
            rows += [dict(r, placement=placement) for r in json.load(f)["results"]]
    for r in rows:
        r.pop("steps", None)
    times = {}
    for label in ("full", "half", "full-again"):
        path = os.path.join(out, f"rate-{label}.json")
        if os.path.exists(path):
            with open(path) as f:
                times[label] = json.load(f)["results"][0]
    rate_facts = None
    if "half" in times and "full" in times:
        full = min(t["step_s"] for k, t in times.items() if k != "half")
        ratio = times["half"]["step_s"] / full
        rate_facts = dict(rate=facts.get("rate"), half_rate="half the rate",
                          bytes=times["half"]["bytes"], ratio=ratio,
                          link_bound=ratio >= LINK_BOUND,
                          step_s={k: t["step_s"] for k, t in times.items()})
    results = dict(suite="scaling over links", compute="emulated (a fixed wait per step)",
                   fabric=fab, points=rows, sizes=sorted({r["bytes"] for r in rows}),
                   buckets=list(BUCKETS), batch=BATCH, errors=[], commands=[],
                   rate_check=rate_facts, box=True, hosts=None)
    results.update(facts)  # the run's own facts, its commands among them
    return finish(results, out)


def join(out, *others):
    """Add the points of other runs' ``results.json`` to ``out``'s and rewrite its report.

    For a grid measured in parts (``--placement own``, then ``--placement beside --ps N``):
    the first run's fabric and rate check stand for all; the load, commands and seconds
    of every part are kept.
    """
    with open(os.path.join(out, "results.json")) as f:
        results = json.load(f)
    for other in others:
        with open(os.path.join(other, "results.json")) as f:
            part = json.load(f)
        results["points"] += part["points"]
        results["loadavg"] += part["loadavg"]
        results["commands"] += part["commands"]
        results["errors"] += part["errors"]
        results["seconds"] += part["seconds"]
    results["sizes"] = sorted({r["bytes"] for r in results["points"]})
    return finish(results, out)
