"""The process around the training: this rank's Server, its array backend, how it exits.

Holds ``server`` (roles over COMM_WORLD, communicators, ``join``), ``backend`` (numpy or
CuPy: the only module that imports CuPy), ``cuda_aware`` (whether MPI takes device
buffers), ``lifeline`` (ends the job when a peer dies), ``witness`` (names a killed
peer from outside the ranks), ``exits`` (exit codes, abort-on-error, signals), ``launch``
(mpiexec argv), ``stall`` (how long a wait may last before a rank is named) and
``timeline``.

May import: the spec layer (``mpitf.cluster``, ``mpitf.tables``, ``placement``,
``config``, ``options``, ``checks``, ``errors``). ``Server.join`` reaches up to
``mpitf.ps`` on purpose (see ``docs/design.md``).
"""
