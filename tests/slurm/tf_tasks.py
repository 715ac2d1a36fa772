"""Print, per rank of an srun step, its MPI rank, SLURM_PROCID, role and TensorFlow's task.

Each rank builds the job's cluster as the jobs do (cluster_from_args: under srun through
SlurmClusterResolver), takes its role from mpitf.cluster.roles through Server, and asks TensorFlow's
resolver which task Slurm task SLURM_PROCID is; tests/jobs/test_slurm.py compares them.
"""

import argparse
import json
import os

from mpi4py import MPI

from mpitf.cluster import add_cluster_arguments
from mpitf.cluster.flags import cluster_from_args
from mpitf.cluster.resolvers import SlurmClusterResolver
from mpitf.runtime.server import Server

parser = argparse.ArgumentParser()
add_cluster_arguments(parser)
args = parser.parse_args()
size = MPI.COMM_WORLD.Get_size()
server = Server(cluster_from_args(args, size), deadline=30)
tf = SlurmClusterResolver({"ps": args.num_ps, "worker": size - args.num_ps}, gpus_per_node=0,
                          auto_set_gpu=False)
tf.cluster_spec()
print(json.dumps({"rank": server.rank, "procid": int(os.environ["SLURM_PROCID"]),
                  "host": MPI.Get_processor_name(), "role": [server.job_name, server.task_index],
                  "tf": list(tf.get_task_info()),
                  "address": server.cluster.task_address(server.job_name, server.task_index)}),
      flush=True)
