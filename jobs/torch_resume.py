"""A custom torch loop that resumes where it stopped: its own sampler, a LambdaLR, global_step.

    mpiexec -n 3 python jobs/torch_resume.py --checkpoint-dir ckpt --steps 40

1 ps + 2 workers fit a small MLP to a regression set made here. The loop is plain torch with
its own sampler (``EpochSampler``: a shuffled pass over this worker's shard each epoch) whose
``state_dict()``/``load_state_dict()`` hold its position ``{"epoch", "cursor"}``: passed as
``dataset=``, mpitf saves each worker's position with every checkpoint and puts it back when
the job resumes. ``lr_scheduler=`` advances the LambdaLR to the restored step. SIGTERM or
SIGUSR1 cuts a checkpoint and exits 75; rerun the same command and it goes on from there,
each worker printing ``worker K step S loss L`` with the losses of a run never stopped
(``--deterministic``: sync mode sums the gradients in worker order, so bit for bit).
``--log-file`` takes the chief's progress lines off stdout; ``--log-every 0`` drops them.
"""

import argparse
import sys

from mpi4py import MPI

from mpitf import ClusterSpec, Server, abort_on_error


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--save-checkpoint-steps", type=int, default=None)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--log-file", default=None, help="the chief's progress lines go here")
    p.add_argument("--deterministic", action="store_true")
    return p.parse_args()


class EpochSampler:
    """Batches of row indices of one shard: a fresh shuffle each epoch, from (seed, epoch).

    ``state_dict()`` is the position of the next batch, all that a restart needs.
    """

    def __init__(self, rows, batch_size, seed):
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.epoch, self.cursor = 0, 0

    def next_indices(self):
        """Return the next batch's indices into the shard."""
        import torch

        order = torch.randperm(len(self.rows),
                               generator=torch.Generator().manual_seed(self.seed + self.epoch))
        batch = self.rows[order[self.cursor:self.cursor + self.batch_size]]
        self.cursor += self.batch_size
        if self.cursor + self.batch_size > len(self.rows):  # the last full batch was taken
            self.epoch, self.cursor = self.epoch + 1, 0
        return batch

    def state_dict(self):
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state):
        self.epoch, self.cursor = state["epoch"], state["cursor"]


def say(line):
    """Write ``line`` in one write: the ranks share mpiexec's stdout."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main():
    args = parse_args()
    world = MPI.COMM_WORLD
    with abort_on_error():
        server = Server(ClusterSpec({"ps": 1, "worker": world.Get_size() - 1}))
        if server.job_name == "ps":
            server.join()
            sys.exit(server.exit_code)
        import torch

        from mpitf.torch import DistributedOptimizer

        torch.manual_seed(0)  # the same data and starting model on every worker
        x = torch.randn(600, 8)
        y = torch.tanh(x @ torch.randn(8, 1)) + 0.1 * torch.randn(600, 1)
        k, workers = server.replica_index, server.num_replicas
        sampler = EpochSampler(torch.arange(k, len(x), workers), args.batch_size, seed=k)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                    torch.nn.Linear(32, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(  # warmup, then a slow decay
            opt, lambda step: min(1.0, (step + 1) / 10) * 0.98 ** step)
        log = open(args.log_file, "a") if args.log_file and server.is_chief else None
        dist = DistributedOptimizer(opt, model, server, lr_scheduler=sched, dataset=sampler,
                                    last_step=args.steps, checkpoint_dir=args.checkpoint_dir,
                                    save_checkpoint_steps=args.save_checkpoint_steps,
                                    deterministic=args.deterministic,
                                    log_every=args.log_every, log_stream=log)
        while not dist.should_stop():
            rows = sampler.next_indices()
            dist.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
            loss.backward()
            dist.step(loss)
            sched.step()
            say(f"worker {k} step {dist.global_step} loss {loss.item()!r} "
                f"lr {sched.get_last_lr()[0]!r}")
        sys.exit(dist.close())


if __name__ == "__main__":
    main()
