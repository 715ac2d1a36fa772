"""Whether this rank's MPI library takes device buffers as they are (CUDA-aware MPI).

:func:`cuda_aware_support` decides it from an override, MPI's own query, or the library
family's environment; :func:`mpitf.runtime.backend.select_backend` records the answer
in the :class:`~mpitf.runtime.backend.Backend` it returns.
"""

import os

from mpitf.errors import ConfigurationError

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flag(env, name):
    """Read a boolean environment flag: True, False, or None when unset or unreadable."""
    value = env.get(name)
    if value is None:
        return None
    value = value.strip().lower()
    return True if value in _TRUE else False if value in _FALSE else None


def cuda_aware_support(mpi=None, env=os.environ):
    """Decide whether the MPI library takes device buffers, and say why.

    In order: the ``MPITF_CUDA_AWARE=0|1`` override; ``MPI.Query_cuda_support()``
    when mpi4py has it (MPIX_Query_cuda_support); then by library family,
    Open MPI (``OMPI_MCA_opal_cuda_support``), MVAPICH2 (``MV2_USE_CUDA=1``),
    Intel MPI (``I_MPI_OFFLOAD``), MPICH (``MPIR_CVAR_ENABLE_GPU=1``).

    Args:
        mpi: the ``mpi4py.MPI`` module (imported when None) or a stand-in with
            ``Get_library_version()`` and optionally ``Query_cuda_support()``.
        env: the environment to read.

    Returns:
        ``(True | False | None, reason)``; None means it cannot tell, which
        callers treat as False.
    """
    override = env.get("MPITF_CUDA_AWARE")
    if override is not None and override.strip() != "":
        if override.strip() == "1":
            return True, "MPITF_CUDA_AWARE=1"
        if override.strip() == "0":
            return False, "MPITF_CUDA_AWARE=0"
        raise ConfigurationError(
            f"MPITF_CUDA_AWARE must be 0 or 1 (or unset to detect), got {override!r}"
        )
    if mpi is None:
        from mpi4py import MPI as mpi

    query = getattr(mpi, "Query_cuda_support", None)
    if query is not None:
        try:
            supported = bool(query())
        except NotImplementedError:
            pass  # the library lacks MPIX_Query_cuda_support: decide by family below
        else:
            return supported, f"MPIX_Query_cuda_support() = {int(supported)}"

    version = str(mpi.Get_library_version())
    first_line = version.strip().splitlines()[0] if version.strip() else "?"
    if "Open MPI" in version:
        flag = _flag(env, "OMPI_MCA_opal_cuda_support")
        if flag is not None:
            return flag, "Open MPI: " + _shown(env, "OMPI_MCA_opal_cuda_support")
        return None, (
            "Open MPI: OMPI_MCA_opal_cuda_support unset, cannot tell without ompi_info; "
            "set MPITF_CUDA_AWARE=1 if it is built with CUDA"
        )
    if "MVAPICH" in version:  # before MPICH: MVAPICH2 descends from it
        return env.get("MV2_USE_CUDA", "").strip() == "1", "MVAPICH2: " + _shown(
            env, "MV2_USE_CUDA"
        )
    if "Intel(R) MPI" in version:
        return bool(_flag(env, "I_MPI_OFFLOAD")), "Intel MPI: " + _shown(env, "I_MPI_OFFLOAD")
    if "MPICH" in version:
        # MPICH built with GPU support enables it by default, but the CPU-only
        # builds (the pip wheel among them) say nothing either: unset is unknown.
        reason = "MPICH: " + _shown(env, "MPIR_CVAR_ENABLE_GPU")
        if "MPIR_CVAR_ENABLE_GPU" not in env:
            return None, reason
        return bool(_flag(env, "MPIR_CVAR_ENABLE_GPU")), reason
    return None, f"unknown MPI library {first_line!r}"


def _shown(env, name):
    """Return ``NAME=value`` or ``NAME unset`` for a reason string."""
    return f"{name}={env[name]}" if name in env else f"{name} unset"
