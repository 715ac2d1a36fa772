"""mpitf.torch under mpiexec: equal to plain torch, aliases kept or refused, bad input, resume.

Each run is 1 ps + W workers on a small MLP (tests/mpi/torch_driver.py); every worker also
trains the model with plain torch on the W batches' mean gradient and prints the largest
relative difference. torch is a test requirement: without it these tests fail.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch  # noqa: F401 - fail here, loudly, when the torch extra is missing

from mpitf.runtime.exits import EXIT_REQUEUE
from mpitf.testing import kill_group, mpiexec_command, run_mpi

pytestmark = pytest.mark.mpi

REPO = Path(__file__).resolve().parent.parent
DRIVER = "tests/mpi/torch_driver.py"
RESULT = re.compile(r"worker (\d+): step (\d+) maxrel: (\S+) moved: (\S+) lr: ([0-9.e+-]+)")
DIGEST = re.compile(r"digest: (\w+)")


def drive(n, *args, timeout=60):
    run = run_mpi(n, [DRIVER, *map(str, args)], timeout=timeout, cwd=str(REPO))
    assert not run.timed_out, run.output
    return run


def results(run, steps, workers):
    assert run.returncode == 0, run.output
    found = RESULT.findall(run.stdout)
    assert sorted(int(w) for w, *_ in found) == list(range(workers)), run.output
    for _, step, _, moved, _ in found:
        assert int(step) == steps
        assert float(moved) > 0.01  # training moved the parameters
    return [float(r[2]) for r in found], float(found[0][4])


@pytest.mark.parametrize("optimizer", ["sgd", "nesterov", "adam", "adamw", "adagrad",
                                       "rmsprop"])
def test_one_worker_equals_torch_optim_with_its_lr_scheduler(optimizer):
    run = drive(2, "--optimizer", optimizer, "--schedule", "--steps", 30)
    (maxrel,), lr = results(run, 30, 1)
    assert maxrel < 1e-6, run.output  # float32 rounding: torch fuses some ops (FMA)
    # LambdaLR's factor after 30 steps: the rate the ps applied followed it.
    base = {"sgd": 0.1, "nesterov": 0.05, "adam": 0.01, "adamw": 0.01, "adagrad": 0.05,
            "rmsprop": 0.003}[optimizer]
    assert lr == pytest.approx(base * 0.97**30, rel=1e-5)
    assert "keys: 0.weight,0.bias,2.weight,2.bias" in run.stdout  # state_dict names


def test_two_workers_equal_torch_on_the_mean_gradient_with_and_without_buckets():
    run = drive(3, "--optimizer", "adamw", "--schedule", "--steps", 30)
    maxrels, _ = results(run, 30, 2)
    assert max(maxrels) < 1e-5, run.output
    # 64 bytes: four buckets, pushed from backward's hooks from the second step on
    hooks = drive(3, "--optimizer", "adamw", "--schedule", "--steps", 30, "--bucket-bytes", 64)
    assert results(hooks, 30, 2)[0] == maxrels, hooks.output
    assert "4 buckets leave as backward produces them" in hooks.stdout, hooks.output
    assert "buckets pushed during backward: 116" in hooks.stdout  # 4 a step from the 2nd
    assert DIGEST.findall(hooks.stdout) == DIGEST.findall(run.stdout) != [], hooks.output


def test_gradient_accumulation_with_buckets():
    # two backward calls per step from the first: the hooks see it and push at step()
    run = drive(3, "--bucket-bytes", 64, "--accumulate-from", 0, "--steps", 8)
    maxrels, _ = results(run, 8, 2)
    assert max(maxrels) < 1e-5, run.output
    assert "backward ran 2 times before step() (gradient accumulation): the 4 buckets leave " \
           "at step()" in run.stdout, run.output
    assert "buckets pushed during backward: 0" in run.stdout, run.output
    # ... but only from step 3: buckets had left, so every rank ends naming the parameter
    late = drive(3, "--bucket-bytes", 64, "--accumulate-from", 3, "--steps", 8)
    assert late.returncode != 0 and "maxrel" not in late.stdout, late.output
    assert "backward reached '2.bias' twice before step() at step 3, but its bucket had " \
           "already been pushed" in late.output, late.output


@pytest.mark.parametrize("n,num_ps,mode", [(4, 2, "sync"), (2, 1, "async")])
def test_clip_norm_equals_torch_clip_grad_norm(n, num_ps, mode):
    # sync: on the aggregated gradient, the two ps agreeing on the norm; async: per push.
    run = drive(n, "--num-ps", num_ps, "--mode", mode, "--clip", 0.3, "--optimizer", "sgd")
    maxrels, _ = results(run, 20, n - num_ps)
    assert max(maxrels) < 1e-6, run.output
    unclipped = drive(n, "--num-ps", num_ps, "--mode", mode, "--optimizer", "sgd")
    assert RESULT.findall(unclipped.stdout)[0][3] != RESULT.findall(run.stdout)[0][3]


def test_torch_zero_grad_set_to_none_is_bound_again():
    run = drive(2, "--break", "torch_zero_grad")
    (maxrel,), _ = results(run, 20, 1)
    assert maxrel < 1e-5, run.output


@pytest.mark.parametrize("brk,words", [
    ("unused", "parameter '0.weight' requires grad but backward left its gradient None at "
               "step 3"),
    ("to", "parameter '0.weight' no longer lies in mpitf's buffer at step 0 (its data is now "
           "torch.float64"),
    ("load", "model.load_state_dict() was called after DistributedOptimizer wrapped the model"),
])
def test_a_broken_alias_ends_every_rank_naming_it(brk, words):
    run = drive(3, "--break", brk)
    assert run.returncode != 0, run.output
    assert words in run.output, run.output
    assert "maxrel" not in run.stdout


@pytest.mark.parametrize("optimizer,words", [
    ("amsgrad", "Adam(amsgrad=True) is not supported on the ps: leave amsgrad off"),
    ("lbfgs", "mpitf.torch cannot run LBFGS on the ps: use one of torch.optim's Adagrad, "
              "Adam, AdamW, RMSprop, SGD"),
])
def test_an_unsupported_optimizer_is_refused_before_training(optimizer, words):
    run = drive(3, "--optimizer", optimizer)
    assert run.returncode != 0, run.output
    assert words in run.output, run.output
    assert "step 1," not in run.output


def test_param_groups_that_differ_are_refused():
    from mpitf.errors import ConfigurationError
    from mpitf.torch.translate import translate

    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b], "weight_decay": 0.1}], lr=0.1)
    with pytest.raises(ConfigurationError, match=r"param groups 0 and 1 differ in "
                                                 r"\['weight_decay'\]"):
        translate(opt)
    assert translate(torch.optim.AdamW([a], lr=0.1)).config() == {
        "name": "adamw", "learning_rate": 0.1, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
        "weight_decay": 0.01}


def test_sigterm_checkpoints_exits_75_and_resumes_bit_for_bit(tmp_path):
    ckpt = tmp_path / "ckpt"
    ref = drive(2, "--steps", 40)
    (ref_rel,), _ = results(ref, 40, 1)
    log = tmp_path / "out.log"
    cmd = mpiexec_command(2, [sys.executable, DRIVER, "--steps", "100000", "--checkpoint-dir",
                              ckpt, "--sleep", "0.02"])
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=str(REPO),
                                env=dict(os.environ, PYTHONUNBUFFERED="1"),
                                start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 30
        while "step 10," not in log.read_text() and time.monotonic() < end \
                and proc.poll() is None:
            time.sleep(0.01)
        assert "step 10," in log.read_text(), log.read_text()
        os.kill(proc.pid, signal.SIGTERM)  # Hydra's mpiexec forwards it to every rank
        code = proc.wait(timeout=30)
    finally:
        kill_group(proc)
    text = log.read_text()
    assert code == EXIT_REQUEUE, text
    (step,) = re.findall(r"SIGTERM: checkpointed at step (\d+); exiting with code 75", text)
    assert 10 <= int(step) < 40, text
    resumed = drive(2, "--steps", 40, "--checkpoint-dir", ckpt)
    assert f"restored {ckpt}" in resumed.stdout and f"at step {step}" in resumed.stdout
    (rel,), _ = results(resumed, 40, 1)
    assert rel < 1e-5
    assert DIGEST.findall(resumed.stdout) == DIGEST.findall(ref.stdout), resumed.output
    # The export loads into the model as it is: its names are the state_dict keys.
    out = tmp_path / "export.npz"
    subprocess.run([sys.executable, "-m", "mpitf.cli.main", "ckpt", "export", str(ckpt),
                    "--out", str(out)], check=True, timeout=60, cwd=str(REPO))
    import numpy as np

    exported = dict(np.load(out))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    assert sorted(exported) == sorted(model.state_dict())
    model.load_state_dict({k: torch.from_numpy(v) for k, v in exported.items()})


def test_torch_mnist_job_reaches_95_percent(tmp_path):
    from mpitf.data.datasets import ensure_digits

    data = ensure_digits(str(tmp_path / "digits.h5"))
    run = run_mpi(3, ["jobs/torch_mnist.py", "--data", data], timeout=120, cwd=str(REPO))
    assert not run.timed_out and run.returncode == 0, run.output
    (acc,) = re.findall(r"^step 300: test accuracy (\S+)$", run.stdout, re.M)
    assert float(acc) >= 0.95, run.output
    assert run.stdout.count("mpitf.torch: rank") == 2  # each worker says its threads once


def test_readme_torch_loops_differ_in_at_most_six_lines():
    import difflib

    text = (REPO / "README.md").read_text()
    section = text[text.index("## PyTorch"):text.index("## TensorFlow programs on mpitf")]
    plain, ours = re.findall(r"```python\n(.*?)```", section, re.S)
    changed = [d for d in difflib.ndiff(plain.splitlines(), ours.splitlines())
               if d.startswith("+ ")]
    assert len(changed) <= 6, changed
