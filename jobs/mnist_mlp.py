"""Between-graph training of an MLP (or CNN) on the digits set: mpitf's mlp_mnist_dist.py.

Run: mpiexec -n 3 python jobs/mnist_mlp.py --num-ps 1 --steps 300 --mode sync
Every rank runs this script; the MPI rank decides whether it is a ps or a worker.
"""

import json
import os
import sys

import numpy as np
from mpi4py import MPI

from mpitf.data import ShardedDataset, load_split
from mpitf.flags import (
    add_training_arguments,
    check_roles,
    data_path,
    make_optimizer_from_args,
    resolve_cluster,
    setup_backend,
)
from mpitf.guard import RankParser, abort_on_error, setup_logging
from mpitf.models import build_model
from mpitf.server import Server
from mpitf.session import TrainingSession


def main(argv=None):
    parser = RankParser(description=__doc__.splitlines()[0])
    add_training_arguments(parser)
    parser.add_argument("--export", default=None,
                        help="after training, the chief writes every variable to this .npz")
    args = parser.parse_args(argv)
    setup_logging()
    world = MPI.COMM_WORLD
    cluster = resolve_cluster(args, world.Get_size())
    server = Server(cluster, deadline=args.deadline)
    check_roles(args, server)
    setup_backend(args, server)
    path = data_path(args, world)
    if server.job_name == "ps":
        server.join()
        return server.exit_code
    server.describe()
    workers = server.cluster.task_indices("worker")
    dataset = ShardedDataset(path, "train", workers.index(server.task_index), len(workers),
                             args.batch_size, args.seed)
    image_shape = tuple(dataset.image_shape) if dataset.image_shape is not None else None
    model = build_model(args.model, dataset.x_dim, dataset.num_classes or 10,
                        image_shape=image_shape if args.model == "cnn" else None,
                        **({"hidden": (args.hidden,)} if args.model == "mlp" else {}))
    sess = TrainingSession(
        server, model, make_optimizer_from_args(args), args.mode, dataset,
        last_step=args.steps, checkpoint_dir=args.checkpoint_dir,
        save_checkpoint_steps=args.checkpoint_every, save_checkpoint_secs=args.checkpoint_secs,
        replicas_to_aggregate=args.replicas_to_aggregate, deterministic=args.deterministic,
        staleness=args.staleness, skip_nonfinite=args.skip_nonfinite,
        moving_average_decay=args.moving_average_decay, ps_strategy=args.ps_strategy,
        seed=args.seed, log_every=args.log_every, run_dir=args.run_dir,
        max_to_keep=args.max_to_keep, timeline=args.timeline, batch_size=args.batch_size)
    while not sess.should_stop():
        sess.run()
    if server.is_chief and not sess.requeue:
        x_test, y_test = load_split(path, "test")
        test_loss, test_acc = sess.evaluate(x_test, y_test,
                                            average=bool(args.moving_average_decay))
        counters = sess.client.ps_counters()
        summary = dict(step=sess.global_step, loss=sess.loss, test_loss=test_loss,
                       test_accuracy=test_acc, examples_per_sec=_throughput(sess),
                       workers=len(workers), ps=server.cluster.num_tasks("ps"), mode=args.mode,
                       stale_dropped=sum(c["stale_dropped"] for c in counters),
                       max_staleness=max(c["max_staleness"] for c in counters),
                       max_lead=max(c["max_lead"] for c in counters))
        print("final: " + json.dumps(summary), flush=True)
        if args.export:
            sess.client.pull()
            np.savez(args.export, **{k: np.asarray(v) for k, v in sess.params.items()})
        if args.run_dir:
            os.makedirs(args.run_dir, exist_ok=True)
            with open(os.path.join(args.run_dir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
    sess.close()
    dataset.close()
    return sess.exit_code


def _throughput(sess):
    elapsed = sess.elapsed
    return sess.examples_seen / elapsed if elapsed > 0 else 0.0


if __name__ == "__main__":
    with abort_on_error():
        code = main()
    sys.exit(code)
