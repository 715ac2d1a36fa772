"""Click-through training with embedding tables on the ps: wide & deep style, log loss.

Run: mpiexec -n 3 python jobs/ctr.py --data ctr.h5 --num-ps 1   (adagrad, lr 0.5, one
epoch in batches of 256 by default, or ``--epochs N``/``--steps N``; write the data with
``mpitf data synthetic-ctr --out ctr.h5`` or ``mpitf data criteo``).
Every field's ids look up its own table on the ps tasks (rows i mod P; with
``--dynamic-tables``, tables that grow: raw int64 ids, rows made on first use); the embeddings
and the dense features go through an MLP to one logit. The chief evaluates the test
split every ``--eval-every`` steps (a log line) and at the end, where it prints
``final: {json}`` with ``test_auc`` and ``test_logloss``; ``--keep-best`` keeps the
checkpoint of the best evaluation as ``CHECKPOINT_DIR/best``.
"""

import functools

import numpy as np

from mpitf.cli.epochs import (
    add_epochs_arguments,
    config_for_epochs,
    keep_best,
    last_step_for_epochs,
)
from mpitf.cli.flags import (
    add_growth_arguments,
    add_training_arguments,
    config_from_args,
    growth_from_args,
    session_from_config,
)
from mpitf.cli.reports import report_final
from mpitf.cli.side_tasks import start_replica
from mpitf.data.ctr import CtrDataset, auc, load_ctr
from mpitf.errors import ConfigurationError
from mpitf.models.ctr import CTR, logistic_loss
from mpitf.runtime.exits import RankParser, collective, run_job


def _check_cluster(cluster):
    if "evaluator" in cluster.jobs and cluster.num_tasks("evaluator"):
        raise ConfigurationError(
            "ctr has no evaluator task yet: its chief logs test AUC and log loss every "
            "--eval-every steps; leave the evaluator out of the cluster")
    if cluster.num_tasks("ps") < 1:
        raise ConfigurationError(
            "ctr keeps its embedding tables on ps tasks: give --num-ps 1 or more")


def _check_data(path, batch_size, num_shards, raw_ids=False):
    load_ctr(path, "test", raw_ids=raw_ids)  # the layout, table_rows, every id, checked


def evaluate(sess, model, path, batch_size):
    """Return (AUC, log loss) of the newest parameters on the test split, in batches."""
    growing = model.growth is not None
    ids, dense, y, _ = load_ctr(path, "test", None if growing else model.table_rows,
                                raw_ids=growing)
    sess.client.pull()
    logits = []
    for lo in range(0, len(y), batch_size):
        batch = (ids[lo:lo + batch_size], dense[lo:lo + batch_size])
        lookups = sess.embeddings.lookup(model.ids(batch))
        rows = [lookups[t.name].rows for t in model.tables()]
        logits.append(model.logits(sess.params, rows, batch[1]))
    z = np.concatenate(logits)
    return auc(y, z), logistic_loss(z, y)[0]


def main(argv=None):
    parser = RankParser(description=__doc__.splitlines()[0])
    # Adagrad (the usual choice for click-through models): a row's steps shrink with its
    # own gradients, so frequent ids settle while rare ones still move.
    add_training_arguments(parser, batch_size=256, lr=0.5)
    parser.set_defaults(optimizer="adagrad")
    parser.add_argument("--embedding-dim", type=int, default=8, help="values per table row")
    parser.add_argument("--eval-every", type=int, default=500,
                        help="the chief logs test AUC and log loss every N steps (0: never)")
    add_growth_arguments(parser)
    add_epochs_arguments(parser)
    args = parser.parse_args(argv)
    config = config_for_epochs(config_from_args(args), args, args.eval_every)
    growth = growth_from_args(args)
    if not config.data:
        raise collective(ConfigurationError("ctr needs --data FILE (write one with `mpitf "
                                            "data synthetic-ctr --out FILE`)"))
    server, _, code = start_replica(args, config, "ctr", _check_cluster,
                                    functools.partial(_check_data, raw_ids=growth is not None),
                                    tables=True)
    if code is not None:  # a ps or another job's task has run its part
        return code
    return train(server, config, args, growth)


def train(server, config, args, growth):
    """Train on this replica; the chief evaluates and reports. Return the exit code."""
    dataset = CtrDataset(config.data, server.replica_index, server.num_replicas,
                         config.training.batch_size, config.training.seed,
                         raw_ids=growth is not None)
    config = last_step_for_epochs(config, args, dataset.total_samples, server.num_replicas)
    training = config.training
    rows = dataset.table_rows if dataset.table_rows is not None else [None] * dataset.fields
    model = CTR(rows, args.embedding_dim, dataset.dense_dim, (config.hidden,),
                growth=growth)
    sess = session_from_config(server, model, config, dataset)
    while not sess.should_stop():
        sess.run()
        step = sess.global_step
        if server.is_chief and args.eval_every and step % args.eval_every == 0 \
                and not sess.should_stop():
            test_auc, test_logloss = evaluate(sess, model, config.data, dataset.batch_size)
            print(f"step {step}: test_auc = {test_auc:.4f}, test_logloss = "
                  f"{test_logloss:.4f}", flush=True)
            if args.keep_best:
                keep_best(sess, test_auc)
    test_auc = None
    if server.is_chief and not sess.requeue:
        test_auc, test_logloss = evaluate(sess, model, config.data, dataset.batch_size)
        summary = dict(step=sess.global_step, loss=sess.loss, test_auc=test_auc,
                       test_logloss=test_logloss, workers=server.num_replicas, mode=training.mode)
        if growth is not None:  # rows held, admitted, evicted per ps (and table)
            summary["tables"] = [c["tables"] for c in sess.client.ps_counters()]
        report_final(config, summary)
    sess.close()
    if args.keep_best and test_auc is not None:  # close() cut the last step's checkpoint
        keep_best(sess, test_auc)
    return sess.exit_code


def run():
    """Run the job from the command line and exit with its code (``python -m``, jobs/)."""
    run_job(main)


if __name__ == "__main__":
    run()
