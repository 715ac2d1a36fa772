"""The options that refuse each other, and the options a job's facts refuse.

:func:`refuse_combinations` runs when a :class:`~mpitf.config.TrainingConfig` is built (two
options that cannot work together); :func:`check_job` is
:meth:`TrainingConfig.check_job <mpitf.config.TrainingConfig.check_job>`, the one check of
the options against the job's facts (:class:`~mpitf.checks.JobFacts`: its MPI, ps tasks,
replicas, backends, tables and nodes). Each message names both sides and the fix.
"""

from .errors import ConfigurationError

_REPLICATION = "ps_replication_steps (--ps-replication-steps)"
_AGGREGATION = "aggregate_per_node (--aggregate-per-node)"
_DELTAS = "full_checkpoint_every (--full-checkpoint-every)"
_NO_TABLES = ("a model without embedding tables (a delta holds the rows of tables that changed, "
              "beside the whole dense shard, as a full checkpoint)")


def _off_host(backends):
    """Return the first of ``backends`` (names) that is not the host's (numpy), or None."""
    return next((name for name in sorted(backends) if name != "numpy"), None)


def refuse_combinations(config):
    """Raise if two of ``config``'s options refuse each other (checked at construction)."""
    if config.local_steps is not None and not config.consistency.applies_locally:
        raise ConfigurationError(
            f"local_steps (--local-steps) needs mode 'local', got {config.mode!r}: give "
            "--mode local or drop --local-steps")
    if config.consistency.applies_locally:
        _refuse(f"mode {config.mode!r} (--mode)", (
            (config.bucket_bytes, f"bucket_bytes={config.bucket_bytes} (--bucket-bytes): a "
             "worker pushes its parameters in one frame per ps"),
            (config.replicas_to_aggregate is not None,
             "replicas_to_aggregate (--replicas-to-aggregate): every worker's parameters "
             "are averaged"),
            (config.wire_dtype != "float32", f"wire_dtype {config.wire_dtype} "
             "(--wire-dtype): parameters travel in float32")))
    if config.deterministic and not config.consistency.sums_gradients:
        raise ConfigurationError(f"deterministic (--deterministic) needs mode 'sync', got "
                                 f"{config.mode!r}: in {config.mode} mode the order of updates "
                                 "depends on timing; drop one of them")
    if config.aggregate_per_node:
        _refuse("aggregate_per_node (--aggregate-per-node)", (
            (not config.consistency.sums_gradients, f"mode {config.mode!r} (--mode): it "
             "sums each step's gradients, which only sync mode has"),
            (config.bucket_bytes, f"bucket_bytes={config.bucket_bytes} (--bucket-bytes): a "
             "node pushes one frame per ps"),
            (config.skip_nonfinite, "skip_nonfinite (--skip-nonfinite): a node pushes whole"),
            (config.clients is not None, "in-graph replication (clients)")))
    if config.ps_replication_steps:
        _refuse(_REPLICATION, (
            (config.bucket_bytes, f"bucket_bytes={config.bucket_bytes} (--bucket-bytes): a "
             "ps copies and re-routes whole frames; give --bucket-bytes 0"),
            (config.aggregate_per_node, "aggregate_per_node (--aggregate-per-node)")))
    if config.heal:
        _refuse("heal (--heal)", (
            (config.deterministic, "deterministic (--deterministic): a lost worker ends "
             "such a job before a replacement could join"),
            (config.aggregate_per_node, "aggregate_per_node (--aggregate-per-node)"),
            (config.clients is not None, "in-graph replication (clients)")))
    if config.full_checkpoint_every > 1:
        _refuse_deltas(config)
    if config.wire_dtype != "float32":
        _refuse(f"wire_dtype {config.wire_dtype} (--wire-dtype)", (
            (config.aggregate_per_node, "aggregate_per_node (--aggregate-per-node): a "
             "node's shared window holds float32 frames"),
            (config.moving_average_decay is not None,
             "moving_average_decay (--moving-average-decay): the average would travel in "
             "a third buffer")))


def _refuse_deltas(config):
    """Refuse what delta checkpoints do not work with (ckpt/deltas.py)."""
    if not (config.save_checkpoint_steps or config.save_checkpoint_secs):
        raise ConfigurationError(
            f"{_DELTAS} takes deltas between the checkpoints --checkpoint-every or "
            "--checkpoint-secs takes, and neither is given (only the final checkpoint, a "
            "full one, would be written): give one of them, or drop the option")
    _refuse(_DELTAS, (
        (config.heal, "heal (--heal): a replaced ps does not know which rows changed "
         "before it joined"),
        (config.ps_replication_steps, f"{_REPLICATION}: a buddy serving a lost ps's shard "
         "does not know which of its rows changed")))


def _refuse(option_name, conflicts, fix="drop one of them"):
    """Raise for the first conflict ``(bad, what[, its own fix])`` that is ``bad``."""
    for bad, what, *own in conflicts:
        if bad:
            raise ConfigurationError(
                f"{option_name} does not support {what}; {own[0] if own else fix}")


def check_job(config, facts):
    """Raise if an option cannot work in the job :class:`JobFacts` ``facts`` describe.

    The one check of the options against the job's facts (its MPI, ps tasks, replicas,
    backends, tables and nodes): every rank calls it with the same facts before
    training, so a refusal is one message, alike everywhere. Each message names the
    option, the fact and the fix.
    """
    gpu, replica_gpu = _off_host(facts.backends), _off_host(facts.replica_backends)
    if config.consistency.applies_locally:  # a table's rows live on the ps, updated per step
        _refuse(f"mode {config.mode!r} (--mode)", ((facts.tables, "embedding tables"),))
    if config.ps_replication_steps:
        if not facts.ulfm:
            raise ConfigurationError(
                f"{_REPLICATION} keeps a copy of each ps's shard for when that ps dies, "
                "which needs Open MPI with ULFM (mpitf run --mpiexec <Open MPI's "
                "mpiexec>); under this MPI a lost ps ends the job: drop the option")
        if facts.num_ps < 2:
            raise ConfigurationError(
                f"{_REPLICATION} keeps a copy of each ps's shard on another ps, but the "
                f"job has {facts.num_ps} ps task: give it 2 or more, or drop the option")
        _refuse(_REPLICATION, (
            (gpu, f"the {gpu} backend (frames and copies move through host memory)",
             "use --device cpu or drop the option"),), "drop the option")
    _refuse(_DELTAS, ((config.full_checkpoint_every > 1 and not facts.tables, _NO_TABLES),),
            "drop the option")
    if config.heal and not facts.ulfm:
        raise ConfigurationError(
            "heal (--heal) replaces a lost rank with a spawned one, which needs Open MPI with "
            "ULFM (mpitf run --mpiexec <Open MPI's mpiexec>); under this MPI a lost rank "
            "ends the job: drop the option")
    if config.aggregate_per_node:
        r = config.replicas_to_aggregate
        _refuse(_AGGREGATION, (
            (r is not None and r != facts.num_replicas,
             f"backup workers (replicas_to_aggregate {r} of {facts.num_replicas} "
             "replicas): a node's push stands for all its replicas; leave "
             "--replicas-to-aggregate out"),
            (facts.tables, "embedding tables (their rows are pushed by id)"),
            (replica_gpu, f"the {replica_gpu} backend (a node shares host memory)",
             "use --device cpu or drop the flag")), "drop the flag")
        if facts.nodes_problem:
            raise ConfigurationError(f"{_AGGREGATION}: {facts.nodes_problem}")
    if config.wire_dtype != "float32":
        _refuse(f"wire_dtype {config.wire_dtype} (--wire-dtype)", (
            (facts.tables, "embedding tables (their rows travel on messages of their own)"),
            (gpu, f"the {gpu} backend (it converts in host memory)",
             "use --device cpu or --wire-dtype float32")), "use --wire-dtype float32")
