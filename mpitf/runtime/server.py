"""Give this rank its place in the cluster: its job and task, its communicators, and ``join()``.

``Server(cluster)`` is collective over ``MPI.COMM_WORLD``: every rank shares its host name,
every rank computes the same rank -> task map (see :mod:`mpitf.cluster.roles`), and a spec that
does not fit the world fails identically on every rank, so each exits without waiting for
the others.
"""

import atexit
import logging
import os

from mpi4py import MPI

from ..cluster import ClusterSpec
from ..cluster.device import device_name, local_rank
from ..cluster.roles import assign_roles, describe_roles, training_replicas
from ..config import DEFAULT_DEADLINE, check_deadline
from ..errors import CollectiveError, ConfigurationError
from . import heal, spin, ulfm
from .lifeline import Lifeline

_log = logging.getLogger("mpitf")


class Server:
    """An MPI rank acting as one task of a cluster: ``ps``, ``chief``, ``worker`` or any job.

    ``job_name`` and ``task_index`` are TensorFlow's names (a chief rank is
    ``/job:chief/task:0``). The training replicas are the chief task (if any) then the
    worker tasks by index, as in TensorFlow's ``MultiWorkerMirroredStrategy``:
    ``replica_ranks``, ``num_replicas``, ``replica_index`` and ``replica_comm`` give that
    view (the last two are None on a task that does not train).

    Args:
        cluster: a :class:`ClusterSpec` or anything it accepts; None means
            ``{"ps": 1, "worker": world_size - 1}`` (or one worker alone).
        job_name, task_index: the role this process expects, as TensorFlow's ``Server``
            takes them. The role comes from the MPI rank all the same; one that disagrees
            is an error naming both. None: no expectation.
        comm: the communicator the cluster spans (``MPI.COMM_WORLD``).
        deadline: seconds a rank waits on a peer before ending the job with a message
            naming it. None waits forever.
        fixed_deadline: False (the default): ``deadline`` bounds start-up and checkpoints,
            and once steps have run a silent peer is named within max(30 s, 10 x the
            slowest step) (see :func:`mpitf.config.stall_allowance`); True: every wait is
            ``deadline`` (then set it above the longest step).
    """

    def __init__(self, cluster=None, job_name=None, task_index=None, comm=None,
                 deadline=DEFAULT_DEADLINE, fixed_deadline=False):
        self.deadline = check_deadline(deadline)
        self.fixed_deadline = bool(fixed_deadline)
        spin.use_environment()
        world = comm if comm is not None else MPI.COMM_WORLD
        spawned = heal.parent()  # this process replaces a lost rank (--heal)
        self.replacement = None  # then: what the survivors told it (see heal())
        replacing = spawned is not None
        if replacing:
            with heal.within_deadline("joining the job", os.environ[heal.REPLACES]):
                world, self.replacement = heal.join_as_replacement(spawned)
        if cluster is None:
            size = world.Get_size()
            cluster = {"ps": 1 if size > 1 else 0, "worker": size - 1 if size > 1 else 1}
        self.cluster = cluster if isinstance(cluster, ClusterSpec) else ClusterSpec(cluster)
        self.rank = world.Get_rank()
        token = self.replacement["token"] if replacing else \
            world.bcast(os.urandom(6).hex() if self.rank == 0 else None, root=0)
        gathered = world.allgather((MPI.Get_processor_name(), os.getpid(), job_name, task_index))
        self.hosts = [g[0] for g in gathered]
        self.pids = [g[1] for g in gathered]
        try:
            self.roles = self.replacement["roles"] if replacing else \
                assign_roles(self.cluster, self.hosts)
        except Exception as exc:
            raise CollectiveError(exc) from exc  # every rank raised this from the same facts
        _check_claims([g[2:] for g in gathered], self.roles)
        self.job_name, self.task_index = self.roles[self.rank]
        # A private duplicate keeps mpitf's messages apart from the user's own MPI traffic
        # (a replacement's communicator is private already).
        self.comm = world if replacing else world.Dup()
        # Under ULFM a lost training replica is survived (the ps acknowledges it and goes
        # on, see mpitf.ps.service): errors must come back as exceptions, not end the job.
        self.ulfm = ulfm.enabled()
        if self.ulfm:
            self.comm.Set_errhandler(MPI.ERRORS_RETURN)
            ulfm.watch(self.comm)
        self.job_comm, self.replica_comm = self._split(self.comm)
        self.chief_index = self.replacement["chief_index"] if replacing else 0
        self.local_rank, self.local_size = local_rank(self.comm)
        if replacing:  # the last of the survivors' collectives in Server.heal
            self.replacement["facts"] = self.comm.allgather(None)
        self.exit_code = 0
        self._token = token
        self._watch_peers(world)

    def _watch_peers(self, world):
        """Start the lifeline: it names a same-node rank that dies, ends this one with its proxy."""
        me = self.hosts[self.rank]
        peers = {r: p for r, (h, p) in enumerate(zip(self.hosts, self.pids))
                 if h == me and r != self.rank}
        self.lifeline = Lifeline(self.rank, peers, self._token, self._describe_rank,
                                 lambda: world.Abort(1),
                                 parent=os.getppid() if world.Get_size() > 1 else None,
                                 survivable=self.replica_ranks if self.ulfm else ())
        self.lifeline.watch()
        atexit.register(self.lifeline.mark_exit)

    def _split(self, comm):
        """Return ``comm``'s (job communicator, replica communicator) for this rank.

        Collective over ``comm``. Sets ``replica_ranks``, ``num_replicas`` and
        ``replica_index``; the replica communicator is None on a task that does not train.
        """
        job_ids = {job: i for i, job in enumerate(sorted({j for j, _ in self.roles}))}
        job_comm = comm.Split(job_ids[self.job_name], self.task_index)
        replicas = training_replicas(self.cluster)
        self.replica_ranks = [self.roles.index(role) for role in replicas]
        self.num_replicas = len(replicas)
        mine = self.roles[self.rank]
        self.replica_index = replicas.index(mine) if mine in replicas else None
        replica_comm = comm.Split(MPI.UNDEFINED if self.replica_index is None else 0,
                                  self.replica_index or 0)
        return job_comm, None if replica_comm == MPI.COMM_NULL else replica_comm

    def heal(self, facts=None):
        """Replace the lost ranks by spawned processes (``--heal``); return what changed.

        Collective over the survivors (every rank alive calls it at a quiescent point:
        no message of the job in flight). ``facts`` (picklable) is what this rank tells
        the others and the replacements (a ps: its workers' data positions). Returns
        ``{"lost": ranks, "seconds": s, "facts": [per rank]}`` (the seconds from the shrink
        to the merge), or raises :class:`~mpitf.runtime.heal.NoFreeSlot` when nothing
        could be spawned (the job goes on without, as before).
        """
        known = dict(roles=self.roles, token=self._token, chief_index=self.chief_index)
        with heal.within_deadline("the heal (shrink, spawn, merge)", self.rank):
            new, lost, seconds = heal.shrink_and_spawn(self.comm, known)
        heal.repoint(self.comm, new)  # the old communicator (and the dead ranks) are left
        gathered = self.comm.allgather((MPI.Get_processor_name(), os.getpid(), None, None))
        self.hosts = [g[0] for g in gathered]
        self.pids = [g[1] for g in gathered]
        job_comm, replica_comm = self._split(self.comm)
        heal.repoint(self.job_comm, job_comm)
        if replica_comm is not None:
            heal.repoint(self.replica_comm, replica_comm)
        local_rank(self.comm)  # collective, as a replacement's Server calls it
        facts = self.comm.allgather(facts)
        return dict(lost=lost, seconds=seconds, facts=facts)

    def survive(self, ranks):
        """Count ``ranks``' deaths as survivable too (ps tasks with a buddy replica)."""
        self.lifeline.survivable = self.lifeline.survivable | frozenset(ranks)

    def _describe_rank(self, rank):
        job, task = self.roles[rank]
        return f"rank {rank} (/job:{job}/task:{task} on {self.hosts[rank]})"

    def peer(self, rank, operation):
        """Return keyword arguments naming ``rank``'s real task for a PeerError."""
        job, task = self.roles[rank]
        return dict(rank=rank, job=job, task=task, host=self.hosts[rank], operation=operation)

    @property
    def is_chief(self):
        """Return True on the chief replica, which initialises, logs and checkpoints.

        It is the chief task if the cluster has one, else the lowest worker task; under ULFM,
        once that one died, the lowest surviving replica (``chief_index``).
        """
        return self.replica_index == self.chief_index

    @property
    def device(self):
        """Return this task's device name, e.g. ``/job:ps/replica:0/task:1/device:CPU:0``."""
        return device_name(self.job_name, self.task_index)

    @property
    def target(self):
        """Return a TF-style target string naming this task (for logs; MPI needs none)."""
        return f"mpi://{self.hosts[self.rank]}/job:{self.job_name}/task:{self.task_index}"

    def ranks_of(self, job):
        """Return the ranks running ``job``'s tasks, in task-index order."""
        pairs = sorted((t, r) for r, (j, t) in enumerate(self.roles) if j == job)
        return [r for _, r in pairs]

    def rank_of(self, job, task_index):
        """Return the rank that runs ``/job:job/task:task_index``."""
        for r, role in enumerate(self.roles):
            if role == (job, task_index):
                return r
        raise ValueError(f"no task /job:{job}/task:{task_index} in this cluster")

    def host_of(self, rank):
        """Return the host name rank ``rank`` runs on."""
        return self.hosts[rank]

    def describe(self, file=None):
        """Print the rank -> device -> host table on rank 0 (``log_device_placement``)."""
        text = describe_roles(self.roles, self.hosts)
        if self.rank == 0:
            print(text, file=file, flush=True)
        return text

    def join(self):
        """Serve as a parameter server until every replica is done; elsewhere, return.

        The ps learns the model's layout, optimizer and consistency mode from the chief,
        so a ps script needs nothing but this call, as in TensorFlow. On a task of any
        other job it returns at once: under MPI such a task has nothing to serve (in
        TensorFlow its gRPC server would block forever).
        """
        if self.job_name != "ps":
            return None
        # The one forward reach of this module: the service builds on server, not the reverse.
        from ..ps.service import serve

        self.exit_code = serve(self)
        return None


def _check_claims(claims, roles):
    """Raise, alike on every rank, if a rank's ``Server(job_name, task_index)`` is not its role."""
    for rank, ((job, task), (role_job, role_task)) in enumerate(zip(claims, roles)):
        if job not in (None, role_job) or task not in (None, role_task):
            # Every rank checks every claim: one message, exit code 2.
            raise CollectiveError(ConfigurationError(
                f"Server(job_name={job!r}, task_index={task!r}) on MPI rank {rank}, which runs "
                f"/job:{role_job}/task:{role_task}; roles come from the MPI rank (see "
                "mpitf.cluster.roles): start the processes in that order or leave job_name and "
                "task_index out"))
