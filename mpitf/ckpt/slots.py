"""Optimizer state on restore: the slots a checkpoint holds, checked against the job's.

A checkpoint's optimizer state is its slots, stored per variable by name (``m``, ``v``,
``momentum_buffer``, ...). Restored into an optimizer that keeps other slots, the ones the
checkpoint lacks would start at zero without a word and the ones it has would be dropped:
an SGD checkpoint resumed with Adam, momentum turned on, a centered RMSprop. That is
refused, naming both sides, unless the job asks to start its optimizer state afresh
(``reset_optimizer_state``), which is said once in the log. Two rules that keep the same
slots (torch's Adam and AdamW) restore into each other, as torch's ``load_state_dict``
allows; options that leave the slots as they are (a learning rate, weight decay, betas)
may change.
"""

from ..errors import ConfigurationError
from ..runtime.exits import EXIT_USAGE
from .names import read_manifest
from .pieces import index_pieces

__all__ = ["OptimizerStateError", "check_optimizer_state"]


class OptimizerStateError(ConfigurationError):
    """A checkpoint's optimizer state does not fit the job's optimizer (exit code 2)."""

    exit_code = EXIT_USAGE


def _slots(names):
    return ", ".join(sorted(names)) or "no slots"


def check_optimizer_state(ckpt_dir, optimizer, variables, reset=False, log=print):
    """Refuse restoring ``ckpt_dir`` into ``optimizer`` when their slots differ.

    Args:
        ckpt_dir: the checkpoint to restore.
        optimizer: the job's (its ``name``, ``slot_names`` and ``config()``).
        variables: the model's variable names.
        reset: the job's ``reset_optimizer_state``: log once, and the slots start afresh.
        log: where that line goes (the chief's logger).
    Raises OptimizerStateError naming the checkpoint's optimizer and slots and the job's.
    """
    manifest = read_manifest(ckpt_dir)
    held = (manifest.get("layout") or {}).get("optimizer") or {}
    held_name = held.get("name", "an unrecorded optimizer")
    if reset:
        log(f"reset_optimizer_state: {ckpt_dir}'s parameters are restored, its "
            f"optimizer state ({held_name}) is not: {optimizer.name}'s slots start afresh "
            f"at step {manifest['global_step']}")
        return
    saved = {}
    for kind, slot, var in index_pieces(ckpt_dir, manifest):
        if kind == "slots":
            saved.setdefault(var, set()).add(slot)
    want = set(optimizer.slot_names)
    for var in variables:
        have = saved.get(var, set())
        if have != want:
            raise OptimizerStateError(
                f"{ckpt_dir} holds {held_name}'s optimizer state ({_slots(have)} for "
                f"{var!r}) but the job asks for {optimizer.name} ({_slots(want)}): restored, "
                "its slots would "
                + ("start at zero" if want - have else "be dropped")
                + "; resume with the checkpoint's optimizer, or pass --reset-optimizer-state "
                  "(reset_optimizer_state=True) to restore the parameters and start the "
                  "optimizer state afresh")
