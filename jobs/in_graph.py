"""In-graph replication on the digits set: one client (worker task 0) drives every worker.

Run: mpiexec -n 4 python jobs/in_graph.py --num-ps 1 --steps 200
Worker task 0 is the only client of the ps: each step it splits the global batch (chunk i
is the batch worker i reads in between-graph training), every worker task computes the
gradient of its chunk, and the client averages them and pushes the mean through the ps.
With --deterministic the parameters equal those of jobs/mnist_mlp.py --deterministic
bit for bit. --batch-size is the chunk of one worker task.
"""

import json
import os
import sys

import numpy as np
from mpi4py import MPI

from mpitf.data import load_split
from mpitf.errors import ConfigurationError
from mpitf.flags import (
    add_training_arguments,
    check_roles,
    data_path,
    make_optimizer_from_args,
    resolve_cluster,
    setup_backend,
)
from mpitf.guard import (
    CheckpointSignals,
    RankParser,
    abort_on_error,
    collective,
    setup_logging,
)
from mpitf.layout import FlatLayout
from mpitf.models import build_model
from mpitf.placement import replica_device_setter
from mpitf.replication import InGraphBatches, InGraphReplica, InGraphWorker
from mpitf.server import Server
from mpitf.session import TrainingSession
from mpitf.timeline import Timeline


def main(argv=None):
    parser = RankParser(description=__doc__.splitlines()[0])
    add_training_arguments(parser)
    parser.add_argument("--export", default=None,
                        help="after training, the client writes every variable to this .npz")
    args = parser.parse_args(argv)
    setup_logging()
    world = MPI.COMM_WORLD
    cluster = resolve_cluster(args, world.Get_size())
    if cluster.num_tasks("ps") < 1:
        raise collective(ConfigurationError(
            "in-graph replication pushes through a ps: use --num-ps 1 or more "
            "(jobs/towers.py trains without one)"))
    if args.mode != "sync":
        raise collective(ConfigurationError(
            "in-graph replication has a single client, so only --mode sync applies"))
    server = Server(cluster, deadline=args.deadline)
    check_roles(args, server)
    setup_backend(args, server)
    path = data_path(args, world)
    if server.job_name == "ps":
        server.join()
        return server.exit_code
    server.describe()
    num_workers = cluster.num_tasks("worker")
    batches = InGraphBatches(path, num_workers, args.batch_size, args.seed) \
        if server.is_chief else None
    # The compute tasks read no data; they learn the model's shape from the client.
    first = batches.shards[0] if batches else None
    x_dim, num_classes, image_shape = server.job_comm.bcast(
        (first.x_dim, first.num_classes, first.image_shape) if first else None, root=0)
    model = build_model(args.model, x_dim, num_classes or 10,
                        image_shape=tuple(image_shape) if args.model == "cnn" and image_shape
                        else None,
                        **({"hidden": (args.hidden,)} if args.model == "mlp" else {}))
    if not server.is_chief:
        return _compute(server, model, args)

    replica = InGraphReplica(server.job_comm, model)
    sess = TrainingSession(
        server, replica, make_optimizer_from_args(args), "sync", batches,
        last_step=args.steps, checkpoint_dir=args.checkpoint_dir,
        save_checkpoint_steps=args.checkpoint_every, save_checkpoint_secs=args.checkpoint_secs,
        deterministic=args.deterministic, skip_nonfinite=args.skip_nonfinite,
        moving_average_decay=args.moving_average_decay, ps_strategy=args.ps_strategy,
        seed=args.seed, log_every=args.log_every, run_dir=args.run_dir,
        max_to_keep=args.max_to_keep, timeline=args.timeline,
        batch_size=batches.batch_size, clients=[0])
    replica.attach(sess.client)
    try:
        while not sess.should_stop():
            sess.run()
    finally:
        replica.stop()
    if not sess.requeue:
        x_test, y_test = load_split(path, "test")
        test_loss, test_acc = sess.evaluate(x_test, y_test,
                                            average=bool(args.moving_average_decay))
        elapsed = sess.elapsed
        summary = dict(step=sess.global_step, loss=sess.loss, test_loss=test_loss,
                       test_accuracy=test_acc,
                       examples_per_sec=sess.examples_seen / elapsed if elapsed > 0 else 0.0,
                       workers=num_workers, ps=cluster.num_tasks("ps"), mode="sync",
                       replication="in-graph")
        print("final: " + json.dumps(summary), flush=True)
        if args.export:
            sess.client.pull()
            np.savez(args.export, **{k: np.asarray(v) for k, v in sess.params.items()})
        if args.run_dir:
            os.makedirs(args.run_dir, exist_ok=True)
            with open(os.path.join(args.run_dir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
    sess.close()
    batches.close()
    return sess.exit_code


def _compute(server, model, args):
    """Run a compute task: gradients of the client's chunks, no session, no ps traffic."""
    CheckpointSignals().install()  # a requeue signal is the client's to act on
    placement = replica_device_setter(server.cluster, ps_strategy=args.ps_strategy)
    layout = FlatLayout(placement.place(model.variables()))
    InGraphWorker(server.job_comm, model, layout).serve()
    if args.timeline:  # collective with the client's and the ps's end of training
        Timeline(server.rank, server.device, True).gather_and_write(server.comm, args.timeline)
    return 0


if __name__ == "__main__":
    with abort_on_error():
        code = main()
    sys.exit(code)
