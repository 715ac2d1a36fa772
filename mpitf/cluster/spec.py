"""Describe the jobs of a cluster: `ClusterSpec`, and every text or dict form it is given in.

`ClusterSpec` keeps the interface and meaning of ``tf.train.ClusterSpec``, so
ported code works: any job name, jobs in insertion order, empty jobs kept,
ValueError for an absent job or task. Addresses keep TensorFlow's ``host:port``
form, but ports are ignored: MPI carries every message. Every job runs; what the
``ps``, ``chief``, ``worker``, ``evaluator`` and other jobs do, and which MPI rank runs
which task, is :mod:`mpitf.cluster.roles`' business.

The forms, all parsed here: a dict of host lists or counts (TensorFlow's), the flag string
``ps|h:p;h:p,worker|h:p`` (:meth:`ClusterSpec.from_string`), ``--ps_hosts/--worker_hosts``
(:meth:`~ClusterSpec.from_hosts`), counts (:meth:`~ClusterSpec.from_counts`), TF_CONFIG's
``cluster`` (:meth:`~ClusterSpec.from_tf_config`), and the ``--spec`` text of ``mpitf
cluster`` (:func:`parse_spec`), which takes any of them. TF_CONFIG and Slurm are read by
:mod:`mpitf.cluster.resolvers`, as TensorFlow's resolvers read them;
:mod:`mpitf.cluster.flags` picks a job's cluster from its flags and environment.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping

from mpitf.errors import ConfigurationError

__all__ = ["SPEC_FORMS", "ClusterSpec", "parse_spec", "split_address"]

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1", "")
_JOB_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")
_log = logging.getLogger("mpitf")
_port_note = {"given": False}  # the port note is logged once per process


def _check_job(job):
    """Return a job name TensorFlow's device names accept, or raise."""
    if isinstance(job, str) and _JOB_NAME.match(job):
        return job
    raise ConfigurationError(
        f"bad job name {job!r}: expecting letters, digits and '_', starting with a letter,"
        " as in TensorFlow's device names (/job:<name>)")


def split_address(address):
    """Split an address into (host, port text or None), as leniently as TensorFlow.

    A path-like address (``unix:/tmp/s``) names no host: its host is ``""``.
    """
    if not isinstance(address, str) or not address.strip():
        raise ConfigurationError(f"expecting an address string 'host:port', got {address!r}")
    addr = address.strip()
    if "/" in addr:
        return "", None
    if addr.startswith("[") and "]" in addr:
        host, _, rest = addr[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else None
    if addr.count(":") == 1:
        host, port = addr.split(":")
        return host, port
    return addr, None


def _task_index(value, job):
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(
            f"bad task index {value!r} in job {job!r}: expecting an integer >= 0")
    return value


class ClusterSpec:
    """Hold the jobs and tasks of a cluster, as ``tf.train.ClusterSpec`` does.

    Args:
        cluster: a dict mapping each job to a list of addresses, to a dict
            ``{task_index: address}`` (sparse indices), or to a task count (that
            many tasks on ``"localhost"``; an mpitf extension); or another
            `ClusterSpec`. Jobs keep their order, empty jobs are kept, an address is
            any non-empty string, and an absent job or task raises ValueError.
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
                split_address(address)  # raises on a non-string or empty address
            spec[job] = {i: parsed[i] for i in sorted(parsed)}
        self._spec = spec
        if any(split_address(a)[1] is not None for t in spec.values() for a in t.values()) \
                and not _port_note["given"]:
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
    def from_counts(cls, num_ps, num_workers):
        """Build a spec of num_ps ps and num_workers workers, all on ``localhost``."""
        num_ps, num_workers = _count(num_ps, "num_ps"), _count(num_workers, "num_workers")
        if num_workers < 1:
            raise ConfigurationError("num_workers is 0: mpitf needs at least one worker")
        return cls({"ps": num_ps, "worker": num_workers})

    @classmethod
    def from_tf_config(cls, config):
        """Build the spec of a parsed TF_CONFIG's ``cluster`` (empty when it has none)."""
        if "cluster" not in config:
            return cls({})
        try:
            return cls(config["cluster"])
        except ConfigurationError as exc:
            raise ConfigurationError(f"TF_CONFIG's cluster: {exc}") from None

    # --- tf.train.ClusterSpec interface -------------------------------------
    def _tasks(self, job):
        try:
            return self._spec[job]
        except (KeyError, TypeError):
            raise ConfigurationError(f"no such job in cluster: {job!r}") from None

    @property
    def jobs(self):
        """The job names, in the order they were given."""
        return list(self._spec)

    @property
    def total_tasks(self):
        """The number of tasks over all jobs: the MPI world size this spec needs."""
        return sum(len(t) for t in self._spec.values())

    def num_tasks(self, job):
        """Return the number of tasks in a job; ValueError if there is no such job."""
        return len(self._tasks(job))

    def task_indices(self, job):
        """Return the sorted task indices of a job; ValueError if there is no such job."""
        return list(self._tasks(job))

    def task_address(self, job, task_index):
        """Return the address of one task; ValueError if there is no such job or task."""
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
        """Return the jobs as a dict: a list per dense job, a dict per sparse or empty one."""
        return {job: self.job_tasks(job) if tasks and max(tasks) + 1 == len(tasks)
                else dict(tasks) for job, tasks in self._spec.items()}

    def to_string(self):
        """Return the grpc_tensorflow_server flag form ``ps|h:p;h:p,worker|h:p``.

        Jobs without tasks are left out: the flag form has no way to write one.
        """
        dicts = {job: t for job, t in self.as_dict().items() if t}
        sparse = [job for job, tasks in dicts.items() if isinstance(tasks, dict)]
        if sparse:
            raise ConfigurationError(
                f"job {sparse[0]!r} has sparse task indices, which the flag form cannot"
                " express: pass the spec as a dict or TF_CONFIG instead")
        return ",".join(f"{job}|{';'.join(tasks)}" for job, tasks in dicts.items())

    def __eq__(self, other):
        """Equal to a spec, or a dict that makes a spec, with the same jobs and tasks."""
        if isinstance(other, Mapping):
            try:
                other = ClusterSpec(other)
            except ConfigurationError:
                return False
        if not isinstance(other, ClusterSpec):
            return NotImplemented
        return self._spec == other._spec

    def __hash__(self):
        return hash(frozenset((job, tuple(t.items())) for job, t in self._spec.items()))

    def __bool__(self):
        return bool(self._spec)

    def __repr__(self):  # jobs sorted, as TensorFlow prints them
        return f"ClusterSpec({dict(sorted(self.as_dict().items()))!r})"


def _count(value, name):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(f"bad {name}={value!r}: expecting an integer >= 0")
    return value


# --- the --spec forms of `mpitf cluster` ---------------------------------------------
SPEC_FORMS = ("'ps|host:port;...,worker|host:port;...', a JSON dict such as "
              "'{\"ps\": 2, \"worker\": [\"a:1\", \"b:1\"]}' or TF_CONFIG,"
              " or counts 'ps=2,worker=3'")


def parse_spec(text):
    """Return the ClusterSpec a ``--spec`` value describes, in any of its forms (``SPEC_FORMS``).

    The flag form (:meth:`ClusterSpec.from_string`), a JSON dict (TensorFlow's, or a whole
    TF_CONFIG: its ``cluster``), or job counts ``ps=2,worker=3``.
    """
    text = (text or "").strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise ConfigurationError(f"--spec is not valid JSON ({exc}): {text!r}") from None
        if isinstance(value, dict) and "cluster" in value:
            return ClusterSpec.from_tf_config(value)
        return ClusterSpec(value)
    if "|" in text:
        return ClusterSpec.from_string(text)
    if "=" in text:
        counts = {}
        for token in text.split(","):
            job, _, count = (t.strip() for t in token.partition("="))
            if not count.isdigit():
                raise ConfigurationError(
                    f"bad count in {token.strip()!r}: expecting 'job=N' with N >= 0")
            if job in counts:
                raise ConfigurationError(f"job {job!r} is given twice in --spec {text!r}")
            counts[job] = int(count)
        return ClusterSpec(counts)
    raise ConfigurationError(f"cannot read --spec {text!r}: expecting {SPEC_FORMS}")
