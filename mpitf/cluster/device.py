"""Name devices as TensorFlow does, and choose the GPU of a rank on its node.

`DeviceSpec` keeps the interface and meaning of ``tf.DeviceSpec``: an immutable,
possibly partial name ``/job:<job>/replica:<r>/task:<t>/device:<TYPE>:<i>``.
The helpers below find a rank's place on its node (`local_rank`), the GPUs
CUDA will show it (`visible_gpus`), and which one it uses
(`gpu_for_local_rank`). mpi4py is imported only inside `local_rank`.
"""

from __future__ import annotations

import logging
import os

from mpitf.errors import ConfigurationError

__all__ = ["DeviceSpec", "local_rank", "visible_gpus", "gpu_for_local_rank", "device_name"]

# The shorthand types TensorFlow accepts without "device:", as in "/gpu:0" or "CPU:1".
SHORTHAND_TYPES = frozenset({"CPU", "GPU", "TPU", "CUSTOM", "EPU"})
_log = logging.getLogger("mpitf")


def _as_index(value, name):
    if value is None:
        return None
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(f"bad {name} {value!r}: expecting an integer >= 0")
    return value


def _as_name(value, name):
    if value is None:
        return None
    if not isinstance(value, str) or not value or any(c in value for c in "/: "):
        raise ConfigurationError(
            f"bad {name} {value!r}: expecting a non-empty name without '/', ':' or spaces")
    return value


class DeviceSpec:
    """Name a (possibly partial) device, as ``tf.DeviceSpec`` does.

    Args:
        job: the job name, e.g. ``"ps"``.
        replica: the replica index.
        task: the task index.
        device_type: e.g. ``"CPU"`` or ``"GPU"``; lower-case ``cpu``/``gpu`` are
            upper-cased, as in TensorFlow.
        device_index: the device index; None means any device of that type.
    """

    __slots__ = ("_job", "_replica", "_task", "_device_type", "_device_index", "_string")

    def __init__(self, job=None, replica=None, task=None, device_type=None, device_index=None):
        self._job = _as_name(job, "job")
        self._replica = _as_index(replica, "replica")
        self._task = _as_index(task, "task")
        if device_type in ("cpu", "gpu"):
            device_type = device_type.upper()
        self._device_type = _as_name(device_type, "device type")
        self._device_index = _as_index(device_index, "device index")
        parts = []
        if self._job is not None:
            parts.append(f"/job:{self._job}")
        if self._replica is not None:
            parts.append(f"/replica:{self._replica}")
        if self._task is not None:
            parts.append(f"/task:{self._task}")
        if self._device_type is not None:
            index = "*" if self._device_index is None else self._device_index
            parts.append(f"/device:{self._device_type}:{index}")
        self._string = "".join(parts)

    @classmethod
    def from_string(cls, spec):
        """Parse a full or partial device name; its components may come in any order.

        Accepted components: ``job:<name>``, ``replica:<int>``, ``task:<int>``,
        ``device:<TYPE>:<int or *>``, and the shorthand ``<TYPE>[:<int or *>]``
        for CPU, GPU, TPU, CUSTOM and EPU in either case (``/gpu:0``, ``CPU:1``).
        Repeating job, replica or task keeps the last, as in TensorFlow; two
        device components are an error.
        """
        if spec is None:
            return cls()
        if not isinstance(spec, str):
            raise ConfigurationError(f"expecting a device name string, got {spec!r}")
        fields = {}
        for part in spec.split("/"):
            if not part:
                continue
            y = part.split(":")
            if len(y) == 2 and y[0] in ("job", "replica", "task"):
                fields[y[0]] = _as_name(y[1], "job") if y[0] == "job" else _parse_int(y[1], part)
            elif len(y) in (1, 2) and y[0].upper() in SHORTHAND_TYPES or (
                    len(y) == 3 and y[0] == "device"):
                if "device_type" in fields:
                    raise ConfigurationError(
                        f"multiple device types: second device {part!r} in {spec!r};"
                        " give one device type")
                fields["device_type"] = y[1] if y[0] == "device" else y[0].upper()
                index = y[-1] if len(y) > 1 else "*"
                fields["device_index"] = None if index == "*" else _parse_int(index, part)
            else:
                raise ConfigurationError(
                    f"unknown component {part!r} in device name {spec!r}: expecting"
                    " /job:<name>/replica:<int>/task:<int>/device:<TYPE>:<int>")
        return cls(**fields)

    def parse_from_string(self, spec):
        """Return the spec a device name describes, as TensorFlow 2's method of this name does.

        Specs are immutable, so this spec is left as it is; the result does not take
        its fields (`make_merged_spec` does that).
        """
        return DeviceSpec.from_string(spec)

    def to_string(self):
        """Return the name ``/job:<j>/replica:<r>/task:<t>/device:<TYPE>:<i>`` of the set fields."""
        return self._string

    def make_merged_spec(self, dev):
        """Return a new spec with this spec's fields, overridden by the fields set in dev."""
        mine, theirs = self._fields(), dev._fields()
        return DeviceSpec(**{k: theirs[k] if theirs[k] is not None else v
                             for k, v in mine.items()})

    def replace(self, **kwargs):
        """Return a new spec with the given fields replaced (None clears one)."""
        unknown = set(kwargs) - set(self._fields())
        if unknown:
            raise ConfigurationError(
                f"unknown field {sorted(unknown)[0]!r}: expecting job, replica, task,"
                " device_type or device_index")
        return DeviceSpec(**{**self._fields(), **kwargs})

    def _fields(self):
        return {"job": self._job, "replica": self._replica, "task": self._task,
                "device_type": self._device_type, "device_index": self._device_index}

    @property
    def job(self):
        """The job name, or None."""
        return self._job

    @property
    def replica(self):
        """The replica index, or None."""
        return self._replica

    @property
    def task(self):
        """The task index, or None."""
        return self._task

    @property
    def device_type(self):
        """The device type, e.g. ``"GPU"``, or None."""
        return self._device_type

    @property
    def device_index(self):
        """The device index, or None for any device of the type."""
        return self._device_index

    def __eq__(self, other):
        if not isinstance(other, DeviceSpec):
            return NotImplemented
        return self._string == other._string

    def __hash__(self):
        return hash(self._string)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self._fields().items() if v is not None)
        return f"DeviceSpec({args})"

    def __str__(self):
        return self._string


def _parse_int(text, part):
    if not text.isdigit():
        raise ConfigurationError(f"bad index {text!r} in {part!r}: expecting an integer >= 0")
    return int(text)


def device_name(job, task, device_type="CPU", index=0):
    """Return the full device name, e.g. ``/job:ps/replica:0/task:1/device:CPU:0``."""
    return DeviceSpec(job, 0, task, device_type, index).to_string()


def local_rank(comm):
    """Return (local_rank, local_size): this rank's place among the ranks on its node.

    Args:
        comm: an mpi4py communicator; the ranks sharing memory with this one are
            found with ``Split_type(COMM_TYPE_SHARED)``, ordered by rank in comm.
    """
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def visible_gpus(env=os.environ, device_count=None):
    """Return the physical GPUs CUDA shows this process; CUDA numbers them 0..n-1.

    Reads ``CUDA_VISIBLE_DEVICES`` as CUDA does: a comma-separated list whose
    parsing stops at the first invalid entry (a negative, repeated or, when
    device_count is given, out-of-range id); ``""``, ``-1`` and ``NoDevFiles``
    hide every GPU. UUID entries (``GPU-...``, ``MIG-...``) are returned as
    strings, since their ordinal is not known without NVML. Without the
    variable, ``range(device_count)`` when device_count is given, else ``[]``.
    """
    device_count = _as_index(device_count, "device_count")
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return list(range(device_count or 0))
    gpus = []
    for entry in (e.strip() for e in raw.split(",")):
        if entry.startswith(("GPU-", "MIG-")) and entry not in gpus:
            gpus.append(entry)
            continue
        valid = entry.isdigit() and int(entry) not in gpus and (
            device_count is None or int(entry) < device_count)
        if not valid:
            if entry and entry not in ("-1", "NoDevFiles") and not entry.startswith("-"):
                _log.warning("mpitf: CUDA_VISIBLE_DEVICES=%r: CUDA ignores %r and every id"
                             " after it", raw, entry)
            break
        gpus.append(int(entry))
    return gpus


def gpu_for_local_rank(local_rank, num_visible):
    """Return the CUDA ordinal for a local rank (round robin), or None without GPUs."""
    local_rank = _as_index(local_rank, "local_rank")
    num_visible = _as_index(num_visible, "num_visible")
    return local_rank % num_visible if num_visible else None
