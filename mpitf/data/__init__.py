"""Training data: HDF5 files sharded over workers and streamed, and the data sets mpitf writes.

Holds ``sharded`` (``ShardedDataset``, checks), ``stream`` (a shard read in chunk-aligned
blocks through a bounded shuffle buffer), ``batches`` (positions for checkpoints, prefetch),
``chunks`` (how converters chunk arrays), ``datasets`` (the digits set, MNIST IDX
conversion) and ``ctr``, ``ctr_convert``, ``ctr_synthetic`` (click-through files: fixed-table
or raw ids, Criteo, synthetic).

May import: ``mpitf.config`` (its checks) and ``mpitf.errors`` only.
"""
