"""Local SGD's policy on the ps: average the workers' parameters every K local steps.

Under ``--mode local --local-steps K`` (Lin et al., "Don't use large mini-batches, use
local SGD", ICLR 2020; Stich, "Local SGD converges fast and communicates little", ICLR
2019) each worker runs the optimizer on its own copy of the model, with the ps's update
rules (:class:`~mpitf.worker.local.LocalSteps`), and every K steps pushes its parameters
instead of a gradient. The ps waits for every active worker's parameters of that step,
puts their mean in place of its shard (the update rule is :meth:`Shard.assign
<mpitf.ps.shard.Shard.assign>`, not the optimizer) and answers each worker with it. The
global step counts local steps, so it advances by K per average; a push carries the step
its sender reached.
"""

from ..errors import PeerError
from .consistency import SyncReplicas


class LocalAverage(SyncReplicas):
    """Sync over parameters: the mean of every worker's, once per ``mode.local_steps``.

    The parameters are summed as they arrive (one receive frame), as sync sums gradients;
    a worker that finished or paused is not waited for.
    """

    name = "local"
    applies_gradients = False

    def __init__(self, num_workers, mode):
        super().__init__(num_workers, num_workers)
        self.mode = mode
        self.round_step = None  # the step this average's pushes reached, once one came

    def applies_at_once(self):
        """Return False: every worker's parameters make an average."""
        return False

    def admit(self, svc, worker, step, bucket=0):
        """Return True for parameters of a step past the ps's; raise for any other.

        Every worker averages at the same steps (every ``local_steps``, and the last), so
        parameters of an older step, or of another step than the others', are a worker
        run with other options.
        """
        if step <= svc.state.global_step or self.round_step not in (None, step):
            expected = (f"step {self.round_step}, as the others did" if self.round_step
                        else f"a step past {svc.state.global_step}")
            raise PeerError(
                f"parameters of step {step} pushed for an average, but the ps expected "
                f"{expected}: every worker needs the same --local-steps ({self.mode.local_steps})",
                **svc.describe_worker(worker, "push"))
        self.round_step = step
        if bucket == svc.pipeline.last:
            svc.state.note_staleness(0)
        return True

    def steps(self, svc):
        """Return the local steps this average stands for (and start the next one)."""
        step, self.round_step = self.round_step, None
        return step - svc.state.global_step
