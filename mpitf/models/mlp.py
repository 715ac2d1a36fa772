"""The reference multilayer perceptron, named as in TensorFlow's MNIST example."""

import numpy

from ..config import check_int
from .layers import ReferenceModel, dense_stack, dense_stack_backward, softmax_cross_entropy

__all__ = ["MLP"]


class MLP(ReferenceModel):
    """Dense layers with ReLU, then a linear softmax layer.

    Variables are ``hidden1/weights``, ``hidden1/biases``, ... ``hiddenK/...``
    and ``softmax_linear/weights``, ``softmax_linear/biases``, in that order.

    Args:
        input_dim: features per sample (rows of ``x``).
        hidden: widths of the hidden layers; ``()`` gives softmax regression.
        num_classes: number of output classes.
        dtype: floating dtype of the variables (and of the computation).
    """

    def __init__(self, input_dim=64, hidden=(128,), num_classes=10, dtype=numpy.float32):
        super().__init__(dtype)
        check_int("MLP input_dim", input_dim, 1)
        hidden = tuple(check_int("MLP hidden units", h, 1) for h in hidden)
        check_int("MLP num_classes", num_classes, 2)
        self.input_dim, self.hidden, self.num_classes = int(input_dim), hidden, int(num_classes)
        self._layers = [f"hidden{i + 1}" for i in range(len(hidden))] + ["softmax_linear"]
        widths = (self.input_dim, *hidden, self.num_classes)
        for name, fan_in, fan_out in zip(self._layers, widths[:-1], widths[1:]):
            self._specs.append((f"{name}/weights", (fan_in, fan_out), fan_in))
            self._specs.append((f"{name}/biases", (fan_out,), None))

    def __repr__(self):
        return (f"MLP(input_dim={self.input_dim}, hidden={self.hidden}, "
                f"num_classes={self.num_classes}, dtype={self.dtype.name})")

    def logits(self, params, x):
        """Return the unnormalised class scores for rows ``x``, shape ``(N, num_classes)``."""
        _, x = self._stage(params, x)
        return dense_stack(params, self._layers, x)[0]

    def loss_and_grads(self, params, batch, grads, final=None):
        """Write d(mean loss)/d(param) into ``grads[name]`` in place; return the mean loss.

        ``final(names)``, if given, is called after each layer's gradients are written
        (the last layer first), so a bucketed push can send them during backward.
        """
        xp, x = self._stage(params, batch[0])
        logits, caches = dense_stack(params, self._layers, x)
        loss, d = softmax_cross_entropy(logits, xp.asarray(batch[1]))
        dense_stack_backward(d, caches, params, self._layers, grads, final)
        return loss
