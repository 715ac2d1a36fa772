"""FTRL-Proximal as tf.train.FtrlOptimizer, in place on flat buffers (dense or gathered rows).

Its own module because :mod:`mpitf.ps.optimizers` is at its size limit; ``make_optimizer``
builds it by name ("ftrl") like the others. With ``p = learning_rate_power`` (-0.5)::

    accum_new = accum + g*g
    sigma     = (accum_new**-p - accum**-p) / lr
    linear   += g - sigma * var
    quadratic = accum_new**-p / lr + 2 * l2
    var       = (sign(linear) * l1 - linear) / quadratic  if |linear| > l1  else 0
    accum     = accum_new

On the ps's embedding tables it runs on the rows a push carries only (see ps/sparse.py).
"""

from mpitf.config import check_number

from .optimizers import _SCRATCH, Optimizer


class Ftrl(Optimizer):
    """FTRL-Proximal (McMahan et al. 2013) with TensorFlow's hyper-parameters and slots."""

    name = "ftrl"
    slot_names = ("accum", "linear")
    _hyper = ("learning_rate_power", "initial_accumulator_value", "l1", "l2")

    def __init__(self, learning_rate=0.1, learning_rate_power=-0.5,
                 initial_accumulator_value=0.1, l1=0.0, l2=0.0):
        super().__init__(learning_rate)
        check_number("ftrl: learning_rate_power", learning_rate_power, high=0.0,
                     high_open=False)
        check_number("ftrl: initial_accumulator_value", initial_accumulator_value, low=0.0,
                     low_open=True)
        check_number("ftrl: l1", l1, low=0.0)
        check_number("ftrl: l2", l2, low=0.0)
        self.learning_rate_power = float(learning_rate_power)
        self.initial_accumulator_value = float(initial_accumulator_value)
        self.l1, self.l2 = float(l1), float(l2)

    def init_slots(self, slots):
        """Fill ``accum`` with ``initial_accumulator_value`` (``linear`` starts at 0)."""
        slots["accum"].fill(self.initial_accumulator_value)

    def _power(self, xp, x, out):
        if self.learning_rate_power == -0.5:
            return xp.sqrt(x, out=out)
        return xp.power(x, -self.learning_rate_power, out=out)

    def reference_update(self, xp, params, grad, slots, step):
        lr = self.learning_rate(step)
        accum, linear, tmp = slots["accum"], slots["linear"], slots[_SCRATCH]
        xp.multiply(grad, grad, out=tmp)
        xp.add(tmp, accum, out=tmp)  # accum_new
        xp.add(linear, grad, out=linear)
        self._power(xp, accum, accum)  # old accum ** -p
        self._power(xp, tmp, grad)  # new accum ** -p (grad is ours to overwrite)
        xp.subtract(grad, accum, out=accum)
        xp.divide(accum, lr, out=accum)  # sigma
        xp.multiply(accum, params, out=accum)
        xp.subtract(linear, accum, out=linear)
        xp.divide(grad, lr, out=grad)
        xp.add(grad, 2.0 * self.l2, out=grad)  # quadratic
        xp.clip(linear, -self.l1, self.l1, out=accum)
        xp.subtract(accum, linear, out=accum)
        xp.divide(accum, grad, out=params)
        accum[...] = tmp
