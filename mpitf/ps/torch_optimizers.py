"""Apply torch.optim's update rules in place to a ps's flat buffers.

The same protocol as :mod:`mpitf.ps.optimizers` (``make_slots``, ``apply``, ``config``), the
same in-place ``xp`` ufuncs, and the arithmetic of torch.optim's single-tensor (CPU
default) implementations, in their order, so the numbers equal torch's to float32 rounding:
SGD (momentum, dampening, nesterov, L2 weight decay), Adam and AdamW (decoupled weight
decay; amsgrad off), Adagrad (lr_decay, eps, weight decay) and RMSprop (alpha, eps, weight
decay, momentum, centered). ``step`` is the ps's global step before the update, so torch's
per-parameter step count is ``step + 1``.

Each also takes the learning rate a push carries (:meth:`TorchOptimizer.set_learning_rate`):
mpitf.torch sends the rate the param group holds at every step, so torch's LR schedulers
drive the ps.
"""

import math

from mpitf.config import check_number
from mpitf.errors import ConfigurationError

from .optimizers import _SCRATCH, Optimizer

__all__ = ["AdamW", "TORCH_OPTIMIZERS", "TorchAdagrad", "TorchAdam", "TorchRMSprop",
           "TorchSGD"]


class TorchOptimizer(Optimizer):
    """Base of torch's rules: a configured rate (or schedule) a push may replace."""

    _pushed_lr = None

    def set_learning_rate(self, lr):
        """Apply ``lr`` from the next update on (the rate a worker's push carried)."""
        self._pushed_lr = float(lr)

    def learning_rate(self, step):
        """Return the rate the last push carried, else the configured one at ``step``."""
        if self._pushed_lr is not None:
            return self._pushed_lr
        return super().learning_rate(step)

    @staticmethod
    def _check(name, **values):
        for key, value in values.items():
            check_number(f"{name}: {key}", value, low=0.0)

    def _l2(self, xp, params, grad, tmp):
        """``grad += weight_decay * params`` (torch's ``grad.add(param, alpha=wd)``)."""
        if self.weight_decay:
            xp.multiply(params, self.weight_decay, out=tmp)
            xp.add(grad, tmp, out=grad)


# torch's fused ops, in the order its CPU kernels compute them (so the roundings agree).


def _lerp(xp, a, end, weight, tmp):
    """``a.lerp_(end, weight)``: ``a + w*(end - a)``, or ``end - (end - a)*(1 - w)`` if w >= 0.5."""
    xp.subtract(end, a, out=tmp)
    if abs(weight) < 0.5:
        xp.multiply(tmp, weight, out=tmp)
        xp.add(a, tmp, out=a)
    else:
        w = xp.float32(weight) if a.dtype == xp.float32 else weight
        xp.multiply(tmp, 1 - w, out=tmp)
        xp.subtract(end, tmp, out=a)


def _addcmul(xp, a, t1, t2, value, tmp):
    """``a.addcmul_(t1, t2, value=v)``: ``a + v*t1*t2``."""
    xp.multiply(t1, value, out=tmp)
    xp.multiply(tmp, t2, out=tmp)
    xp.add(a, tmp, out=a)


def _addcdiv(xp, a, t1, t2, value, tmp):
    """``a.addcdiv_(t1, t2, value=v)``: ``a + v*t1/t2`` (``tmp`` may be ``t1``)."""
    xp.multiply(t1, value, out=tmp)
    xp.divide(tmp, t2, out=tmp)
    xp.add(a, tmp, out=a)


class TorchSGD(TorchOptimizer):
    """torch.optim.SGD: ``buf = mu*buf + (1-dampening)*g`` (``buf = g`` at the first step)."""

    name = "torch_sgd"
    slot_names = ("momentum_buffer",)
    _hyper = ("momentum", "dampening", "nesterov", "weight_decay")

    def __init__(self, learning_rate=0.01, momentum=0.0, dampening=0.0, nesterov=False,
                 weight_decay=0.0):
        super().__init__(learning_rate)
        self._check("torch_sgd", momentum=momentum, dampening=dampening,
                    weight_decay=weight_decay)
        self.momentum, self.dampening = float(momentum), float(dampening)
        self.nesterov, self.weight_decay = bool(nesterov), float(weight_decay)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ConfigurationError("torch_sgd: nesterov needs a momentum and zero dampening")
        if not self.momentum:
            self.slot_names = ()

    def reference_update(self, xp, params, grad, slots, step):
        lr, mu, tmp = self.learning_rate(step), self.momentum, slots[_SCRATCH]
        self._l2(xp, params, grad, tmp)
        if mu:
            buf = slots["momentum_buffer"]
            if step == 0:
                buf[...] = grad
            else:
                xp.multiply(buf, mu, out=buf)
                if self.dampening:
                    xp.multiply(grad, 1.0 - self.dampening, out=tmp)
                    xp.add(buf, tmp, out=buf)
                else:
                    xp.add(buf, grad, out=buf)
            if self.nesterov:
                xp.multiply(buf, mu, out=tmp)
                xp.add(grad, tmp, out=grad)
            else:
                grad = buf
        xp.multiply(grad, lr, out=tmp)
        xp.subtract(params, tmp, out=params)


class TorchAdam(TorchOptimizer):
    """torch.optim.Adam (L2 weight decay in the gradient), amsgrad off.

    ``m.lerp_(g, 1-beta1)``, ``v = beta2*v + (1-beta2)*g*g``,
    ``var -= lr/(1-beta1**t) * m / (sqrt(v)/sqrt(1-beta2**t) + eps)``.
    """

    name = "torch_adam"
    slot_names = ("exp_avg", "exp_avg_sq")
    _hyper = ("beta1", "beta2", "eps", "weight_decay")
    decoupled = False

    def __init__(self, learning_rate=0.001, beta1=0.9, beta2=0.999, eps=1e-8,
                 weight_decay=0.0):
        super().__init__(learning_rate)
        check_number(f"{self.name}: beta1", beta1, low=0.0, high=1.0, high_open=True)
        check_number(f"{self.name}: beta2", beta2, low=0.0, high=1.0, high_open=True)
        self._check(self.name, eps=eps, weight_decay=weight_decay)
        self.beta1, self.beta2 = float(beta1), float(beta2)
        self.eps, self.weight_decay = float(eps), float(weight_decay)

    def reference_update(self, xp, params, grad, slots, step):
        lr, b1, b2, t = self.learning_rate(step), self.beta1, self.beta2, step + 1
        m, v, tmp = slots["exp_avg"], slots["exp_avg_sq"], slots[_SCRATCH]
        if self.decoupled:
            if self.weight_decay:
                xp.multiply(params, 1.0 - lr * self.weight_decay, out=params)
        else:
            self._l2(xp, params, grad, tmp)
        _lerp(xp, m, grad, 1.0 - b1, tmp)
        xp.multiply(v, b2, out=v)
        _addcmul(xp, v, grad, grad, 1.0 - b2, tmp)
        xp.sqrt(v, out=tmp)
        xp.divide(tmp, math.sqrt(1.0 - b2**t), out=tmp)
        xp.add(tmp, self.eps, out=tmp)
        _addcdiv(xp, params, m, tmp, -(lr / (1.0 - b1**t)), grad)


class AdamW(TorchAdam):
    """torch.optim.AdamW: Adam with decoupled weight decay ``var *= 1 - lr * weight_decay``."""

    name = "adamw"
    decoupled = True

    def __init__(self, learning_rate=0.001, beta1=0.9, beta2=0.999, eps=1e-8,
                 weight_decay=0.01):
        super().__init__(learning_rate, beta1, beta2, eps, weight_decay)


class TorchAdagrad(TorchOptimizer):
    """torch.optim.Adagrad: ``sum += g*g``; ``var -= lr/(1+(t-1)*lr_decay) * g/(sqrt(sum)+eps)``."""

    name = "torch_adagrad"
    slot_names = ("sum",)
    _hyper = ("lr_decay", "weight_decay", "initial_accumulator_value", "eps")

    def __init__(self, learning_rate=0.01, lr_decay=0.0, weight_decay=0.0,
                 initial_accumulator_value=0.0, eps=1e-10):
        super().__init__(learning_rate)
        self._check("torch_adagrad", lr_decay=lr_decay, weight_decay=weight_decay,
                    initial_accumulator_value=initial_accumulator_value, eps=eps)
        self.lr_decay, self.weight_decay = float(lr_decay), float(weight_decay)
        self.initial_accumulator_value, self.eps = float(initial_accumulator_value), float(eps)

    def init_slots(self, slots):
        """Fill the sum with ``initial_accumulator_value``."""
        slots["sum"].fill(self.initial_accumulator_value)

    def reference_update(self, xp, params, grad, slots, step):
        acc, tmp = slots["sum"], slots[_SCRATCH]
        clr = self.learning_rate(step) / (1.0 + step * self.lr_decay)
        self._l2(xp, params, grad, tmp)
        _addcmul(xp, acc, grad, grad, 1.0, tmp)
        xp.sqrt(acc, out=tmp)
        xp.add(tmp, self.eps, out=tmp)
        _addcdiv(xp, params, grad, tmp, -clr, grad)


class TorchRMSprop(TorchOptimizer):
    """torch.optim.RMSprop: ``sq = alpha*sq + (1-alpha)*g*g``; centered, momentum optional."""

    name = "rmsprop"
    _hyper = ("alpha", "eps", "weight_decay", "momentum", "centered")

    def __init__(self, learning_rate=0.01, alpha=0.99, eps=1e-8, weight_decay=0.0,
                 momentum=0.0, centered=False):
        super().__init__(learning_rate)
        check_number("rmsprop: alpha", alpha, low=0.0, high=1.0)
        self._check("rmsprop", eps=eps, weight_decay=weight_decay, momentum=momentum)
        self.alpha, self.eps, self.weight_decay = float(alpha), float(eps), float(weight_decay)
        self.momentum, self.centered = float(momentum), bool(centered)
        self.slot_names = ("square_avg",) + (("momentum_buffer",) if self.momentum else ()) \
            + (("grad_avg",) if self.centered else ())

    def reference_update(self, xp, params, grad, slots, step):
        lr, a, tmp = self.learning_rate(step), self.alpha, slots[_SCRATCH]
        sq = slots["square_avg"]
        self._l2(xp, params, grad, tmp)
        xp.multiply(sq, a, out=sq)
        _addcmul(xp, sq, grad, grad, 1.0 - a, tmp)
        if self.centered:
            avg = slots["grad_avg"]
            _lerp(xp, avg, grad, 1.0 - a, tmp)
            xp.multiply(avg, avg, out=tmp)
            xp.subtract(sq, tmp, out=tmp)
            xp.sqrt(tmp, out=tmp)
        else:
            xp.sqrt(sq, out=tmp)
        xp.add(tmp, self.eps, out=tmp)
        if self.momentum:
            buf = slots["momentum_buffer"]
            xp.divide(grad, tmp, out=tmp)
            xp.multiply(buf, self.momentum, out=buf)
            xp.add(buf, tmp, out=buf)
            xp.multiply(buf, -lr, out=tmp)
            xp.add(params, tmp, out=params)
        else:
            _addcdiv(xp, params, grad, tmp, -lr, grad)


TORCH_OPTIMIZERS = {cls.name: cls for cls in (TorchSGD, TorchAdam, AdamW, TorchAdagrad,
                                              TorchRMSprop)}
