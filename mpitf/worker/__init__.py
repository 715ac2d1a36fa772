"""The worker side: the client of the ps tasks and the training loop around it.

Holds ``client`` (flat buffers, push/pull; ``rates``: optimizer groups' learning
rates), ``session`` (``TrainingSession``), ``hooks``, ``summaries`` (TensorBoard event
files), ``replication`` (in-graph) and ``towers`` (several local devices in one process).

May import: ``mpitf.ckpt``, ``mpitf.wire``, ``mpitf.models``, ``mpitf.data``,
``mpitf.runtime`` and the spec layer; never ``mpitf.ps``.
"""
