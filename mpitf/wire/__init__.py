"""What travels between workers and ps tasks, and how it reaches MPI.

Holds ``protocol`` (kinds, tags, flags, the one MPI call per frame, waits with
deadlines), ``header`` (the header's words by name: the only code that packs or reads
them), ``frame`` (a frame as MPI moves it, on the worker and on the ps: direct, or staged
through pinned memory in chunks) and ``layout`` (where each ps's frame and each variable
sit in a worker's flat buffer).

May import: ``mpitf.runtime`` and the spec layer.
"""
