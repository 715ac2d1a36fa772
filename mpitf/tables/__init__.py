"""Embedding tables by rows: where each row lives, and the loops that move and apply rows.

``rows`` (`RowPlacement`: which ps holds which row, mod or ranges; `Dedup`: a batch's
unique ids, their inverse and their routing in one pass; `segment_sum`, `take_rows`,
`put_rows`), ``rowkernels`` (the compiled numba loops behind them, imported on first use
so numba loads only in a process that has tables) and ``shard`` (`TableShard`: one ps's
rows of one table with the optimizer's slots: locate, gather, sparse apply). Tables that
grow (any int64 id): ``growth`` (`Growth`: admission and eviction, options with flags),
``hashing`` (`HashPlacement`: an id's owner by hash; initial rows drawn from (seed,
table, id), for every table), ``idmap`` (`IdMap`: id -> slot), ``dynkernels`` (their
compiled loops) and ``dynamic`` (`DynamicShard`).

May import: ``mpitf.errors`` and ``mpitf.options`` only. The worker
(``worker/embedding.py``) and the ps (``ps/sparse.py``) build on it; a table's
description is ``models/embedding.py``'s.
"""
