"""TorchRec's ``EmbeddingBagCollection`` and ``EmbeddingCollection`` with their tables on the ps.

TorchRec's own classes, built from its configs (``EmbeddingBagConfig``/``EmbeddingConfig``:
names, feature names, pooling, initialisation), whose tables are :mod:`mpitf.torch`'s
(``embedding_bags[name]`` an :class:`~mpitf.torch.EmbeddingBag`, ``embeddings[name]`` an
:class:`~mpitf.torch.Embedding`, under the state_dict keys TorchRec gives them). Until a
:class:`~mpitf.torch.DistributedOptimizer` binds the tables, the forward is TorchRec's over
the local weights. Bound, a forward takes a ``KeyedJaggedTensor``, gathers each table's ids
(every feature the table serves, one after another), checks them all, pulls every table's
rows in one sparse request per ps (:meth:`~mpitf.torch.DistributedOptimizer.tables_forward`)
and returns what TorchRec returns: a ``KeyedTensor`` of the pooled features, or a dict of
``JaggedTensor`` per feature. :func:`distribute` swaps the TorchRec collections of a model
for these, with TorchRec's initial values. Needs the ``torchrec`` extra.
"""

import torch
from torchrec.modules import embedding_modules as tr
from torchrec.modules.embedding_configs import DataType, PoolingType
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedTensor

from ..errors import ConfigurationError
from .ids import check_ids
from .tables import Embedding, EmbeddingBag

__all__ = ["EmbeddingBagCollection", "EmbeddingCollection", "distribute"]

_MODES = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}


def _check_config(config, pooled):
    """Refuse a config mpitf's tables cannot hold, naming the table and what to use."""
    if config.data_type != DataType.FP32:
        raise ConfigurationError(f"table {config.name!r}: data_type {config.data_type.name} "
                                 "is not supported on the ps: use DataType.FP32")
    if pooled and config.pooling not in _MODES:
        raise ConfigurationError(f"table {config.name!r}: pooling {config.pooling.name} in an "
                                 "EmbeddingBagCollection: use PoolingType.SUM or MEAN (or an "
                                 "EmbeddingCollection for unpooled rows)")


def _feature(features, name, table):
    """Return feature ``name`` of a KeyedJaggedTensor as a JaggedTensor, or refuse it."""
    if features.variable_stride_per_key():
        raise ConfigurationError("a KeyedJaggedTensor of a batch size per feature "
                                 "(stride_per_key_per_rank) is not supported: give every "
                                 "feature the same batch")
    if name not in features.keys():
        raise ConfigurationError(f"the KeyedJaggedTensor has no feature {name!r} (table "
                                 f"{table!r} reads it): its keys are {features.keys()}")
    return features[name]


def _joined(features, names, module, weighted):
    """Return one table's (ids, offsets with the last, weights, bags per feature).

    The table's features ``names`` one after another; each feature's ids are checked
    first, so a refusal names the feature, the id and its position in that feature.
    """
    parts = [_feature(features, n, module.table_name) for n in names]
    for name, part in zip(names, parts):
        try:
            check_ids(module.table_name, module.num_embeddings, part.values(), bag=False)
        except ConfigurationError as exc:
            raise ConfigurationError(f"feature {name!r}: {exc}") from None
    ids = torch.cat([p.values() for p in parts]) if len(parts) > 1 else parts[0].values()
    lengths = torch.cat([p.lengths() for p in parts]) if len(parts) > 1 else parts[0].lengths()
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    torch.cumsum(lengths.to(torch.int64), 0, out=offsets[1:])
    weights = None
    if weighted:
        weights = torch.cat([p.weights() for p in parts]) if len(parts) > 1 else \
            parts[0].weights()
    return ids.contiguous(), offsets, weights, [len(p.lengths()) for p in parts]


def _bound(modules):
    """Return the front end that bound ``modules`` (all or none of them), or None."""
    fronts = {id(m._front) for m in modules}
    if len(fronts) > 1:
        raise ConfigurationError("a collection's tables are bound to different "
                                 "DistributedOptimizers: wrap the model once")
    return next(iter(modules))._front if modules else None


class EmbeddingBagCollection(tr.EmbeddingBagCollection):
    """TorchRec's EmbeddingBagCollection whose tables live on the ps (see the module docstring).

    Args: TorchRec's (``tables``: EmbeddingBagConfig list, ``is_weighted``: the
    KeyedJaggedTensor's weights are per-sample weights; pooling SUM or MEAN; a table's
    ``feature_names`` may be several features), and ``max_ids``: the ids one step is
    expected to look up in each table (see :class:`~mpitf.torch.EmbeddingBag`).
    """

    def __init__(self, tables, is_weighted=False, device=None, max_ids=1 << 16):
        if device is not None and torch.device(device).type != "cpu":
            raise ConfigurationError(f"mpitf.torch tables live on the CPU, got device {device}")
        for config in tables:
            _check_config(config, pooled=True)
        super().__init__(tables, is_weighted)  # TorchRec's values, as under the same seed
        for config in tables:
            self.embedding_bags[config.name] = EmbeddingBag(
                config.num_embeddings, config.embedding_dim, mode=_MODES[config.pooling],
                include_last_offset=True, max_ids=max_ids,
                _weight=self.embedding_bags[config.name].weight.detach())

    def forward(self, features):
        """Return the features' pooled rows as a KeyedTensor (TorchRec's output)."""
        modules = list(self.embedding_bags.values())
        front = _bound(modules)
        if front is None:
            return super().forward(features)
        counts = []

        def calls():  # run inside tables_forward: a refusal here ends every rank too
            for module, names in zip(modules, self._feature_names):
                ids, offsets, weights, sizes = _joined(features, names, module,
                                                       self._is_weighted)
                counts.append(sizes)
                yield module, (ids, offsets, weights)

        pooled = []
        for out, sizes in zip(front.tables_forward(calls()), counts):
            pooled.extend(out.split(sizes) if len(sizes) > 1 else (out,))
        return KeyedTensor(keys=self._embedding_names, values=torch.cat(pooled, 1),
                           length_per_key=self._lengths_per_embedding)


class EmbeddingCollection(tr.EmbeddingCollection):
    """TorchRec's EmbeddingCollection whose tables live on the ps (see the module docstring).

    Args: TorchRec's ``tables`` (EmbeddingConfig list, one embedding_dim) and
    ``need_indices``, and ``max_ids`` as for :class:`EmbeddingBagCollection`.
    """

    def __init__(self, tables, device=None, need_indices=False, max_ids=1 << 16):
        if device is not None and torch.device(device).type != "cpu":
            raise ConfigurationError(f"mpitf.torch tables live on the CPU, got device {device}")
        for config in tables:
            _check_config(config, pooled=False)
        super().__init__(tables, need_indices=need_indices)
        for config in tables:
            self.embeddings[config.name] = Embedding(
                config.num_embeddings, config.embedding_dim, max_ids=max_ids,
                _weight=self.embeddings[config.name].weight.detach())

    def forward(self, features):
        """Return each feature's rows as a JaggedTensor (TorchRec's dict of them)."""
        modules = list(self.embeddings.values())
        front = _bound(modules)
        if front is None:
            return super().forward(features)
        parts = []

        def calls():  # run inside tables_forward: a refusal here ends every rank too
            for module, names in zip(modules, self._feature_names):
                ids, _, _, _ = _joined(features, names, module, False)
                parts.append([features[n] for n in names])
                yield module, (ids,)

        out = {}
        for rows, jts, names in zip(front.tables_forward(calls()), parts,
                                    self._embedding_names_by_table):
            cuts = rows.split([len(jt.values()) for jt in jts]) if len(jts) > 1 else (rows,)
            for name, jt, values in zip(names, jts, cuts):
                out[name] = JaggedTensor(values=values, lengths=jt.lengths(),
                                         weights=jt.values() if self._need_indices else None)
        return out


def _quietly(kind, *args, **kwargs):
    """Build ``kind(*args, **kwargs)`` leaving torch's random state as it was.

    Its initial values are overwritten by the TorchRec module's: the user's random stream
    (a seed set for what follows) must not move.
    """
    with torch.random.fork_rng():
        return kind(*args, **kwargs)


def _swap(module, max_ids):
    """Return mpitf's collection for a TorchRec one, with its weights; else None."""
    kind = type(module)
    if kind in (EmbeddingBagCollection, EmbeddingCollection):
        return None
    if kind.__name__.startswith("Sharded") or kind.__name__.startswith("FeatureProcessed") \
            or kind.__name__.startswith("Managed") or kind.__name__.startswith("Quant"):
        raise ConfigurationError(
            f"{kind.__name__} is not supported by mpitf.torch.distribute: give it the "
            "model with TorchRec's unsharded EmbeddingBagCollection/EmbeddingCollection "
            "(no DistributedModelParallel, sharding plan, feature processor or quantized "
            "tables); mpitf places the tables on the ps")
    if kind is tr.EmbeddingBagCollection:
        new = _quietly(EmbeddingBagCollection, module.embedding_bag_configs(),
                       module.is_weighted(), max_ids=max_ids)
        old, ours = module.embedding_bags, new.embedding_bags
    elif kind is tr.EmbeddingCollection:
        new = _quietly(EmbeddingCollection, module.embedding_configs(),
                       need_indices=module.need_indices(), max_ids=max_ids)
        old, ours = module.embeddings, new.embeddings
    else:
        return None
    for name, table in old.items():
        weight = table.weight
        if weight.device.type != "cpu":
            raise ConfigurationError(f"table {name!r} is on {weight.device}: build the "
                                     "TorchRec model on the CPU before distribute()")
        fused = getattr(weight, "_optimizer_classes", None)
        if fused:  # apply_optimizer_in_backward: its optimizer would step a local copy
            raise ConfigurationError(
                f"table {name!r} has an optimizer applied in backward "
                f"({fused[0].__name__}): the ps updates the tables; leave out "
                "apply_optimizer_in_backward and give DistributedOptimizer "
                "torch.optim.Adagrad with rowwise_tables=True (row-wise Adagrad), or SGD")
        with torch.no_grad():
            ours[name].weight.copy_(weight)
        ours[name].weight.requires_grad_(weight.requires_grad)
    return new


def distribute(model, max_ids=1 << 16):
    """Swap ``model``'s TorchRec collections for mpitf's (tables on the ps); return the model.

    Every ``torchrec.EmbeddingBagCollection`` and ``EmbeddingCollection`` in ``model`` (or
    ``model`` itself) is replaced, in place, by :class:`EmbeddingBagCollection` /
    :class:`EmbeddingCollection` with the same configs and weights. Call it before the
    optimizer is made (its parameters are the new tables'), then wrap both in
    :class:`~mpitf.torch.DistributedOptimizer`. ``max_ids``: the ids one step is expected
    to look up in each table (buffers grow past it).
    """
    top = _swap(model, max_ids)
    if top is not None:
        return top
    for _, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            new = _swap(child, max_ids)
            if new is not None:
                setattr(parent, name, new)
    return model
