"""A model's untrained state (BatchNorm running statistics, counters): the chief's is the model's.

The ps never sees these values. As with DDP's ``broadcast_buffers`` and Horovod's
``broadcast_parameters(model.state_dict())``, the chief's copy is the one that counts: it
is every worker's at the start (unless restored), the one each checkpoint holds (written
by the chief beside the shards), and every worker takes it at each checkpoint (carried
with the chief's release) and at the end of training (a broadcast over the replicas). In
between each worker updates its own copy from its own batches. On resume every worker
loads the checkpoint's, so a resumed deterministic run ends bit for bit as an unbroken one.
"""

import numpy as np

from ..ckpt.buffers import check_model_buffers, read_buffers
from ..ckpt.names import read_manifest
from ..errors import ConfigurationError


def model_buffers(model, server, clients=None):
    """Return the :class:`ModelBuffers` of ``model``, or None if it has none."""
    if not hasattr(model, "buffers") or not model.buffers():
        return None
    return ModelBuffers(model, server.replica_comm, server.is_chief, clients)


class ModelBuffers:
    """The buffers of a model that has ``buffers()`` (name -> live numpy view, in place).

    ``comm`` is the replica communicator (the chief is its rank 0).
    """

    def __init__(self, model, comm, is_chief, clients=None):
        if clients is not None:
            raise ConfigurationError("a model with buffers needs every replica in the session: "
                                     "leave the in-graph `clients` option unset")
        self._model, self.comm, self.is_chief = model, comm, is_chief

    @property
    def arrays(self):
        """Return the buffers as the model holds them now (name -> numpy view)."""
        return self._model.buffers()

    def copy(self):
        """Return a copy of the buffers (what a checkpoint or a message carries)."""
        return {name: np.array(a, copy=True) for name, a in self.arrays.items()}

    def load(self, values):
        """Copy ``values`` (name -> array) into the model's buffers, in place."""
        for name, a in self.arrays.items():
            np.copyto(a, values[name])

    def start(self, restore):
        """Restore from checkpoint ``restore`` (every worker), or take the chief's."""
        if restore is None:
            self.share()
            return
        manifest = read_manifest(restore)
        check_model_buffers(restore, manifest, self.arrays)
        self.load(read_buffers(restore, manifest))

    def share(self):
        """Every replica takes the chief's buffers (a collective over the replicas)."""
        values = self.comm.bcast(self.copy() if self.is_chief else None, root=0)
        if not self.is_chief:
            self.load(values)
