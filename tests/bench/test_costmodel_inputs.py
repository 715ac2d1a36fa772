"""How mpitf bench measures a job's examples/s and turns profiles into the model's inputs.

Pure functions: the steady rate from the chief's metrics records, the profile's block
statistic, the compute line with its fixed part per step, and the projection of a point.
"""

import pytest

from mpitf.bench import costmodel as cm
from mpitf.bench import jobrate
from mpitf.bench import validation as val
from mpitf.worker.profile import steady_mean


def records(steps, seconds_per_step, per_step=32, every=10, start=0.0, slow=()):
    """The chief's metrics.jsonl records of a run: one every ``every`` global steps."""
    out, t = [], start
    for step in range(every, steps + 1, every):
        dt = every * seconds_per_step * (5 if step in slow else 1)
        t += dt
        out.append(dict(step=step, time=t, examples_per_sec=every * per_step / dt,
                        global_steps_per_sec=every / dt))
    return out


def test_steady_rate_leaves_out_the_warm_up_and_a_delayed_interval():
    recs = records(200, 1e-3, slow=(10, 20, 30, 120))  # slow start, one interval delayed
    rate = jobrate.steady_rate(recs, jobrate.warm_up_steps(200))
    assert jobrate.warm_up_steps(200) == 40 and rate["first_step"] == 40  # a fifth
    assert rate["examples_per_sec"] == pytest.approx(32 / 1e-3)  # the median interval
    assert rate["window_steps"] == 160 and rate["intervals"] == 16
    assert rate["mean_examples_per_sec"] == pytest.approx(160 * 32 / (0.160 + 0.040))


def test_async_rate_counts_every_workers_examples_over_the_chiefs_window():
    # async, 2 workers: the global step moves 2 per chief step; a record's examples per
    # global step is the batch (32), so the rate is both workers' examples
    recs = records(600, 0.5e-3, per_step=32)
    rate = jobrate.steady_rate(recs, jobrate.warm_up_steps(600))
    assert rate["examples_per_sec"] == pytest.approx(64e3)
    with pytest.raises(ValueError, match="expecting two metrics records"):
        jobrate.steady_rate(recs[-1:], 60)  # a chief that logged once: no window


def test_job_env_gives_each_rank_its_share_of_the_cores(monkeypatch):
    monkeypatch.setattr(jobrate.os, "cpu_count", lambda: 8)
    env = jobrate.job_env(3, base={"PATH": "/bin"})
    assert env["OPENBLAS_NUM_THREADS"] == env["OMP_NUM_THREADS"] == "2"
    assert jobrate.job_env(16, base={})["OMP_NUM_THREADS"] == "1"
    assert jobrate.job_env(2, base={"OMP_NUM_THREADS": "7"})["OMP_NUM_THREADS"] == "7"


def test_profile_figures_are_medians_of_block_means():
    assert steady_mean([]) == 0.0 and steady_mean([1.0, 3.0]) == 2.0
    values = [1.0] * 30 + [100.0] * 10  # a block another process delayed
    assert steady_mean(values) == 1.0
    assert steady_mean(list(range(25))) == pytest.approx((4.5 + 17.0) / 2)  # tail joins


def profile(batch, compute, push_pull=150e-6, overhead=100e-6, model_bytes=30000):
    return dict(model_bytes=model_bytes, num_ps=1, batch_size=batch, compute_s=compute,
                compute_s_per_example=compute / batch, push_pull_s=push_pull,
                overhead_s=overhead)


def test_compute_has_a_fixed_part_per_step_measured_by_two_profiles():
    fixed, per_example = val.compute_line([profile(32, 0.3e-3), profile(96, 0.7e-3)])
    assert fixed == pytest.approx(0.1e-3) and per_example == pytest.approx(6.25e-6)
    # one profile: no fixed part
    assert val.compute_line([profile(32, 0.3e-3)]) == pytest.approx((0, 0.3e-3 / 32))
    # compute growing faster than the batch: the line still holds at both batches, and
    # below the smallest one the smallest profile is scaled instead of the line
    fixed, per_example = val.compute_line([profile(32, 0.3e-3), profile(96, 2e-3)])
    assert fixed < 0 and fixed + 32 * per_example == pytest.approx(0.3e-3)
    inputs = dict(compute_fixed_s=fixed, compute_per_example_s=per_example, batches=[32, 96])
    assert val.compute_at(inputs, 96) == pytest.approx(2e-3)
    assert val.compute_at(inputs, 64) == pytest.approx(0.3e-3 + 32 * per_example)
    assert val.compute_at(inputs, 8) == pytest.approx(0.3e-3 / 4)
    positive = dict(inputs, compute_fixed_s=0.1e-3, compute_per_example_s=6.25e-6)
    assert val.compute_at(positive, 8) == pytest.approx(0.1e-3 + 8 * 6.25e-6)
    assert val.compute_line([profile(32, 0.7e-3), profile(96, 0.5e-3)]) == pytest.approx(
        (0.6e-3, 0.0))  # batch 96 faster than 32: noise, so no slope


def test_a_point_is_projected_from_every_profile_of_its_model():
    fabric = cm.Fabric(3e-6, 8e9)
    profs = [profile(32, 0.3e-3, push_pull=140e-6), profile(96, 0.7e-3, push_pull=160e-6)]
    inputs = val.job_inputs(fabric, profs, 3e9)
    assert inputs["overhead_s"] == pytest.approx(100e-6) and inputs["batches"] == [32, 96]
    transfer = 2 * 30000 / 8e9 + 30000 / 3e9 + 2 * 3e-6  # in, out, one apply, latency
    assert inputs["msg_overhead_s"] == pytest.approx((150e-6 - transfer) / 2)
    one = cm.Layout(1, 1, 1)
    for batch, compute in ((32, 0.3e-3), (48, 0.4e-3), (96, 0.7e-3)):
        step = val.project_job(fabric, inputs, batch, one).step_time
        assert step == pytest.approx(compute + 100e-6 + 150e-6)  # O + the mean push+pull
    # the per-step costs weigh more on a small step: 2 workers' strong point at batch 48
    two = val.project_job(fabric, inputs, 48, cm.Layout(2, 1, 1))
    assert two.step_time > 0.4e-3 + 100e-6 + 150e-6  # two pushes on one ps
    assert two.terms["messages"] == pytest.approx(2 * inputs["msg_overhead_s"])


def test_the_event_writer_loads_tensorboardx_without_torch(tmp_path):
    # torch took 2-7 s of the chief's start-up in every job with a run dir; in async mode
    # the other workers trained ahead meanwhile (the modes suite's 1-2M examples/s)
    import subprocess
    import sys

    code = ("import sys; from mpitf.worker.summaries import EventWriter; w = EventWriter("
            f"{str(tmp_path)!r}); w.load(); assert 'torch' not in sys.modules; "
            "w.scalars(1, {'loss': 0.5}); w.close(); import tensorboardX; print('ok')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert run.stdout.strip() == "ok", run.stderr
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1


def test_rounds_keep_each_points_best_run_and_the_fastest_profile():
    from mpitf.bench.runner import best_modes, best_profile, best_scaling

    def scaling_run(w1, w2):
        return dict(results=[dict(model="mlp", scaling="weak", ps=1, workers=w, batch=32,
                                  examples_per_sec=eps, efficiency=0.0)
                             for w, eps in ((1, w1), (2, w2))])

    merged = best_scaling([scaling_run(100.0, 150.0), scaling_run(80.0, 190.0)])
    assert [r["examples_per_sec"] for r in merged["results"]] == [100.0, 190.0]
    assert [r["runs"] for r in merged["results"]] == [[100.0, 80.0], [150.0, 190.0]]
    assert merged["results"][1]["efficiency"] == pytest.approx(190 / (2 * 100))
    slow, fast = dict(step_s=2e-3, compute_s=1.5e-3), dict(step_s=1e-3, compute_s=0.6e-3)
    best = best_profile([slow, fast, dict(slow, step_s=3e-3)])
    assert best["compute_s"] == 0.6e-3 and best["rounds"] == 3  # one round's figures, whole
    assert best["step_s_rounds"] == [2e-3, 1e-3, 3e-3]
    modes = best_modes([dict(results=[dict(mode="sync", examples_per_sec=e)]) for e in (5, 9, 7)])
    assert modes["results"][0]["examples_per_sec"] == 9 and modes["results"][0]["runs"] == [5, 9, 7]
