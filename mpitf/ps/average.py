"""The moving average of the parameters a ps keeps beside them (``--moving-average-decay``)."""

from mpitf.config import check_moving_average_decay
from mpitf.runtime.backend import array_module

__all__ = ["ExponentialMovingAverage"]


class ExponentialMovingAverage:
    """Keep shadow copies of the parameters as tf.train.ExponentialMovingAverage.

    ``shadow -= (1 - decay) * (shadow - params)``, where with ``num_updates``
    the decay is ``min(decay, (1 + step) / (10 + step))``, so early averages
    follow the parameters closely.
    """

    def __init__(self, decay, num_updates=True):
        check_moving_average_decay(decay)
        self.decay = float(decay)
        self.num_updates = bool(num_updates)

    def decay_at(self, step):
        """Return the decay used by the update at global step ``step``."""
        if self.num_updates:
            return min(self.decay, (1.0 + step) / (10.0 + step))
        return self.decay

    def make_shadow(self, params):
        """Return a new shadow buffer initialised to ``params`` (as TF initialises it)."""
        return params.copy()

    def apply(self, ema, params, step):
        """Move the shadow ``ema`` toward ``params`` in place and return the decay used.

        Needs no scratch: ``ema = decay * (ema - params) + params``, which is
        TF's ``ema - (1 - decay) * (ema - params)`` rearranged.
        """
        if ema.shape != params.shape:
            raise ValueError(f"expecting params of shape {ema.shape}, got {params.shape}")
        xp = array_module(ema)
        d = self.decay_at(int(step))
        xp.subtract(ema, params, out=ema)
        xp.multiply(ema, d, out=ema)
        xp.add(ema, params, out=ema)
        return d

    def config(self):
        """Return a JSON-able dict; ``ExponentialMovingAverage(**config)`` rebuilds it."""
        return {"decay": self.decay, "num_updates": self.num_updates}

    def __eq__(self, other):
        return type(other) is type(self) and other.config() == self.config()

    def __repr__(self):
        return f"ExponentialMovingAverage(decay={self.decay!r}, num_updates={self.num_updates!r})"
