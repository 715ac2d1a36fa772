"""When a recommender job ends and what it keeps: ``--epochs``, ``--steps``, ``--keep-best``."""

from ..ckpt.best import keep_if_best
from ..errors import ConfigurationError
from ..runtime.exits import collective

__all__ = ["add_epochs_arguments", "config_for_epochs", "keep_best", "last_step_for_epochs"]


def add_epochs_arguments(parser):
    """Add ``--epochs`` (the default unless ``--steps`` is given: 1) and ``--keep-best``."""
    parser.set_defaults(steps=None)  # None: --steps was not given, --epochs decides
    parser.add_argument("--epochs", type=float, default=None,
                        help="passes over the training split (default: 1, unless --steps "
                             "is given); an epoch is every worker's pass over its shard")
    parser.add_argument("--keep-best", action="store_true",
                        help="with --checkpoint-dir: checkpoint at every evaluation "
                             "(--eval-every) and keep the one of the best test AUC as "
                             "CHECKPOINT_DIR/best")


def config_for_epochs(config, args, eval_every):
    """Check ``--epochs``, ``--steps`` and ``--keep-best``; return ``config`` ready for them.

    ``--keep-best`` needs a checkpoint at every evaluation. Pure: call it on every rank,
    before the cluster starts.
    """
    import dataclasses

    training = config.training
    if args.steps is not None and args.epochs is not None:
        raise collective(ConfigurationError(
            f"--steps {args.steps} and --epochs {args.epochs:g} both say when training ends: "
            "give one"))
    if args.epochs is not None and not args.epochs > 0:
        raise collective(ConfigurationError(f"--epochs {args.epochs:g}: expecting a number "
                                            "of passes above 0, e.g. 1 or 0.5"))
    if not args.keep_best:
        return config
    if not training.checkpoint_dir or not eval_every:
        raise collective(ConfigurationError(
            "--keep-best keeps the checkpoint of the best evaluation: give --checkpoint-dir "
            "DIR and --eval-every N (above 0)"))
    if training.save_checkpoint_steps not in (None, eval_every):
        raise collective(ConfigurationError(
            f"--keep-best checkpoints at every evaluation (--eval-every {eval_every}): "
            f"leave --checkpoint-every {training.save_checkpoint_steps} out"))
    return dataclasses.replace(config, training=training.replace(
        save_checkpoint_steps=eval_every))


def last_step_for_epochs(config, args, total_samples, num_workers):
    """Return ``config`` with its last step from ``--epochs`` (1 by default), unless ``--steps``.

    An epoch is ``total_samples // num_workers // batch_size`` batches on each worker (its
    shard, to its last full batch); in sync mode a global step takes one batch of each
    worker it aggregates, otherwise one batch. Every rank computes the same.
    """
    import dataclasses
    import math

    if args.steps is not None:
        return config
    training = config.training
    per_step = (training.replicas_to_aggregate or num_workers) if training.mode == "sync" \
        else 1
    batches = num_workers * (total_samples // num_workers // training.batch_size)
    last = max(1, math.ceil((args.epochs or 1) * batches / per_step))
    return dataclasses.replace(config, training=training.replace(last_step=last))


def keep_best(session, test_auc):
    """Chief, after an evaluation at a checkpoint's step: keep it if its AUC is the best."""
    step = session.global_step
    if session.committed and session.committed[-1] == step and keep_if_best(
            session.checkpoint_dir, step, "test_auc", test_auc):
        print(f"step {step}: the best test_auc so far ({test_auc:.4f}): kept as "
              f"{session.checkpoint_dir}/best", flush=True)
