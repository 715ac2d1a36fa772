"""The evaluator task (TensorFlow's ``train_and_evaluate`` evaluator): it does not train.

It watches the checkpoint directory, evaluates every committed checkpoint in step order
on the test split (loss and accuracy with the job's model), writes one JSON line each to
``<run_dir>/eval/metrics.jsonl`` and prints one line each. Only checkpoints whose manifest
is in place are read (with the reader ``mpitf ckpt export`` uses), never half-written ones.
Training ends when the chief closes its session and sends ``TAG_TRAINING_END`` with every
step it committed; the evaluator then evaluates through the last one, names any that
``max_to_keep`` deleted before it could read them, and ends. A rank that dies ends
the job through MPI (the lifeline, ``abort_on_error``), which ends the evaluator too.
"""

import json
import logging
import os
import time

from ..ckpt.names import list_checkpoints
from ..ckpt.restore import read_variables
from ..errors import CheckpointError, ConfigurationError
from ..models import evaluate
from ..runtime.exits import EXIT_REQUEUE
from ..wire import protocol as P
from .summaries import EventWriter

_log = logging.getLogger("mpitf")


class Evaluator:
    """Evaluate each checkpoint a training run commits, until training ends.

    Args:
        server: this rank's :class:`~mpitf.runtime.server.Server` (an evaluator task).
        model: the job's model (its ``logits(params, x)``, as :func:`mpitf.models.evaluate`
            uses); the parameters come from each checkpoint, by variable name.
        checkpoint_dir: the directory the chief checkpoints into.
        x, y: the test split.
        run_dir: metrics go to ``<run_dir>/eval/metrics.jsonl`` (None: printed only).
        poll_secs: how often the directory is listed.
    """

    def __init__(self, server, model, checkpoint_dir, x, y, run_dir=None, poll_secs=0.2):
        if not checkpoint_dir:
            raise ConfigurationError(
                "the evaluator evaluates checkpoints, but no checkpoint directory is set: "
                "give the chief's checkpoint_dir (--checkpoint-dir)")
        if not server.replica_ranks:
            raise ConfigurationError(
                "the evaluator follows a training run, but the cluster has no chief or "
                "worker task: add a 'worker' (or 'chief') job to the spec")
        self.server, self.model = server, model
        self.checkpoint_dir = checkpoint_dir
        self.x, self.y = x, y
        self.path = os.path.join(run_dir, "eval", "metrics.jsonl") if run_dir else None
        # TensorFlow's layout: the evaluator's events in <model_dir>/eval beside the chief's.
        self.events = EventWriter(os.path.join(run_dir, "eval")) if run_dir else None
        self.poll_secs = poll_secs
        self.evaluated = []  # the steps evaluated, in order
        self.skipped = []  # the steps deleted before they could be read

    def run(self):
        """Evaluate checkpoints as they appear until the chief says training ended.

        Returns the exit code: 0, or the requeue code when training ended on a signal
        (so every rank of the job asks alike to be requeued).
        """
        chief = self.server.replica_ranks[0]
        comm = self.server.comm
        while not comm.Iprobe(source=chief, tag=P.TAG_TRAINING_END):
            self._evaluate_new()
            time.sleep(self.poll_secs)
        end = comm.recv(source=chief, tag=P.TAG_TRAINING_END)
        last = end.get("step")
        self._evaluate_new(through=last)
        done = set(self.evaluated) | set(self.skipped)
        for step in end.get("committed", ()):
            if step not in done:
                self._skip(step, "deleted (max_to_keep) before it could be evaluated")
        if self.events is not None:
            self.events.close()
        print(f"evaluator: training ended (last checkpoint: step {last}); evaluated "
              f"{len(self.evaluated)} checkpoints", flush=True)
        return EXIT_REQUEUE if end.get("requeue") else 0

    def _evaluate_new(self, through=None):
        done = set(self.evaluated) | set(self.skipped)
        for c in list_checkpoints(self.checkpoint_dir):
            step = c["global_step"]
            if step in done or not c["complete"] or (through is not None and step > through):
                continue
            try:
                params = read_variables(c["path"])
            except (CheckpointError, OSError) as exc:
                if os.path.isdir(c["path"]):
                    raise
                self._skip(step, f"deleted while it was read ({exc})")
                continue
            loss, accuracy = evaluate(self.model, params, self.x, self.y)
            self.evaluated.append(step)
            self._write(step, {"checkpoint": c["name"], "loss": float(loss),
                               "accuracy": float(accuracy), "examples": int(len(self.y))})

    def _skip(self, step, why):
        self.skipped.append(step)
        _log.warning("evaluator: skipping the checkpoint at step %d: %s", step, why)

    def _write(self, step, metrics):
        """Record one evaluation: eval/metrics.jsonl, TensorBoard scalars in eval/, a line."""
        record = {"step": step, **metrics, "time": time.time()}
        if self.path:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
            self.events.scalars(step, {"loss": metrics["loss"],
                                       "accuracy": metrics["accuracy"]})
            self.events.flush()
        print(f"evaluator: step {step}: loss = {metrics['loss']:.4f}, accuracy = "
              f"{metrics['accuracy']:.4f} ({metrics['checkpoint']})", flush=True)
