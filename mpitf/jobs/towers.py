"""Multi-device tower training in one process: the batch is split over local devices.

Run: python jobs/towers.py --devices cpu:0,cpu:1 --steps 200
     mpiexec -n 3 python jobs/towers.py --devices gpu:0,gpu:1 --num-ps 1   (through a ps)
Each tower computes the gradient of its share of the batch on its device (cpu:k = numpy,
gpu:k = CuPy on GPU k); the gradients are averaged on the first device, then applied
locally with the optimizer (no ps) or pushed through the ps like a worker's.
--batch-size is the share of one tower.
"""

import time

from mpi4py import MPI

from mpitf.cli.flags import (
    add_training_arguments,
    check_inputs,
    check_roles,
    chief_rank,
    config_from_args,
    model_from_config,
    optimizer_from_config,
    resolve_cluster,
    session_from_config,
    setup_backend,
)
from mpitf.cli.reports import evaluate_session, report_final
from mpitf.cli.side_tasks import run_side_task
from mpitf.cluster.roles import check_training_cluster
from mpitf.data.sharded import ShardedDataset, load_split
from mpitf.errors import ConfigurationError
from mpitf.models import evaluate
from mpitf.runtime.backend import describe_backend
from mpitf.runtime.exits import RankParser, collective, run_job, setup_logging
from mpitf.runtime.server import Server
from mpitf.worker.hooks import LoggingHook
from mpitf.worker.node import refuse_aggregation
from mpitf.worker.towers import LocalSession, Towers, parse_devices, tower_backend


def main(argv=None):
    parser = RankParser(description=__doc__.splitlines()[0])
    add_training_arguments(parser, steps=200)
    parser.add_argument("--devices", default="cpu:0,cpu:1",
                        help="the towers' devices, e.g. cpu:0,cpu:1 or gpu:0,gpu:1")
    parser.set_defaults(num_ps=0)  # one process trains alone unless asked for a ps
    args = parser.parse_args(argv)
    config = config_from_args(args)  # every value checked, alike on every rank
    refuse_aggregation(config.training, "towers", "its towers already average in one process")
    training = config.training
    setup_logging()
    world = MPI.COMM_WORLD
    cluster = resolve_cluster(args, world.Get_size())
    if cluster.num_tasks("ps") == 0 and world.Get_size() > 1:
        raise collective(ConfigurationError(
            "towers without a ps train in one process: run without mpiexec, or give "
            "--num-ps to push through ps tasks"))
    if cluster.num_tasks("ps"):
        try:
            check_training_cluster(cluster, training.checkpoint_dir)
        except ConfigurationError as exc:
            raise collective(exc) from None
    server = Server(cluster, deadline=config.deadline, fixed_deadline=config.fixed_deadline) \
        if cluster.num_tasks("ps") else None
    if server is not None:
        check_roles(args, server)
    batch = training.batch_size * len(parse_devices(args.devices))
    path = check_inputs(config, world, 0, 1, batch) if server is None else \
        check_inputs(config, server.comm, chief_rank(server), server.num_replicas, batch)
    if server is not None:
        setup_backend(args, server)  # where the session's push/pull buffers live
        if server.job_name == "ps":
            server.join()
            return server.exit_code
        code = run_side_task(server, config, path, "towers")  # evaluator, other jobs
        if code is not None:
            return code
        if args.log_device_placement:
            server.describe()
    backends = [tower_backend(kind, index) for kind, index in parse_devices(args.devices)]
    if server is None or server.is_chief:
        for (kind, index), be in zip(parse_devices(args.devices), backends):
            print(f"tower {kind}:{index}: {describe_backend(be)}", flush=True)
    shard, shards = (server.replica_index, server.num_replicas) if server else (0, 1)
    dataset = ShardedDataset(path, "train", shard, shards, batch, training.seed)
    model = model_from_config(config, dataset.x_dim, dataset.num_classes, dataset.image_shape)
    towers = Towers(model, backends)
    if server is None:
        _train_locally(towers, optimizer_from_config(config), dataset, config, args.devices,
                       path)
        code = 0
    else:
        code = _train_with_ps(server, towers, dataset, config, args, path)
    dataset.close()
    return code


def _train_locally(towers, optimizer, dataset, config, devices, path):
    """Train in this process: average on tower 0, apply there with the optimizer."""
    training = config.training
    metrics = LoggingHook.from_config(training)
    sess = LocalSession(towers, optimizer, dataset, training,
                        hooks=[metrics] if metrics is not None else [])
    start = time.monotonic()
    while not sess.should_stop():
        sess.run()
    elapsed = time.monotonic() - start
    sess.close()
    x_test, y_test = load_split(path, "test")
    test_loss, test_acc = evaluate(towers.model, towers.params, x_test, y_test)
    summary = dict(step=sess.global_step, loss=sess.loss, test_loss=test_loss,
                   test_accuracy=test_acc,
                   examples_per_sec=sess.steps_run * dataset.batch_size / max(elapsed, 1e-9),
                   towers=len(towers.towers), devices=devices, ps=0)
    return report_final(config, summary, towers.params, towers.backends[0].to_host)


def _train_with_ps(server, towers, dataset, config, args, path):
    """Train as a worker: the towers' average is this worker's pushed gradient."""
    sess = session_from_config(server, towers, config, dataset, args.log_device_placement)
    while not sess.should_stop():
        sess.run()
    if server.is_chief and not sess.requeue:
        report_final(config, evaluate_session(
            sess, config, path, towers=len(towers.towers), devices=args.devices,
            workers=server.num_replicas, mode=config.training.mode), sess.params)
    sess.close()
    return sess.exit_code


def run():
    """Run the job from the command line and exit with its code (``python -m``, jobs/)."""
    run_job(main)


if __name__ == "__main__":
    run()
