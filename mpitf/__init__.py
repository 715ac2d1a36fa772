"""mpitf: distributed TensorFlow's ps/worker model (parameter servers, replicas) on MPI.

The public API is ``__all__`` (one line each in ``docs/api.md``). Importing the package is
cheap and does not initialise MPI: every name but the cluster spec and the errors loads
its module on first use.
"""

from .cluster import ClusterSpec
from .cluster.device import DeviceSpec
from .errors import (
    CheckpointError,
    ConfigurationError,
    DataError,
    DeadlineError,
    MpitfError,
    NonFiniteGradientError,
    PeerError,
)

__version__ = "0.1.0"

# Attributes loaded on first access: name -> module that defines it.
_LAZY = {
    "TFConfigClusterResolver": "cluster.resolvers",
    "SlurmClusterResolver": "cluster.resolvers",
    "Server": "runtime.server",
    "abort_on_error": "runtime.exits",
    "TrainingSession": "worker.session",
    "Evaluator": "worker.evaluator",
    "Hook": "worker.hooks",
    "EventWriter": "worker.summaries",
    "make_optimizer": "ps.optimizers",
    "ExponentialDecay": "ps.schedules",
    "ShardedDataset": "data.sharded",
    "default_data_path": "data.datasets",
    "ensure_digits": "data.datasets",
    "build_model": "models",
    "EmbeddingTable": "models.embedding",
    "RowPlacement": "tables.rows",
    "Growth": "tables.growth",
    "replica_device_setter": "placement",
    "GreedyLoadBalancingStrategy": "placement",
    "min_max_variable_partitioner": "placement",
    "fixed_size_partitioner": "placement",
    "variable_axis_size_partitioner": "placement",
}

__all__ = [
    "ClusterSpec",
    "DeviceSpec",
    *_LAZY,
    "MpitfError",
    "ConfigurationError",
    "DataError",
    "CheckpointError",
    "PeerError",
    "DeadlineError",
    "NonFiniteGradientError",
    "__version__",
]


def __getattr__(name):
    """Import a lazy attribute's module on first access (PEP 562)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mpitf' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    """List the public names, lazy ones included."""
    return sorted(set(globals()) | set(__all__))
