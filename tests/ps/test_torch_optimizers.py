"""The ps's torch rules equal torch.optim itself on the same gradients (float32, N steps).

torch is a test requirement (the ``torch`` extra): these tests fail, not skip, without it.
"""

import numpy as np
import pytest
import torch

from mpitf.errors import ConfigurationError
from mpitf.ps.optimizers import make_optimizer

STEPS = 30

CASES = [
    (torch.optim.SGD, dict(lr=0.1), "torch_sgd", {}),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9), "torch_sgd", dict(momentum=0.9)),
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01),
     "torch_sgd", dict(momentum=0.9, dampening=0.3, weight_decay=0.01)),
    (torch.optim.SGD, dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.1),
     "torch_sgd", dict(momentum=0.8, nesterov=True, weight_decay=0.1)),
    (torch.optim.Adam, dict(lr=0.01), "torch_adam", {}),
    (torch.optim.Adam, dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
     "torch_adam", dict(beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1)),
    (torch.optim.AdamW, dict(lr=0.01), "adamw", {}),
    (torch.optim.AdamW, dict(lr=0.02, weight_decay=0.3), "adamw", dict(weight_decay=0.3)),
    (torch.optim.Adagrad, dict(lr=0.1), "torch_adagrad", {}),
    (torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01, weight_decay=0.1,
                               initial_accumulator_value=0.2, eps=1e-6),
     "torch_adagrad", dict(lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.2,
                           eps=1e-6)),
    (torch.optim.RMSprop, dict(lr=0.01), "rmsprop", {}),
    (torch.optim.RMSprop, dict(lr=0.01, alpha=0.9, momentum=0.5, centered=True,
                               weight_decay=0.05),
     "rmsprop", dict(alpha=0.9, momentum=0.5, centered=True, weight_decay=0.05)),
]


def run_both(torch_cls, torch_kwargs, name, kwargs, lrs=None):
    rng = np.random.default_rng(0)
    init = rng.normal(size=257).astype(np.float32)
    grads = rng.normal(size=(STEPS, 257)).astype(np.float32)
    p = torch.nn.Parameter(torch.from_numpy(init.copy()))
    opt = torch_cls([p], **torch_kwargs)
    ours = make_optimizer(name, torch_kwargs["lr"], **kwargs)
    params = init.copy()
    slots = ours.make_slots(params.size, np, np.float32)
    for step in range(STEPS):
        if lrs is not None:
            opt.param_groups[0]["lr"] = lrs[step]
            ours.set_learning_rate(lrs[step])
        # The gradient depends on the parameters, so a drift would grow.
        g = grads[step] + 0.1 * params
        p.grad = torch.from_numpy(g.copy())
        opt.step()
        ours.apply(params, g.copy(), slots, step)
    return p.detach().numpy(), params, init


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[2]}-{sorted(c[3])}")
def test_equals_torch_optim(case):
    theirs, mine, init = run_both(*case)
    assert not np.allclose(theirs, init)  # it moved
    np.testing.assert_allclose(mine, theirs, rtol=2e-6, atol=2e-7)


def test_pushed_learning_rate_is_applied():
    lrs = [0.1 * (0.9**k) for k in range(STEPS)]
    theirs, mine, _ = run_both(torch.optim.AdamW, dict(lr=0.1), "adamw", {}, lrs=lrs)
    np.testing.assert_allclose(mine, theirs, rtol=2e-6, atol=2e-7)


def test_configs_round_trip():
    for _, kw, name, kwargs in CASES:
        opt = make_optimizer(name, kw["lr"], **kwargs)
        assert make_optimizer(**opt.config()) == opt


@pytest.mark.parametrize("name,kwargs,words", [
    ("torch_sgd", dict(nesterov=True), "nesterov needs a momentum"),
    ("adamw", dict(beta1=1.0), "beta1"),
    ("rmsprop", dict(amsgrad=True), "takes no option(s) ['amsgrad']"),
])
def test_bad_options(name, kwargs, words):
    with pytest.raises(ConfigurationError, match=None) as info:
        make_optimizer(name, 0.1, **kwargs)
    assert words in str(info.value)
