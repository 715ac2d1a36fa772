"""The dtypes ``--wire-dtype`` names, and what a 16-bit wire supports (no numba here)."""

import ml_dtypes
import numpy as np

from ..errors import ConfigurationError
from ..runtime.exits import collective

# what --wire-dtype takes, by name
WIRE_NAMES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
              "float16": np.dtype(np.float16)}


def wire_dtype(name, param_dtype=np.float32, backend="numpy", tables=False):
    """Return the numpy dtype frames of wire dtype ``name`` carry (raise if unsupported).

    "float32" is the parameters' own dtype (float64 parameters travel as float64). A 16-bit
    wire carries float32 parameters in host memory (``backend`` "numpy": CuPy has no
    bfloat16) and no embedding tables (``tables``).
    """
    dtype = WIRE_NAMES[name]
    if dtype == np.float32:
        return np.dtype(param_dtype)
    for bad, what in (
            (np.dtype(param_dtype) != np.float32,
             f"{np.dtype(param_dtype).name} parameters: it carries float32 ones"),
            (backend != "numpy", f"the {backend} backend: it converts in host memory; use "
             "--device cpu"),
            (tables, "embedding tables: their rows travel on messages of their own")):
        if bad:
            raise ConfigurationError(f"wire_dtype {name} (--wire-dtype) does not support "
                                     f"{what}; or use --wire-dtype float32")
    return dtype


def host_problem(name, backend):
    """Return the error a 16-bit wire ``name`` makes on a ``backend`` rank, or None.

    Every rank of a job passes its own to ``raise_shared``, so a GPU rank anywhere ends
    every rank with one message before training.
    """
    try:
        wire_dtype(name, backend=backend)
    except ConfigurationError as exc:
        return exc
    return None


def refuse_wire(config, job, why):
    """Raise, alike on every rank, if ``job`` (which keeps float32 frames) got a 16-bit wire."""
    if config.wire_dtype != "float32":
        raise collective(ConfigurationError(
            f"{job} does not support --wire-dtype {config.wire_dtype} ({why}); use "
            "--wire-dtype float32"))
