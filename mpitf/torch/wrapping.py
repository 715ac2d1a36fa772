"""What wrapping a model changes: it is wrapped once, and its copies are plain torch models.

A DDP user's habits after wrapping: ``copy.deepcopy(model)`` for an EMA, ``torch.save(model)``,
a second wrapper by mistake. The hooks the wrapper puts on the model copy as inert ones, and
a model or optimizer that an open wrapper holds is refused by a second.
"""

import weakref

from ..errors import ConfigurationError

__all__ = ["Hook", "claim", "refuse_wrapped", "release"]

# the models and optimizers a DistributedOptimizer holds now: each is wrapped once
_WRAPPED = weakref.WeakSet()


class Hook:
    """A hook the wrapper puts on the model or optimizer; a copy of them gets an inert one.

    ``copy.deepcopy(model)`` (an EMA copy) and ``torch.save(model)`` copy the model's hooks:
    this one copies as a hook that does nothing, so the copy is a plain torch module and
    never drags this rank's session (its MPI communicator) along.
    """

    def __init__(self, call):
        self.call = call

    def __call__(self, *args):
        return None if self.call is None else self.call(*args)

    def __reduce__(self):
        return Hook, (None,)


def refuse_wrapped(model, optimizer):
    """Refuse a model or optimizer that another open DistributedOptimizer already wraps."""
    for what, obj in (("model", model), ("optimizer", optimizer)):
        if obj in _WRAPPED:
            raise ConfigurationError(
                f"this {what} is already wrapped by a DistributedOptimizer: wrap each model "
                "and optimizer once (as DDP) and use that one's step(); close() it before "
                "wrapping again, or wrap a copy made before the first wrapping")


def claim(model, optimizer):
    """Mark ``model`` and ``optimizer`` as wrapped (once their wrapper is made)."""
    _WRAPPED.add(model)
    _WRAPPED.add(optimizer)


def release(model, optimizer):
    """Let ``model`` and ``optimizer`` be wrapped again (their wrapper has closed)."""
    _WRAPPED.discard(model)
    _WRAPPED.discard(optimizer)
