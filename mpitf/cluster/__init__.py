"""The cluster: which jobs and tasks there are, and which MPI rank runs which task.

``spec`` (`ClusterSpec` and every form it is written in: dicts, the flag string, counts,
TF_CONFIG's ``cluster``, ``mpitf cluster --spec``), ``resolvers`` (TF_CONFIG and the Slurm
step, read as TensorFlow reads them), ``flags`` (a job's cluster flags and the cluster they
give, with the role claims held against the rank's role), ``roles`` (the rank -> task
policy, a pure function) and ``device`` (`DeviceSpec` names, local rank, a rank's GPU).

May import: ``mpitf.errors`` only. Inside, ``spec`` imports nothing of the package,
``resolvers`` builds on it, and ``flags``, ``roles`` and ``device`` on those.
This package re-exports what ``mpitf.cluster`` always held.
"""

from .flags import add_cluster_arguments
from .spec import ClusterSpec, split_address

__all__ = ["ClusterSpec", "add_cluster_arguments", "split_address"]
