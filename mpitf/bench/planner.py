"""``mpitf bench --plan``: the ps count, bucket size and aggregation for a cluster not yet owned.

Pure functions over :mod:`mpitf.bench.costmodel`: parse the user's figures, search the
layouts (ps count, bucket size, node-local aggregation), keep the cheapest within 1 % of
the best efficiency, and explain the answer line by line (docs/costmodel.md).
"""

import json
import math
import os
import re

from ..errors import ConfigurationError
from . import costmodel as cm

BUCKETS = (0, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)
_SUFFIX = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
           "KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30, "TI": 1 << 40}


def parse_size(text, flag="--model-bytes"):
    """Return the bytes of ``text`` (``100M``, ``2.5G``, ``64MiB``, ``4096``; K/M/G = 10^3k)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGTkmgt][iI]?)?[bB]?\s*",
                     str(text))
    if not m:
        raise ConfigurationError(f"{flag} {text!r}: expecting a size such as 4096, 100M, "
                                 "2.5G or 64MiB")
    value = float(m.group(1)) * _SUFFIX[(m.group(2) or "").upper()]
    if not value > 0 or math.isinf(value):
        raise ConfigurationError(f"{flag} {text!r}: expecting a size above zero")
    return value


def parse_positive(text, flag, integer=False):
    """Return ``text`` as a positive number (a whole one if ``integer``); raise naming ``flag``."""
    if text is None:
        raise ConfigurationError(f"--plan needs {flag}")
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise ConfigurationError(f"{flag} {text}: expecting a number above zero")
    if integer and int(value) != value:
        raise ConfigurationError(f"{flag} {text}: expecting a whole number")
    return int(value) if integer else value


def parse_fabric(text):
    """Return a :class:`~mpitf.bench.costmodel.Fabric` from a fabric file or ``LAT,BYTES_PER_S``."""
    if text is None:
        raise ConfigurationError("--plan needs --fabric: a file written by 'mpitf bench "
                                 "--suite fabric', or LATENCY_S,BYTES_PER_S such as 1.5e-6,2.5e10")
    parts = str(text).split(",")
    if len(parts) == 2 and not os.path.exists(text):
        try:
            latency, bandwidth = float(parts[0]), float(parts[1])
        except ValueError:
            raise ConfigurationError(f"--fabric {text!r}: expecting LATENCY_S,BYTES_PER_S "
                                     "such as 1.5e-6,2.5e10") from None
        source = "given"
    else:
        try:
            with open(text) as f:
                data = json.load(f)
            latency, bandwidth = float(data["latency_s"]), float(data["bytes_per_s"])
        except FileNotFoundError:
            raise ConfigurationError(f"--fabric {text}: no such file (write one with 'mpitf "
                                     "bench --suite fabric', or give LATENCY_S,BYTES_PER_S)"
                                     ) from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigurationError(f"--fabric {text}: not a fabric file ({exc}); expecting "
                                     "the JSON 'mpitf bench --suite fabric' writes") from None
        source = text
    if not (latency >= 0 and bandwidth > 0) or math.isinf(latency) or math.isinf(bandwidth):
        raise ConfigurationError(f"--fabric {text}: expecting a latency >= 0 s and a "
                                 "bandwidth > 0 bytes/s")
    return cm.Fabric(latency, bandwidth, source)


def _ps_counts(limit, needed):
    """Return the ps counts to try: powers of two up to ``limit`` and the links' minimum."""
    counts = {1, limit}
    p = 2
    while p < limit:
        counts.add(p)
        p *= 2
    if needed:
        counts.update(c for c in (needed, needed + 1) if c <= limit)
    return sorted(counts)


def nodes_used(layout):
    """Return the nodes a layout takes: the workers' nodes, plus the ps's own unless beside."""
    return layout.nodes if layout.beside else layout.nodes + layout.num_ps


def node_efficiency(projection, layout):
    """Return the efficiency per node used (the ps on nodes of their own count as nodes)."""
    return projection.efficiency * layout.nodes / nodes_used(layout)


def plan(fabric, work, ps, nodes, workers_per_node, max_ps=None, mode="sync",
         placements=("own", "beside")):
    """Return the recommended layout as a dict (see :func:`format_plan` for its lines).

    Tries every ps count (powers of two up to ``max_ps``, default ``nodes``, and the fewest
    whose links keep up), bucket size (:data:`BUCKETS`), aggregation (sync, G > 1) and
    placement: each ps on a node of its own, or (one worker per node) one ps beside each
    of P worker nodes, sharing its link. The pick is the best efficiency per node used,
    then the fewest nodes, the fewest ps, and the largest buckets within 1 % of it.
    """
    limit = max_ps or nodes
    aggs = (False, True) if workers_per_node > 1 and mode in ("sync", "backup") else (False,)
    # beside, the model's node link carries one worker's traffic and its ps's
    sides = [False] + ([True] if "beside" in placements and workers_per_node == 1 else [])
    if "own" not in placements:
        sides.remove(False)
    best, counts = [], set()
    for agg in aggs:
        counts.update(_ps_counts(limit, cm.ps_for_links(
            fabric, work, cm.Layout(nodes, workers_per_node, 1, 0, agg, mode))))
    for beside in sides:
        for agg in aggs:
            for p in sorted(c for c in counts if not beside or c <= nodes):
                for k in BUCKETS:
                    if k and k >= work.model_bytes / p:
                        continue  # one bucket is no bucket
                    lay = cm.Layout(nodes, workers_per_node, p, k, agg, mode, beside=beside)
                    best.append((cm.project(fabric, work, ps, lay), lay))
    if not best:
        raise ConfigurationError("--plan-placement beside puts one ps beside each worker "
                                 "node, one worker per node: give --workers-per-node 1 or "
                                 "another placement")
    by_ps = {}
    for pr, lay in best:
        by_ps[lay.num_ps] = max(by_ps.get(lay.num_ps, 0.0), pr.efficiency)
    top = max(node_efficiency(pr, lay) for pr, lay in best)
    pick_pr, pick = min(((pr, lay) for pr, lay in best
                         if node_efficiency(pr, lay) >= 0.99 * top),
                        key=lambda x: (nodes_used(x[1]), x[1].num_ps, x[1].aggregate,
                                       -x[1].bucket_bytes))
    needed = cm.ps_for_links(fabric, work, pick)
    return dict(layout=pick, projection=pick_pr, ps_for_links=needed, by_ps=by_ps,
                ps_for_links_without_agg=cm.ps_for_links(
                    fabric, work, cm.Layout(nodes, workers_per_node, 1, 0, False, mode)),
                fabric=fabric, work=work, ps=ps)


def _t(seconds):
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.3g} us"


def _b(nbytes):
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.4g} {unit}"
    return f"{nbytes:.0f} B"


def format_plan(result):
    """Return the planner's answer as printable lines."""
    lay, pr, f, w = result["layout"], result["projection"], result["fabric"], result["work"]
    t, n = pr.terms, lay.workers
    pushes = cm.senders(lay)
    per_link = pushes * w.model_bytes / lay.num_ps
    load = f"{pushes} pushes x {_b(w.model_bytes)} / {lay.num_ps} ps"
    if lay.beside:  # a node's link: its worker's share to the other ps, the others' to its
        per_link = (lay.num_ps - 1 + pushes - 1) * w.model_bytes / lay.num_ps
        load = (f"({lay.num_ps - 1} other ps + {pushes - 1} other workers) x "
                f"{_b(w.model_bytes)} / {lay.num_ps} ps")
    need = result["ps_for_links"]
    bucket = "one frame per ps (no buckets)" if not lay.bucket_bytes else \
        f"--bucket-bytes {lay.bucket_bytes} ({lay.bucket_bytes >> 10} KiB; {t['buckets']} per ps)"
    lines = [
        f"plan: {lay.nodes} nodes x {lay.workers_per_node} workers = {n} workers, "
        f"{lay.mode}; model {_b(w.model_bytes)}, compute {_t(w.compute)} per step; fabric "
        f"{_t(f.latency)} latency, {f.bandwidth / 1e9:.3g} GB/s per direction ({f.source})",
        f"recommended ps:          {lay.num_ps}",
        "recommended placement:   " + (f"beside the workers (one ps on each of {lay.num_ps} "
                                       "worker nodes)" if lay.beside else
                                       f"on nodes of their own ({lay.num_ps} more nodes)"),
        f"recommended buckets:     {bucket}",
        "node-local aggregation:  " + ("on (--aggregate-per-node)" if lay.aggregate else "off"),
        f"expected step:           {_t(pr.step_time)} (compute {_t(w.compute)}, exposed "
        f"communication {_t(t.get('exposed', pr.step_time - w.compute))})",
        f"expected efficiency:     {pr.efficiency:.3f} of {n} workers computing alone; "
        + (f"{node_efficiency(pr, lay):.3f} per node counting the {lay.num_ps} ps nodes"
           if not lay.beside else "the ps take no nodes of their own"),
        f"bounded by:              {pr.bound}",
        f"ps link load:            {load} = "
        f"{_b(per_link)} per direction per ps link per step = {_t(t['ps_link'])}",
    ]
    if need is None:
        lines.append(f"link check:              LINK-BOUND: one worker's own link needs "
                     f"{_t(t['worker_link'])} for the model, more than the compute; no ps "
                     "count hides it")
    else:
        ok = need <= lay.num_ps
        lines.append(f"link check:              {need} ps carry it within the compute time"
                     f" ({'met' if ok else 'NOT met: the step is link-bound'})"
                     + (f"; without aggregation {result['ps_for_links_without_agg']}"
                        if lay.aggregate else ""))
    lines.append("best efficiency by ps:   " + ", ".join(
        f"{p}: {e:.3f}" for p, e in sorted(result["by_ps"].items())))
    lines.append(f"terms (per step):        worker link {_t(t['worker_link'])}, ps link "
                 f"{_t(t['ps_link'])}, ps messages {_t(t['messages'])}, ps apply "
                 f"{_t(t['apply'])}, latency {_t(t['latency'])}, aggregation "
                 f"{_t(t['aggregate'])}")
    return lines


def main(args):
    """Run ``mpitf bench --plan`` from parsed flags; print the plan; return 0."""
    fabric = parse_fabric(args.fabric)
    nodes = parse_positive(args.nodes, "--nodes", integer=True)
    g = parse_positive(args.workers_per_node, "--workers-per-node", integer=True)
    if args.model_bytes is None:
        raise ConfigurationError("--plan needs --model-bytes (e.g. 100M)")
    work = cm.Workload(parse_size(args.model_bytes),
                       parse_positive(args.compute_ms, "--compute-ms") / 1e3)
    ps = cm.PsNode(apply_rate=parse_size(args.apply_rate, "--apply-rate"),
                   threads=parse_positive(args.ps_threads, "--ps-threads", integer=True),
                   msg_overhead=parse_positive(args.msg_us, "--msg-us") * 1e-6,
                   shm_bandwidth=parse_size(args.shm_rate, "--shm-rate"))
    max_ps = None if args.max_ps is None else parse_positive(args.max_ps, "--max-ps",
                                                             integer=True)
    placements = ("own", "beside") if args.plan_placement == "any" else (args.plan_placement,)
    for line in format_plan(plan(fabric, work, ps, nodes, g, max_ps, args.plan_mode,
                                 placements)):
        print(line)
    return 0
