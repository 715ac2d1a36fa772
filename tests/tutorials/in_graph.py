"""In-graph replication, as TensorFlow's "Distributed TensorFlow" guide describes it, on mpitf.

The original: the "Replicated training" section of TensorFlow's "Distributed TensorFlow"
guide (``tensorflow/docs_src/deploy/distributed.md``, The TensorFlow Authors, Apache
License 2.0), whose in-graph form is one client that pins the variables to ``/job:ps``,
splits each batch with ``tf.split`` and builds one copy of the computation per
``/job:worker/task:i`` device, averaging their losses; every other task runs
``server.join()``. The guide's ``trainer.py`` flags (``--ps_hosts``, ``--worker_hosts``,
``--job_name``, ``--task_index``) and the MNIST tutorial's log lines are kept. Every line
that differs says why in a comment (``TF:`` names what the original calls there).

    mpiexec -n 1 python in_graph.py --job_name=ps --task_index=0 \\
          : -n 1 python in_graph.py --job_name=worker --task_index=0 \\
          : -n 1 python in_graph.py --job_name=worker --task_index=1

What changed besides the imports: mpitf has no graph, so the per-device copies of the
model are :class:`~mpitf.worker.replication.InGraphReplica` (the client's model: it
scatters each chunk to its worker task and averages the gradients) and the other worker
tasks run :class:`~mpitf.worker.replication.InGraphWorker` where TensorFlow's run
``server.join()`` (they compute the client's chunks; a TF worker runs the client's ops).
"""

import argparse
import os
import sys
import time

import mpitf  # TF: import tensorflow as tf
from mpitf.data.sharded import load_split
from mpitf.wire.layout import FlatLayout
from mpitf.worker.replication import InGraphReplica, InGraphWorker

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])  # TF: tf.app.flags
parser.add_argument("--ps_hosts", default="localhost:2222",
                    help="comma-separated hostname:port pairs")
parser.add_argument("--worker_hosts", default="localhost:2223,localhost:2224",
                    help="comma-separated hostname:port pairs")
parser.add_argument("--job_name", default=None, help="one of 'ps', 'worker'")
parser.add_argument("--task_index", type=int, default=0, help="index of task within the job")
parser.add_argument("--data_dir", default=os.path.dirname(mpitf.default_data_path()),
                    help="directory holding digits.h5")
parser.add_argument("--hidden_units", type=int, default=100,
                    help="units in the hidden layer")
parser.add_argument("--batch_size", type=int, default=50,
                    help="examples per worker task and step (the chunk of one device)")
parser.add_argument("--learning_rate", type=float, default=0.3, help="learning rate")
parser.add_argument("--train_steps", type=int, default=100, help="number of training steps")
parser.add_argument("--log_every", type=int, default=10, help="steps between loss lines")

IMAGE_PIXELS = 8  # the digits set holds 8 x 8 images (MNIST: 28)


def main(FLAGS):
    ps_hosts = FLAGS.ps_hosts.split(",")
    worker_hosts = FLAGS.worker_hosts.split(",")
    num_workers = len(worker_hosts)

    # Create a cluster from the parameter server and worker hosts.
    cluster = mpitf.ClusterSpec({"ps": ps_hosts, "worker": worker_hosts})

    # Create and start a server for the local task.
    server = mpitf.Server(cluster, job_name=FLAGS.job_name, task_index=FLAGS.task_index)

    # TF: the client's graph holds the model; in mpitf each task builds the same model.
    model = mpitf.build_model("mlp", IMAGE_PIXELS * IMAGE_PIXELS, 10,
                              hidden=(FLAGS.hidden_units,))
    if FLAGS.job_name == "ps":
        server.join()
        return server.exit_code  # TF's join() never returns; mpitf's does, at the end
    if FLAGS.task_index > 0:
        # TF: server.join(): the client runs this task's share of each step here. In mpitf
        # the task computes the gradients of the chunks the client sends it, until stopped.
        placement = mpitf.replica_device_setter(cluster).place(model.variables())
        InGraphWorker(server.job_comm, model, FlatLayout(placement)).serve()
        return 0

    # The client (worker task 0). TF: with tf.device("/job:ps/task:0"): the variables;
    # inputs = tf.split(images, num_workers); for i in range(num_workers):
    # with tf.device("/job:worker/task:%d" % i): a copy of the model on inputs[i]; the loss
    # the mean of theirs. InGraphReplica is that loop: chunk i goes to worker task i.
    replica = InGraphReplica(server.job_comm, model)
    opt = mpitf.make_optimizer("sgd", FLAGS.learning_rate)  # TF: GradientDescentOptimizer
    data_path = os.path.join(FLAGS.data_dir, "digits.h5")
    data_sets = mpitf.ShardedDataset(data_path, "train",
                                     batch_size=FLAGS.batch_size * num_workers)

    # TF: with tf.Session(server.target) as sess: the client's session talks to the ps.
    # clients=[0]: this task alone pushes and pulls; the session starts the ps.
    with mpitf.TrainingSession(server, replica, opt, mode="sync", clients=[0],
                               log_every=0) as sess:
        replica.attach(sess.client)  # the replicas gather into the session's push buffer
        try:
            for step in range(FLAGS.train_steps):
                start_time = time.time()
                loss_value = sess.run(data_sets.next_batch())  # TF: sess.run([train_op, loss])
                duration = time.time() - start_time
                if (step + 1) % FLAGS.log_every == 0 or step == 0:
                    print("Step %d: loss = %.2f (%.3f sec)" % (step, loss_value, duration))
        finally:
            replica.stop()  # TF: the session's end; mpitf tells the worker tasks to return

        # TF's do_eval(): precision @ 1 on the held-out split.
        x_test, y_test = load_split(data_path, "test")
        _, precision = sess.evaluate(x_test, y_test)
        true_count = int(round(precision * len(y_test)))
        print("  Num examples: %d  Num correct: %d  Precision @ 1: %0.04f"
              % (len(y_test), true_count, precision))
        print("global step = %d" % sess.global_step)
    data_sets.close()
    return 0


if __name__ == "__main__":
    with mpitf.abort_on_error():  # TF: tf.app.run(); an error on one rank ends every rank
        sys.exit(main(parser.parse_args()))
