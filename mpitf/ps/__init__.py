"""The parameter-server side: a ps task's shard, its event loop, its policies and kernels.

Holds ``shard`` (parameters, slots, moving average), ``service`` (the loop over
nonblocking receives), ``consistency`` (sync, async, bounded staleness) and
``optimizers`` (in-place update kernels), ``groups`` (options per group of variables, by
element range of the shard) and ``average`` (the moving average).

May import: ``mpitf.ckpt``, ``mpitf.wire``, ``mpitf.runtime`` and the spec layer; never
``mpitf.worker``.
"""
