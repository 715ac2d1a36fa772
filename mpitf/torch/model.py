"""The torch model as mpitf sees it: which parameters train, its tables, its variables.

Read once, when :class:`~mpitf.torch.optimizer.DistributedOptimizer` wraps the model: the
trainable parameters checked against the torch optimizer (what mpitf cannot push is
refused by name), the mpitf.torch table modules, and the :class:`TorchVariables` the
session places, initialises and checkpoints.
"""

import torch

from ..errors import ConfigurationError
from ..models.embedding import EmbeddingTable
from .buffers import buffer_views
from .tables import _RowTable

__all__ = ["TorchVariables", "examples_in", "refuse_sparse", "sparse_message", "table_modules",
           "trainable"]


class TorchVariables:
    """The model as the session sees it: names, shapes, dtype, the chief's values, buffers.

    ``tables`` (name -> mpitf.torch table module) are its embedding tables: looked up in
    the modules' forward (the session's ``lookup``), so one step's buffers hold
    ``max_ids`` ids of each (``table_batch_size`` 1) until a step looks up more.
    """

    table_batch_size = 1

    def __init__(self, named, module, tables):
        self.named, self.module, self.table_modules = named, module, tables
        self.loss = None

    def buffers(self):
        """Return the untrained state_dict entries as numpy views (see .buffers)."""
        return buffer_views(self.module, {name for name, _ in self.named} | set(
            self.table_modules))

    def tables(self):
        """Return the tables' descriptions (the ps holds their rows)."""
        return [EmbeddingTable(name, m.num_embeddings, m.embedding_dim,
                               m.weight.detach().numpy().dtype.name, lookups=m.max_ids,
                               dynamic=m.dynamic)
                for name, m in self.table_modules.items()]

    def initial_table_rows(self):
        """Return every fixed table's rows as the chief built them (every ps starts from them).

        A table that grows has none: its rows are drawn on the ps from (seed, table, id).
        """
        return {name: m.weight.detach().numpy() for name, m in self.table_modules.items()
                if m.dynamic is None}

    def variables(self):
        return [(name, tuple(p.shape), p.detach().numpy().dtype) for name, p in self.named]

    def init(self, rng):
        """Return the parameters as they are now (the chief's become everyone's)."""
        return {name: p.detach().numpy() for name, p in self.named}

    def loss_and_grads(self, params, batch, grads):
        """Return the loss step() was given; backward already wrote the gradients."""
        return self.loss


def table_modules(model):
    """Return {state_dict key: module} of the mpitf.torch table modules in ``model``."""
    return {f"{q}.weight" if q else "weight": m for q, m in model.named_modules()
            if isinstance(m, _RowTable)}


def trainable(model, optimizer, tables=()):
    """Return ``[(name, param)]`` of the parameters to train, checked against the optimizer.

    A frozen parameter (``requires_grad`` False) may stay in a param group, as torch skips
    it: mpitf holds it as the model's state (the chief's), not as a variable. The weights
    of ``tables`` (names) must be in the optimizer too; they are not dense parameters.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for name, p in named:
        if name in tables and id(p) not in in_optimizer:
            raise ConfigurationError(f"table {name!r} is not in the optimizer: add its "
                                     "weight (model.parameters() holds it)")
    named = [(n, p) for n, p in named if n not in tables]
    in_model = {id(p) for _, p in model.named_parameters()}
    for name, p in named:
        if id(p) not in in_optimizer:
            raise ConfigurationError(
                f"parameter {name!r} requires grad but is not in the optimizer: add it, or "
                "set its requires_grad to False before wrapping")
        if p.device.type != "cpu":
            raise ConfigurationError(
                f"parameter {name!r} is on {p.device}: mpitf.torch serves CPU tensors only "
                "(keep the model on the CPU)")
    if in_optimizer - in_model:
        raise ConfigurationError(
            "the optimizer holds parameters that are not trainable parameters of the model")
    if not named:
        raise ConfigurationError("the model has no parameter that requires grad")
    refuse_sparse(model)
    return named


def refuse_sparse(model):
    """Refuse an embedding whose gradient would be a sparse tensor (``sparse=True``)."""
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse \
                and module.weight.requires_grad:
            raise ConfigurationError(sparse_message(f"{name}.weight" if name else "weight"))


def sparse_message(name):
    return (f"parameter {name!r} gets a sparse gradient (a torch.nn.Embedding or "
            "EmbeddingBag with sparse=True), which mpitf.torch.DistributedOptimizer cannot "
            "push: use mpitf.torch.EmbeddingBag or mpitf.torch.Embedding (torch's "
            "arguments), whose rows live on the ps and are updated sparsely, or build it "
            "with sparse=False (a dense gradient: the whole table every step)")


def examples_in(first):
    """Return the examples in a forward's first input (0 for anything unknown).

    A tensor's first dimension, or a TorchRec KeyedJaggedTensor's batch size (``stride()``).
    """
    if isinstance(first, torch.Tensor):
        return first.shape[0] if first.dim() > 0 else 0
    stride = getattr(first, "stride", None)
    return stride() if callable(stride) and hasattr(first, "lengths") else 0
