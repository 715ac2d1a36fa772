"""Distributed MNIST training with model replicas, between-graph, on mpitf.

The original: TensorFlow's ``tensorflow/tools/dist_test/python/mnist_replica.py`` (The
TensorFlow Authors, Apache License 2.0). This program keeps its flags, its control flow
and its log lines; every line that differs says why in a comment (``TF:`` names what the
original calls there), and the README's "TensorFlow programs on mpitf" sums them up.

One process per task, each told its role by flags, as in TensorFlow. Under MPI the
processes of one job start together (MPMD), in the order of mpitf's rank -> task policy
(ps tasks first on one machine):

    mpiexec -n 1 python mnist_replica.py --job_name=ps --task_index=0 --num_gpus=0 \\
          : -n 1 python mnist_replica.py --job_name=worker --task_index=0 --num_gpus=0 \\
          : -n 1 python mnist_replica.py --job_name=worker --task_index=1 --num_gpus=0

What changed besides the imports: the data are the digits set (8 x 8 pixels, integer
labels) in place of MNIST downloads; the graph becomes mpitf's reference MLP (numpy with
hand-written gradients: mpitf has no graph); ``SyncReplicasOptimizer`` and ``Supervisor``
become ``TrainingSession(mode="sync", replicas_to_aggregate=...)``, since the ps applies
the optimizer and sync replicas are its consistency mode; ``server.join()`` returns when the
workers are done, so the ps exits there.
"""

import argparse
import os
import sys
import tempfile
import time

import mpitf  # TF: import tensorflow as tf
from mpitf.data.sharded import load_split  # TF: the mnist input_data module

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])  # TF: tf.app.flags
parser.add_argument("--data_dir", default=os.path.dirname(mpitf.default_data_path()),
                    help="directory holding digits.h5 (made there when missing)")
parser.add_argument("--download_only", action="store_true",
                    help="only prepare the data; no session, model or training")
parser.add_argument("--task_index", type=int, default=None,
                    help="worker task index, >= 0; task 0 is the chief (initialises)")
parser.add_argument("--num_gpus", type=int, default=1,
                    help="GPUs per machine; 0 trains on the CPU")
parser.add_argument("--replicas_to_aggregate", type=int, default=None,
                    help="sync_replicas: gradients per update (default: num_workers)")
parser.add_argument("--hidden_units", type=int, default=100,
                    help="units in the hidden layer")
parser.add_argument("--train_steps", type=int, default=200,
                    help="number of (global) training steps")
parser.add_argument("--batch_size", type=int, default=100, help="training batch size")
parser.add_argument("--learning_rate", type=float, default=0.01, help="learning rate")
parser.add_argument("--sync_replicas", action="store_true",
                    help="aggregate the workers' gradients before each update")
# TF: --existing_servers (reuse running gRPC servers): mpitf has none; mpiexec starts the tasks.
parser.add_argument("--ps_hosts", default="localhost:2222",
                    help="comma-separated hostname:port pairs")
parser.add_argument("--worker_hosts", default="localhost:2223,localhost:2224",
                    help="comma-separated hostname:port pairs")
parser.add_argument("--job_name", default=None, help="job name: worker or ps")

IMAGE_PIXELS = 8  # TF: 28 (MNIST); the digits set holds 8 x 8 images


def main(FLAGS):
    # TF: input_data.read_data_sets(FLAGS.data_dir, one_hot=True); labels stay integers.
    data_path = mpitf.ensure_digits(os.path.join(FLAGS.data_dir, "digits.h5"))
    if FLAGS.download_only:
        sys.exit(0)

    if FLAGS.job_name is None or FLAGS.job_name == "":
        raise ValueError("Must specify an explicit `job_name`")
    if FLAGS.task_index is None or FLAGS.task_index == "":
        raise ValueError("Must specify an explicit `task_index`")

    print("job name = %s" % FLAGS.job_name)
    print("task index = %d" % FLAGS.task_index)

    # Construct the cluster and start the server.
    ps_spec = FLAGS.ps_hosts.split(",")
    worker_spec = FLAGS.worker_hosts.split(",")
    num_workers = len(worker_spec)

    cluster = mpitf.ClusterSpec({"ps": ps_spec, "worker": worker_spec})
    server = mpitf.Server(cluster, job_name=FLAGS.job_name, task_index=FLAGS.task_index)
    if FLAGS.job_name == "ps":
        server.join()
        sys.exit(server.exit_code)  # TF's join() never returns; mpitf's does, at the end

    is_chief = FLAGS.task_index == 0
    if FLAGS.num_gpus > 0 and FLAGS.num_gpus < num_workers:
        raise ValueError("number of gpus is less than number of workers")
    # TF: worker_device = "/job:worker/task:%d/gpu:%d" and, around the model,
    # with tf.device(tf.train.replica_device_setter(worker_device=..., cluster=cluster)).
    # The session places the variables with replica_device_setter(cluster), the same
    # round-robin over the ps tasks; this worker's computation runs in this process (numpy).

    # TF: hid_w, hid_b, sm_w, sm_b as tf.Variables and a softmax over xw_plus_b: mpitf has no
    # graph, so the same network is its reference MLP (hidden1/..., softmax_linear/...).
    model = mpitf.build_model("mlp", IMAGE_PIXELS * IMAGE_PIXELS, 10,
                              hidden=(FLAGS.hidden_units,))
    opt = mpitf.make_optimizer("adam", FLAGS.learning_rate)  # TF: tf.train.AdamOptimizer

    if FLAGS.sync_replicas:
        if FLAGS.replicas_to_aggregate is None:
            replicas_to_aggregate = num_workers
        else:
            replicas_to_aggregate = FLAGS.replicas_to_aggregate
    else:
        replicas_to_aggregate = None
    train_dir = tempfile.mkdtemp()

    if is_chief:
        print("Worker %d: Initializing session..." % FLAGS.task_index)
    else:
        print("Worker %d: Waiting for session to be initialized..." % FLAGS.task_index)

    # TF: SyncReplicasOptimizer(opt, replicas_to_aggregate, total_num_replicas=num_workers)
    # and Supervisor(is_chief, logdir=train_dir, ...).prepare_or_wait_for_session(): in mpitf
    # sync replicas are the ps's consistency mode, chosen where the session starts.
    sess = mpitf.TrainingSession(
        server, model, opt, mode="sync" if FLAGS.sync_replicas else "async",
        replicas_to_aggregate=replicas_to_aggregate,
        checkpoint_dir=train_dir, save_checkpoint_secs=600,  # the Supervisor's defaults
        log_every=0)  # the program prints its own lines
    print("Worker %d: Session initialization complete." % FLAGS.task_index)

    # TF builds cross_entropy as a sum over the batch; mpitf's loss is the batch mean.
    mnist_train = mpitf.ShardedDataset(data_path, "train", batch_size=FLAGS.batch_size,
                                       seed=FLAGS.task_index)  # TF: mnist.train, a whole copy

    time_begin = time.time()
    print("Training begins @ %f" % time_begin)

    local_step = 0
    while True:
        batch_xs, batch_ys = mnist_train.next_batch()  # TF: next_batch(FLAGS.batch_size)
        sess.run((batch_xs, batch_ys))  # TF: sess.run([train_step, global_step], feed_dict)
        step = sess.global_step
        local_step += 1

        now = time.time()
        print("%f: Worker %d: training step %d done (global step: %d)"
              % (now, FLAGS.task_index, local_step, step))

        if step >= FLAGS.train_steps:
            break

    time_end = time.time()
    print("Training ends @ %f" % time_end)
    training_time = time_end - time_begin
    print("Training elapsed time: %f s" % training_time)

    # TF: sess.run(cross_entropy, feed_dict=val_feed), a sum over the validation set; the
    # digits set's held-out split is "test", and evaluate() returns the mean and accuracy.
    val_x, val_y = load_split(data_path, "test")
    val_loss, val_accuracy = sess.evaluate(val_x, val_y)
    val_xent = val_loss * len(val_y)
    print("After %d training step(s), validation cross entropy = %g"
          % (FLAGS.train_steps, val_xent))
    print("validation accuracy = %g (%d examples, mean cross entropy %g)"  # not in TF's
          % (val_accuracy, len(val_y), val_loss))
    sess.close()  # TF's Supervisor stops with the process; mpitf tells the ps this one is done
    mnist_train.close()


if __name__ == "__main__":
    with mpitf.abort_on_error():  # TF: tf.app.run(); an error on one rank ends every rank
        main(parser.parse_args())
