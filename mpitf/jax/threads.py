"""XLA's CPU platform and thread count for a rank that shares its node with other ranks.

XLA's CPU client sizes its thread pool from ``NPROC`` (else every core) when jax first
computes, so this must run before that: ``import mpitf.jax`` does it. Several ranks on a
node each taking every core fight for them, as torch's default threads do.
"""

import os

import jax
from jax._src import xla_bridge  # backends_are_initialized: jax has no public test for it

from ..runtime.cores import launcher_local_ranks as local_ranks
from ..runtime.cores import node_share, usable_cores

__all__ = ["local_ranks", "share_threads"]

# NPROC as share_threads set it: a child process that inherits it chooses again.
_MARK = "MPITF_JAX_NPROC"
# Set when share_threads ran: (threads, cores, local ranks), or None (the user chose).
chosen = None
late = False  # True: jax had computed before share_threads ran, with XLA's default threads


def share_threads():
    """Make jax compute on the CPU with this rank's share of its node's cores.

    Selects jax's ``cpu`` platform and sets ``NPROC`` (cores // ranks on the node, at least 1)
    unless the user set them or jax has already started; returns ``(threads, cores, ranks)``,
    or None when the environment (or an earlier start of jax) chose.
    """
    global chosen, late
    if xla_bridge.backends_are_initialized():
        late = "NPROC" not in os.environ
        return None
    if not os.environ.get("JAX_PLATFORMS") and not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")  # mpitf.jax serves host (CPU) arrays
    if "NPROC" in os.environ and os.environ["NPROC"] != os.environ.get(_MARK):
        return None  # the user's
    cores, ranks = usable_cores(), local_ranks()
    threads = node_share(ranks)
    os.environ["NPROC"] = os.environ[_MARK] = str(threads)
    chosen = (threads, cores, ranks)
    return chosen
