"""The ps's learning-rate schedules: torch's and TF's numbers, warmup, configs, bad input."""

import math

import numpy as np
import pytest
import torch

from mpitf.errors import ConfigurationError
from mpitf.ps.optimizers import make_optimizer
from mpitf.ps.schedules import make_schedule


def torch_rates(make, steps, lr=0.1):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = make(opt)
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return rates


@pytest.mark.parametrize("config,make", [
    ({"schedule": "cosine_decay", "decay_steps": 40},
     lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=40)),
    ({"schedule": "cosine_decay", "decay_steps": 40, "alpha": 0.1},
     lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=40, eta_min=0.01)),
    ({"schedule": "step_decay", "step_size": 7, "gamma": 0.5},
     lambda o: torch.optim.lr_scheduler.StepLR(o, 7, 0.5)),
    ({"schedule": "polynomial_decay", "decay_steps": 30, "power": 2.0, "end_learning_rate": 0},
     lambda o: torch.optim.lr_scheduler.PolynomialLR(o, total_iters=30, power=2.0)),
    ({"schedule": "linear_decay", "decay_steps": 30},
     lambda o: torch.optim.lr_scheduler.LinearLR(o, 1.0, 0.0, total_iters=30)),
])
def test_equals_torch_schedulers(config, make):
    schedule = make_schedule({**config, "initial_learning_rate": 0.1})
    ours = [schedule(s) for s in range(41)]  # torch's cosine climbs again after T_max
    np.testing.assert_allclose(ours, torch_rates(make, 41), rtol=1e-9, atol=1e-12)


def test_warmup_then_decay_and_constant():
    cos = make_schedule({"schedule": "cosine_decay", "initial_learning_rate": 1.0,
                         "decay_steps": 10, "warmup_steps": 4})
    assert [cos(s) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert cos(9) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cos(100) == 0.0
    const = make_schedule({"schedule": "constant", "initial_learning_rate": 0.2,
                           "warmup_steps": 2})
    assert [const(s) for s in range(4)] == [0.1, 0.2, 0.2, 0.2]


def test_piecewise_constant_as_tf():
    pc = make_schedule({"schedule": "piecewise_constant", "boundaries": [10, 20],
                        "values": [1.0, 0.5, 0.1]})
    assert [pc(s) for s in (0, 10, 11, 20, 21)] == [1.0, 1.0, 0.5, 0.5, 0.1]


def test_schedules_drive_every_optimizer_and_round_trip():
    cfg = {"schedule": "polynomial_decay", "initial_learning_rate": 0.1, "decay_steps": 100,
           "warmup_steps": 5}
    opt = make_optimizer("adamw", cfg)
    assert make_optimizer(**opt.config()) == opt
    assert opt.learning_rate(0) == pytest.approx(0.02)
    assert make_optimizer("momentum", cfg).learning_rate(200) == pytest.approx(0.0001)


@pytest.mark.parametrize("config,words", [
    ({"schedule": "cosine_decay", "initial_learning_rate": 0.1, "decay_steps": 0},
     "cosine_decay: decay_steps"),
    ({"schedule": "piecewise_constant", "boundaries": [5], "values": [1.0]},
     "one value more than boundaries"),
    ({"schedule": "piecewise_constant", "boundaries": [5, 3], "values": [1, 2, 3]},
     "boundaries must increase"),
    ({"schedule": "warmup_cosine", "initial_learning_rate": 0.1}, "unknown learning-rate"),
    ({"schedule": "step_decay", "initial_learning_rate": 0.1, "step_size": 3, "bogus": 1},
     "bad arguments for schedule 'step_decay'"),
])
def test_bad_schedules(config, words):
    with pytest.raises(ConfigurationError) as info:
        make_schedule(config)
    assert words in str(info.value)
