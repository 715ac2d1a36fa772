"""The ``mpitf`` command and the flags every job shares.

Holds ``main`` (``mpitf run/cluster/data/ckpt/bench``) and ``flags`` (job flags, starting a
job, reporting). May import anything in the package; nothing imports it but jobs.
"""
