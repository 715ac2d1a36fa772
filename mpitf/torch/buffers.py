"""What of a torch model mpitf can hold: the dtypes and devices it accepts, and its buffers.

Trainable parameters live on the ps, in one dtype (float32 or float64: what the ps's
kernels run). Everything else in ``model.state_dict()`` (BatchNorm running statistics,
its int64 ``num_batches_tracked``, frozen parameters) is the model's *buffers*: numpy
views handed to :mod:`mpitf.worker.buffers`, which keeps the chief's copy as the model's
and checkpoints it (see that module for how workers are kept consistent).
"""

import torch

from ..errors import ConfigurationError

# The dtypes the ps trains: its fused kernels run on float32 and float64.
TRAINABLE_DTYPES = (torch.float32, torch.float64)


def check_model(model, named):
    """Refuse, naming it, a parameter or buffer mpitf cannot hold; ``named`` are the trained.

    Trained parameters must share one dtype, float32 or float64; every tensor of the
    state_dict must be on the CPU in a dtype numpy holds (not bfloat16).
    """
    first_name, first = named[0]
    for name, p in named:
        if p.dtype not in TRAINABLE_DTYPES or p.dtype != first.dtype:
            mixed = f", but {first_name!r} is {first.dtype}" if p.dtype != first.dtype else ""
            raise ConfigurationError(
                f"parameter {name!r} is {p.dtype}{mixed}: mpitf.torch trains parameters of "
                "one dtype, float32 or float64 (buffers, such as BatchNorm's int64 count, may "
                "be any dtype but bfloat16); call model.float() before DistributedOptimizer")
    trained = {name for name, _ in named}
    for name, t in model.state_dict(keep_vars=True).items():
        if name in trained:
            continue
        if t.device.type != "cpu":
            raise ConfigurationError(
                f"buffer {name!r} is on {t.device}: mpitf.torch serves CPU tensors only "
                "(keep the model on the CPU)")
        if t.dtype == torch.bfloat16:
            raise ConfigurationError(
                f"buffer {name!r} is torch.bfloat16, which mpitf cannot checkpoint: keep "
                "buffers in float32 (model.float()) or another numpy dtype")


def buffer_views(model, trained):
    """Return every state_dict entry not in ``trained`` as a numpy view (name -> array).

    The views share memory with the tensors, so what BatchNorm updates in place is what a
    checkpoint saves, and a restore writes straight into the model.
    """
    return {name: t.detach().numpy() for name, t in model.state_dict(keep_vars=True).items()
            if name not in trained}
