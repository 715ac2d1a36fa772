"""Hello, distributed TensorFlow! -- the two-task ``local`` cluster, on mpitf.

The original: the "Create a cluster" example of TensorFlow's "Distributed TensorFlow" guide
(``tensorflow/docs_src/deploy/distributed.md``, The TensorFlow Authors, Apache License
2.0): two processes build ``ClusterSpec({"local": ["localhost:2222", "localhost:2223"]})``
and a ``Server`` for their own task; task 0 runs a constant placed on task 1 and prints
it, task 1 serves (``server.join()``). Every line that differs says why (``TF:`` names
what the original calls there); the README's "TensorFlow programs on mpitf" sums them up.

One process per task, as in TensorFlow, started together by one MPMD line:

    mpiexec -n 1 python local_cluster.py --task_index=0 \\
          : -n 1 python local_cluster.py --task_index=1

(or ``mpiexec -n 2 python local_cluster.py``: without ``--task_index`` each process takes
the task of its MPI rank).
"""

import argparse

from mpi4py import MPI  # TF: not needed; mpitf has no graph, so task 1's value travels by MPI

import mpitf  # TF: import tensorflow as tf

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--job_name", default="local", help="this process's job: local")
parser.add_argument("--task_index", type=int, default=None, help="this process's task")
args = parser.parse_args()

cluster = mpitf.ClusterSpec({"local": ["localhost:2222", "localhost:2223"]})  # TF: tf.train.
server = mpitf.Server(cluster, job_name=args.job_name, task_index=args.task_index)  # TF: tf.train.
print(f"task {server.task_index}: {server.target}", flush=True)

if server.task_index == 0:
    # TF: with tf.device("/job:local/task:1"): c = tf.constant("Hello, distributed TensorFlow!")
    #     with tf.Session(server.target) as sess: print(sess.run(c))
    # mpitf places no ops: task 1 makes the value and sends it on the script's own
    # communicator (mpitf's own messages use a private duplicate, server.comm).
    c = MPI.COMM_WORLD.recv(source=server.rank_of("local", 1))
    print(c, flush=True)
else:
    c = f"Hello, distributed TensorFlow! (made on {server.device})"
    MPI.COMM_WORLD.send(c, dest=server.rank_of("local", 0))
    server.join()  # TF: serves until killed; under MPI there is nothing to serve: it returns
