"""The reference convolutional net: conv 3x3 -> relu -> max-pool 2x2 -> dense -> softmax."""

import numpy

from ..config import check_int
from ..errors import ConfigurationError
from .layers import (
    ReferenceModel,
    conv2d,
    conv2d_backward,
    dense,
    dense_backward,
    max_pool2x2,
    max_pool2x2_backward,
    relu,
    relu_backward,
    softmax_cross_entropy,
)

__all__ = ["CNN"]


class CNN(ReferenceModel):
    """A small convolutional classifier for images that arrive as flat rows.

    ``x`` has shape ``(N, H*W*C)``, each row an NHWC image flattened in C order
    (as the HDF5 data sets store them); it is reshaped to ``(N, H, W, C)`` inside.
    Variables: ``conv1/weights`` (HWIO), ``conv1/biases``,
    ``softmax_linear/weights``, ``softmax_linear/biases``.

    Args:
        image_shape: ``(H, W, C)`` of one image; H and W at least 2.
        num_classes: number of output classes.
        filters: output channels of the convolution.
        kernel_size: side of the square convolution kernel.
        dtype: floating dtype of the variables (and of the computation).
    """

    def __init__(self, image_shape=(8, 8, 1), num_classes=10, filters=8, kernel_size=3,
                 dtype=numpy.float32):
        super().__init__(dtype)
        image_shape = tuple(int(s) for s in image_shape)
        if len(image_shape) == 2:
            image_shape = (*image_shape, 1)
        if len(image_shape) != 3 or min(image_shape[:2]) < 2 or image_shape[2] < 1:
            raise ConfigurationError(
                f"CNN needs image_shape (H, W, C) with H, W >= 2 and C >= 1, got {image_shape}")
        check_int("CNN filters", filters, 1)
        check_int("CNN kernel_size", kernel_size, 1)
        check_int("CNN num_classes", num_classes, 2)
        self.image_shape, self.num_classes = image_shape, int(num_classes)
        self.filters, self.kernel_size = int(filters), int(kernel_size)
        self.input_dim = int(numpy.prod(image_shape))
        h, w, c = image_shape
        k = self.kernel_size
        flat = (h // 2) * (w // 2) * self.filters
        self._specs = [
            ("conv1/weights", (k, k, c, self.filters), k * k * c),
            ("conv1/biases", (self.filters,), None),
            ("softmax_linear/weights", (flat, self.num_classes), flat),
            ("softmax_linear/biases", (self.num_classes,), None),
        ]

    def __repr__(self):
        return (f"CNN(image_shape={self.image_shape}, num_classes={self.num_classes}, "
                f"filters={self.filters}, kernel_size={self.kernel_size}, "
                f"dtype={self.dtype.name})")

    def _images(self, params, x):
        """Return ``(xp, x)`` with flat rows staged and reshaped to NHWC."""
        xp, x = self._stage(params, x)
        if x.ndim != 2 or x.shape[1] != self.input_dim:
            raise ConfigurationError(
                f"CNN for images {self.image_shape} expects x of shape (N, {self.input_dim}), "
                f"got {tuple(x.shape)}"
            )
        return xp, x.reshape(x.shape[0], *self.image_shape)

    def _forward(self, params, images):
        """Return the logits and the layer caches."""
        h, conv_cache = conv2d(images, params["conv1/weights"], params["conv1/biases"], "same")
        h, relu_cache = relu(h)
        h, pool_cache = max_pool2x2(h)
        pooled_shape = h.shape
        logits, dense_cache = dense(h.reshape(h.shape[0], -1), params["softmax_linear/weights"],
                                    params["softmax_linear/biases"])
        return logits, (conv_cache, relu_cache, pool_cache, pooled_shape, dense_cache)

    def logits(self, params, x):
        """Return the unnormalised class scores for flat rows ``x``."""
        _, images = self._images(params, x)
        return self._forward(params, images)[0]

    def loss_and_grads(self, params, batch, grads):
        """Write d(mean loss)/d(param) into ``grads[name]`` in place; return the mean loss."""
        xp, images = self._images(params, batch[0])
        logits, caches = self._forward(params, images)
        conv_cache, relu_cache, pool_cache, pooled_shape, dense_cache = caches
        loss, d = softmax_cross_entropy(logits, xp.asarray(batch[1]))
        d = dense_backward(d, dense_cache, params["softmax_linear/weights"],
                           grads["softmax_linear/weights"], grads["softmax_linear/biases"])
        d = max_pool2x2_backward(d.reshape(pooled_shape), pool_cache)
        d = relu_backward(d, relu_cache)
        conv2d_backward(d, conv_cache, params["conv1/weights"], grads["conv1/weights"],
                        grads["conv1/biases"])
        return loss
