"""The dtype each ``--wire-dtype`` name stands for (no numba here).

The names are :data:`mpitf.config.WIRE_DTYPES`; what a 16-bit wire cannot carry in a job
(embedding tables, a GPU backend) is refused with the other options, by
:meth:`mpitf.config.TrainingConfig.check_job`.
"""

import ml_dtypes
import numpy as np

from ..config import WIRE_DTYPES
from ..errors import ConfigurationError

# what --wire-dtype takes, by name: numpy's dtypes, and ml_dtypes' bfloat16
WIRE_NAMES = {name: np.dtype(getattr(ml_dtypes, name) if name == "bfloat16" else name)
              for name in WIRE_DTYPES}


def wire_dtype(name, param_dtype=np.float32):
    """Return the numpy dtype frames of wire dtype ``name`` carry.

    "float32" is the parameters' own dtype (float64 parameters travel as float64); a
    16-bit wire carries float32 parameters only (raises for others, a fact of the model).
    """
    dtype = WIRE_NAMES[name]
    if dtype == np.float32:
        return np.dtype(param_dtype)
    if np.dtype(param_dtype) != np.float32:
        raise ConfigurationError(
            f"wire_dtype {name} (--wire-dtype) does not support "
            f"{np.dtype(param_dtype).name} parameters: it carries float32 ones; or use "
            "--wire-dtype float32")
    return dtype
