"""The fused ps kernels equal the reference ufunc passes bit for bit, on any threads.

The reference is each optimizer's ``reference_update`` (the numpy/CuPy passes, what the ps ran
before the fused kernels, and what a CuPy ps still runs). Hypothesis draws the sizes, the
values (zeros, subnormals, huge and tiny magnitudes included) and the hyper-parameters.
"""

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from mpitf.config import TrainingConfig
from mpitf.errors import ConfigurationError
from mpitf.ps import kernels
from mpitf.ps.optimizers import make_optimizer
from mpitf.ps.threads import KernelPool, default_threads

F32 = np.float32
_values = st.floats(-1e6, 1e6, width=32, allow_nan=False, allow_infinity=False)
_positive = st.floats(1e-30, 1e6, width=32, allow_nan=False, allow_infinity=False)


def _optimizers():
    lr = st.floats(1e-6, 10.0)
    unit = st.floats(0.0, 0.999)
    return st.one_of(
        st.builds(lambda r: make_optimizer("sgd", r), lr),
        st.builds(lambda r: make_optimizer("torch_sgd", r), lr),  # without momentum or decay
        st.builds(lambda r, m, n: make_optimizer("momentum", r, momentum=m, use_nesterov=n),
                  lr, st.floats(0.0, 2.0), st.booleans()),
        st.builds(lambda r, b1, b2, e: make_optimizer("adam", r, beta1=b1, beta2=b2, epsilon=e),
                  lr, unit, unit, st.floats(0.0, 1e-3)),
        st.builds(lambda r, a: make_optimizer("adagrad", r, initial_accumulator_value=a),
                  lr, st.floats(1e-6, 1.0)),
        st.builds(lambda r, a, l1, l2: make_optimizer("ftrl", r, initial_accumulator_value=a,
                                                      l1=l1, l2=l2),
                  lr, st.floats(1e-6, 1.0), st.floats(0.0, 1.0), st.floats(0.0, 1.0)),
    )


def _same_bits(a, b):
    """Equal, bit for bit: NaN payloads and signed zeros included."""
    return a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _run(opt, params, grads, steps, apply, slots=None):
    p = params.copy()
    slots = slots or opt.make_slots(p.size, np, p.dtype)
    for step, g in zip(steps, grads):
        apply(p, g.copy(), slots, step)
    return p, {k: slots[k] for k in opt.slot_names}


def _reference(opt):
    return lambda p, g, s, step: opt.reference_update(np, p, g, s, step)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(opt=_optimizers(), data=st.data(), n=st.integers(0, 300),
       dtype=st.sampled_from([np.float32, np.float64]))
def test_each_fused_kernel_equals_the_reference_passes_bit_for_bit(opt, data, n, dtype):
    params = data.draw(arrays(dtype, n, elements=_values))
    grads = [data.draw(arrays(dtype, n, elements=_values)) for _ in range(3)]
    steps = data.draw(st.lists(st.integers(0, 10**6), min_size=3, max_size=3))
    with np.errstate(all="ignore"):
        want, want_slots = _run(opt, params, grads, steps, _reference(opt))
        got, got_slots = _run(opt, params, grads, steps, opt.apply)
    assert _same_bits(got, want)
    for k in want_slots:
        assert _same_bits(got_slots[k], want_slots[k]), k


@pytest.mark.parametrize("name", sorted(kernels.FUSED))
def test_every_fused_optimizer_runs_its_kernel_on_host_buffers(name):
    opt = make_optimizer(name, 0.1)
    p, g = np.ones(8, F32), np.ones(8, F32)
    assert kernels.fused_apply(opt, p, g, opt.make_slots(8, np, F32), 0)
    assert not (p == 1).all()  # it updated them
    # a gradient of another dtype than the wire's, or a strided view: the reference passes
    assert not kernels.fused_apply(opt, p, g.astype(np.float64), opt.make_slots(8, np, F32), 0)
    assert not kernels.fused_apply(opt, p[::2], g[::2], opt.make_slots(4, np, F32), 0)
    assert not kernels.fused_apply(opt, p, g, opt.make_slots(8, np, F32), 0,
                                   reply=np.empty(8, np.int16))


def test_torch_sgd_runs_the_sgd_kernel_only_without_momentum_or_weight_decay():
    p, g = np.ones(8, F32), np.ones(8, F32)
    for options in ({"momentum": 0.9}, {"weight_decay": 0.1}):
        opt = make_optimizer("torch_sgd", 0.1, **options)
        assert not kernels.fused_apply(opt, p, g, opt.make_slots(8, np, F32), 0)
    assert (p == 1).all()  # the reference passes are the caller's to run


WIRE = [ml_dtypes.bfloat16, np.float16]


@pytest.mark.slow
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(opt=_optimizers(), data=st.data(), n=st.integers(0, 300),
       wire=st.sampled_from(WIRE), reply=st.sampled_from([None, "wire", "float32"]))
def test_a_wire_dtype_gradient_is_widened_and_the_reply_rounded_in_the_kernel(
        opt, data, n, wire, reply):
    """As the reference on the float32 gradient, then the parameters cast to the reply's."""
    params = data.draw(arrays(F32, n, elements=_values))
    with np.errstate(over="ignore"):  # beyond float16's range: inf, as on the wire
        grads = [data.draw(arrays(F32, n, elements=_values)).astype(wire) for _ in range(2)]
    out_dtype = None if reply is None else (wire if reply == "wire" else F32)
    want_slots = opt.make_slots(n, np, F32)
    got_slots = opt.make_slots(n, np, F32)
    want, got = params.copy(), params.copy()
    out = None if out_dtype is None else np.empty(n, out_dtype)
    with np.errstate(all="ignore"):
        for step, g in enumerate(grads):
            opt.reference_update(np, want, g.astype(F32), want_slots, step)
            assert kernels.fused_apply(opt, got, g, got_slots, step, reply=out)
            assert _same_bits(got, want)
            if out is not None:
                assert _same_bits(out, want.astype(out_dtype))
    for k in opt.slot_names:
        assert _same_bits(got_slots[k], want_slots[k]), k


def test_wire_conversions_are_exact_at_the_edges():
    x = np.array([0.0, -0.0, 1.0, -2.5, np.inf, -np.inf, np.nan, -np.nan, 1e-40, 3.4e38,
                  65504.0, 65520.0, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 6e-8], F32)
    opt = make_optimizer("sgd", 1.0)
    for wire in WIRE:
        for reply in (wire, F32):
            p, out = np.zeros_like(x), np.empty(x.size, reply)
            with np.errstate(all="ignore"):
                g = (-x).astype(wire)
                assert kernels.fused_apply(opt, p, g, {}, 0, reply=out)
                assert _same_bits(p, F32(0) - g.astype(F32) * F32(1.0))  # widened exactly
                assert _same_bits(out, p.astype(reply)), (wire, reply)


def test_optimizer_apply_takes_a_wire_gradient_and_a_reply_on_the_reference_path_too():
    opt = make_optimizer("ftrl", 0.1, learning_rate_power=-0.7)  # no fused kernel
    g = np.linspace(-1, 1, 16, dtype=F32)
    want, got = np.ones(16, F32), np.ones(16, F32)
    s1, s2 = opt.make_slots(16, np, F32), opt.make_slots(16, np, F32)
    opt.reference_update(np, want, g.astype(ml_dtypes.bfloat16).astype(F32), s1, 0)
    out = np.empty(16, ml_dtypes.bfloat16)
    opt.apply(got, g.astype(ml_dtypes.bfloat16), s2, 0, reply=out)
    assert _same_bits(got, want) and _same_bits(out, want.astype(ml_dtypes.bfloat16))


def test_ftrl_with_another_power_keeps_the_reference_passes():
    opt = make_optimizer("ftrl", 0.1, learning_rate_power=-0.7)
    p, g = np.ones(8, F32), np.ones(8, F32)
    assert not kernels.fused_apply(opt, p, g, opt.make_slots(8, np, F32), 0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(opt=_optimizers(), data=st.data(), n=st.integers(0, 5000),
       threads=st.integers(2, 5), min_chunk=st.integers(1, 700))
def test_threads_give_the_bits_of_one_thread(opt, data, n, threads, min_chunk):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    params = rng.standard_normal(n).astype(F32)
    grads = [rng.standard_normal(n).astype(F32) for _ in range(3)]
    pool = KernelPool(threads, min_chunk=min_chunk)
    try:  # a drawn epsilon of 0 divides by zero: the kernels' inf, warned by the ufuncs
        with np.errstate(divide="ignore", invalid="ignore"):
            one, one_slots = _run(opt, params, grads, (0, 1, 2), opt.apply)
            many, many_slots = _run(opt, params, grads, (0, 1, 2),
                                    lambda p, g, s, step: opt.apply(p, g, s, step, pool))
    finally:
        pool.close()
    assert _same_bits(many, one)
    for k in one_slots:
        assert _same_bits(many_slots[k], one_slots[k]), k


def test_chunks_cover_the_buffer_in_whole_cache_lines_and_are_kept():
    pool = KernelPool(3, min_chunk=10)
    try:
        b = pool.bounds(1000)
        assert b[0] == 0 and b[-1] == 1000 and len(b) == 4
        assert all(x % 16 == 0 for x in b[:-1]) and list(b) == sorted(b)
        assert pool.bounds(1000) is b  # made once per size
        assert len(pool.bounds(25)) == 3  # two chunks of >= 10 elements, not three
    finally:
        pool.close()


def test_an_error_in_a_kernel_thread_reaches_the_caller():
    seen = []

    def kernel(lo, hi, out):
        seen.append((lo, hi))
        if lo > 0:
            raise ValueError("chunk failed")

    pool = KernelPool(2, min_chunk=4)
    try:
        with pytest.raises(ValueError, match="chunk failed"):
            pool.run(kernel, 64, (None,))
        pool.run(lambda lo, hi, out: seen.append((lo, hi)), 64, (None,))  # still serves
    finally:
        pool.close()
    assert sorted(seen) == [(0, 32), (0, 32), (32, 64), (32, 64)]


def test_default_threads_share_the_cores_among_the_ranks_of_a_node():
    import os

    cores = len(os.sched_getaffinity(0))
    assert default_threads() == cores
    hosts = ["a", "a", "a", "b"]
    assert default_threads(hosts, 0) == max(1, cores // 3)
    assert default_threads(hosts, 3) == cores


@pytest.mark.parametrize("value, message", [
    (0, "ps_threads (--ps-threads) must be >= 1, got 0"),
    (2.0, "ps_threads (--ps-threads) must be an integer, got 2.0"),
    (5000, "ps_threads (--ps-threads) must be at most 1024, got 5000"),
])
def test_bad_ps_threads_are_refused(value, message):
    with pytest.raises(ConfigurationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainingConfig(ps_threads=value)
    assert TrainingConfig(ps_threads=3).ps_threads == 3


def test_warm_up_compiles_the_kernel_before_the_first_step():
    seconds = kernels.warm_up(make_optimizer("adam", 0.1), np.float32)
    assert 0 <= seconds < 60
    assert kernels.warm_up(make_optimizer("none", 0.1), np.float32) < 1.0


def test_a_ps_of_small_buffers_never_loads_numba():
    # Below FUSED_MIN_SIZE elements the ufunc passes apply (the same bits, as above), and
    # numba's import and start (0.3-0.5 s of CPU) stay out of a small job's start-up.
    code = """if True:
        import sys
        import numpy as np
        import mpitf.ps.service
        from mpitf.ps.optimizers import FUSED_MIN_SIZE, make_optimizer
        from mpitf.placement import VariableSlice
        from mpitf.ps.shard import Shard
        from mpitf.runtime.backend import get_backend
        adam = make_optimizer("adam", 0.1)
        w = VariableSlice("w", (100,), "float32", 0, 0, 100, 0)
        Shard([w], 100, np.float32, adam, get_backend())
        for n in (100, FUSED_MIN_SIZE - 1):
            adam.apply(np.ones(n, np.float32), np.ones(n, np.float32),
                       adam.make_slots(n, np, np.float32), 0)
        print("numba" in sys.modules)
        n = FUSED_MIN_SIZE
        adam.apply(np.ones(n, np.float32), np.ones(n, np.float32),
                   adam.make_slots(n, np, np.float32), 0)
        print("numba" in sys.modules)
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["False", "True"]
