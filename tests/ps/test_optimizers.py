"""The ps optimizers against plain-numpy references of TF 1.x's update rules."""

import json
import math
import tracemalloc

import numpy as np
import pytest
from numpy.testing import assert_allclose

from mpitf.errors import ConfigurationError
from mpitf.ps.optimizers import (
    Adam,
    ExponentialMovingAverage,
    Optimizer,
    array_module,
    make_optimizer,
)
from mpitf.ps.schedules import ExponentialDecay, make_schedule

N, STEPS = 257, 7


def _data(seed=0, n=N, steps=STEPS):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(n), [rng.standard_normal(n) for _ in range(steps)]


def _run(opt, p0, grads, first_step=0):
    params = p0.copy()
    slots = opt.make_slots(params.size, np, params.dtype)
    for i, g in enumerate(grads):
        opt.apply(params, g.copy(), slots, first_step + i)  # apply may overwrite grad
    return params, slots


# ------------------------------------------------------------------ references


def ref_sgd(p, grads, lr):
    p = p.copy()
    for i, g in enumerate(grads):
        p = p - lr(i) * g
    return p


def ref_momentum(p, grads, lr, mu, nesterov):
    p, acc = p.copy(), np.zeros_like(p)
    for i, g in enumerate(grads):
        acc = acc * mu + g
        if nesterov:
            p = p - (g * lr(i) + acc * mu * lr(i))
        else:
            p = p - lr(i) * acc
    return p, acc


def ref_adam(p, grads, lr, b1, b2, eps):
    p, m, v = p.copy(), np.zeros_like(p), np.zeros_like(p)
    for i, g in enumerate(grads):
        t = i + 1
        lr_t = lr(i) * math.sqrt(1 - b2**t) / (1 - b1**t)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr_t * m / (np.sqrt(v) + eps)
    return p, m, v


def ref_adagrad(p, grads, lr, init):
    p, acc = p.copy(), np.full_like(p, init)
    for i, g in enumerate(grads):
        acc = acc + g * g
        p = p - lr(i) * g / np.sqrt(acc)
    return p, acc


# ----------------------------------------------------------------- optimizers


def test_sgd_matches_reference():
    p0, grads = _data(1)
    params, slots = _run(make_optimizer("sgd", learning_rate=0.1), p0, grads)
    assert_allclose(params, ref_sgd(p0, grads, lambda s: 0.1), rtol=1e-12)
    assert make_optimizer("sgd").slot_names == ()


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_matches_reference(nesterov):
    p0, grads = _data(2)
    opt = make_optimizer("momentum", learning_rate=0.05, momentum=0.8, use_nesterov=nesterov)
    params, slots = _run(opt, p0, grads)
    want_p, want_acc = ref_momentum(p0, grads, lambda s: 0.05, 0.8, nesterov)
    assert_allclose(params, want_p, rtol=1e-12)
    assert_allclose(slots["momentum"], want_acc, rtol=1e-12)
    assert opt.slot_names == ("momentum",)


def test_adam_matches_reference():
    p0, grads = _data(3)
    opt = make_optimizer("adam", learning_rate=0.01, beta1=0.85, beta2=0.99, epsilon=1e-7)
    params, slots = _run(opt, p0, grads)
    want_p, want_m, want_v = ref_adam(p0, grads, lambda s: 0.01, 0.85, 0.99, 1e-7)
    assert_allclose(params, want_p, rtol=1e-12)
    assert_allclose(slots["m"], want_m, rtol=1e-12)
    assert_allclose(slots["v"], want_v, rtol=1e-12)
    assert opt.slot_names == ("m", "v")


def test_adam_defaults_are_tf_defaults():
    opt = make_optimizer("adam")
    assert (opt.beta1, opt.beta2, opt.epsilon) == (0.9, 0.999, 1e-8)


def test_adam_bias_correction_uses_global_step():
    # Resuming at step 100 with fresh slots must use t = 101, not t = 1.
    p0, grads = _data(4, steps=1)
    opt = make_optimizer("adam", learning_rate=0.01)
    params, _ = _run(opt, p0, grads, first_step=100)
    g = grads[0]
    m, v = 0.1 * g, 0.001 * g * g
    lr_t = 0.01 * math.sqrt(1 - 0.999**101) / (1 - 0.9**101)
    assert_allclose(params, p0 - lr_t * m / (np.sqrt(v) + 1e-8), rtol=1e-12)


def test_adagrad_matches_reference_and_initial_accumulator():
    opt = make_optimizer("adagrad", learning_rate=0.3, initial_accumulator_value=0.25)
    slots = opt.make_slots(5, np, np.float64)
    assert_allclose(slots["accumulator"], np.full(5, 0.25))
    assert np.all(make_optimizer("adagrad").make_slots(3, np, np.float32)["accumulator"] == 0.1)
    p0, grads = _data(5)
    params, slots = _run(opt, p0, grads)
    want_p, want_acc = ref_adagrad(p0, grads, lambda s: 0.3, 0.25)
    assert_allclose(params, want_p, rtol=1e-12)
    assert_allclose(slots["accumulator"], want_acc, rtol=1e-12)


def test_none_optimizer_does_nothing():
    p0, grads = _data(6)
    opt = make_optimizer("none")
    params, slots = _run(opt, p0, grads)
    assert slots == {}
    assert np.array_equal(params, p0)


def test_schedule_drives_updates():
    sched = ExponentialDecay(0.1, decay_steps=2, decay_rate=0.5, staircase=True)
    p0, grads = _data(7)
    params, _ = _run(make_optimizer("sgd", learning_rate=sched), p0, grads)
    assert_allclose(params, ref_sgd(p0, grads, sched), rtol=1e-12)
    opt = make_optimizer("momentum", learning_rate=sched.config(), use_nesterov=True)
    params, _ = _run(opt, p0, grads)
    assert_allclose(params, ref_momentum(p0, grads, sched, 0.9, True)[0], rtol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adagrad", "none"])
def test_dtype_follows_buffer(name, dtype):
    opt = make_optimizer(name)
    params = np.ones(10, dtype=dtype)
    slots = opt.make_slots(10, np, dtype)
    assert all(s.dtype == dtype for s in slots.values())
    opt.apply(params, np.full(10, 0.5, dtype=dtype), slots, 0)
    assert params.dtype == dtype
    assert np.all(np.isfinite(params))
    if name != "none":
        assert np.all(params < 1)


SCHEDULE = {"schedule": "exponential_decay", "initial_learning_rate": 0.3, "decay_steps": 2,
            "decay_rate": 0.7}


@pytest.mark.parametrize("rate", [0.3, SCHEDULE], ids=["constant", "schedule"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["sgd", "momentum"])
def test_bound_update_equals_apply_bit_for_bit(name, dtype, rate):
    """``bind`` (every push of a shard) updates as ``apply`` does, a schedule's rate per step."""
    opt = make_optimizer(name, learning_rate=rate)
    p0, grads = _data(11, n=1024)
    applied, bound = p0.astype(dtype), p0.astype(dtype)
    slots_a, slots_b = (opt.make_slots(1024, np, dtype) for _ in range(2))
    update = opt.bind(bound, slots_b)
    for step, g in enumerate(grads):
        opt.apply(applied, g.astype(dtype), slots_a, step)
        update(g.astype(dtype), step)
    assert np.array_equal(bound, applied)
    assert not np.array_equal(bound, p0.astype(dtype))


def test_bound_sgd_refuses_a_gradient_of_another_size():
    opt = make_optimizer("sgd")
    update = opt.bind(np.zeros(8, np.float32), {})
    with pytest.raises(ValueError, match="expecting grad of 8 elements, got 9"):
        update(np.zeros(9, np.float32), 0)


def test_shape_mismatch_raises():
    opt = make_optimizer("sgd")
    with pytest.raises(ValueError, match="shape"):
        opt.apply(np.zeros(3), np.zeros(4), opt.make_slots(3, np, np.float64), 0)


# ------------------------------------------------------------------- no alloc


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adagrad", "none"])
def test_apply_allocates_nothing(name):
    kwargs = {"use_nesterov": True} if name == "momentum" else {}
    opt = make_optimizer(
        name,
        learning_rate={
            "schedule": "exponential_decay",
            "initial_learning_rate": 0.01,
            "decay_steps": 10,
            "decay_rate": 0.9,
        },
        **kwargs,
    )
    n = 1_000_000
    params = np.ones(n, dtype=np.float32)
    grad = np.full(n, 1e-3, dtype=np.float32)
    slots = opt.make_slots(n, np, np.float32)
    opt.apply(params, grad, slots, 0)  # warm up any lazily-created state
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for step in range(1, 101):
            opt.apply(params, grad, slots, step)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak - base < 64 * 1024


def test_ema_apply_allocates_nothing():
    ema = ExponentialMovingAverage(0.999)
    params = np.ones(1_000_000, dtype=np.float32)
    shadow = ema.make_shadow(params)
    ema.apply(shadow, params, 0)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for step in range(1, 101):
            ema.apply(shadow, params, step)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak - base < 64 * 1024


# ------------------------------------------------------------------ schedules


@pytest.mark.parametrize("staircase", [False, True])
def test_exponential_decay_values(staircase):
    sched = ExponentialDecay(0.1, 100, 0.96, staircase=staircase)
    for step in (0, 1, 50, 99, 100, 101, 250, 1000):
        p = step // 100 if staircase else step / 100
        assert sched(step) == pytest.approx(0.1 * 0.96**p, rel=1e-12)
    opt = make_optimizer("sgd", learning_rate=sched)
    assert opt.learning_rate(250) == pytest.approx(0.1 * 0.96 ** (2 if staircase else 2.5))


def test_constant_learning_rate():
    assert make_optimizer("adam", learning_rate=0.25).learning_rate(12345) == 0.25


def test_schedule_config_round_trip():
    sched = ExponentialDecay(0.5, 1000, 0.9, staircase=True)
    cfg = json.loads(json.dumps(sched.config()))
    assert cfg["schedule"] == "exponential_decay"
    assert make_schedule(cfg) == sched
    assert make_schedule(sched) is sched
    assert make_schedule(3) == 3.0


@pytest.mark.parametrize(
    "bad",
    [
        {"schedule": "cosine"},
        {"schedule": "exponential_decay", "initial_learning_rate": 0.1},
        {
            "schedule": "exponential_decay",
            "initial_learning_rate": 0.1,
            "decay_steps": 0,
            "decay_rate": 0.5,
        },
        {
            "schedule": "exponential_decay",
            "initial_learning_rate": -1,
            "decay_steps": 10,
            "decay_rate": 0.5,
        },
    ],
)
def test_bad_schedule_raises(bad):
    with pytest.raises(ConfigurationError):
        make_schedule(bad)


# --------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("sgd", {}),
        ("momentum", {"momentum": 0.5, "use_nesterov": True}),
        ("adam", {"beta1": 0.8, "beta2": 0.9, "epsilon": 1e-6}),
        ("adagrad", {"initial_accumulator_value": 0.3}),
        ("none", {}),
    ],
)
@pytest.mark.parametrize(
    "lr",
    [
        0.125,
        {
            "schedule": "exponential_decay",
            "initial_learning_rate": 0.1,
            "decay_steps": 10,
            "decay_rate": 0.5,
            "staircase": True,
        },
    ],
)
def test_config_round_trip(name, kwargs, lr):
    opt = make_optimizer(name, learning_rate=lr, **kwargs)
    assert isinstance(opt, Optimizer)
    assert opt.name == name
    cfg = json.loads(json.dumps(opt.config()))
    again = make_optimizer(**cfg)
    assert again == opt
    assert again.config() == opt.config()
    assert again.learning_rate(17) == opt.learning_rate(17)


def test_unknown_optimizer_lists_choices():
    with pytest.raises(ConfigurationError) as err:
        make_optimizer("lamb")  # rmsprop is known since issue 12
    for name in ("sgd", "momentum", "adam", "adagrad", "none"):
        assert name in str(err.value)


def test_unknown_option_lists_valid_ones():
    with pytest.raises(ConfigurationError, match="beta1"):
        make_optimizer("adam", beta3=0.5)


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("sgd", {"learning_rate": -0.1}),
        ("sgd", {"learning_rate": float("nan")}),
        ("sgd", {"learning_rate": "fast"}),
        ("adam", {"beta1": 1.0}),
        ("adam", {"beta2": -0.1}),
        ("adam", {"epsilon": -1e-8}),
        ("momentum", {"momentum": -0.9}),
        ("adagrad", {"initial_accumulator_value": 0.0}),
    ],
)
def test_bad_hyper_parameters_raise(name, kwargs):
    with pytest.raises(ConfigurationError):
        make_optimizer(name, **kwargs)


def test_class_defaults():
    assert Adam().learning_rate(0) == 0.001  # TF's AdamOptimizer default


# ------------------------------------------------------------------------ EMA


@pytest.mark.parametrize("num_updates", [True, False])
def test_ema_matches_reference(num_updates):
    ema = ExponentialMovingAverage(0.9, num_updates=num_updates)
    rng = np.random.default_rng(8)
    params = rng.standard_normal(N)
    shadow = ema.make_shadow(params)
    want = shadow.copy()
    for step in range(STEPS):
        params = params + rng.standard_normal(N)
        d = min(0.9, (1 + step) / (10 + step)) if num_updates else 0.9
        want = want - (1 - d) * (want - params)
        assert ema.apply(shadow, params, step) == d
        assert_allclose(shadow, want, rtol=1e-12)
    assert ExponentialMovingAverage(**ema.config()) == ema


def test_ema_bad_decay():
    with pytest.raises(ConfigurationError):
        ExponentialMovingAverage(1.5)


# -------------------------------------------------------------- array_module


def test_array_module_numpy_and_fake_cupy(monkeypatch):
    import sys
    import types

    assert array_module(np.zeros(2)) is np
    assert array_module([1, 2]) is np
    fake = types.ModuleType("cupy")
    monkeypatch.setitem(sys.modules, "cupy", fake)
    FakeArray = type("ndarray", (), {"__module__": "cupy._core.core"})
    assert array_module(FakeArray()) is fake
