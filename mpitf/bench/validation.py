"""The cost model against every measured point of ``mpitf bench``: the ``validation`` list.

Each entry is ``{"suite", "point", "ranks", "cores", "measured", "projected", "error_pct",
"unit", "basis", "counted"}`` (unit: examples/s for jobs, s for a push+pull round
trip). ``basis`` says where the projection's inputs come from: ``predicted`` (measured
elsewhere: the fabric ping-pong, separate profiled runs of the job, the kernels suite)
or ``fitted`` (the point itself took part in a fit; never counted). Points with more
ranks than cores are marked and not counted either. A job point is projected from its
model's inputs (:func:`job_inputs`, the same for every point of the model), never from
its own run.
"""

import os
import statistics

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


def message_cost(fabric, profile, rate):
    """Return the ps's software seconds per message (``o``) that one profile shows.

    What the profiled push+pull leaves over the fabric's transfer and latency and the
    apply, over the two messages of a step (the push in, the reply out).
    """
    ps = cm.PsNode(apply_rate=rate, threads=1, msg_overhead=0.0)
    work = cm.Workload(profile["model_bytes"], profile["compute_s"], profile["batch_size"])
    t = cm.comm_terms(fabric, work, ps, cm.Layout(1, 1, profile["num_ps"]), 1)
    return max(0.0, (profile["push_pull_s"] - cm.pipelined(t) - t["latency"]) / 2)


def compute_line(profiles):
    """Return ``(fixed, per_example)``: compute per step = fixed + per_example x batch.

    The line through the profiles' (batch, compute) (least squares over more than two),
    so it holds at the profiled batches; its fixed part may be negative (compute growing
    faster than the batch: the CNN here), see :func:`compute_at`. A larger batch measured
    faster, which only noise does, gives the mean compute for every batch; one profile: no
    fixed part.
    """
    batches = [p["batch_size"] for p in profiles]
    if len(set(batches)) < 2:
        return 0.0, statistics.fmean(p["compute_s_per_example"] for p in profiles)
    computes = [p["compute_s"] for p in profiles]
    fixed, per_example, _ = cm.fit_alpha_beta(batches, computes, nonnegative=False)
    if per_example <= 0:
        return statistics.fmean(computes), 0.0
    return fixed, per_example


def compute_at(inputs, batch):
    """Return a model's compute per step at ``batch`` from its :func:`job_inputs`.

    The line; below the smallest profiled batch a negative fixed part would shrink compute
    faster than the batch (to nothing), so there the smallest profile is scaled instead.
    """
    line = inputs["compute_fixed_s"] + inputs["compute_per_example_s"] * batch
    smallest = inputs["batches"][0]
    if inputs["compute_fixed_s"] >= 0 or batch >= smallest:
        return line
    return (inputs["compute_fixed_s"] + inputs["compute_per_example_s"] * smallest) * (
        batch / smallest)


def job_inputs(fabric, profiles, rate):
    """Return the inputs of one model from all its profiles: ``{"compute_fixed_s", ...}``.

    Compute is a fixed part per step plus a part per example (:func:`compute_line`); the
    session's overhead ``O`` per step and the ps's cost ``o`` per message do not depend on
    the batch: each is the mean over the profiles. Every point of the model uses these.
    """
    fixed, per_example = compute_line(profiles)
    return dict(model_bytes=profiles[0]["model_bytes"], num_ps=profiles[0]["num_ps"],
                compute_fixed_s=fixed, compute_per_example_s=per_example,
                overhead_s=statistics.fmean(p["overhead_s"] for p in profiles),
                msg_overhead_s=statistics.fmean(message_cost(fabric, p, rate)
                                                for p in profiles),
                apply_rate=rate, batches=sorted(p["batch_size"] for p in profiles))


def project_job(fabric, inputs, batch, layout):
    """Return the :class:`~mpitf.bench.costmodel.Projection` of a job point (see the docs)."""
    work = cm.Workload(inputs["model_bytes"], compute_at(inputs, batch), batch,
                       overhead=inputs["overhead_s"])
    ps = cm.PsNode(apply_rate=inputs["apply_rate"], threads=1,
                   msg_overhead=inputs["msg_overhead_s"])
    return cm.project(fabric, work, ps, layout)


def model_inputs(results):
    """Return ``{model: job_inputs}`` from the results' fabric, profiles and kernels suite."""
    fabric = fabric_of(results)
    if fabric is None:
        return {}
    rate = apply_rate(results)
    return {model: job_inputs(fabric, list(by_batch.values()), rate)
            for model, by_batch in (results.get("profiles") or {}).items() if by_batch}


def entry(suite, point, ranks, measured, projected, basis="predicted", unit="examples/s"):
    """Return one validation entry; ``counted`` is False past the cores or when fitted."""
    cores = os.cpu_count() or 1
    err = cm.error_percent(measured, projected)
    return dict(suite=suite, point=point, ranks=ranks, cores=cores, measured=measured,
                projected=projected, error_pct=err, unit=unit, basis=basis,
                counted=ranks <= cores and basis == "predicted")


def validate_jobs(results, fabric):
    """Return entries for the scaling and modes points (examples/sec)."""
    inputs, out = model_inputs(results), []
    rows = [("scaling", r, r.get("scaling", "")) for r in
            (results.get("scaling") or {}).get("results", [])]
    for key in ("modes", "modes_w1"):
        rows += [(key.split("_")[0], r, "") for r in (results.get(key) or {}).get("results", [])]
    for suite, r, kind in rows:
        model = r.get("model", (results.get("modes") or {}).get("metadata", {}).get("model",
                                                                                    "mlp"))
        if model not in inputs:
            continue
        batch, mode = r.get("batch", 32), r.get("mode", "sync")
        lay = cm.Layout(r["workers"], 1, r["ps"], 0, False, mode)
        pr = project_job(fabric, inputs[model], batch, lay)
        point = (f"{model} {kind} W={r['workers']} P={r['ps']} batch={batch}" if suite ==
                 "scaling" else f"{mode} W={r['workers']} P={r['ps']}")
        out.append(entry(suite, point, r["workers"] + r["ps"], r["examples_per_sec"],
                         pr.examples_per_sec))
    return out


def validate_pushpull(results):
    """Return entries for the 1-worker push+pull points, one frame (round-trip seconds).

    An ``sgd`` point is predicted as the model composes a step, from figures that are not
    its own: the wire (the raw MPI round trip of the same rounds and size, which on one
    machine is a copy through caches whose cost moves with where the host runs the two
    ranks), mpitf's software cost per round trip (``none`` minus raw at the smallest
    size), the fused kernel's cost per call (``apply_us`` at the smallest size) and the
    shard's bytes at the kernel's rate on the ps (``apply_us`` at the largest size, the
    same run; else the kernels suite's ``A``): one worker's push is applied where it
    lands, one pass. The ``none`` points fit the mpitf link (alpha + beta x bytes, basis
    ``fitted``): a ps that changes nothing sends back lines both ranks hold in cache, so
    they are not a wire a training step meets.
    """
    pp = results.get("pushpull_main")
    if not pp:
        return []
    rows = [r for r in pp["results"] if not r.get("bucket_bytes")]  # the one-frame path
    none = {r["bytes"]: r["mpitf_us"] * 1e-6 for r in rows if r["optimizer"] == "none"}
    if len(none) < 2:
        return []
    alpha, beta, _ = cm.fit_alpha_beta(list(none), list(none.values()))
    smallest, largest = (f(rows, key=lambda r: r["bytes"]) for f in (min, max))
    software = max(0.0, none[smallest["bytes"]] - smallest["raw_mpi_us"] * 1e-6)
    per_call = smallest.get("apply_us", smallest["axpy_us"]) * 1e-6
    rate = (largest["bytes"] / largest["num_ps"] / (largest["apply_us"] * 1e-6)
            if largest.get("apply_us") else apply_rate(results))
    ranks = pp["metadata"]["ranks"]
    out = []
    for r in rows:
        if r["optimizer"] == "none":
            projected, basis = alpha + beta * r["bytes"], "fitted"
        else:
            projected = (r["raw_mpi_us"] * 1e-6 + software + per_call +
                         r["bytes"] / r["num_ps"] / rate)
            basis = "predicted"
        out.append(entry("pushpull", f"{r['bytes']} B ps {r['optimizer']}", ranks,
                         r["mpitf_us"] * 1e-6, projected, basis, "s"))
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
