"""mpitf: distributed TensorFlow's ps/worker model (parameter servers, replicas) on MPI.

Importing the package is cheap and does not initialise MPI: `Server` (which imports
``mpi4py.MPI``) and the placement helpers (which import numpy) load on first use.
"""

from .cluster import ClusterSpec
from .device import DeviceSpec
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

__all__ = [
    "ClusterSpec",
    "DeviceSpec",
    "Server",
    "replica_device_setter",
    "GreedyLoadBalancingStrategy",
    "min_max_variable_partitioner",
    "MpitfError",
    "ConfigurationError",
    "DataError",
    "CheckpointError",
    "PeerError",
    "DeadlineError",
    "NonFiniteGradientError",
    "__version__",
]

# Attributes loaded on first access: name -> module that defines it.
_LAZY = {
    "Server": "runtime.server",
    "replica_device_setter": "placement",
    "GreedyLoadBalancingStrategy": "placement",
    "min_max_variable_partitioner": "placement",
}


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
