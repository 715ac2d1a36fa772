"""A base for models that wrap another (in-graph replicas, towers): delegate the protocol."""


class ModelWrapper:
    """Pass ``variables``, ``init`` and ``logits`` through to the wrapped ``model``.

    Subclasses override ``loss_and_grads``, which is where they differ.
    """

    def __init__(self, model):
        self.model = model

    def variables(self):
        """Return the wrapped model's variables."""
        return self.model.variables()

    def init(self, rng):
        """Return the wrapped model's initial values."""
        return self.model.init(rng)

    def logits(self, params, x):
        """Return the wrapped model's logits."""
        return self.model.logits(params, x)
