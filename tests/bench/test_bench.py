"""The push/pull, overlap and sparse benchmarks' JSON, and the timeline of a training job.

The cost model and the planner: tests/bench/test_costmodel.py."""

import json
import sys

import pytest

from tests.support import REPO


@pytest.mark.mpi
def test_pushpull_json(mpirun, tmp_path):
    out = tmp_path / "pp.json"
    run = mpirun(2, REPO / "benchmarks" / "pushpull.py", "--num-ps", 1, "--quick", "--sizes",
                 "4096,1048576", "--rounds", 1, "--reps", 20, "--json", out, timeout=60)
    assert run.returncode == 0, run.output
    data = json.loads(out.read_text())
    rows = data["results"]
    assert {(r["bytes"], r["optimizer"]) for r in rows} == {
        (b, o) for b in (4096, 1048576) for o in ("none", "sgd")}
    keys = ("mpitf_gbps", "raw_mpi_gbps", "ratio", "mpitf_us", "raw_mpi_us", "axpy_us",
            "apply_us")
    for r in rows:
        assert r["num_ps"] == 1 and r["num_workers"] == 1
        assert all(r[k] > 0 for k in keys), r
    assert data["ps_peak_rss"] and all(v > 0 for v in data["ps_peak_rss"].values())
    for k in ("mpi_library", "hostname", "date", "repetitions"):
        assert data["metadata"][k]


@pytest.mark.slow
@pytest.mark.mpi
def test_sparse_json(mpirun, tmp_path):
    # issue 13's command and JSON, on a small table: the bytes on the wire within the bound
    out = tmp_path / "s.json"
    run = mpirun(2, REPO / "benchmarks" / "sparse.py", "--rows", 10000, "--dim", 8,
                 "--batch", 64, "--fields", 4, "--zipf", 1.2, "--num-ps", 1, "--steps", 5,
                 "--json", out, timeout=60)
    assert run.returncode == 0, run.output
    (row,) = json.loads(out.read_text())["results"]
    for key in ("step_us", "raw_us", "dense_us", "gather_scatter_us", "dedup_us"):
        assert row[key] > 0, row
    assert 1 < row["unique_ids"] <= 64 * 4
    headers = 2048  # the sparse and dense messages' headers and alignment: ~1.4 KB measured
    assert row["unique_ids"] * (8 + 2 * 8 * 4) < row["bytes_per_step"] \
        <= row["bytes_bound"] + headers, row


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.mpi
def test_torch_tables_json(mpirun, tmp_path):
    # the torch click model with mpitf.torch.EmbeddingBag against nn.EmbeddingBag (quick)
    out = tmp_path / "tt.json"
    run = mpirun(2, REPO / "benchmarks" / "torch_tables.py", "--quick", "--json", out,
                 timeout=120)
    assert run.returncode == 0, run.output
    (row,) = json.loads(out.read_text())["results"]
    assert row["tables_ms"] > 0 and row["dense_ms"] > 0, row
    assert row["ratio"] == pytest.approx(row["dense_ms"] / row["tables_ms"])
    assert row["rows"] == 10_000 and 1 < row["unique_ids"] <= 256 * 26


@pytest.mark.slow
@pytest.mark.mpi
def test_recsys_json(mpirun, tmp_path):
    # the dlrm model through mpitf.torch against plain torch plus a raw round trip (quick)
    out = tmp_path / "rs.json"
    run = mpirun(2, REPO / "benchmarks" / "recsys.py", "--quick", "--json", out, timeout=120)
    assert run.returncode == 0, run.output
    (row,) = json.loads(out.read_text())["results"]
    assert row["mpitf_ms"] > 0 and row["torch_ms"] > 0 and row["raw_ms"] > 0, row
    assert row["ratio"] == pytest.approx(row["mpitf_ms"] / (row["torch_ms"] + row["raw_ms"]))
    # 4 tables' unique ids of 256 examples: ids (pull, push) and a 16-float row each way
    assert row["fields"] == 4 and row["bytes_to_ps"] - row["bytes_back"] <= 4 * 256 * 16


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


@pytest.mark.mpi
def test_profile_steps_writes_the_planner_figures(mpirun, tmp_path):
    from mpitf.bench.scaling import model_bytes

    run = mpirun(3, REPO / "jobs" / "mnist_mlp.py", "--num-ps", 2, "--steps", 16,
                 "--profile-steps", 10, "--log-every", 0, "--run-dir", tmp_path / "run",
                 timeout=60)
    assert run.returncode == 0, run.output
    assert run.stdout.count("profile: 10 steps") == 1  # the chief only, once
    prof = json.loads((tmp_path / "run" / "profile.json").read_text())
    assert prof["model_bytes"] == model_bytes("mlp") == sum(prof["bytes_per_ps"])
    assert prof["num_ps"] == len(prof["bytes_per_ps"]) == 2 and prof["workers"] == 1
    assert prof["steps"] == 10 and prof["batch_size"] == 32 and prof["mode"] == "sync"
    assert prof["compute_s"] > 0 and prof["push_pull_s"] > 0 and prof["overhead_s"] >= 0
    assert prof["compute_s_per_example"] * 32 == pytest.approx(prof["compute_s"])
    assert prof["step_s"] >= prof["compute_s"]
    assert prof["plan_flags"].startswith(f"--model-bytes {prof['model_bytes']} --compute-ms ")
    assert not (tmp_path / "run" / "timeline.json").exists()


def test_histograms_alone_open_the_event_file_before_the_first_step(tmp_path):
    # --log-every 0 with histograms on opened it (importing tensorboardX) inside the loop,
    # a stall of a second that made a profiled step's mean 20-50x its median.
    from types import SimpleNamespace

    from mpitf.worker.hooks import LoggingHook

    hook = LoggingHook(0, str(tmp_path), summary_every=100)
    hook.begin(SimpleNamespace(global_step=0, steps_run=0))
    assert hook.events._writer is not None


def test_pushpull_measures_the_default_buckets_first_then_one_bucket():
    from mpitf.bench.pushpull import configurations, parse_args
    from mpitf.config import DEFAULT_BUCKET_BYTES

    args = parse_args([])
    assert args.bucket_bytes == [DEFAULT_BUCKET_BYTES, 0]
    assert configurations(args)[:2] == [("none", DEFAULT_BUCKET_BYTES, "float32"),
                                        ("none", 0, "float32")]


def _pushpull_row(nbytes, optimizer, bucket_bytes, ratio):
    return dict(bytes=nbytes, optimizer=optimizer, bucket_bytes=bucket_bytes, ratio=ratio,
                mpitf_us=10.0 / ratio, raw_mpi_us=10.0, num_workers=1, num_ps=1)


def test_report_checks_todays_targets_on_the_default_buckets():
    from mpitf.bench.report import _targets
    from mpitf.config import DEFAULT_BUCKET_BYTES as B

    rows = [_pushpull_row(4096, o, b, r) for o, b, r in
            (("none", B, 0.8), ("none", 0, 0.7), ("sgd", B, 0.5), ("sgd", 0, 0.5))]
    rows += [_pushpull_row(16 << 20, o, b, r) for o, b, r in
             (("none", B, 1.2), ("none", 0, 1.0), ("sgd", B, 0.9), ("sgd", 0, 0.6))]
    lines = "\n".join(_targets(dict(pushpull_main=dict(results=rows))))
    assert "2 MiB buckets" in lines
    # 4 KiB: each optimizer's time over raw MPI's (1 / ratio), one bucket's beside it
    assert "push+pull of 4096 B (none) <= 1.5 x raw MPI's time: 1.25 x; one bucket: 1.43 x " \
           "(met)" in lines, lines
    assert "push+pull of 4096 B (sgd) <= 1.5 x raw MPI's time: 2.00 x; one bucket: 2.00 x " \
           "(MISSED)" in lines, lines
    assert "ps sgd from 16 MiB >= 0.85 x raw GB/s: worst 0.90; one bucket: worst 0.60 (met)" \
        in lines, lines
    assert "ps none from 16 MiB >= 0.95 x raw GB/s: worst 1.20; one bucket: worst 1.00 (met)" \
        in lines, lines
    assert "1.25 x (raw + axpy)" not in lines  # the old one-frame target is gone


@pytest.mark.slow
@pytest.mark.mpi
def test_frameworks_vs_ddp_json(mpirun, tmp_path):
    # 1 ps + 2 workers against torch DDP on the same workers, and the ps's CPU shares
    out = tmp_path / "ddp.json"
    run = mpirun(3, REPO / "benchmarks" / "frameworks.py", "--vs-ddp", "--quick", "--idle",
                 0.3, "--json", out, timeout=120)
    assert run.returncode == 0, run.output
    data = json.loads(out.read_text())
    assert data["mpitf_ms"] > 0 and data["ddp_ms"] > 0
    assert data["ratio"] == pytest.approx(data["mpitf_ms"] / data["ddp_ms"])
    for share in ("ps_busy", "ps_idle", "worker_wait_idle"):
        assert 0 <= data[share] < 2, (share, data)  # a share of one core (2: a wrong clock)
    assert data["global_batch"] == 8 and data["parameters"] > 0
    assert "ratio" in run.stdout and "target <= 1.05" in run.stdout


def test_report_states_the_two_core_limit_beside_a_bucketed_figure():
    from mpitf.bench.pushpull import _limit
    from mpitf.bench.report import _targets
    from mpitf.config import DEFAULT_BUCKET_BYTES as B

    # raw 4 ms: 2 ms a copy; the ps copies in (2 ms) and applies (2 ms): at best 4/4 = 1
    assert _limit("sgd", B, 4e-3, 2e-3, 8 * B) == pytest.approx(1.0)
    assert _limit("none", B, 4e-3, 2e-3, 8 * B) == pytest.approx(2.0)
    assert _limit("sgd", 0, 4e-3, 2e-3, 8 * B) is None  # one bucket
    assert _limit("sgd", B, 4e-3, 2e-3, B) is None  # a shard within one bucket
    assert _limit("adam", B, 4e-3, 2e-3, 8 * B) is None
    row = dict(_pushpull_row(16 << 20, "sgd", B, 0.8), limit=0.9)
    lines = "\n".join(_targets(dict(pushpull_main=dict(results=[row]))))
    assert "worst 0.80 (limit 0.90) (MISSED)" in lines, lines
