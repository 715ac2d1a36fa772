"""A loop's own sampler as the data position mpitf checkpoints for each worker."""

from ..errors import ConfigurationError

__all__ = ["SamplerPosition", "data_position"]


class SamplerPosition:
    """A loop's own sampler as the session's data position, through its ``state_dict()``.

    The checkpoint keeps two integers per worker, ``{"epoch", "cursor"}`` (the next batch's
    position, as :class:`~mpitf.data.sharded.ShardedDataset`'s); a sampler with
    ``state_dict()``/``load_state_dict()`` over those two (as torchdata's stateful
    loaders have) is saved with every checkpoint and repositioned on restore.
    """

    def __init__(self, sampler):
        self.sampler = sampler

    def state(self):
        """Return the sampler's position, checked."""
        state = self.sampler.state_dict()
        try:
            position = {"epoch": int(state["epoch"]), "cursor": int(state["cursor"])}
        except (KeyError, TypeError, ValueError):
            raise ConfigurationError(
                f"the dataset's state_dict() returned {state!r}: mpitf checkpoints a "
                "worker's data position as {'epoch': int, 'cursor': int} (the next "
                "batch's epoch and place in it); return those two") from None
        if set(state) != set(position):
            raise ConfigurationError(
                f"the dataset's state_dict() holds {sorted(state)}: mpitf checkpoints only "
                "'epoch' and 'cursor' (integers); derive the rest from them")
        return position

    def restore(self, state):
        """Reposition the sampler at a checkpoint's position."""
        self.sampler.load_state_dict({"epoch": int(state["epoch"]),
                                      "cursor": int(state["cursor"])})


def data_position(dataset):
    """Return ``dataset`` as the session takes it: a sampler with state_dict() is adapted."""
    if dataset is None or hasattr(dataset, "restore") or not hasattr(dataset, "state_dict"):
        return dataset
    if not hasattr(dataset, "load_state_dict"):
        raise ConfigurationError("the dataset has state_dict() but no load_state_dict(): "
                                 "give it both, so a restored checkpoint repositions it")
    return SamplerPosition(dataset)
