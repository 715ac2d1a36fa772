"""In-graph replication on the digits set: one client (worker task 0) drives every worker.

Run: mpiexec -n 4 python jobs/in_graph.py --num-ps 1 --steps 200
Worker task 0 is the only client of the ps: each step it splits the global batch (chunk i
is the batch worker i reads in between-graph training), every worker task computes the
gradient of its chunk, and the client averages them and pushes the mean through the ps.
With --deterministic the parameters equal those of jobs/mnist_mlp.py --deterministic
bit for bit. --batch-size is the chunk of one worker task.
"""


from mpitf.cli.flags import (
    add_training_arguments,
    config_from_args,
    model_from_config,
    session_from_config,
)
from mpitf.cli.reports import evaluate_session, report_final
from mpitf.cli.side_tasks import start_replica
from mpitf.errors import ConfigurationError
from mpitf.modes import MODES
from mpitf.placement import replica_device_setter
from mpitf.runtime.exits import (
    CheckpointSignals,
    RankParser,
    run_job,
)
from mpitf.runtime.timeline import Timeline
from mpitf.wire.layout import FlatLayout
from mpitf.worker.node import refuse_aggregation
from mpitf.worker.replication import InGraphBatches, InGraphReplica, InGraphWorker


def main(argv=None):
    parser = RankParser(description=__doc__.splitlines()[0])
    add_training_arguments(parser)
    args = parser.parse_args(argv)
    if not MODES[args.mode].sums_gradients:
        parser.error("in-graph replication has a single client, so only --mode sync applies")
    config = config_from_args(args)  # every value checked, alike on every rank
    refuse_aggregation(config.training, "in_graph", "its replicas already push through one client")
    training = config.training
    server, path, code = start_replica(args, config, "in_graph", _check_cluster)
    if code is not None:  # a ps, an evaluator or another job's task has run its part
        return code
    num_workers = server.num_replicas
    batches = InGraphBatches(path, num_workers, training.batch_size, training.seed) \
        if server.is_chief else None
    # The compute tasks read no data; they learn the model's shape from the client.
    first = batches.shards[0] if batches else None
    x_dim, num_classes, image_shape = server.replica_comm.bcast(
        (first.x_dim, first.num_classes, first.image_shape) if first else None, root=0)
    model = model_from_config(config, x_dim, num_classes, image_shape)
    if not server.is_chief:
        return _compute(server, model, training)

    replica = InGraphReplica(server.replica_comm, model)
    sess = session_from_config(server, replica, config, batches, args.log_device_placement,
                               clients=(0,), replicas_to_aggregate=None)
    replica.attach(sess.client)
    try:
        while not sess.should_stop():
            sess.run()
    finally:
        replica.stop()
    if not sess.requeue:
        summary = evaluate_session(sess, config, path, workers=num_workers, mode="sync",
                                   replication="in-graph")
        report_final(config, summary, sess.params)
    sess.close()
    batches.close()
    return sess.exit_code


def _check_cluster(cluster):
    if cluster.num_tasks("ps") < 1:
        raise ConfigurationError("in-graph replication pushes through a ps: use --num-ps 1 "
                                 "or more (jobs/towers.py trains without one)")


def _compute(server, model, training):
    """Run a compute task: gradients of the client's chunks, no session, no ps traffic."""
    CheckpointSignals().install()  # a requeue signal is the client's to act on
    placement = replica_device_setter(server.cluster, ps_strategy=training.ps_strategy)
    layout = FlatLayout(placement.place(model.variables()))
    InGraphWorker(server.replica_comm, model, layout).serve()
    if training.timeline:  # collective with the client's and the ps's end of training
        Timeline(server.rank, server.device, True).gather_and_write(server.comm,
                                                                    training.timeline)
    return 0


def run():
    """Run the job from the command line and exit with its code (``python -m``, jobs/)."""
    run_job(main)


if __name__ == "__main__":
    run()
