"""Train a few steps through mpitf, then list the TCP ports the job's processes listen on.

Rank 0 prints one line ``listening: [[port, [fds of owning ranks]], ...]`` as JSON. The
listeners are read from /proc (no tools needed): the LISTEN sockets of /proc/net/tcp{,6}
whose inodes are open in one of the ranks.
"""

import json
import os
import sys

import numpy as np

import mpitf


def listening_ports(pids):
    """Return {port: sorted pids} of the TCP sockets in LISTEN state that ``pids`` hold."""
    inodes = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(name):
            continue
        with open(name) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # TCP_LISTEN
                    inodes[fields[9]] = int(fields[1].rsplit(":", 1)[1], 16)
    owners = {}
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        for fd in os.listdir(fd_dir):
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue  # closed meanwhile
            if target.startswith("socket:["):
                port = inodes.get(target[8:-1])
                if port is not None:
                    owners.setdefault(port, set()).add(pid)
    return {port: sorted(p) for port, p in owners.items()}


class Linear:
    """A one-matrix model: enough to move real pushes and pulls."""

    def variables(self):
        return [("w", (16, 4), np.float32)]

    def init(self, rng):
        return {"w": rng.standard_normal((16, 4)).astype(np.float32)}

    def loss_and_grads(self, params, batch, grads):
        grads["w"][...] = 0.01 * params["w"]
        return float((params["w"] ** 2).sum())


with mpitf.abort_on_error():
    server = mpitf.Server(mpitf.ClusterSpec({"ps": 1, "worker": 2}))
    if server.job_name == "ps":
        server.join()
    else:
        with mpitf.TrainingSession(server, Linear(), mpitf.make_optimizer("sgd", 0.1),
                                   last_step=20, log_every=0, run_dir=None) as sess:
            while not sess.should_stop():
                sess.run(batch=(None, None))
    pids = server.comm.gather(os.getpid(), root=0)
    if server.rank == 0:
        print("listening: " + json.dumps(sorted(listening_ports(pids).items())), flush=True)
    server.comm.Barrier()
    sys.exit(server.exit_code if server.job_name == "ps" else sess.exit_code)
