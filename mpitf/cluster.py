"""Describe the ps and worker jobs of a cluster, and map MPI ranks onto their tasks.

`ClusterSpec` keeps the interface and meaning of ``tf.train.ClusterSpec``, so
ported code works. Addresses keep TensorFlow's ``host:port`` form, but ports are
ignored: MPI carries every message. Only the jobs ``ps`` and ``worker`` exist;
mpitf's chief is worker task 0.

Which MPI rank runs which task is :mod:`mpitf.roles`' business.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping

from mpitf.errors import ConfigurationError

__all__ = [
    "ClusterSpec", "add_cluster_arguments", "cluster_from_args", "check_claimed_role",
    "claimed_roles",
    "split_address", "tf_config_task",
]

JOBS = ("ps", "worker")
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1", "")
_log = logging.getLogger("mpitf")
_port_note = {"given": False}  # the port note is logged once per process


def _check_job(job):
    if job in JOBS:
        return job
    msg = f"unknown job name {job!r}: mpitf runs the jobs 'ps' and 'worker'"
    if job in ("chief", "master"):
        msg += "; mpitf's chief is worker task 0; list that host first under 'worker'"
    raise ConfigurationError(msg)


def split_address(address):
    """Split ``host``, ``host:port`` or ``[v6]:port`` into (host, port or None)."""
    if not isinstance(address, str):
        raise ConfigurationError(f"expecting an address string 'host:port', got {address!r}")
    addr = address.strip()
    if not addr:
        raise ConfigurationError("empty host in the cluster spec: give 'host' or 'host:port'")
    bad = [c for c in ",;|/ \t" if c in addr]
    if bad:
        raise ConfigurationError(f"bad character {bad[0]!r} in address {addr!r}")
    if addr.startswith("["):
        host, sep, rest = addr[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ConfigurationError(f"malformed address {addr!r}: expecting '[v6 address]:port'")
        port = rest[1:] if rest else None
    elif addr.count(":") == 1:
        host, port = addr.split(":")
    else:  # a bare name, or a bare IPv6 address
        host, port = addr, None
    if not host:
        raise ConfigurationError(f"empty host in address {addr!r}: expecting 'host:port'")
    if port is not None and not (port.isdigit() and int(port) <= 65535):
        raise ConfigurationError(
            f"bad port {port!r} in address {addr!r}: expecting a number in 0..65535")
    return host, (None if port is None else int(port))


def _task_index(value, job):
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(
            f"bad task index {value!r} in job {job!r}: expecting an integer >= 0")
    return value


class ClusterSpec:
    """Hold the tasks of the ps and worker jobs, as ``tf.train.ClusterSpec`` does.

    Args:
        cluster: a dict mapping each job to a list of ``"host:port"`` addresses,
            to a dict ``{task_index: address}`` (sparse indices), or to a task
            count (that many tasks on ``"localhost"``; an mpitf extension); or
            another `ClusterSpec`. Jobs with no tasks are left out, and lookups
            of ``"ps"`` in a spec without ps tasks read as empty (a spec with
            zero ps trains locally). The empty dict gives the empty, false spec.
    """

    def __init__(self, cluster):
        if isinstance(cluster, ClusterSpec):
            self._spec = {job: dict(tasks) for job, tasks in cluster._spec.items()}
            return
        if not isinstance(cluster, Mapping):
            raise ConfigurationError(
                "expecting a dict of job name -> list of 'host:port', dict of task index"
                f" -> address, or task count, or a ClusterSpec; got {type(cluster).__name__}")
        spec = {}
        for job, tasks in cluster.items():
            _check_job(job)
            if isinstance(tasks, Mapping):
                parsed = {_task_index(i, job): a for i, a in tasks.items()}
                if len(parsed) != len(tasks):
                    raise ConfigurationError(f"a task index is given twice in job {job!r}")
            elif isinstance(tasks, (list, tuple)):
                parsed = dict(enumerate(tasks))
            elif isinstance(tasks, int) and not isinstance(tasks, bool) and tasks >= 0:
                parsed = dict.fromkeys(range(tasks), "localhost")
            else:
                raise ConfigurationError(
                    f"bad tasks {tasks!r} for job {job!r}: expecting a list of 'host:port',"
                    " a dict of task index -> address, or a task count >= 0")
            for address in parsed.values():
                split_address(address)  # raises on a malformed address
            if parsed:
                spec[job] = {i: parsed[i].strip() for i in sorted(parsed)}
        self._spec = dict(sorted(spec.items()))
        if cluster and "worker" not in self._spec:
            raise ConfigurationError("the cluster spec has no worker task: mpitf needs one")
        self._check_addresses()

    def _check_addresses(self):
        seen, ports = {}, False
        for job, tasks in self._spec.items():
            for i, address in tasks.items():
                if split_address(address)[1] is None:
                    continue
                ports = True
                if address in seen:
                    raise ConfigurationError(
                        f"address {address!r} is used twice, by /job:{seen[address]} and"
                        f" /job:{job}/task:{i}: give each task its own host:port")
                seen[address] = f"{job}/task:{i}"
        if ports and not _port_note["given"]:
            _port_note["given"] = True
            _log.info("mpitf: ports in the cluster spec are ignored; MPI carries the traffic")

    # --- constructors -------------------------------------------------------
    @classmethod
    def from_string(cls, s):
        """Parse the grpc_tensorflow_server flag form ``ps|h:p;h:p,worker|h:p;h:p``."""
        if not isinstance(s, str) or not s.strip():
            raise ConfigurationError(
                f"empty cluster spec {s!r}: expecting 'ps|host:port;...,worker|host:port;...'")
        spec = {}
        for token in s.strip().split(","):
            job, sep, hosts = (t.strip() for t in token.partition("|"))
            tasks = [h.strip() for h in hosts.split(";")]
            what = ("missing '|'" if not sep else "empty job name" if not job
                    else "empty host" if not all(tasks) else None)
            if what:
                raise ConfigurationError(f"{what} in {token!r}: expecting 'job|host:port;...'")
            if job in spec:
                raise ConfigurationError(f"job {job!r} is given twice in the cluster spec {s!r}")
            spec[_check_job(job)] = tasks
        return cls(spec)

    @classmethod
    def from_hosts(cls, ps_hosts, worker_hosts):
        """Build the spec from the comma-separated ``--ps_hosts``/``--worker_hosts`` flags."""
        def split(hosts, flag):
            if hosts is None or isinstance(hosts, str) and not hosts.strip():
                return []
            items = hosts.split(",") if isinstance(hosts, str) else list(hosts)
            for h in items:
                if not isinstance(h, str) or not h.strip():
                    raise ConfigurationError(
                        f"empty host in {flag}={hosts!r}: expecting 'host:port,host:port'")
            return [h.strip() for h in items]
        workers = split(worker_hosts, "--worker_hosts")
        if not workers:
            raise ConfigurationError("--worker_hosts is empty: mpitf needs at least one worker")
        return cls({"ps": split(ps_hosts, "--ps_hosts"), "worker": workers})

    @classmethod
    def from_tf_config(cls, value):
        """Build the spec from the ``cluster`` part of TF_CONFIG (a JSON string or dict)."""
        cluster = _tf_config(value).get("cluster")
        if not isinstance(cluster, Mapping) or not cluster:
            raise ConfigurationError(
                "TF_CONFIG has no 'cluster' entry: expecting {\"cluster\": {\"worker\": [...]}}")
        return cls(cluster)

    @classmethod
    def from_slurm(cls, env, num_ps):
        """Build the spec for the current Slurm job step: num_ps ps, the rest workers.

        Every task gets the address ``"localhost"``: nodelists are not expanded,
        because `assign_roles` places tasks by the ranks' own processor names,
        which spreads the ps tasks over the nodes without them.
        """
        var = "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
        raw = env.get(var)
        if raw is None:
            raise ConfigurationError(
                "SLURM_NTASKS is not set: this is not inside a Slurm job step;"
                " run under srun, or give --cluster_spec or --num-ps with mpiexec")
        if not str(raw).strip().isdigit() or int(raw) < 1:
            raise ConfigurationError(f"bad {var}={raw!r}: expecting a task count >= 1")
        ntasks = int(raw)
        num_ps = _count(num_ps, "num_ps")
        if num_ps >= ntasks:
            raise ConfigurationError(
                f"num_ps={num_ps} leaves no worker among the {ntasks} Slurm tasks:"
                f" use --num-ps below {ntasks} or ask for more tasks (--ntasks)")
        return cls.from_counts(num_ps, ntasks - num_ps)

    @classmethod
    def from_counts(cls, num_ps, num_workers):
        """Build a spec of num_ps ps and num_workers workers, all on ``localhost``."""
        num_ps, num_workers = _count(num_ps, "num_ps"), _count(num_workers, "num_workers")
        if num_workers < 1:
            raise ConfigurationError("num_workers is 0: mpitf needs at least one worker")
        return cls({"ps": num_ps, "worker": num_workers})

    # --- tf.train.ClusterSpec interface -------------------------------------
    def _tasks(self, job):
        return self._spec.get(_check_job(job), {})

    @property
    def jobs(self):
        """The job names, sorted."""
        return list(self._spec)

    @property
    def total_tasks(self):
        """The number of tasks over all jobs: the MPI world size this spec needs."""
        return sum(len(t) for t in self._spec.values())

    def num_tasks(self, job):
        """Return the number of tasks in a job."""
        return len(self._tasks(job))

    def task_indices(self, job):
        """Return the sorted task indices of a job."""
        return list(self._tasks(job))

    def task_address(self, job, task_index):
        """Return the address of one task."""
        tasks = self._tasks(job)
        if task_index not in tasks:
            raise ConfigurationError(
                f"no task with index {task_index!r} in job {job!r}:"
                f" expecting one of {list(tasks)}")
        return tasks[task_index]

    def job_tasks(self, job):
        """Return the addresses of a job's tasks by index, with None where an index is absent."""
        tasks = self._tasks(job)
        out = [None] * (max(tasks) + 1 if tasks else 0)
        for i, address in tasks.items():
            out[i] = address
        return out

    def as_dict(self):
        """Return the jobs as a dict: a list per dense job, a dict per sparse one."""
        return {job: self.job_tasks(job) if max(tasks) + 1 == len(tasks) else dict(tasks)
                for job, tasks in self._spec.items()}

    def to_string(self):
        """Return the grpc_tensorflow_server flag form ``ps|h:p;h:p,worker|h:p``."""
        dicts = self.as_dict()
        sparse = [job for job, tasks in dicts.items() if isinstance(tasks, dict)]
        if sparse:
            raise ConfigurationError(
                f"job {sparse[0]!r} has sparse task indices, which the flag form cannot"
                " express: pass the spec as a dict or TF_CONFIG instead")
        return ",".join(f"{job}|{';'.join(tasks)}" for job, tasks in dicts.items())

    def __eq__(self, other):
        if not isinstance(other, ClusterSpec):
            return NotImplemented
        return self._spec == other._spec

    def __ne__(self, other):  # as TF defines it
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self):
        return hash(tuple((job, tuple(t.items())) for job, t in self._spec.items()))

    def __bool__(self):
        return bool(self._spec)

    def __repr__(self):
        return f"ClusterSpec({self.as_dict()!r})"


def _count(value, name):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(f"bad {name}={value!r}: expecting an integer >= 0")
    return value


def _tf_config(value):
    if isinstance(value, Mapping):
        return value
    try:
        config = json.loads(value)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"TF_CONFIG is not valid JSON ({exc}): {value!r}") from None
    if not isinstance(config, dict):
        raise ConfigurationError(f"TF_CONFIG must be a JSON object, got {value!r}")
    return config


def tf_config_task(value):
    """Return the (job, index) of TF_CONFIG's ``task`` entry, or None when it has none."""
    task = _tf_config(value).get("task")
    if not task:
        return None
    if not isinstance(task, Mapping) or "type" not in task:
        raise ConfigurationError(
            f"bad TF_CONFIG task {task!r}: expecting {{\"type\": \"worker\", \"index\": 0}}")
    return _check_job(task["type"]), _task_index(task.get("index", 0), task["type"])


# --- command-line resolution ------------------------------------------------
def add_cluster_arguments(parser):
    """Add the cluster flags of TensorFlow's example scripts to an argparse parser."""
    group = parser.add_argument_group("cluster")
    group.add_argument("--cluster_spec", "--cluster-spec", dest="cluster_spec", default=None,
                       help="cluster in flag form 'ps|host:port;...,worker|host:port;...'")
    group.add_argument("--ps_hosts", "--ps-hosts", dest="ps_hosts", default=None,
                       help="comma-separated host:port list of the ps job")
    group.add_argument("--worker_hosts", "--worker-hosts", dest="worker_hosts", default=None,
                       help="comma-separated host:port list of the worker job")
    group.add_argument("--num-ps", "--num_ps", dest="num_ps", type=int, default=1,
                       help="ps tasks when no spec is given; the other MPI ranks are workers"
                            " (default: 1)")
    group.add_argument("--job_name", "--job-name", dest="job_name", default=None,
                       help="accepted for TF scripts; checked against the role of the MPI rank")
    group.add_argument("--task_index", "--task-index", dest="task_index", type=int, default=None,
                       help="accepted for TF scripts; checked against the role of the MPI rank")
    return group


def cluster_from_args(args, world_size, env=os.environ):
    """Resolve the cluster spec from flags, then TF_CONFIG, then --num-ps and the world size."""
    spec_flag = getattr(args, "cluster_spec", None)
    ps_hosts = getattr(args, "ps_hosts", None)
    worker_hosts = getattr(args, "worker_hosts", None)
    # A flag given empty ('') is an error, never "not given": it would train with defaults.
    if spec_flag is not None and (ps_hosts is not None or worker_hosts is not None):
        raise ConfigurationError(
            "--cluster_spec and --ps_hosts/--worker_hosts both given: pass only one of them")
    if spec_flag is not None:
        return ClusterSpec.from_string(spec_flag)
    if ps_hosts is not None and worker_hosts is None:
        raise ConfigurationError("--ps_hosts needs --worker_hosts: give both")
    if worker_hosts is not None:
        return ClusterSpec.from_hosts(ps_hosts, worker_hosts)
    if env.get("TF_CONFIG"):
        return ClusterSpec.from_tf_config(env["TF_CONFIG"])
    num_ps = _count(getattr(args, "num_ps", 1), "--num-ps")
    if num_ps >= world_size:
        raise ConfigurationError(
            f"--num-ps={num_ps} needs more MPI ranks than the world's {world_size}"
            f" (num_ps ps and at least one worker): run with mpiexec -n {num_ps + 1}"
            " or more, or lower --num-ps (0 trains locally)")
    return ClusterSpec.from_counts(num_ps, world_size - num_ps)


def claimed_roles(args, env=os.environ):
    """Return the roles this rank was told to run: ``[(source, job, index)]``.

    The sources are ``--job_name/--task_index`` and the ``task`` entry of TF_CONFIG when the
    cluster comes from TF_CONFIG (no cluster flag given); either may leave out the index.
    """
    claims = []
    job, task = getattr(args, "job_name", None), getattr(args, "task_index", None)
    if job is not None or task is not None:
        claim = " ".join(f"--{k}={v}" for k, v in (("job_name", job), ("task_index", task))
                         if v is not None)
        claims.append((claim, job, task))
    flags = [getattr(args, k, None) for k in ("cluster_spec", "ps_hosts", "worker_hosts")]
    if env.get("TF_CONFIG") and all(f is None for f in flags):
        entry = tf_config_task(env["TF_CONFIG"])
        if entry is not None:
            claims.append((f"TF_CONFIG task {{\"type\": \"{entry[0]}\", \"index\": {entry[1]}}}",
                           *entry))
    return claims


def check_claimed_role(args, job, task_index, rank=None, env=os.environ):
    """Raise if --job_name/--task_index or TF_CONFIG's task disagree with this rank's role."""
    for claim, claimed_job, claimed_task in claimed_roles(args, env):
        if (claimed_job is None or claimed_job == job) and (
                claimed_task is None or claimed_task == task_index):
            continue
        who = "this MPI rank" if rank is None else f"MPI rank {rank}"
        raise ConfigurationError(
            f"{claim} but {who} runs /job:{job}/task:{task_index}; roles come from the MPI "
            "rank (see mpitf.roles for the mapping policy): drop the claim or fix the spec")
