"""Between-graph training of an MLP (or CNN) on the digits set: mpitf's mlp_mnist_dist.py.

Run: mpiexec -n 3 python jobs/mnist_mlp.py --num-ps 1 --steps 300 --mode sync
Every rank runs this script; the MPI rank decides whether it is a ps, the chief, a worker
or the evaluator (``--evaluator``, or an ``evaluator`` job in the spec: it evaluates each
checkpoint of --checkpoint-dir into RUN_DIR/eval/metrics.jsonl).
"""


from mpitf.cli.flags import (
    add_training_arguments,
    config_from_args,
    evaluate_session,
    model_from_config,
    report_final,
    session_from_config,
)
from mpitf.cli.side_tasks import start_replica
from mpitf.data.sharded import ShardedDataset
from mpitf.errors import ConfigurationError
from mpitf.runtime.exits import RankParser, run_job


def main(argv=None):
    parser = RankParser(description=__doc__.splitlines()[0])
    add_training_arguments(parser)
    args = parser.parse_args(argv)
    config = config_from_args(args)  # every value checked, alike on every rank
    server, path, code = start_replica(args, config, "mnist_mlp", _check_cluster)
    if code is not None:  # a ps, an evaluator or another job's task has run its part
        return code
    training = config.training
    dataset = ShardedDataset(path, "train", server.replica_index, server.num_replicas,
                             training.batch_size, training.seed)
    model = model_from_config(config, dataset.x_dim, dataset.num_classes, dataset.image_shape)
    sess = session_from_config(server, model, config, dataset, args.log_device_placement)
    while not sess.should_stop():
        sess.run()
    if server.is_chief and not sess.requeue:
        summary = evaluate_session(sess, config, path, workers=server.num_replicas,
                                   mode=training.mode)
        report_final(config, summary, sess.params)
    sess.close()
    dataset.close()
    return sess.exit_code


def _check_cluster(cluster):
    if cluster.num_tasks("ps") < 1:
        raise ConfigurationError(
            "mnist_mlp trains through ps tasks but the cluster has none: give --num-ps 1 or "
            "more (jobs/towers.py trains in one process without a ps)")


def run():
    """Run the job from the command line and exit with its code (``python -m``, jobs/)."""
    run_job(main)


if __name__ == "__main__":
    run()
