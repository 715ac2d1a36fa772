"""The GPT recipe under DDP and under mpitf.torch: the same losses (issue 44's clipping).

tests/mpi/gpt_driver.py runs one loop (AdamW with decay/no-decay groups, a warmup +
cosine LambdaLR, two micro-batches of accumulation, ``clip_grad_norm_`` that binds) under
DDP (gloo, 2 ranks) and under mpitf.torch (2 workers, with 1 ps and with 2): DDP clips the
mean gradient after its all-reduce, so mpitf must too (its ps tasks agree on the norm).
"""

import re

import pytest
import torch  # noqa: F401 - fail here, loudly, when the torch extra is missing

from mpitf.testing import run_mpi
from tests.support import REPO

pytestmark = pytest.mark.mpi

DRIVER = "tests/mpi/gpt_driver.py"
LINE = re.compile(r"^rank (\d) step (\d+) loss (\S+) norm (\S+)$", re.M)
STEPS, MAX_NORM = 50, 0.5


def _losses_and_norms(n, *args):
    run = run_mpi(n, [DRIVER, "--steps", str(STEPS), "--max-norm", str(MAX_NORM),
                      *map(str, args)], timeout=150, cwd=str(REPO))
    assert not run.timed_out and run.returncode == 0, run.output
    found = {(int(r), int(s)): (float(loss), float(norm))
             for r, s, loss, norm in LINE.findall(run.stdout)}
    assert sorted(found) == [(r, s) for r in range(2) for s in range(STEPS)], run.output
    return found


@pytest.mark.slow
def test_the_gpt_recipe_gives_ddps_losses_with_one_and_two_ps(tmp_path):
    ddp = _losses_and_norms(2, "--under", "ddp", "--store", tmp_path / "gloo")
    # the clip binds: the mean gradient's norm is above max_norm at most steps
    above = sum(norm > MAX_NORM for _, norm in ddp.values())
    assert above >= 0.9 * len(ddp), ddp
    # 1 ps: the model (30k weights) is one frame; 2 ps in 4 KiB buckets, which each ps
    # holds until the step's last is in
    for args in (("--num-ps", 1), ("--num-ps", 2, "--bucket-bytes", 4096)):
        ours = _losses_and_norms(2 + args[1], *args)
        for key, (loss, norm) in ddp.items():
            assert ours[key][0] == pytest.approx(loss, rel=1e-5), (args, key, ours[key], loss)
            # clip_grad_norm_ returned DDP's norm: the mean's, that the ps tasks agreed on
            assert ours[key][1] == pytest.approx(norm, rel=1e-5), (args, key, ours[key], norm)
