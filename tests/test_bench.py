"""The cost model (pure), the push/pull benchmark's JSON, and the timeline of a training job."""

import json
import math
import sys
from pathlib import Path

import pytest

from mpitf.bench import costmodel as cm

REPO = Path(__file__).resolve().parent.parent


def test_fit_recovers_known_alpha_beta():
    alpha, beta = 7e-6, 2e-10
    sizes = [4096 << (2 * k) for k in range(8)]
    fit = cm.fit_alpha_beta(sizes, [alpha + beta * s for s in sizes])
    assert fit.alpha == pytest.approx(alpha, rel=1e-6)
    assert fit.beta == pytest.approx(beta, rel=1e-6)
    assert fit.bandwidth == pytest.approx(2 / beta)
    plain = cm.fit_alpha_beta(sizes, [alpha + beta * s for s in sizes], relative=False)
    assert plain.beta == pytest.approx(beta, rel=1e-6)


def test_fit_with_noise_and_bad_input():
    sizes = [1e3, 1e4, 1e5, 1e6, 1e7]
    noisy = [(5e-6 + 1e-10 * s) * f for s, f in zip(sizes, (1.02, 0.98, 1.01, 0.99, 1.0))]
    fit = cm.fit_alpha_beta(sizes, noisy)
    assert fit.alpha == pytest.approx(5e-6, rel=0.1)
    assert fit.beta == pytest.approx(1e-10, rel=0.05)
    assert fit.alpha >= 0 and fit.max_rel_error < 0.05
    with pytest.raises(ValueError):
        cm.fit_alpha_beta([1, 1], [1.0, 2.0])
    with pytest.raises(ValueError):
        cm.fit_alpha_beta([1], [1.0])


def test_apply_cost_and_order_statistics():
    fit = cm.with_apply_cost(cm.LinkFit(1e-6, 1e-10), [1e6, 2e6], [1e-4, 2e-4])
    assert fit.gamma == pytest.approx(1e-10)
    assert cm.kth_fastest(1.0, 0.0, 8, 8) == 1.0
    assert cm.kth_fastest(1.0, 0.5, 8, 7) < cm.kth_fastest(1.0, 0.5, 8, 8)
    with pytest.raises(ValueError):
        cm.kth_fastest(1.0, 0.5, 4, 5)


FIT = cm.LinkFit(alpha=10e-6, beta=2e-10, gamma=1e-10)


@pytest.mark.parametrize("mode", cm.MODES)
def test_projection_monotone(mode):
    model, batch, per_ex = 40e6, 32, 50e-6
    n_values = [2, 4, 16, 64, 256, 1024]
    eps = [cm.project(FIT, mode, n, 4, model, batch, per_ex)["examples_per_sec"]
           for n in n_values]
    eff = [cm.project(FIT, mode, n, 4, model, batch, per_ex)["efficiency"] for n in n_values]
    assert all(b >= a * (1 - 1e-12) for a, b in zip(eps, eps[1:]))  # more workers never slower
    assert all(b <= a + 1e-12 for a, b in zip(eff, eff[1:]))  # ... but never more efficient
    steps = [cm.project(FIT, mode, 64, p, model, batch, per_ex)["step_time"] for p in (1, 2, 8)]
    assert steps[0] >= steps[1] >= steps[2]  # more ps never slower
    one = cm.project(FIT, "sync", 1, 1, model, batch, per_ex)
    assert one["efficiency"] == pytest.approx(1.0)


def test_saturation_and_ps_needed():
    model, compute = 40e6, 2e-3
    n_sat = cm.saturation_workers(FIT, model, 1, compute)
    assert cm.link_time(FIT, model, math.floor(n_sat), 1) - FIT.alpha <= compute
    need = [cm.ps_needed(FIT, model, n, compute) for n in (1, 8, 64, 512)]
    assert need == sorted(need) and need[0] >= 1
    for n, p in zip((1, 8, 64, 512), need):
        assert cm.link_time(FIT, model, n, p) < compute
        if p > 1:
            assert cm.link_time(FIT, model, n, p - 1) >= compute
    assert cm.ps_needed(FIT, model, 8, FIT.alpha / 2) == math.inf
    big = cm.project(FIT, "sync", 4096, 1, model, 32, 50e-6)
    assert big["link_bound"]


def test_compute_per_example_and_error():
    model, batch = 4e5, 32
    per_ex = 40e-6
    eps = batch / (per_ex * batch + cm.link_time(FIT, model, 1, 1))
    assert cm.compute_per_example(FIT, model, batch, eps) == pytest.approx(per_ex)
    assert cm.error_percent(100.0, 110.0) == pytest.approx(10.0)


@pytest.mark.mpi
def test_pushpull_json(mpirun, tmp_path):
    out = tmp_path / "pp.json"
    run = mpirun(2, REPO / "benchmarks" / "pushpull.py", "--num-ps", 1, "--quick", "--sizes",
                 "4096,1048576", "--json", out, timeout=60)
    assert run.returncode == 0, run.output
    data = json.loads(out.read_text())
    rows = data["results"]
    assert {(r["bytes"], r["optimizer"]) for r in rows} == {
        (b, o) for b in (4096, 1048576) for o in ("none", "sgd")}
    keys = ("mpitf_gbps", "raw_mpi_gbps", "ratio", "mpitf_us", "raw_mpi_us", "axpy_us")
    for r in rows:
        assert r["num_ps"] == 1 and r["num_workers"] == 1
        assert all(r[k] > 0 for k in keys), r
    assert data["ps_peak_rss"] and all(v > 0 for v in data["ps_peak_rss"].values())
    for k in ("mpi_library", "hostname", "date", "repetitions"):
        assert data["metadata"][k]


@pytest.mark.mpi
def test_overlap_json(mpirun, tmp_path):
    out = tmp_path / "ov.json"
    run = mpirun(2, REPO / "benchmarks" / "overlap.py", "--quick", "--json", out, timeout=120)
    assert run.returncode == 0, run.output
    row = json.loads(out.read_text())
    assert row["layers"] == 4 and row["buckets"] == 4  # one bucket per layer
    assert sorted(row["step_ms"]) == ["1", "4"]
    for key in ("compute_ms", "comm_ms", "backward_ms"):
        assert row[key] > 0, row
    for k in ("1", "4"):
        assert row["step_ms"][k] > 0 and 0 <= row["hidden"][k] <= 1
        assert row["exposed_ms"][k] >= 0
    assert row["ratio"] == pytest.approx(row["step_ms"]["4"] / row["step_ms"]["1"])
    assert "ratio" in run.stdout


@pytest.mark.mpi
def test_frameworks_json(mpirun, tmp_path):
    # torch MLP and CNN against torch alone + raw MPI, and buckets against one (quick mode)
    out = tmp_path / "fw.json"
    run = mpirun(2, REPO / "benchmarks" / "frameworks.py", "--quick", "--json", out,
                 timeout=120)
    assert run.returncode == 0, run.output
    data = json.loads(out.read_text())
    for name in ("mlp", "cnn"):
        row = data[name]
        assert all(row[k] > 0 for k in ("torch_ms", "raw_ms", "mpitf_ms", "bytes")), row
        assert row["ratio"] == pytest.approx(row["mpitf_ms"] / (row["torch_ms"] +
                                                                row["raw_ms"]))
    ov = data["overlap"]
    assert ov["buckets"] == ov["layers"] == 3 and ov["one_bucket_ms"] > 0
    assert ov["ratio"] == pytest.approx(ov["buckets_ms"] / ov["one_bucket_ms"])
    assert "3 buckets leave as backward produces them" in run.stdout, run.output
    assert data["repeats"] == 1 and len(data["load_average"]) == 3


@pytest.mark.mpi
def test_timeline_covers_every_rank_and_step(mpirun, tmp_path):
    trace, steps = tmp_path / "tl.json", 6
    run = mpirun(3, REPO / "jobs" / "mnist_mlp.py", "--num-ps", 1, "--steps", steps,
                 "--log-every", 100, "--run-dir", tmp_path / "run", "--timeline", trace,
                 timeout=60)
    assert run.returncode == 0, run.output
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    names = {e["pid"]: e["args"]["name"] for e in json.loads(trace.read_text())["traceEvents"]
             if e["name"] == "process_name"}
    assert sorted(names) == [0, 1, 2]
    ps = [r for r, n in names.items() if "/job:ps/" in n]
    workers = [r for r, n in names.items() if "/job:worker/" in n]
    assert len(ps) == 1 and len(workers) == 2
    for rank in workers:
        for kind in ("compute", "push_pull"):
            seen = {e["args"].get("step") for e in events if e["pid"] == rank and
                    e["name"] == kind}
            assert set(range(steps)) <= seen, (rank, kind, sorted(seen, key=str))
    applied = {e["args"].get("step") for e in events if e["pid"] == ps[0] and
               e["name"] == "apply"}
    assert set(range(steps)) <= applied
    assert all(e["dur"] >= 0 for e in events)


@pytest.mark.mpi
def test_timeline_shows_push_apply_and_pull_per_bucket(mpirun, tmp_path):
    trace, steps = tmp_path / "tl.json", 4
    run = mpirun(3, REPO / "jobs" / "mnist_mlp.py", "--num-ps", 1, "--steps", steps,
                 "--log-every", 100, "--run-dir", tmp_path / "run", "--timeline", trace,
                 "--bucket-bytes", 64, timeout=60)  # one ps: four buckets, a variable each
    assert run.returncode == 0, run.output
    trace_events = json.loads(trace.read_text())["traceEvents"]
    events = [e for e in trace_events if e["ph"] == "X"]
    names = {e["pid"]: e["args"]["name"] for e in trace_events if e["name"] == "process_name"}
    (ps,) = [r for r, n in names.items() if "/job:ps/" in n]
    workers = [r for r, n in names.items() if "/job:worker/" in n]
    every = {(step, k) for step in range(steps) for k in range(4)}
    for rank, kinds in [(w, ("push", "pull")) for w in workers] + [(ps, ("apply",))]:
        for kind in kinds:
            seen = {(e["args"].get("step"), e["args"].get("bucket")) for e in events
                    if e["pid"] == rank and e["name"] == kind}
            assert every <= seen, (rank, kind, sorted(seen))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
