"""TensorFlow's TF_CONFIG and Slurm cluster resolvers, reading what TensorFlow reads as it does.

`TFConfigClusterResolver` and `SlurmClusterResolver` keep the interface of
``tf.distribute.cluster_resolver``'s classes of those names: ``cluster_spec()``,
``task_type``, ``task_id``, ``rpc_layer``, ``master()``, ``environment`` and, for Slurm,
``num_accelerators()``. The specs they build are TensorFlow's, host names and ports included.

Design differences, all because MPI carries the traffic and mpitf builds no graph:

- no ``ClusterResolver`` base class and no ``SimpleClusterResolver``; no protobuf
  ``ClusterDef``; ``master()`` and ``rpc_layer`` only format strings (no gRPC is spoken).
- `TFConfigClusterResolver` has no ``num_accelerators()``: TensorFlow counts them by
  listing a session's devices, and mpitf has no session that sees another task's devices.
- which task an MPI rank runs is :mod:`mpitf.cluster.roles`' business, not the resolver's: a
  rank's role comes from its MPI rank, and the ``task`` of TF_CONFIG is a claim that
  :func:`mpitf.cluster.flags.check_claimed_role` holds against that role.
- both read a mapping ``env`` (keyword-only; default ``os.environ``) instead of
  ``os.environ`` alone, and raise :class:`~mpitf.errors.ConfigurationError` (a
  ValueError) with a fix where TensorFlow raises RuntimeError, ValueError or KeyError.
"""

import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping

from mpitf.cluster.spec import ClusterSpec
from mpitf.errors import ConfigurationError

__all__ = ["SlurmClusterResolver", "TFConfigClusterResolver", "expand_hostlist",
           "expand_tasks_per_node"]

_SLURM_DOC = "run the job under srun (see slurm/README.md)"


def _master_url(address, rpc_layer):
    return f"{rpc_layer}://{address}" if rpc_layer else address


def _index(value, what):
    """Return a task index from an int or a string of digits, as TensorFlow's int() does."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(f"bad {what} {value!r}: expecting an integer >= 0")
    return value


# --- TF_CONFIG ----------------------------------------------------------------------------
class TFConfigClusterResolver:
    """Read the cluster and this task from the TF_CONFIG environment variable, as TensorFlow.

    ``TF_CONFIG`` is JSON: ``{"cluster": {"worker": ["w0:2222", ...], ...}, "task":
    {"type": "worker", "index": 0}, "rpc_layer": "grpc", "session_master": "..."}``, every
    key optional. Unset, blank or ``"{}"`` gives an empty spec; a ``task`` without ``index``
    has ``task_id`` None, one without ``type`` has ``task_type`` None. The variable is
    read anew on every call, as TensorFlow does.

    Args:
        task_type, task_id, rpc_layer, environment: override what TF_CONFIG says.
        env: the mapping to read ``TF_CONFIG`` from (an mpitf extension; default
            ``os.environ``).
    """

    def __init__(self, task_type=None, task_id=None, rpc_layer=None, environment=None, *,
                 env=None):
        self._task_type, self._task_id = task_type, task_id
        self._rpc_layer, self._environment = rpc_layer, environment
        self._env = os.environ if env is None else env

    def _config(self):
        raw = self._env.get("TF_CONFIG")
        if raw is None or not str(raw).strip():
            return {}
        try:
            config = json.loads(raw)
        except ValueError as exc:
            raise ConfigurationError(f"TF_CONFIG is not valid JSON ({exc}): {raw!r}") from None
        if not isinstance(config, dict):
            raise ConfigurationError(f"TF_CONFIG must be a JSON object, got {raw!r}")
        return config

    def _task(self):
        task = self._config().get("task") or {}
        if not isinstance(task, Mapping):
            raise ConfigurationError(
                f"bad TF_CONFIG task {task!r}: expecting {{\"type\": \"worker\", \"index\": 0}}")
        return task

    @property
    def task_type(self):
        """The job of this task: the override, else TF_CONFIG's ``task.type`` as a string."""
        if self._task_type is not None:
            return str(self._task_type)
        task = self._task()
        return str(task["type"]) if "type" in task else None

    @task_type.setter
    def task_type(self, task_type):
        self._task_type = task_type

    @property
    def task_id(self):
        """The index of this task: the override, else TF_CONFIG's ``task.index``, or None."""
        if self._task_id is not None:
            return _index(self._task_id, "task_id")
        task = self._task()
        return _index(task["index"], "TF_CONFIG task index") if "index" in task else None

    @task_id.setter
    def task_id(self, task_id):
        self._task_id = task_id

    @property
    def rpc_layer(self):
        """The override, else TF_CONFIG's ``rpc_layer``, else None."""
        return self._rpc_layer if self._rpc_layer is not None else self._config().get(
            "rpc_layer")

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer):
        self._rpc_layer = rpc_layer

    @property
    def environment(self):
        """The ``environment`` given to the constructor (TensorFlow's: None or "google")."""
        return self._environment

    def cluster_spec(self):
        """Return the `ClusterSpec` of TF_CONFIG's ``cluster``; an empty one when it has none."""
        return ClusterSpec.from_tf_config(self._config())

    def master(self, task_type=None, task_id=None, rpc_layer=None):
        """Return ``session_master``, else '' for a one-task cluster, else the task's URL."""
        session_master = self._config().get("session_master")
        if session_master is not None:
            return session_master
        spec = self.cluster_spec()
        if not spec.jobs or (len(spec.jobs) == 1 and len(spec.job_tasks(spec.jobs[0])) == 1):
            return ""
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        rpc_layer = rpc_layer if rpc_layer is not None else self.rpc_layer
        return _master_url(spec.task_address(task_type, task_id), rpc_layer)


# --- Slurm ----------------------------------------------------------------------------------
def _split_outside_brackets(text):
    parts, current, inside = [], "", False
    for c in text:
        if c == "[":
            if inside:
                raise ValueError("'[' inside a range")
            inside = True
        elif c == "]":
            if not inside:
                raise ValueError("']' without '['")
            inside = False
        elif c == "," and not inside:
            parts.append(current)
            current = ""
            continue
        current += c
    if inside:
        raise ValueError("'[' without ']'")
    return parts + [current]


def _expand_range(ranges):
    """Yield the numbers of '1,3-5' as strings, zero-padded to the width of each start."""
    for item in ranges.split(","):
        first, sep, last = item.partition("-")
        if not first.isdigit() or (sep and not last.isdigit()):
            raise ValueError(f"bad range {item!r}")
        stop = int(last) if sep else int(first)
        if stop < int(first):
            raise ValueError(f"range {item!r} runs backwards")
        for number in range(int(first), stop + 1):
            yield str(number).zfill(len(first))


def _expand_part(part):
    prefix, bracket, rest = part.partition("[")
    if not bracket:
        return [prefix]
    ranges, _, suffix = rest.partition("]")
    return [prefix + n + tail for n in _expand_range(ranges) for tail in _expand_part(suffix)]


def expand_hostlist(hostlist):
    """Expand a Slurm hostlist into host names, in order, duplicates kept, as TensorFlow.

    ``"t02n[13,41-43]"`` gives ``t02n13 t02n41 t02n42 t02n43``; ``"node[01-03],gpu7"`` keeps
    the zero padding of each range's start: ``node01 node02 node03 gpu7``. A range may be
    followed by more text or another range (``"r[1-2]n[1-2]"``), as Slurm writes them.
    """
    try:
        if not isinstance(hostlist, str) or not hostlist.strip():
            raise ValueError("empty")
        hosts = []
        for part in _split_outside_brackets(hostlist.strip()):
            if not part:
                raise ValueError("an empty host name")
            hosts.extend(_expand_part(part))
        return hosts
    except ValueError as exc:
        raise ConfigurationError(
            f"bad Slurm hostlist {hostlist!r} ({exc}): expecting e.g. 'n[1-3,7],gpu01'") from None


def expand_tasks_per_node(tasks_per_node):
    """Expand Slurm's tasks-per-node list, ``"3(x2),2,1"`` -> ``[3, 3, 2, 1]``, as TensorFlow."""
    counts = []
    for part in str(tasks_per_node).split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ConfigurationError(
                f"bad Slurm tasks-per-node list {tasks_per_node!r}: expecting e.g. '2(x3),1'")
        counts.extend([int(m[1])] * int(m[2] or 1))
    return counts


def _visible_gpus(env):
    """Count this node's GPUs: CUDA_VISIBLE_DEVICES if set, else nvidia-smi, else none."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "--list-gpus"], capture_output=True, text=True, check=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise ConfigurationError(
            f"cannot count this node's GPUs ({smi} --list-gpus: {exc}): pass gpus_per_node"
        ) from None
    return sum(line.startswith("GPU ") for line in out.splitlines())


class SlurmClusterResolver:
    """Build the cluster of the current Slurm job step, as TensorFlow's resolver of that name.

    Reads ``SLURM_PROCID`` and, where the arguments leave them open, ``SLURM_STEP_NUM_TASKS``,
    ``SLURM_STEP_NODELIST`` and ``SLURM_STEP_TASKS_PER_NODE``. ``cluster_spec()`` lists the
    nodes sorted by name, gives the tasks on a node the ports ``port_base``,
    ``port_base + 1``, ..., and hands them out to the jobs sorted by name (so ``ps``
    before ``worker``) in that order: Slurm task r (``SLURM_PROCID`` r, under srun also MPI
    rank r) is entry r. It also sets ``task_type``/``task_id`` for this process and, with
    ``auto_set_gpu``, its ``CUDA_VISIBLE_DEVICES``.

    Args:
        jobs: job name -> task count; default ``{"worker": SLURM_STEP_NUM_TASKS}``.
        port_base: the port of the first task on each node.
        gpus_per_node: default: the entries of ``CUDA_VISIBLE_DEVICES`` if it is set, else
            what ``nvidia-smi --list-gpus`` lists, else 0. (TensorFlow counts ``""`` as
            one GPU and needs nvidia-smi; mpitf counts none and runs without GPUs.)
        gpus_per_task: default: ``gpus_per_node // (most tasks on a node)``; 0 gives each
            task ``""``, where TensorFlow fails.
        tasks_per_node: an int for every node of ``SLURM_STEP_NODELIST``, a dict host ->
            count, or None to read ``SLURM_STEP_TASKS_PER_NODE``.
        auto_set_gpu: write this task's GPUs to ``env["CUDA_VISIBLE_DEVICES"]``.
        rpc_layer: the scheme of ``master()``'s URLs.
        env: the mapping to read (and, with auto_set_gpu, write); default ``os.environ``.
    """

    def __init__(self, jobs=None, port_base=8888, gpus_per_node=None, gpus_per_task=None,
                 tasks_per_node=None, auto_set_gpu=True, rpc_layer="grpc", *, env=None):
        self._env = os.environ if env is None else env
        self._rank = self._int_var("PROCID")
        if jobs is None:
            jobs = {"worker": self._int_var("STEP_NUM_TASKS")}
        if not isinstance(jobs, Mapping):
            raise ConfigurationError(f"bad jobs {jobs!r}: expecting a dict job -> task count")
        self._jobs = {job: _index(n, f"task count of job {job!r}") for job, n in jobs.items()}
        self._port_base = _index(port_base, "port_base")
        if tasks_per_node is None:
            counts = expand_tasks_per_node(self._var("STEP_TASKS_PER_NODE"))
            hosts = self._hostlist()
            if len(counts) != len(hosts):
                raise ConfigurationError(
                    f"SLURM_STEP_TASKS_PER_NODE={self._var('STEP_TASKS_PER_NODE')!r} gives"
                    f" {len(counts)} nodes but SLURM_STEP_NODELIST names {len(hosts)}")
            self._task_configuration = dict(zip(hosts, counts))
        elif isinstance(tasks_per_node, Mapping):
            self._task_configuration = {str(h): _index(n, f"tasks on {h!r}")
                                        for h, n in tasks_per_node.items()}
        else:
            count = _index(tasks_per_node, "tasks_per_node")
            self._task_configuration = dict.fromkeys(self._hostlist(), count)
        most = max(self._task_configuration.values(), default=0)
        num_tasks = sum(self._task_configuration.values())
        self._gpus_per_node = _index(_visible_gpus(self._env) if gpus_per_node is None
                                     else gpus_per_node, "gpus_per_node")
        self._gpus_per_task = _index(self._gpus_per_node // max(most, 1) if gpus_per_task is None
                                     else gpus_per_task, "gpus_per_task")
        self._auto_set_gpu = auto_set_gpu
        self.task_type = self.task_id = None  # set by cluster_spec(), as in TensorFlow
        self.rpc_layer = rpc_layer
        if most * self._gpus_per_task > self._gpus_per_node:
            raise ConfigurationError(
                f"{most} tasks on a node with {self._gpus_per_task} GPUs each need"
                f" {most * self._gpus_per_task}, but a node has {self._gpus_per_node}:"
                " lower gpus_per_task or the tasks per node")
        if sum(self._jobs.values()) != num_tasks:
            raise ConfigurationError(
                f"the jobs {self._jobs} ask for {sum(self._jobs.values())} tasks but the Slurm"
                f" step runs {num_tasks}: ask srun for that many tasks (-n) or change the jobs")
        if not 0 <= self._rank < num_tasks:
            raise ConfigurationError(
                f"SLURM_PROCID={self._rank} is not one of the step's {num_tasks} tasks")

    def _var(self, name):
        value = self._env.get(f"SLURM_{name}")
        if value is None or not str(value).strip():
            raise ConfigurationError(
                f"SLURM_{name} is not set: this is not inside a Slurm job step; {_SLURM_DOC}")
        return str(value).strip()

    def _int_var(self, name):
        value = self._var(name)
        if not value.isdigit():
            raise ConfigurationError(f"bad SLURM_{name}={value!r}: expecting an integer >= 0")
        return int(value)

    def _hostlist(self):
        return expand_hostlist(self._var("STEP_NODELIST"))

    def cluster_spec(self):
        """Return the step's `ClusterSpec`; set task_type, task_id and (auto_set_gpu) the GPUs."""
        addresses, gpus, per_task = [], [], self._gpus_per_task
        for host, count in sorted(self._task_configuration.items()):
            for slot in range(count):
                addresses.append(f"{host}:{self._port_base + slot}")
                gpus.append(",".join(str(g) for g in range(slot * per_task,
                                                           (slot + 1) * per_task)))
        jobs, start = {}, 0
        for job, count in sorted(self._jobs.items()):
            jobs[job] = addresses[start:start + count]
            if start <= self._rank < start + count:
                self.task_type, self.task_id = job, self._rank - start
            start += count
        if self._auto_set_gpu:
            self._env["CUDA_VISIBLE_DEVICES"] = gpus[self._rank]
        return ClusterSpec(jobs)

    def get_task_info(self):
        """Return (task_type, task_id); both None until cluster_spec() has run."""
        return self.task_type, self.task_id

    def master(self, task_type=None, task_id=None, rpc_layer=None):
        """Return the URL of a task (default: this one), or '' when none is known."""
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        if task_type is None or task_id is None:
            return ""
        address = self.cluster_spec().task_address(task_type, task_id)
        return _master_url(address, rpc_layer or self.rpc_layer)

    @property
    def environment(self):
        """Always '': Slurm is not Google's environment."""
        return ""

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
        """Return ``{"GPU": gpus_per_task}`` (``{}`` without GPUs); the arguments are unused."""
        del task_type, task_id, config_proto
        return {"GPU": self._gpus_per_task} if self._gpus_per_task else {}
