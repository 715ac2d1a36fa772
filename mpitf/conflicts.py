"""Options that do not go together: the refusals a TrainingConfig makes across its fields.

Each names both options and the one to drop, so the message says how to fix the flags.
"""

from .errors import ConfigurationError


def check_combinations(config):
    """Raise a ConfigurationError for options of ``config`` that refuse each other."""
    if config.aggregate_per_node:
        _check_aggregation(config)
    if config.wire_dtype != "float32":
        _check_wire(config)


def _check_aggregation(config):
    """Refuse what node-local aggregation does not support, naming the option to drop."""
    for bad, what in (
            (config.mode != "sync", f"mode {config.mode!r} (--mode): it sums each step's "
             "gradients, which only sync mode has"),
            (config.bucket_bytes, f"bucket_bytes={config.bucket_bytes} (--bucket-bytes): a "
             "node pushes one frame per ps"),
            (config.skip_nonfinite, "skip_nonfinite (--skip-nonfinite): a node pushes whole"),
            (config.clients is not None, "in-graph replication (clients)")):
        if bad:
            raise ConfigurationError(f"aggregate_per_node (--aggregate-per-node) does not "
                                     f"support {what}; drop one of them")


def check_aggregation(config, num_replicas):
    """Raise if ``config`` aggregates per node with backup workers (a node's push is whole)."""
    r = config.replicas_to_aggregate
    if config.aggregate_per_node and r is not None and r != num_replicas:
        raise ConfigurationError(
            f"aggregate_per_node (--aggregate-per-node) does not support backup workers "
            f"(replicas_to_aggregate {r} of {num_replicas} replicas): a node's push stands "
            "for all its replicas; leave --replicas-to-aggregate out or drop one of them")


def _check_wire(config):
    """Refuse what a 16-bit wire (bfloat16, float16) does not support."""
    for bad, what in (
            (config.aggregate_per_node, "aggregate_per_node (--aggregate-per-node): a node's "
             "shared window holds float32 frames"),
            (config.moving_average_decay is not None,
             "moving_average_decay (--moving-average-decay): the average would travel in a "
             "third buffer")):
        if bad:
            raise ConfigurationError(f"wire_dtype {config.wire_dtype} (--wire-dtype) does not "
                                     f"support {what}; drop one of them")
