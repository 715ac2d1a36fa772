"""The cost model and the planner as pure functions, and ``mpitf bench --plan`` from the CLI."""

import json
import math
import subprocess
import sys

import pytest

from mpitf.bench import costmodel as cm
from mpitf.bench import planner
from mpitf.bench import validation as val
from mpitf.config import TrainingConfig
from mpitf.errors import ConfigurationError
from tests.support import REPO

IB = cm.Fabric(1.5e-6, 2.5e10)  # the worked example's fabric (docs/costmodel.md)
PS = cm.PsNode(apply_rate=2e9, threads=8, msg_overhead=10e-6)
RESNET = cm.Workload(100e6, 0.150)  # ~100 MB of float32, 150 ms per step


def test_fit_recovers_known_alpha_beta_and_refuses_bad_input():
    alpha, beta = 7e-6, 2e-10
    sizes = [4096 << (2 * k) for k in range(8)]
    a, b, err = cm.fit_alpha_beta(sizes, [alpha + beta * s for s in sizes])
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)
    assert err < 1e-9
    noisy = [(5e-6 + 1e-10 * s) * f for s, f in zip(sizes, (1.02, 0.98, 1.01, 0.99) * 2)]
    a, b, err = cm.fit_alpha_beta(sizes, noisy)
    assert a == pytest.approx(5e-6, rel=0.1) and b == pytest.approx(1e-10, rel=0.05)
    with pytest.raises(ValueError):
        cm.fit_alpha_beta([1, 1], [1.0, 2.0])
    with pytest.raises(ValueError):
        cm.fit_alpha_beta([1], [1.0])
    assert cm.kth_fastest(1.0, 0.0, 8, 8) == 1.0
    assert cm.kth_fastest(1.0, 0.5, 8, 7) < cm.kth_fastest(1.0, 0.5, 8, 8)


def test_one_worker_step_is_compute_plus_a_round_trip():
    work = cm.Workload(1e6, 0.01, batch=32, overhead=0.001)
    ps = cm.PsNode(apply_rate=1e9, threads=2, msg_overhead=5e-6)
    pr = cm.project(IB, work, ps, cm.Layout(1))
    trip = 2 * (1e6 / 2.5e10 + 5e-6) + 1e6 / 2e9 + 2 * 1.5e-6  # in, out, one apply, L
    assert pr.step_time == pytest.approx(0.011 + trip)
    assert pr.examples_per_sec == pytest.approx(32 / pr.step_time)
    assert pr.efficiency == pytest.approx(0.011 / pr.step_time)


@pytest.mark.parametrize("mode", cm.MODES)
def test_physical_limits_and_monotonicity(mode):
    for buckets in (0, 1 << 20):
        eps, eff = [], []
        for nodes in ((2,) if mode == "backup" else (1, 2)) + (8, 64, 512, 4096):
            pr = cm.project(IB, RESNET, PS, cm.Layout(nodes, 1, 8, buckets, mode=mode))
            assert 0 < pr.efficiency <= 1 and pr.step_time >= RESNET.compute
            eps.append(pr.examples_per_sec)
            eff.append(pr.efficiency)
        assert all(b >= a * (1 - 1e-12) for a, b in zip(eps, eps[1:]))  # more never slower
        if mode != "backup":  # backup's share of examples kept, (N-1)/N, grows with N
            assert all(b <= a + 1e-12 for a, b in zip(eff, eff[1:]))  # never more efficient
    steps = [cm.project(IB, RESNET, PS, cm.Layout(256, 1, p, mode=mode)).step_time
             for p in (1, 2, 8, 64)]
    assert steps == sorted(steps, reverse=True)  # more ps never slower


def test_aggregation_divides_the_ps_link_load_by_the_workers_per_node():
    off = cm.project(IB, RESNET, PS, cm.Layout(64, 4, 8))
    on = cm.project(IB, RESNET, PS, cm.Layout(64, 4, 8, aggregate=True))
    assert off.terms["ps_link"] == pytest.approx(256 * 100e6 / 8 / 2.5e10)
    assert on.terms["ps_link"] == pytest.approx(off.terms["ps_link"] / 4)
    assert on.terms["aggregate"] == pytest.approx(2 * 100e6 / PS.shm_bandwidth)
    assert on.step_time < off.step_time
    assert cm.project(IB, RESNET, PS, cm.Layout(64, 4, 8, aggregate=True, mode="async")
                      ).terms["aggregate"] == 0  # sync only


def test_backup_workers_trade_examples_for_the_straggler_tail():
    work = cm.Workload(10e6, 0.1, batch=32, straggle=0.5)
    sync = cm.project(IB, work, PS, cm.Layout(16, 1, 4))
    backup = cm.project(IB, work, PS, cm.Layout(16, 1, 4, mode="backup", replicas=14))
    assert backup.step_time < sync.step_time
    assert backup.examples_per_sec == pytest.approx(14 * 32 / backup.step_time)


def test_ps_for_links_and_the_link_bound():
    lay = cm.Layout(128, 4)
    need = cm.ps_for_links(IB, RESNET, lay)
    assert need == math.ceil(512 * 100e6 / (2.5e10 * 0.150)) == 14
    assert 512 * 100e6 / need / 2.5e10 <= 0.150 < 512 * 100e6 / (need - 1) / 2.5e10
    slow = cm.Fabric(1e-6, 1e8)  # 100 MB takes a second on one worker's own link
    assert cm.ps_for_links(slow, RESNET, lay) is None
    lines = planner.format_plan(planner.plan(slow, RESNET, PS, 16, 1))
    assert any("LINK-BOUND" in line for line in lines)


@pytest.mark.parametrize("nodes, ps, bucket, agg, eff", [
    (128, 14, 262144, True, 0.868), (1024, 110, 262144, True, 0.724)])
def test_worked_example(nodes, ps, bucket, agg, eff):
    result = planner.plan(IB, RESNET, PS, nodes, 4)
    lay, pr = result["layout"], result["projection"]
    assert (lay.num_ps, lay.bucket_bytes, lay.aggregate) == (ps, bucket, agg)
    assert pr.efficiency == pytest.approx(eff, abs=5e-4) and pr.efficiency <= 1
    assert result["ps_for_links"] <= lay.num_ps  # the links keep up within the compute
    assert pr.terms["ps_link"] <= RESNET.compute


def test_parse_size_and_fabric(tmp_path):
    assert planner.parse_size("100M") == 100e6
    assert planner.parse_size("2.5G") == 2.5e9
    assert planner.parse_size("64MiB") == 64 << 20
    assert planner.parse_size("4096") == 4096
    for bad in ("", "ten", "-5M", "0", "12X", "1e999"):
        with pytest.raises(ConfigurationError, match="--model-bytes"):
            planner.parse_size(bad)
    f = planner.parse_fabric("1.5e-6,2.5e10")
    assert (f.latency, f.bandwidth) == (1.5e-6, 2.5e10)
    path = tmp_path / "fabric.json"
    path.write_text(json.dumps({"latency_s": 2e-6, "bytes_per_s": 1e10}))
    assert planner.parse_fabric(str(path)).bandwidth == 1e10
    path.write_text("{}")
    with pytest.raises(ConfigurationError, match="not a fabric file"):
        planner.parse_fabric(str(path))
    for bad, why in (("1e-6,-3", "bandwidth > 0"), ("a,b", "LATENCY_S,BYTES_PER_S"),
                     (str(tmp_path / "none.json"), "no such file")):
        with pytest.raises(ConfigurationError, match=why):
            planner.parse_fabric(bad)
    with pytest.raises(ConfigurationError, match="profile_steps"):
        TrainingConfig(profile_steps=-1)


def _plan(*args):
    return subprocess.run([sys.executable, "-m", "mpitf.cli.main", "bench", "--plan", *args],
                          capture_output=True, text=True, timeout=60)


def test_plan_command_prints_the_recommendation():
    run = _plan("--nodes", "128", "--workers-per-node", "4", "--model-bytes", "100M",
                "--compute-ms", "150", "--fabric", "1.5e-6,2.5e10", "--ps-threads", "8")
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "recommended ps:          14\n" in out
    assert "--bucket-bytes 262144" in out and "aggregation:  on" in out
    assert "expected efficiency:     0.868" in out and "bounded by:" in out


@pytest.mark.parametrize("args, message", [
    (["--nodes", "-3"], "--nodes -3: expecting a number above zero"),
    (["--model-bytes", "10X"], "--model-bytes '10X': expecting a size"),
    (["--fabric", "/no/such/fabric.json"], "--fabric /no/such/fabric.json: no such file"),
    (["--compute-ms", "0"], "--compute-ms 0: expecting a number above zero"),
    (["--workers-per-node", "1.5"], "--workers-per-node 1.5: expecting a whole number"),
    (["--nodes", "many"], "--nodes many: expecting a number above zero"),
])
def test_plan_bad_input_is_one_message_and_exit_2(args, message):
    base = {"--nodes": "8", "--model-bytes": "1M", "--compute-ms": "10",
            "--fabric": "1e-6,1e10"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    run = _plan(*[x for kv in base.items() for x in kv])
    assert run.returncode == 2 and run.stdout == ""
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith(f"mpitf: error: {message}")


def test_validation_entries_count_only_predicted_points_within_the_cores():
    def raw_us(b):
        return 5 + b / 4e3

    def none_us(b):  # mpitf's 8 us over raw; the 64 KiB point off the line
        return raw_us(b) + 8 + (30 if b == 65536 else 0)

    def apply_us(b):  # the ps's kernel: 3 us per call, 2 GB/s
        return 3 + b / 2e3

    def sgd_us(b):  # the wire, mpitf's 8 us, the kernel's call and b at its rate, as timed
        return raw_us(b) + 8 + apply_us(4096) + b * apply_us(1 << 20) / (1 << 20)

    def row(b, o):
        return dict(bytes=b, optimizer=o, num_ps=1, raw_mpi_us=raw_us(b), axpy_us=b / 1e3,
                    mpitf_us=sgd_us(b) if o == "sgd" else none_us(b), apply_us=apply_us(b))

    prof = dict(model_bytes=40000, compute_s=1e-3, compute_s_per_example=1e-3 / 32,
                batch_size=32, num_ps=1, push_pull_s=5e-4, overhead_s=1e-4)
    results = dict(
        fabric=dict(latency_s=2e-6, bytes_per_s=5e9),
        profiles={"mlp": {"32": prof, "96": dict(prof, batch_size=96, compute_s=1)}},
        scaling=dict(results=[
            dict(model="mlp", scaling="weak", workers=w, ps=1, batch=32,
                 examples_per_sec=32 / (1.5e-3 + 1e-4 * w)) for w in (1, 2)]),
        pushpull_main=dict(metadata=dict(ranks=2), results=[
            row(b, o) for b in (4096, 65536, 1 << 20) for o in ("none", "sgd")]))
    entries = val.validate(results)
    keys = {"suite", "point", "ranks", "cores", "measured", "projected", "error_pct"}
    assert all(keys <= set(e) for e in entries) and len(entries) == 8
    scaling = [e for e in entries if e["suite"] == "scaling"]
    assert [e["ranks"] for e in scaling] == [2, 3]
    assert abs(scaling[0]["error_pct"]) < 1  # the profile's own configuration
    pushpull = [e for e in entries if e["suite"] == "pushpull"]
    assert [e["basis"] for e in pushpull] == ["fitted", "predicted"] * 3
    # sgd: the same size's raw + mpitf's cost (none - raw at 4 KiB) + the kernel's call
    # (at 4 KiB) + the bytes at the rate of the kernel at the largest size
    assert all(abs(e["error_pct"]) < 1e-6 for e in pushpull if e["basis"] == "predicted")
    assert abs(pushpull[2]["error_pct"]) > 1  # the none point off the line
    assert all(e["counted"] == (e["ranks"] <= e["cores"] and e["basis"] == "predicted")
               for e in entries)
    counted, worst, ok = val.claim(entries)
    assert worst == max(abs(e["error_pct"]) for e in counted)


def test_the_docs_worked_example_is_what_the_planner_prints(capsys):
    import re
    import shlex

    from mpitf.cli.main import main

    doc = (REPO / "docs" / "costmodel.md").read_text()
    blocks = re.findall(r"```\n\$ (mpitf bench --plan[^\n]*)\n(.*?)```", doc, re.S)
    assert len(blocks) == 2
    for command, printed in blocks:
        assert main(shlex.split(command)[1:]) == 0
        assert capsys.readouterr().out == printed


SLOW_LINKS = cm.Fabric(1e-4, 6.25e7)  # 500 Mbit/s, as the box's scaling runs


def test_the_planner_puts_ps_beside_the_workers_where_a_node_is_worth_more():
    work = cm.Workload(16e6, 0.1)
    result = planner.plan(SLOW_LINKS, work, PS, 8, 1)
    lay = result["layout"]
    assert lay.beside and lay.num_ps == 8
    own = planner.plan(SLOW_LINKS, work, PS, 8, 1, placements=("own",))["layout"]
    assert not own.beside
    # beside, every node used is a worker's; on nodes of their own the ps nodes count too
    assert planner.node_efficiency(result["projection"], lay) == \
        pytest.approx(result["projection"].efficiency)
    own_pr = cm.project(SLOW_LINKS, work, PS, own)
    assert planner.node_efficiency(own_pr, own) == \
        pytest.approx(own_pr.efficiency * 8 / (8 + own.num_ps))
    assert planner.node_efficiency(own_pr, own) < result["projection"].efficiency
    lines = planner.format_plan(result)
    assert "recommended placement:   beside the workers (one ps on each of 8 worker nodes)" \
        in lines
    # a node's link: its worker's share to the 7 other ps, the 7 other workers' to its ps
    assert any(line.startswith("ps link load:            (7 other ps + 7 other workers) x "
                               "16 MB / 8 ps = 28 MB per direction") for line in lines)


def test_with_several_workers_a_node_the_planner_keeps_ps_on_nodes_of_their_own():
    assert not planner.plan(IB, RESNET, PS, 128, 4)["layout"].beside
    run = _plan("--nodes", "8", "--workers-per-node", "2", "--model-bytes", "16M",
                "--compute-ms", "100", "--fabric", "1e-4,6.25e7", "--plan-placement", "beside")
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip() == (
        "mpitf: error: --plan-placement beside puts one ps beside each worker node, one "
        "worker per node: give --workers-per-node 1 or another placement")
