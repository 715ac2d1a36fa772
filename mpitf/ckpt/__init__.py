"""Checkpoints: sharded HDF5 files, the manifest, ``latest``, verification, resharding.

Storage below both sides: each ps writes and reads its own shard, the chief writes the
manifest. Holds ``store`` (writing, listing, verifying, reading) and ``commands``
(``mpitf ckpt``).

May import: ``mpitf.wire``, ``mpitf.runtime`` and the spec layer.
"""
