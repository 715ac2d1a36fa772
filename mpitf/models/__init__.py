"""Reference models and the layer library; any object with the model protocol works.

The protocol mpitf needs from a model::

    variables() -> [(name, shape, dtype)]            # creation order
    init(rng) -> {name: numpy array}                 # deterministic given rng
    loss_and_grads(params, (x, y), grads) -> float   # writes grads[name][...] in place
    logits(params, x) -> array

A model with embedding tables (sparse variables on the ps, :mod:`.embedding`) adds
``tables()`` and ``ids(batch)``, and its ``loss_and_grads`` takes a fourth argument, the
batch's lookups (rows to read, row gradients to write). A model whose ``loss_and_grads``
takes a keyword ``final`` calls ``final(names)`` as soon as backward has written those
variables' gradients, so that with buckets they leave while the layers below compute.
"""

import math

from ..errors import ConfigurationError
from .cnn import CNN
from .layers import ReferenceModel, accuracy, evaluate
from .mlp import MLP

__all__ = ["CNN", "MLP", "ReferenceModel", "accuracy", "build_model", "evaluate"]


def build_model(name, input_dim, num_classes, image_shape=None, **kwargs):
    """Build a reference model by name: ``"mlp"`` or ``"cnn"``.

    Args:
        name: ``"mlp"`` or ``"cnn"``.
        input_dim: features per sample.
        num_classes: number of classes.
        image_shape: ``(H, W, C)`` for the CNN; default a square one-channel image
            of ``input_dim`` pixels.
        **kwargs: passed to the model (``hidden``, ``filters``, ``dtype``, ...).
    """
    if name == "mlp":
        return MLP(input_dim=input_dim, num_classes=num_classes, **kwargs)
    if name == "cnn":
        if image_shape is None:
            side = int(round(input_dim**0.5))
            if side * side != input_dim:
                raise ConfigurationError(
                    f"cnn needs image_shape for input_dim={input_dim} (not a square image)"
                )
            image_shape = (side, side, 1)
        if math.prod(image_shape) != input_dim:
            raise ConfigurationError(
                f"image_shape {tuple(image_shape)} does not hold input_dim={input_dim} values"
            )
        return CNN(image_shape=image_shape, num_classes=num_classes, **kwargs)
    raise ConfigurationError(f"unknown model {name!r}; expected 'mlp' or 'cnn'")
