"""The cost model against every measured point of ``mpitf bench``: the ``validation`` list.

Each entry is ``{"suite", "point", "ranks", "cores", "measured", "projected", "error_pct",
"unit", "basis", "counted"}`` (unit: examples/s for jobs, s for a push+pull round
trip). ``basis`` says where the projection's inputs come from: ``predicted`` (measured
elsewhere: the fabric ping-pong, a separate profiled run of the job, the kernels suite)
or ``fitted`` (the point itself took part in a fit; never
counted). Points with more ranks than cores are marked and not counted either.
"""

import math
import os

from . import costmodel as cm

DEFAULT_APPLY_RATE = 2e9  # bytes/s per thread, when the kernels suite did not run


def apply_rate(results):
    """Return SGD's apply bytes/s on one thread from the kernels suite (or the default)."""
    rows = [r for r in (results.get("kernels") or {}).get("results", [])
            if r["optimizer"] == "sgd" and r["threads"] == 1]
    return rows[0]["param_bytes"] / rows[0]["apply_s"] if rows else DEFAULT_APPLY_RATE


def fabric_of(results):
    """Return the measured :class:`~mpitf.bench.costmodel.Fabric` (None if not measured)."""
    f = results.get("fabric")
    return cm.Fabric(f["latency_s"], f["bytes_per_s"], "fabric suite") if f else None


def job_inputs(fabric, profile, rate):
    """Return (Workload maker, PsNode) for a job from its profile.

    The ps's cost per message in a training job (wake-up, decode, reply) is what the
    profiled push+pull leaves over the fabric's transfer and the apply: two messages a step.
    """
    ps = cm.PsNode(apply_rate=rate, threads=1, msg_overhead=0.0)
    work = cm.Workload(profile["model_bytes"], profile["compute_s"], profile["batch_size"])
    lay = cm.Layout(1, 1, profile["num_ps"], 0, False, "sync")
    t = cm.comm_terms(fabric, work, ps, lay, 1)
    base = cm.pipelined(t) + t["latency"]
    ps = cm.PsNode(apply_rate=rate, threads=1,
                   msg_overhead=max(0.0, (profile["push_pull_s"] - base) / 2))

    def workload(batch):
        return cm.Workload(profile["model_bytes"], profile["compute_s_per_example"] * batch,
                           batch, overhead=profile["overhead_s"])
    return workload, ps


def nearest_profile(by_batch, batch):
    """Return the profile (of ``{batch: profile}``) whose batch is nearest ``batch``, by ratio.

    Compute per example is not constant in the batch (BLAS changes kernels and threads),
    so each point takes the profile taken at, or nearest, its own batch.
    """
    if not by_batch:
        return None
    return min(by_batch.values(), key=lambda p: abs(math.log(p["batch_size"] / batch)))


def entry(suite, point, ranks, measured, projected, basis="predicted", unit="examples/s"):
    """Return one validation entry; ``counted`` is False past the cores or when fitted."""
    cores = os.cpu_count() or 1
    err = cm.error_percent(measured, projected)
    return dict(suite=suite, point=point, ranks=ranks, cores=cores, measured=measured,
                projected=projected, error_pct=err, unit=unit, basis=basis,
                counted=ranks <= cores and basis == "predicted")


def validate_jobs(results, fabric):
    """Return entries for the scaling and modes points (examples/sec)."""
    profiles, rate, out = results.get("profiles") or {}, apply_rate(results), []
    rows = [("scaling", r, r.get("scaling", "")) for r in
            (results.get("scaling") or {}).get("results", [])]
    for key in ("modes", "modes_w1"):
        rows += [(key.split("_")[0], r, "") for r in (results.get(key) or {}).get("results", [])]
    for suite, r, kind in rows:
        model = r.get("model", (results.get("modes") or {}).get("metadata", {}).get("model",
                                                                                    "mlp"))
        batch = r.get("batch", 32)
        prof = nearest_profile(profiles.get(model), batch)
        if prof is None:
            continue
        workload, ps = job_inputs(fabric, prof, rate)
        mode = r.get("mode", "sync")
        lay = cm.Layout(r["workers"], 1, r["ps"], 0, False, mode)
        pr = cm.project(fabric, workload(batch), ps, lay)
        point = (f"{model} {kind} W={r['workers']} P={r['ps']} batch={batch}" if suite ==
                 "scaling" else f"{mode} W={r['workers']} P={r['ps']}")
        out.append(entry(suite, point, r["workers"] + r["ps"], r["examples_per_sec"],
                         pr.examples_per_sec))
    return out


def validate_pushpull(results):
    """Return entries for the 1-worker push+pull points (round-trip seconds).

    The mpitf link (alpha + beta x bytes) is fitted on the ps-``none`` points (basis
    ``fitted``); the ``sgd`` points are predicted from that fit plus SGD's axpy, timed
    apart on the ps in the same run.
    """
    pp = results.get("pushpull_main")
    if not pp:
        return []
    rows = pp["results"]
    none = [r for r in rows if r["optimizer"] == "none"]
    if len({r["bytes"] for r in none}) < 2:
        return []
    alpha, beta, _ = cm.fit_alpha_beta([r["bytes"] for r in none],
                                       [r["mpitf_us"] * 1e-6 for r in none])
    ranks = pp["metadata"]["ranks"]
    out = []
    for r in rows:
        link = alpha + beta * r["bytes"]
        projected = link if r["optimizer"] == "none" else link + r["axpy_us"] * 1e-6
        out.append(entry("pushpull", f"{r['bytes']} B ps {r['optimizer']}", ranks,
                         r["mpitf_us"] * 1e-6, projected,
                         "fitted" if r["optimizer"] == "none" else "predicted", "s"))
    return out


def validate(results):
    """Return the ``validation`` list of a results dict (empty entries when inputs lack)."""
    fabric = fabric_of(results)
    out = validate_pushpull(results)
    if fabric is not None:
        out += validate_jobs(results, fabric)
    return out


def claim(entries, target=15.0):
    """Return (counted entries, worst |error| %, all within ``target``) over counted points."""
    counted = [e for e in entries if e["counted"]]
    worst = max((abs(e["error_pct"]) for e in counted), default=None)
    return counted, worst, worst is not None and worst <= target
