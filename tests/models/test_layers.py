"""Gradient checks of the layer library and the reference models, and a training smoke test."""

import time

import numpy as np
import pytest

from mpitf.errors import ConfigurationError
from mpitf.models import CNN, MLP, accuracy, build_model, evaluate
from mpitf.models import layers as L

TOL = 1e-5


def rel_error(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(a) + np.linalg.norm(b), 1e-30)


def numeric_grad(f, x, eps=1e-6):
    """Central differences of scalar f() with respect to array x (modified in place)."""
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = x[i]
        x[i] = old + eps
        fp = f()
        x[i] = old - eps
        fm = f()
        x[i] = old
        g[i] = (fp - fm) / (2 * eps)
    return g


def check_in_place(grads, arrays_before, ids_before):
    """The backward wrote into the given arrays: same objects, new values."""
    for name, g in grads.items():
        assert id(g) == ids_before[name]
        assert not np.array_equal(g, arrays_before[name]), f"{name} not written"


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def test_xp_is_numpy_for_numpy_arrays():
    assert L._xp(np.zeros(3)) is np
    assert L._xp(np.float64(1.0)) is np


def test_dense_gradients(rng):
    x = rng.standard_normal((5, 4))
    w = rng.standard_normal((4, 3))
    b = rng.standard_normal(3)
    r = rng.standard_normal((5, 3))

    def loss():
        return float((L.dense(x, w, b)[0] * r).sum())

    y, cache = L.dense(x, w, b)
    np.testing.assert_allclose(y, x @ w + b)
    flat = np.full(12 + 3, np.nan)  # grads are views into one flat buffer
    dw, db = flat[:12].reshape(4, 3), flat[12:]
    dx = L.dense_backward(r, cache, w, dw, db)
    assert np.shares_memory(dw, flat) and np.shares_memory(db, flat)
    assert not np.isnan(flat).any()
    assert rel_error(dw, numeric_grad(loss, w)) < TOL
    assert rel_error(db, numeric_grad(loss, b)) < TOL
    assert rel_error(dx, numeric_grad(loss, x)) < TOL


def test_dense_backward_into_non_contiguous_out(rng):
    x, w, dy = rng.standard_normal((3, 4)), rng.standard_normal((4, 2)), rng.standard_normal((3, 2))
    big = np.zeros((4, 4))
    dw = big[:, ::2]
    db = np.zeros(2)
    L.dense_backward(dy, x, w, dw, db)
    np.testing.assert_allclose(big[:, ::2], x.T @ dy)


def test_relu_gradients(rng):
    x = rng.standard_normal((6, 7))
    x[np.abs(x) < 1e-2] = 0.5  # keep away from the kink
    r = rng.standard_normal((6, 7))
    y, cache = L.relu(x)
    np.testing.assert_array_equal(y, np.maximum(x, 0))
    dx = L.relu_backward(r, cache)
    assert rel_error(dx, numeric_grad(lambda: float((L.relu(x)[0] * r).sum()), x)) < TOL


@pytest.mark.parametrize("padding", ["same", "valid"])
@pytest.mark.parametrize("kernel", [(3, 3), (2, 3)])
def test_conv2d_gradients(rng, padding, kernel):
    kh, kw = kernel
    x = rng.standard_normal((2, 5, 6, 3))
    w = rng.standard_normal((kh, kw, 3, 4))
    b = rng.standard_normal(4)
    y, cache = L.conv2d(x, w, b, padding)
    expect_hw = (5, 6) if padding == "same" else (5 - kh + 1, 6 - kw + 1)
    assert y.shape == (2, *expect_hw, 4)
    r = rng.standard_normal(y.shape)

    def loss():
        return float((L.conv2d(x, w, b, padding)[0] * r).sum())

    dw, db = np.zeros_like(w), np.zeros_like(b)
    ids = {"w": id(dw), "b": id(db)}
    dx = L.conv2d_backward(r, cache, w, dw, db)
    check_in_place({"w": dw, "b": db}, {"w": np.zeros_like(w), "b": np.zeros_like(b)}, ids)
    assert dx.shape == x.shape
    assert rel_error(dw, numeric_grad(loss, w)) < TOL
    assert rel_error(db, numeric_grad(loss, b)) < TOL
    assert rel_error(dx, numeric_grad(loss, x)) < TOL


def test_conv2d_matches_direct_convolution(rng):
    x = rng.standard_normal((1, 4, 4, 2))
    w = rng.standard_normal((3, 3, 2, 1))
    y, _ = L.conv2d(x, w, np.zeros(1), "same")
    xp = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    direct = np.array([[(xp[0, i:i + 3, j:j + 3, :] * w[..., 0]).sum() for j in range(4)]
                       for i in range(4)])
    np.testing.assert_allclose(y[0, :, :, 0], direct)


def test_conv2d_rejects_bad_input(rng):
    with pytest.raises(ConfigurationError, match="channels"):
        L.conv2d(np.zeros((1, 4, 4, 2)), np.zeros((3, 3, 1, 1)), np.zeros(1))
    with pytest.raises(ConfigurationError, match="padding"):
        L.conv2d(np.zeros((1, 4, 4, 1)), np.zeros((3, 3, 1, 1)), np.zeros(1), "full")


@pytest.mark.parametrize("shape", [(2, 4, 6, 3), (1, 5, 3, 2)])
def test_max_pool_gradients(rng, shape):
    x = rng.permutation(np.prod(shape)).reshape(shape) / 7.0  # distinct values: no ties
    r = rng.standard_normal((shape[0], shape[1] // 2, shape[2] // 2, shape[3]))
    y, cache = L.max_pool2x2(x)
    h2, w2 = shape[1] // 2, shape[2] // 2
    ref = x[:, : 2 * h2, : 2 * w2].reshape(shape[0], h2, 2, w2, 2, shape[3]).max(axis=(2, 4))
    np.testing.assert_array_equal(y, ref)
    dx = L.max_pool2x2_backward(r, cache)
    num = numeric_grad(lambda: float((L.max_pool2x2(x)[0] * r).sum()), x, eps=1e-4)
    assert rel_error(dx, num) < TOL


def test_softmax_cross_entropy_gradients(rng):
    logits = rng.standard_normal((6, 5)) * 3
    labels = rng.integers(0, 5, 6)
    loss, dlogits = L.softmax_cross_entropy(logits, labels)
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    assert isinstance(loss, float)
    assert loss == pytest.approx(-np.log(p[np.arange(6), labels]).mean())
    num = numeric_grad(lambda: L.softmax_cross_entropy(logits, labels)[0], logits)
    assert rel_error(dlogits, num) < TOL


def test_softmax_cross_entropy_is_stable_and_keeps_dtype():
    logits = np.array([[1000.0, 0.0], [-1000.0, 0.0]], dtype=np.float32)
    loss, d = L.softmax_cross_entropy(logits, np.array([0, 1]))
    assert np.isfinite(loss) and loss == pytest.approx(0.0, abs=1e-6)
    assert d.dtype == np.float32 and np.isfinite(d).all()


def _model_grad_check(model, x, y):
    params = model.init(np.random.default_rng(0))
    specs = model.variables()
    assert [n for n, _, _ in specs] == list(params)
    sizes = [int(np.prod(s)) for _, s, _ in specs]
    flat = np.full(sum(sizes), np.nan)
    grads, off = {}, 0
    for (name, shape, dtype), size in zip(specs, sizes):
        assert params[name].shape == tuple(shape) and params[name].dtype == dtype
        grads[name] = flat[off : off + size].reshape(shape)
        off += size
    ids = {n: id(g) for n, g in grads.items()}
    loss = model.loss_and_grads(params, (x, y), grads)
    assert isinstance(loss, float)
    assert not np.isnan(flat).any(), "some gradient entries were not written"
    for name in grads:
        assert id(grads[name]) == ids[name] and np.shares_memory(grads[name], flat)
        num = numeric_grad(lambda: model.loss_and_grads(params, (x, y), {
            n: np.empty(s) for n, s, _ in specs}), params[name])
        assert rel_error(grads[name], num) < TOL, name


def test_mlp_gradients(rng):
    model = MLP(input_dim=6, hidden=(5, 4), num_classes=3, dtype=np.float64)
    assert [n for n, _, _ in model.variables()] == [
        "hidden1/weights", "hidden1/biases", "hidden2/weights", "hidden2/biases",
        "softmax_linear/weights", "softmax_linear/biases"]
    _model_grad_check(model, rng.standard_normal((7, 6)), rng.integers(0, 3, 7))


def test_cnn_gradients(rng):
    model = CNN(image_shape=(4, 4, 2), num_classes=3, filters=3, dtype=np.float64)
    x = rng.standard_normal((3, 32))
    _model_grad_check(model, x, rng.integers(0, 3, 3))


def test_init_is_deterministic_and_truncated():
    model = MLP(input_dim=50, hidden=(40,), num_classes=10)
    a, b = model.init(np.random.default_rng(7)), model.init(np.random.default_rng(7))
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
        assert a[name].dtype == np.float32
    w = a["hidden1/weights"]
    assert np.abs(w).max() <= 2 / np.sqrt(50) + 1e-6
    assert not a["hidden1/biases"].any()


def test_build_model():
    assert isinstance(build_model("mlp", 64, 10), MLP)
    cnn = build_model("cnn", 64, 10)
    assert isinstance(cnn, CNN) and cnn.image_shape == (8, 8, 1)
    with pytest.raises(ConfigurationError, match="unknown model"):
        build_model("resnet", 64, 10)
    with pytest.raises(ConfigurationError, match="image_shape"):
        build_model("cnn", 60, 10)


def _train(model, x, y, steps, lr, batch=32, seed=0):
    rng = np.random.default_rng(seed)
    params = model.init(rng)
    grads = {n: np.zeros(s, d) for n, s, d in model.variables()}
    for _ in range(steps):
        idx = rng.integers(0, len(x), batch)
        model.loss_and_grads(params, (x[idx], y[idx]), grads)
        for n in params:
            params[n] -= lr * grads[n]
    return params


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    from mpitf.data.datasets import prepare_digits
    from mpitf.data.sharded import load_split

    path = str(tmp_path_factory.mktemp("digits") / "digits.h5")
    prepare_digits(path)
    return load_split(path, "train"), load_split(path, "test")


def test_mlp_learns_digits(digits):
    (xtr, ytr), (xte, yte) = digits
    model = MLP(input_dim=64, hidden=(64,), num_classes=10)
    t0 = time.perf_counter()
    params = _train(model, xtr, ytr, steps=400, lr=0.5)
    assert time.perf_counter() - t0 < 10
    loss, acc = evaluate(model, params, xte, yte, batch_size=100)
    assert acc > 0.9 and loss < 0.5
    assert accuracy(model, params, xte, yte) == pytest.approx(acc)
    assert params["hidden1/weights"].dtype == np.float32


def test_cnn_learns_digits(digits):
    (xtr, ytr), (xte, yte) = digits
    model = CNN()
    params = _train(model, xtr, ytr, steps=200, lr=0.5)
    assert accuracy(model, params, xte, yte) > 0.8
