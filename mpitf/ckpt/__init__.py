"""Checkpoints: sharded HDF5 files, the manifest, ``latest``, verification, resharding.

Below both sides: each ps writes and reads its own shard, the chief writes the manifest.
``files`` (atomic writes, checksums), ``names`` (checkpoint names, ``latest``, listing,
manifests), ``pieces`` (a shard's datasets, read and tiled), ``write``, ``verify``,
``restore`` (resharding), ``cut`` (the consistent-cut protocol both sides call), ``lock``
(one job per checkpoint directory) and ``commands`` (``mpitf ckpt``).

May import: ``mpitf.wire``, ``mpitf.runtime`` and the spec layer.
"""
