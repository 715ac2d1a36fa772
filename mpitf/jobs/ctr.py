"""Click-through training with embedding tables on the ps: wide & deep style, log loss.

Run: mpiexec -n 3 python jobs/ctr.py --data ctr.h5 --num-ps 1   (adagrad, lr 0.5, 3000
steps of 256 by default; write the data with ``mpitf data synthetic-ctr --out ctr.h5`` or
``mpitf data criteo``).
Every field's ids look up its own table on the ps tasks (rows i mod P); the embeddings
and the dense features go through an MLP to one logit. The chief evaluates the test
split every ``--eval-every`` steps (a log line) and at the end, where it prints
``final: {json}`` with ``test_auc`` and ``test_logloss``.
"""

import numpy as np

from mpitf.cli.flags import (
    add_training_arguments,
    check_roles,
    claim_checkpoint_dir,
    config_from_args,
    raise_shared,
    report_final,
    resolve_cluster,
    session_from_config,
    setup_backend,
)
from mpitf.cli.side_tasks import run_side_task
from mpitf.data.ctr import CtrDataset, auc, load_ctr
from mpitf.errors import ConfigurationError, MpitfError
from mpitf.models.ctr import CTR, logistic_loss
from mpitf.roles import check_training_cluster
from mpitf.runtime.exits import RankParser, collective, run_job


def start(args, config):
    """Cluster, Server, backend, the data file checked (rank 0 for all), the checkpoint lock."""
    from mpi4py import MPI

    from mpitf.runtime.server import Server

    cluster = resolve_cluster(args, MPI.COMM_WORLD.Get_size())
    try:
        check_training_cluster(cluster, config.training.checkpoint_dir)
    except MpitfError as exc:
        raise collective(exc) from None
    if "evaluator" in cluster.jobs and cluster.num_tasks("evaluator"):
        raise collective(ConfigurationError(
            "ctr has no evaluator task yet: its chief logs test AUC and log loss every "
            "--eval-every steps; leave the evaluator out of the cluster"))
    if cluster.num_tasks("ps") < 1:
        raise collective(ConfigurationError(
            "ctr keeps its embedding tables on ps tasks: give --num-ps 1 or more"))
    if not config.data:
        raise collective(ConfigurationError("ctr needs --data FILE (write one with `mpitf "
                                            "data synthetic-ctr --out FILE`)"))
    server = Server(cluster, deadline=config.deadline, fixed_deadline=config.fixed_deadline)
    check_roles(args, server)
    setup_backend(args, server)
    problem = None
    if server.rank == 0:
        try:
            load_ctr(config.data, "test")
        except MpitfError as exc:
            problem = exc
    raise_shared(server.comm, problem)
    if config.training.checkpoint_dir:
        claim_checkpoint_dir(server, config.training.checkpoint_dir)
    return server


def evaluate(sess, model, path, batch_size):
    """Return (AUC, log loss) of the newest parameters on the test split, in batches."""
    ids, dense, y, _ = load_ctr(path, "test", model.table_rows)
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
    add_training_arguments(parser, steps=3000, batch_size=256, lr=0.5)
    parser.set_defaults(optimizer="adagrad")
    parser.add_argument("--embedding-dim", type=int, default=8, help="values per table row")
    parser.add_argument("--eval-every", type=int, default=500,
                        help="the chief logs test AUC and log loss every N steps (0: never)")
    args = parser.parse_args(argv)
    config = config_from_args(args)
    server = start(args, config)
    if server.job_name == "ps":
        server.join()
        return server.exit_code
    code = run_side_task(server, config, config.data, "ctr")  # other jobs' tasks exit 0
    if code is not None:
        return code
    training = config.training
    dataset = CtrDataset(config.data, server.replica_index, server.num_replicas,
                         training.batch_size, training.seed)
    model = CTR(dataset.table_rows, args.embedding_dim, dataset.dense_dim, (config.hidden,))
    sess = session_from_config(server, model, config, dataset)
    while not sess.should_stop():
        sess.run()
        step = sess.global_step
        if server.is_chief and args.eval_every and step % args.eval_every == 0 \
                and not sess.should_stop():
            test_auc, test_logloss = evaluate(sess, model, config.data, dataset.batch_size)
            print(f"step {step}: test_auc = {test_auc:.4f}, test_logloss = "
                  f"{test_logloss:.4f}", flush=True)
    if server.is_chief and not sess.requeue:
        test_auc, test_logloss = evaluate(sess, model, config.data, dataset.batch_size)
        summary = dict(step=sess.global_step, loss=sess.loss, test_auc=test_auc,
                       test_logloss=test_logloss, workers=server.num_replicas, mode=training.mode)
        report_final(config, summary)
    sess.close()
    return sess.exit_code


def run():
    """Run the job from the command line and exit with its code (``python -m``, jobs/)."""
    run_job(main)


if __name__ == "__main__":
    run()
