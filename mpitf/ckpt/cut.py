"""The consistent cut: how the chief, the other workers and every ps take and restore one.

Saving, in order:

- chief: :func:`request` sends SAVE to every ps, which then flags its replies; a worker
  that gets a flagged reply finishes its step and tells every ps it paused;
- each ps, once every worker has paused or finished: :func:`save_shard` writes its shard
  and reports it to the chief;
- chief: :func:`collect` the reports, :func:`commit` (check every shard, write the
  manifest, move ``latest``, prune), :func:`release` the paused workers, who
  :func:`wait_for_release`; the message says whether to stop (after a signal).

Restoring: :func:`agree_on_restore` (the chief chooses, every worker learns the choice;
:func:`check_optimizer_state`, from ``slots``, refuses slots that do not fit the job),
:func:`data_position` (each worker's place in its data) and :func:`restore_shard` (each
ps, through host memory onto its device).

Callers pass in what this needs (a communicator, ranks, the client's ``send_control``,
``host_of``/``peer`` to name a silent rank, the shard's buffers); ``docs/design.md`` says
why the cut is consistent.
"""

import logging

from mpi4py import MPI

from ..errors import PeerError
from ..runtime import ulfm
from ..wire import protocol as P
from .buffers import FILE as BUFFERS
from .buffers import write_buffers
from .deltas import load_chain_tables
from .files import writing
from .lock import acquire
from .names import MANIFEST, checkpoint_name, read_manifest, shard_name
from .restore import load_shard
from .slots import check_optimizer_state  # noqa: F401 - the restore check, for the session
from .verify import find_restorable
from .write import prepare_save, set_aside_newer, write_manifest, write_shard

_log = logging.getLogger("mpitf")


# ------------------------------------------------------------------------ saving


def _lost_in_cut(exc, whose, peer, step=None):
    """Return the error for ``exc``, a rank dead in the middle of a cut (ULFM); else re-raise.

    Not survived: the paused replicas wait for the chief's release, its successor cannot
    tell which ps tasks reported to the dead one, and a dead ps's piece of the cut is
    missing (a loss between cuts is survived: :mod:`mpitf.ps.losses`).
    """
    if not ulfm.is_failure(exc):
        raise exc
    at = "" if step is None else f" at step {step}"
    return PeerError(f"died during the checkpoint cut{at}; {whose} loss is survived between "
                     f"cuts, not in one: resume from the latest checkpoint", **peer)


def request(root, step, send_control, delta=False):
    """Chief: ask every ps for a cut expected at ``step``; False if it is already saved.

    ``delta``: the ps tasks write only the table rows changed since the last checkpoint
    (``FLAG_DELTA``; :mod:`~mpitf.ckpt.deltas`). Checkpoints newer than the restored one
    were set aside at the start, so the only checkpoint that can stand at ``step`` is the
    restored one itself (a run resumed at its last step): then nothing is sent. A leftover
    directory is cleared first.
    """
    with writing(f"{root}/{checkpoint_name(step)}", "checkpoint directory"):
        if not prepare_save(root, step):
            return False
    send_control(P.SAVE, P.FLAG_DELTA if delta else 0)
    return True


def save_shard(comm, chief, root, ps_task, num_ps, global_step, slices, backend, params,
               slots, average, positions, paused, counters, tables=None, peer=None):
    """A quiescent ps: write its shard (from host copies of its buffers), report to the chief.

    ``positions`` maps each worker to the (epoch, cursor) it sent with its last applied
    push; ``paused`` are the workers waiting for the chief's release; ``tables`` the ps's
    rows of the embedding tables (host arrays); ``peer(rank, operation)`` names the chief
    if it died.
    """
    ckpt_dir = f"{root}/{checkpoint_name(global_step)}"
    with writing(f"{ckpt_dir}/{shard_name(ps_task, num_ps)}", "checkpoint shard"):
        entry = write_shard(ckpt_dir, ps_task, num_ps, global_step, slices,
                            backend.to_host(params),
                            {k: backend.to_host(v) for k, v in slots.items()},
                            None if average is None else backend.to_host(average), tables)
    report = dict(entry=entry, ps_task=ps_task, global_step=global_step,
                  positions={w: {"epoch": int(e), "cursor": int(c)}
                             for w, (e, c) in positions.items()},
                  paused=sorted(paused), counters=counters)
    try:
        comm.send(report, dest=chief, tag=P.TAG_CONTROL)
    except MPI.Exception as exc:
        raise _lost_in_cut(exc, "the chief's", peer(chief, "checkpoint"), global_step) from exc


def collect(comm, ps_ranks, deadline, host_of):
    """Chief, paused: return every ps's report of its shard, in ps task order.

    A ps that died in the cut (ULFM) ends the job, named: its buddy serves its shard from
    the next step, but the cut it was to write is not whole.
    """
    reports = []
    for p, rank in enumerate(ps_ranks):
        def peer(p=p, rank=rank):
            return dict(rank=rank, job="ps", task=p, host=host_of(rank),
                        operation="checkpoint write")
        try:
            reports.append(P.recv_object(comm, rank, P.TAG_CONTROL, deadline, peer))
        except MPI.Exception as exc:
            raise _lost_in_cut(exc, "a ps's", peer()) from exc
    return reports


def commit(root, reports, variables, layout, max_to_keep, buffers=None, delta=None):
    """Chief: check the shards, write the manifest, move ``latest``, prune; return the step.

    ``variables`` is ``[(name, shape, dtype)]``; ``layout`` is as
    :func:`~mpitf.ckpt.write.write_manifest` takes it. The data positions are the ones the
    ps tasks recorded with the pushes they applied. ``buffers`` (name -> array, the chief's
    untrained state) are written beside the shards, before the manifest. ``delta``: the
    manifest's entry of a delta checkpoint (:func:`~mpitf.ckpt.deltas.delta_entry`).
    """
    steps = {r["global_step"] for r in reports}
    if len(steps) > 1:
        _log.warning("ps tasks cut the checkpoint at different steps %s", sorted(steps))
    step = reports[0]["global_step"]
    entry = None
    if buffers:
        with writing(f"{root}/{checkpoint_name(step)}/{BUFFERS}", "checkpoint buffers"):
            entry = write_buffers(f"{root}/{checkpoint_name(step)}", buffers)
    with writing(f"{root}/{checkpoint_name(step)}/{MANIFEST}", "checkpoint manifest"):
        path = write_manifest(root, step, [r["entry"] for r in reports], variables, layout,
                              reports[0]["positions"], max_to_keep=max_to_keep,
                              buffers=entry, delta=delta)
    kind = f" (delta on {delta['base']})" if delta else ""
    print(f"checkpoint {path} at step {step}{kind}", flush=True)
    return step


def release(comm, reports, worker_ranks, chief, message):
    """Chief: send ``message`` (``{"stop", "step"}``) to every other paused worker."""
    waiting = {w for r in reports for w in r["paused"]}
    for w in sorted(waiting):
        rank = worker_ranks[w]
        if rank != chief:
            comm.send(message, dest=rank, tag=P.TAG_CONTROL)


def wait_for_release(comm, chief, deadline, peer, step):
    """A paused worker other than the chief: return the chief's message once it is saved.

    ``peer(rank, operation)`` names a rank's task for the error if the chief is silent or
    died; ``step``: the step of the cut.
    """
    try:
        return P.recv_object(comm, chief, P.TAG_CONTROL, deadline,
                             lambda: peer(chief, "checkpoint"))
    except MPI.Exception as exc:
        raise _lost_in_cut(exc, "the chief's", peer(chief, "checkpoint"), step) from exc


# --------------------------------------------------------------------- restoring


def agree_on_restore(comm, root, members=None, log=print):
    """Return the checkpoint every worker restores from, or None to start from scratch.

    The chief (rank 0 of ``comm``) passes the checkpoint ``root``, holds its lock (see
    :mod:`~mpitf.ckpt.lock`; a live owner elsewhere is an error) and chooses the newest
    checkpoint that verifies, setting newer ones aside so their steps can be saved again;
    the others pass None and learn its choice, so every data position comes from the same
    checkpoint. In-graph, ``members`` are the worker tasks that run sessions: only they
    are asked.
    """
    restore = None
    if root:
        acquire(root, log=log)  # the job's own lock (taken at start-up by the jobs), or now
        found = find_restorable(root, log=log)
        if found:
            restore = found[0]
            set_aside_newer(root, int(found[1]["global_step"]), log=log)
    group = comm
    if members is not None:
        group = comm.Create_group(comm.Get_group().Incl(sorted(members)))
    restore = group.bcast(restore, root=0)
    if group is not comm:
        group.Free()
    return restore


def data_position(ckpt_dir, task):
    """Return worker ``task``'s data position ``{"epoch", "cursor"}`` saved in ``ckpt_dir``.

    A worker the checkpoint has no position for (it was written with fewer workers)
    starts the saved epoch from its beginning.
    """
    workers = read_manifest(ckpt_dir).get("workers", {})
    state = workers.get(str(task))
    if state is None:
        first = next(iter(workers.values()), {"epoch": 0})
        state = {"epoch": first["epoch"], "cursor": 0}
        _log.info("no saved data position for worker %d (the checkpoint had %d workers); "
                  "starting epoch %d from its beginning", task, len(workers), state["epoch"])
    return state


def restore_shard(ckpt_dir, slices, backend, params, slots, average=None, tables=None):
    """A ps: fill its buffers from ``ckpt_dir`` (any placement), through host memory.

    ``slots`` maps slot name to buffer (scratch excluded); ``average`` is the moving
    average's buffer or None; ``tables`` the ps's embedding tables to fill (see
    :func:`~mpitf.ckpt.tables.load_tables`). Returns ``{"global_step", "positions", "missing_slots",
    "missing_average"}``; ``positions`` maps each worker to its saved (epoch, cursor).
    """
    manifest = read_manifest(ckpt_dir)
    gpu = backend.is_gpu
    host = (lambda buf: backend.to_host(buf).copy()) if gpu else (lambda buf: buf)
    host_params = host(params)
    host_slots = {k: host(v) for k, v in slots.items()}
    host_average = None if average is None else host(average)
    loaded = load_shard(ckpt_dir, manifest, slices, host_params, host_slots, host_average)
    if tables:
        load_chain_tables(ckpt_dir, manifest, tables)
    if gpu:
        backend.to_device(host_params, out=params)
        for k, v in host_slots.items():
            backend.to_device(v, out=slots[k])
        if average is not None:
            backend.to_device(host_average, out=average)
    positions = {int(k): (v["epoch"], v["cursor"])
                 for k, v in manifest.get("workers", {}).items()}
    return dict(loaded, global_step=int(manifest["global_step"]), positions=positions)
