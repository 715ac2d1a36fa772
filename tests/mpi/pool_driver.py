"""Small requests that wait in MPI before the ps looks, received by the ps's receive pool.

Run: mpiexec -n N python tests/mpi/pool_driver.py MESSAGES [posted]

Every rank but 0 sends MESSAGES small frames to rank 0 and enters a barrier; rank 0
enters it first, so the frames have all arrived (unexpected) before it receives any, and
then takes them with one pool frame. It prints ``received: {source: [values...]}``.
With receives posted ahead with ANY_SOURCE, MPICH's UCX netmod left the second frame from
another node waiting forever (mpitf/ps/receive_pool.py). ``posted`` (two ranks): the pool
of one sender, made before the barrier, so a frame may land in a posted receive or wait in
MPI until the receive is posted again.
"""

import json
import sys

import numpy as np
from mpi4py import MPI

from mpitf.ps.receive_pool import ReceivePool, receive_pool
from mpitf.runtime.backend import numpy_backend
from mpitf.wire import protocol as P
from mpitf.wire.frame import Frame


def quiet():
    raise SystemExit("nothing arrived within 20 s")


def main():
    count, posted = int(sys.argv[1]), sys.argv[2:] == ["posted"]
    comm = MPI.COMM_WORLD.Dup()
    if posted and comm.size != 2:
        raise SystemExit("posted: two ranks, one sender")
    if comm.rank:
        for k in range(count):
            comm.Send([np.full(16, 100 * comm.rank + k, np.int32), MPI.BYTE], 0, P.TAG_REQUEST)
        comm.Barrier()
        return
    frames = [Frame.allocate(numpy_backend(), 16, np.int32)]
    if posted:  # before the barrier: frames land in a posted receive or wait for one
        pool = receive_pool(comm, frames, P.TAG_REQUEST, [1])
    comm.Barrier()
    if not posted:
        pool = ReceivePool(comm, frames, P.TAG_REQUEST)  # matched probes, any sender
    got = {}
    for _ in range(count * (comm.size - 1)):
        index = pool.wait_next(20.0, quiet, 20.0, str)
        got.setdefault(pool.source, []).append(int(pool[index].bytes.view(np.int32)[0]))
        pool.release(index)
    pool.close()
    print("received: " + json.dumps(got), flush=True)


if __name__ == "__main__":
    main()
