"""The checkpoint with the best evaluation, kept beside the rolling ones as ``ROOT/best``.

A job that evaluates at its checkpoints (``--keep-best``) copies the checkpoint whose
evaluation beats every earlier one to ``ROOT/best`` (a checkpoint directory: ``mpitf ckpt
show``/``export ROOT/best`` read it), with ``best.json`` naming its step and score.
``max_to_keep`` never prunes it, and a rerun that resumes keeps comparing with it.
"""

import json
import os
import shutil

from .names import checkpoint_name

__all__ = ["BEST", "best_record", "keep_if_best"]

BEST = "best"
_RECORD = "best.json"


def best_record(root):
    """Return ``{"step", "metric", "score"}`` of ``ROOT/best``, or None when there is none."""
    try:
        with open(os.path.join(root, BEST, _RECORD)) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


def keep_if_best(root, step, metric, score):
    """Copy checkpoint ``step`` to ``ROOT/best`` if ``score`` (higher is better) beats it.

    Returns True when it was copied. The copy is written beside and renamed into place,
    so ``ROOT/best`` is always one whole checkpoint.
    """
    record = best_record(root)
    if record is not None and record["score"] >= score:
        return False
    best, fresh = os.path.join(root, BEST), os.path.join(root, f".{BEST}.new")
    shutil.rmtree(fresh, ignore_errors=True)
    shutil.copytree(os.path.join(root, checkpoint_name(step)), fresh)
    with open(os.path.join(fresh, _RECORD), "w") as f:
        json.dump({"step": int(step), "metric": metric, "score": float(score)}, f)
    old = os.path.join(root, f".{BEST}.old")
    shutil.rmtree(old, ignore_errors=True)
    if os.path.isdir(best):
        os.replace(best, old)
    os.replace(fresh, best)
    shutil.rmtree(old, ignore_errors=True)
    return True
