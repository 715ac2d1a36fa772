"""mpitf.torch under mpiexec: equal to plain torch, aliases kept or refused, bad input, resume.

Each run is 1 ps + W workers on a small MLP (tests/mpi/torch_driver.py); every worker also
trains the model with plain torch on the W batches' mean gradient and prints the largest
relative difference. torch is a test requirement: without it these tests fail.
"""

import re
import subprocess
import sys

import pytest
import torch  # noqa: F401 - fail here, loudly, when the torch extra is missing

from mpitf.runtime.exits import EXIT_REQUEUE
from mpitf.testing import run_mpi, signal_when
from tests.support import REPO

pytestmark = pytest.mark.mpi

DRIVER = "tests/mpi/torch_driver.py"
RESULT = re.compile(r"worker (?P<worker>\d+): step (?P<step>\d+) maxrel: (?P<maxrel>\S+) "
                    r"moved: (?P<moved>\S+) lr: (?P<lr>\S+) optimizer: (?P<name>\w+)$", re.M)
CLIPPED = re.compile(r"the reference clipped (\d+ of \d+) steps")
DIGEST = re.compile(r"digest: (\w+)")
BUFFERS = re.compile(r"worker \d+: buffers (\w+) bufrel: ([0-9.e+-]+)")


def drive(n, *args, timeout=60):
    run = run_mpi(n, [DRIVER, *map(str, args)], timeout=timeout, cwd=str(REPO))
    assert not run.timed_out, run.output
    return run


def results(run, steps, workers):
    assert run.returncode == 0, run.output
    found = list(RESULT.finditer(run.stdout))
    assert sorted(int(m["worker"]) for m in found) == list(range(workers)), run.output
    for m in found:
        assert int(m["step"]) == steps
        assert float(m["moved"]) > 0.01  # training moved the parameters
    return [float(m["maxrel"]) for m in found], float(found[0]["lr"])


@pytest.mark.slow
def test_one_worker_equals_torch_optim_with_its_lr_scheduler():
    # Each optimizer trains in turn in one launch (the ps serves each): one torch import.
    base = {"sgd": 0.1, "nesterov": 0.05, "adam": 0.01, "adamw": 0.01, "adagrad": 0.05,
            "rmsprop": 0.003}
    run = drive(2, "--optimizer", ",".join(base), "--schedule", "--steps", 30, timeout=120)
    assert run.returncode == 0, run.output
    found = {m["name"]: m for m in RESULT.finditer(run.stdout)}
    assert sorted(found) == sorted(base), run.output
    for name, m in found.items():
        assert m["worker"] == "0" and m["step"] == "30", run.output
        assert float(m["moved"]) > 0.01, name  # training moved the parameters
        assert float(m["maxrel"]) < 1e-6, (name, run.output)  # torch fuses some ops
        # LambdaLR's factor after 30 steps: the rate the ps applied followed it.
        assert float(m["lr"]) == pytest.approx(base[name] * 0.97**30, rel=1e-5), name
    assert run.stdout.count("keys: 0.weight,0.bias,2.weight,2.bias") == len(base)  # names


@pytest.mark.slow
def test_two_workers_equal_torch_on_the_mean_gradient_with_and_without_buckets():
    run = drive(3, "--optimizer", "adamw", "--schedule", "--steps", 30)
    maxrels, _ = results(run, 30, 2)
    assert max(maxrels) < 1e-5, run.output
    # 64 bytes: 13 buckets (each parameter apart, the weights cut into 64-byte pieces),
    # pushed from backward's hooks from the second step on
    hooks = drive(3, "--optimizer", "adamw", "--schedule", "--steps", 30, "--bucket-bytes", 64)
    assert results(hooks, 30, 2)[0] == maxrels, hooks.output
    assert "13 buckets leave as backward produces them" in hooks.stdout, hooks.output
    assert "buckets pushed during backward: 377" in hooks.stdout  # 13 a step from the 2nd
    assert DIGEST.findall(hooks.stdout) == DIGEST.findall(run.stdout) != [], hooks.output


@pytest.mark.slow
def test_gradient_accumulation_with_buckets():
    # two backward calls per step from the first: the hooks see it and push at step()
    run = drive(3, "--bucket-bytes", 64, "--accumulate-from", 0, "--steps", 8)
    maxrels, _ = results(run, 8, 2)
    assert max(maxrels) < 1e-5, run.output
    assert "backward ran 2 times before step() (gradient accumulation): the 13 buckets leave " \
           "at step()" in run.stdout, run.output
    assert "buckets pushed during backward: 0" in run.stdout, run.output
    # ... but only from step 3: buckets had left, so every rank ends naming the parameter
    late = drive(3, "--bucket-bytes", 64, "--accumulate-from", 3, "--steps", 8)
    assert late.returncode != 0 and "maxrel" not in late.stdout, late.output
    assert "backward reached '2.bias' twice before step() at step 3, but its bucket had " \
           "already been pushed" in late.output, late.output


@pytest.mark.slow
def test_clip_grad_norm_clips_the_mean_gradient_on_the_ps_with_buckets():
    # torch's clip_grad_norm_ in the loop clips the 2 workers' mean (DDP's meaning), on
    # the ps: the gradients stay as backward left them, so from step 2 the 13 buckets leave
    # during backward and the ps holds them until the last; the reference clips the mean.
    run = drive(3, "--bucket-bytes", 64, "--clip-grad-norm", 0.3, "--optimizer", "sgd",
                "--steps", 10)
    maxrels, _ = results(run, 10, 2)
    assert max(maxrels) < 1e-6, run.output  # each worker's own clipped: 0.06 apart
    assert "mpitf.torch: 13 buckets leave as backward produces them" in run.stdout, run.output
    assert "buckets pushed during backward: 117" in run.stdout, run.output
    assert CLIPPED.findall(run.stdout) == ["10 of 10"] * 2, run.output  # the bound bound
    # clipping from step 3 on: step 3's buckets had left unclipped, so every rank ends
    late = drive(3, "--bucket-bytes", 64, "--clip-grad-norm", 0.3, "--clip-from", 3,
                 "--optimizer", "sgd", "--steps", 10)
    assert late.returncode != 0 and "maxrel" not in late.stdout, late.output
    assert "step 3 asks the ps for clipping to 0.3 (clip_grad_norm_), but backward had " \
           "already pushed its buckets with the last step's no clipping" in late.output, \
        late.output
    assert "Traceback" not in late.output


@pytest.mark.slow
@pytest.mark.parametrize("bucket_bytes", [0, 64])
def test_a_nan_gradient_ends_every_rank_naming_it(bucket_bytes):
    # one frame, or buckets that left during backward: found at step() either way
    run = drive(2, "--bucket-bytes", bucket_bytes, "--nan-at", 3, "--steps", 6)
    assert run.returncode != 0 and "maxrel" not in run.stdout, run.output
    assert "the gradient of variable '0.weight' holds NaN or Inf at step 3" in run.output
    assert "Traceback" not in run.output


@pytest.mark.slow
def test_a_model_over_the_default_bucket_pushes_during_backward_by_default():
    # 3 MiB (hidden 65536): the session's 2 MiB buckets, the hooks pushing from step 2
    run = drive(2, "--optimizer", "adamw", "--hidden", 65536, "--steps", 6)
    (maxrel,), _ = results(run, 6, 1)
    assert maxrel < 1e-6, run.output
    found = re.search(r"mpitf.torch: (\d+) buckets leave as backward produces them",
                      run.stdout)
    assert found and int(found[1]) >= 2, run.output
    assert f"buckets pushed during backward: {5 * int(found[1])}" in run.stdout, run.output


@pytest.mark.slow
def test_local_sgd_of_one_worker_equals_torch_optim_with_its_lr_scheduler():
    # --mode local: the worker runs the ps's rule (AdamW) on its own copy with the rate
    # its scheduler set, and every 4 steps the ps's average of one worker is its own
    # parameters: plain torch's run, to float32 rounding.
    run = drive(2, "--mode", "local", "--optimizer", "adamw", "--schedule")
    (maxrel,), lr = results(run, 20, 1)
    assert maxrel < 1e-6, run.output
    assert lr == pytest.approx(0.01 * 0.97**20, rel=1e-5)  # the schedule ran (maxrel: followed)


@pytest.mark.slow
@pytest.mark.parametrize("n,num_ps,mode", [(4, 2, "sync"), (2, 1, "async")])
def test_clip_norm_equals_torch_clip_grad_norm(n, num_ps, mode):
    # sync: on the aggregated gradient, the two ps agreeing on the norm; async: per push.
    run = drive(n, "--num-ps", num_ps, "--mode", mode, "--clip", 0.3, "--optimizer", "sgd")
    maxrels, _ = results(run, 20, n - num_ps)
    assert max(maxrels) < 1e-6, run.output
    # the bound changed every step's gradient: without clipping, no match to 1e-6
    assert CLIPPED.findall(run.stdout) == ["20 of 20"] * (n - num_ps), run.output


@pytest.mark.slow
def test_no_sync_accumulates_as_ddp_after_buckets_left_during_backward():
    # 64-byte buckets: 13 of them leave during backward at steps 1 and 2; from step 3 on
    # the first half-batch's backward runs inside dist.no_sync() (refused without it:
    # test_gradient_accumulation_with_buckets), and every step pushes at step().
    run = drive(3, "--accumulate-from", 3, "--no-sync", "--bucket-bytes", 64, "--steps", 8,
                "--schedule")
    maxrels, _ = results(run, 8, 2)
    assert max(maxrels) < 1e-6, run.output
    assert "buckets pushed during backward: 26" in run.stdout, run.output
    assert run.stdout.count("mpitf.torch: no_sync(): gradients accumulate") == 1, run.output


@pytest.mark.slow
def test_deepcopy_and_torch_save_of_a_wrapped_model_give_plain_torch_models():
    # An EMA copy and a saved model, made after wrapping: training goes on as before, the
    # copies keep the values at wrapping, run forward, and load a state_dict.
    run = drive(3, "--copies", "--steps", 5)
    maxrels, _ = results(run, 5, 2)
    assert max(maxrels) < 1e-6, run.output
    assert "worker 0: copies unchanged: [True, True] outputs: [(10, 3), (10, 3)]" \
        in run.stdout, run.output


@pytest.mark.slow
def test_examples_per_sec_counts_the_inputs_first_dimension(tmp_path):
    # No dataset, no batch_size: the model's input (10 rows a worker) is counted, so the
    # metrics' examples per global step are 2 workers x 10 at every logged step.
    import json

    run = drive(3, "--steps", 6, "--run-dir", tmp_path)
    results(run, 6, 2)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for r in records:
        per_step = r["examples_per_sec"] / r["global_steps_per_sec"]
        assert abs(per_step - 20) < 1e-6, records


@pytest.mark.slow
def test_torch_zero_grad_set_to_none_is_bound_again():
    # With BatchNorm: one worker's running statistics follow plain torch's.
    run = drive(2, "--break", "torch_zero_grad", "--model", "bn")
    (maxrel,), _ = results(run, 20, 1)
    assert maxrel < 1e-5, run.output
    ((_, bufrel),) = BUFFERS.findall(run.stdout)
    assert float(bufrel) < 1e-5, run.output


@pytest.mark.slow
@pytest.mark.parametrize("brk,words", [
    ("unused", "parameter '0.weight' requires grad but backward left its gradient None at "
               "step 3"),
    ("to", "parameter '0.weight' no longer lies in mpitf's buffer at step 0 (its data is now "
           "torch.float64"),
    ("load", "model.load_state_dict() was called after DistributedOptimizer wrapped the model"),
    ("torch_step", "optimizer.step() on the optimizer that DistributedOptimizer wraps: it "
                   "would train this worker's copy only and push nothing; call "
                   "dist.step(loss)"),
    ("twice", "this model is already wrapped by a DistributedOptimizer: wrap each model and "
              "optimizer once"),
])
def test_a_broken_alias_ends_every_rank_naming_it(brk, words):
    # The ps and one worker: each worker checks its own model, so a second finds the
    # same, at the cost of another torch start (5 s of CPU, most of it importing).
    run = drive(2, "--break", brk)
    assert run.returncode != 0, run.output
    assert words in run.output, run.output
    assert "maxrel" not in run.stdout


@pytest.mark.slow
@pytest.mark.parametrize("args,words", [
    (["--optimizer", "lbfgs"], "mpitf.torch cannot run LBFGS on the ps: use one of "
                               "torch.optim's Adagrad, Adam, AdamW, RMSprop, SGD"),
    (["--model", "half"], "parameter '2.weight' is torch.float16, but '0.weight' is "
                          "torch.float32: mpitf.torch trains parameters of one dtype, float32 "
                          "or float64"),
], ids=["lbfgs", "half"])
def test_what_mpitf_cannot_run_is_refused_before_training(args, words):
    run = drive(2, *args)
    assert run.returncode != 0, run.output
    assert words in run.output, run.output
    assert "step 1," not in run.output


def test_param_groups_become_groups_on_the_ps_and_what_it_cannot_run_is_refused():
    # Param groups that differ were refused before issue 26; now each is a group of
    # variables with its own options (tests/ps/test_optimizer_groups.py trains them).
    from mpitf.errors import ConfigurationError
    from mpitf.torch.translate import translate

    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b], "weight_decay": 0.1}], lr=0.1)
    groups = translate(opt, {id(a): "a", id(b): "b"}).config()["groups"]
    assert [(g["variables"], g["weight_decay"]) for g in groups] == [(["a"], 0.0), (["b"], 0.1)]
    mixed = torch.optim.Adam([{"params": [a]}, {"params": [b],
                                                "decoupled_weight_decay": True}], lr=0.1)
    with pytest.raises(ConfigurationError, match=r"Adam: param group 0 runs torch_adam but "
                                                 r"group 1 runs adamw"):
        translate(mixed, {id(a): "a", id(b): "b"})
    with pytest.raises(ConfigurationError, match=r"Adam\(amsgrad=True\) is not supported on "
                                                 r"the ps: leave amsgrad off"):
        translate(torch.optim.Adam([a], lr=0.01, amsgrad=True))
    assert translate(torch.optim.AdamW([a], lr=0.1)).config() == {
        "name": "adamw", "learning_rate": 0.1, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
        "weight_decay": 0.01}


def test_dtypes_devices_and_buffers_mpitf_holds():
    # In-process: DistributedOptimizer runs these checks on every rank before the session,
    # as test_what_mpitf_cannot_run_is_refused_before_training[half] shows under mpiexec.
    from mpitf.errors import ConfigurationError
    from mpitf.torch.buffers import buffer_views, check_model
    from mpitf.torch.model import trainable

    def named(m):
        return list(m.named_parameters())

    model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Linear(4, 3))
    model[1].bias = torch.nn.Parameter(torch.empty(3, device="meta"))
    with pytest.raises(ConfigurationError, match=r"parameter '1.bias' is on meta: mpitf.torch "
                                                 r"serves CPU tensors only"):
        trainable(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model = torch.nn.Sequential(torch.nn.Linear(2, 4).bfloat16())
    with pytest.raises(ConfigurationError, match=r"parameter '0.weight' is torch.bfloat16: "
                                                 r"mpitf.torch trains parameters of one dtype"):
        check_model(model, named(model))
    model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.BatchNorm1d(4))
    model[1].weight.requires_grad_(False)  # frozen: a buffer to mpitf, as in the state_dict
    trained = [(n, p) for n, p in named(model) if p.requires_grad]
    check_model(model, trained)
    views = buffer_views(model, {n for n, _ in trained})
    assert list(views) == ["1.weight", "1.running_mean", "1.running_var",
                           "1.num_batches_tracked"]
    views["1.num_batches_tracked"][...] = 7  # the views are the model's memory
    assert int(model[1].num_batches_tracked) == 7
    model[1].running_mean.data = model[1].running_mean.bfloat16()
    with pytest.raises(ConfigurationError, match=r"buffer '1.running_mean' is torch.bfloat16"):
        check_model(model, trained)


@pytest.mark.slow
def test_sigterm_checkpoints_exits_75_and_resumes_bit_for_bit(tmp_path):
    # A BatchNorm model on 2 workers: its running statistics (float32 and an int64 count)
    # are checkpointed by the chief and every worker holds the chief's at the end.
    ckpt = tmp_path / "ckpt"
    bn = ["--model", "bn"]
    ref = drive(3, *bn, "--steps", 40)
    ref_rel, _ = results(ref, 40, 2)
    assert max(ref_rel) < 1e-5, ref.output
    hexes = [h for h, _ in BUFFERS.findall(ref.stdout)]
    assert len(hexes) == 2 and len(set(hexes)) == 1, ref.output  # the chief's, everywhere
    log = tmp_path / "out.log"
    code, text = signal_when(3, [DRIVER, *bn, "--steps", 100000, "--checkpoint-dir", ckpt,
                                 "--sleep", 0.02], log, "step 10,", wait=90, cwd=str(REPO))
    assert code == EXIT_REQUEUE, text
    (step,) = re.findall(r"SIGTERM: checkpointed at step (\d+); exiting with code 75", text)
    assert 10 <= int(step) < 40, text
    resumed = drive(3, *bn, "--steps", 40, "--checkpoint-dir", ckpt)
    assert f"restored {ckpt}" in resumed.stdout and f"at step {step}" in resumed.stdout
    rel, _ = results(resumed, 40, 2)
    assert max(rel) < 1e-5
    assert DIGEST.findall(resumed.stdout) == DIGEST.findall(ref.stdout), resumed.output
    assert sorted(BUFFERS.findall(resumed.stdout)) == sorted(BUFFERS.findall(ref.stdout))
    # The export loads into the model as it is: its names are the state_dict keys,
    # buffers included, and its values are the resumed chief's.
    out = tmp_path / "export.npz"
    subprocess.run([sys.executable, "-m", "mpitf.cli.main", "ckpt", "export", str(ckpt),
                    "--out", str(out)], check=True, timeout=60, cwd=str(REPO))
    import hashlib

    import numpy as np

    exported = dict(np.load(out))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.BatchNorm1d(16),
                                torch.nn.Tanh(), torch.nn.Linear(16, 3))
    assert sorted(exported) == sorted(model.state_dict())
    model.load_state_dict({k: torch.from_numpy(v) for k, v in exported.items()})
    state = hashlib.sha256(b"".join(v.numpy().tobytes() for v in model.state_dict().values()))
    assert DIGEST.findall(ref.stdout) == [state.hexdigest()[:16]]
    # A model that differs from the checkpoint: named with both shapes on every rank's
    # exit, the checkpoint left as it was.
    def listing():  # the lock an aborted job leaves is taken over by the next one
        return sorted((p.name, p.stat().st_size) for p in ckpt.iterdir()
                      if not p.name.startswith(".mpitf-lock"))

    before = listing()
    other = drive(2, *bn, "--steps", 40, "--checkpoint-dir", ckpt, "--hidden", 17)
    assert other.returncode != 0, other.output
    assert f"variable '0.weight' has shape (17, 8) in the model but (16, 8) in {ckpt}" \
        in other.output, other.output
    assert "maxrel" not in other.stdout
    assert listing() == before
    verify = subprocess.run([sys.executable, "-m", "mpitf.cli.main", "ckpt", "verify",
                             str(ckpt)], capture_output=True, text=True, timeout=60,
                            cwd=str(REPO))
    assert verify.returncode == 0, verify.stdout


@pytest.mark.slow
def test_torch_mnist_job_reaches_95_percent_and_resumes_bit_for_bit(tmp_path, digits_file):
    # The job in deterministic sync mode: one run to the end (its accuracy); one SIGTERMed
    # after step 50 (checkpoint, exit 75) and rerun; both final checkpoints export alike.
    # 150 steps, half the job's default: 0.98 here either way, in half the training.
    import numpy as np

    job = ["jobs/torch_mnist.py", "--data", digits_file, "--deterministic", "--steps", "150",
           "--checkpoint-dir"]
    run = run_mpi(3, [*job, tmp_path / "whole"], timeout=120, cwd=str(REPO))
    assert not run.timed_out and run.returncode == 0, run.output
    (acc,) = re.findall(r"^step 150: test accuracy (\S+)$", run.stdout, re.M)
    assert float(acc) >= 0.95, run.output
    assert run.stdout.count("mpitf.torch: rank") == 2  # each worker says its threads once
    broken = tmp_path / "broken"
    code, text = signal_when(3, [*job, broken], tmp_path / "out.log", "step 50,", wait=90,
                             cwd=str(REPO))
    assert code == EXIT_REQUEUE, text
    resumed = run_mpi(3, [*job, broken], timeout=120, cwd=str(REPO))
    assert resumed.returncode == 0 and f"restored {broken}" in resumed.stdout, resumed.output
    assert re.findall(r"^step 150: test accuracy (\S+)$", resumed.stdout, re.M) == [acc]
    exports = []
    for name in ("whole", "broken"):
        out = tmp_path / f"{name}.npz"
        done = subprocess.run([sys.executable, "-m", "mpitf.cli.main", "ckpt", "export",
                               str(tmp_path / name), "--out", str(out)], cwd=str(REPO),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        exports.append(np.load(out))
    whole, again = exports
    assert sorted(whole.files) == sorted(again.files) and "2.running_mean" in whole.files
    for key in whole.files:
        assert whole[key].tobytes() == again[key].tobytes(), key


LOSS = re.compile(r"^worker (\d) step (\d+) loss (\S+) lr (\S+)$", re.M)


def losses(text):
    """Return {(worker, step): (loss, next lr)} of jobs/torch_resume.py's lines, as printed."""
    return {(int(w), int(s)): (loss, lr) for w, s, loss, lr in LOSS.findall(text)}


@pytest.mark.slow
def test_a_custom_loop_stopped_by_sigterm_resumes_with_the_losses_of_a_run_never_stopped(
        tmp_path):
    # jobs/torch_resume.py: the loop's own sampler (dataset=, state_dict() over epoch and
    # cursor: 1000 steps of 16 rows from shards of 300 rows is 55 epochs), a LambdaLR
    # (lr_scheduler=), 1 ps + 2 workers in deterministic sync mode. Every loss and rate is
    # compared as printed (repr: bit for bit). The stopped run is signalled at its step 10
    # and cuts where the signal lands: the run never stopped goes far enough past it.
    job = ["jobs/torch_resume.py", "--deterministic", "--log-every", "200"]
    whole = run_mpi(3, [*job, "--steps", "1000", "--log-file", tmp_path / "progress.log"],
                    timeout=120, cwd=str(REPO))
    assert not whole.timed_out and whole.returncode == 0, whole.output
    expected = losses(whole.stdout)
    assert sorted(expected) == [(w, s) for w in (0, 1) for s in range(1, 1001)], whole.output
    # log_stream: the chief's progress lines went to the file, none to stdout
    progress = (tmp_path / "progress.log").read_text()
    assert re.findall(r"^step (\d+), loss = ", progress, re.M) == [
        str(s) for s in range(200, 1001, 200)], progress
    assert ", loss = " not in whole.stdout, whole.output
    ckpt = tmp_path / "ckpt"
    code, text = signal_when(3, [*job, "--steps", "100000", "--checkpoint-dir", ckpt],
                             tmp_path / "out.log", "worker 0 step 10 ", wait=90,
                             cwd=str(REPO))
    assert code == EXIT_REQUEUE, text
    (step,) = map(int, re.findall(r"SIGTERM: checkpointed at step (\d+); exiting", text))
    assert 10 <= step < 1000, text
    stopped = losses(text)
    assert max(s for _, s in stopped) == step and stopped == {
        key: expected[key] for key in stopped}, text
    resumed = run_mpi(3, [*job, "--steps", "1000", "--checkpoint-dir", ckpt], timeout=120,
                      cwd=str(REPO))
    assert not resumed.timed_out and resumed.returncode == 0, resumed.output
    assert f"restored {ckpt}/ckpt-{step:08d} at step {step}" in resumed.stdout, resumed.output
    after = losses(resumed.stdout)
    assert sorted(after) == [(w, s) for w in (0, 1) for s in range(step + 1, 1001)]
    assert after == {key: expected[key] for key in after}, resumed.output


@pytest.mark.slow
def test_the_torch_example_trains_by_epochs(tmp_path, digits_file):
    # The digits' 1437 training images over 2 workers in batches of 32: 22 steps an epoch.
    job = ["jobs/torch_mnist.py", "--data", digits_file, "--deterministic"]
    run = run_mpi(3, [*job, "--epochs", "0.5"], timeout=120, cwd=str(REPO))
    assert not run.timed_out and run.returncode == 0, run.output
    assert re.findall(r"^step (\d+): test accuracy", run.stdout, re.M) == ["11"], run.output
    both = run_mpi(3, [*job, "--epochs", "1", "--steps", "5"], timeout=120, cwd=str(REPO))
    assert both.returncode == 2, both.output
    assert both.output.count("--steps 5 and --epochs 1 both say when training ends: give "
                             "one") == 1, both.output


def test_a_model_is_wrapped_once_until_closed_and_the_wrappers_hooks_copy_inert():
    # In-process, the two rules of mpitf/torch/wrapping.py that the mpiexec tests above
    # (twice, copies) rely on.
    import copy
    import pickle

    from mpitf.errors import ConfigurationError
    from mpitf.torch.wrapping import Hook, claim, refuse_wrapped, release

    model, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    refuse_wrapped(model, opt)  # free
    claim(model, opt)
    with pytest.raises(ConfigurationError, match="this model is already wrapped"):
        refuse_wrapped(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ConfigurationError, match="this optimizer is already wrapped"):
        refuse_wrapped(other, opt)
    release(model, opt)
    refuse_wrapped(model, opt)  # free again once its wrapper closed
    calls = []
    hook = Hook(calls.append)
    hook(1)
    assert calls == [1]
    assert copy.deepcopy(hook)(2) is None and pickle.loads(pickle.dumps(hook))(3) is None
    assert calls == [1]


def test_readme_torch_loops_differ_in_at_most_six_lines():
    import difflib

    from tests.docs.blocks import examples

    # docs/pytorch.md: the plain loop, then ours (then the tables); their first lines say
    # what each is an excerpt of
    plain, ours = ("\n".join(code.splitlines()[1:]) for code in examples("docs/pytorch.md")[:2])
    changed = [d for d in difflib.ndiff(plain.splitlines(), ours.splitlines())
               if d.startswith("+ ")]
    assert len(changed) <= 6, changed
