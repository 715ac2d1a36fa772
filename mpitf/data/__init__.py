"""Training data: HDF5 files sharded over workers, and the offline data sets mpitf ships.

Holds ``sharded`` (``ShardedDataset``, checks, positions for checkpoints) and ``datasets``
(the digits set, MNIST IDX conversion).

May import: ``mpitf.config`` (its checks) and ``mpitf.errors`` only.
"""
