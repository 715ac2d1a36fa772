"""The cost model of parameter-server training: step time, examples/s and efficiency.

Pure functions, no MPI. Every input is a measurement (see docs/costmodel.md for the
equations and which suite or flag measures each term):

* :class:`Fabric`: one-way latency ``L`` and bandwidth ``W`` of one link, per direction
  (``mpitf bench --suite fabric``, a ping-pong between two nodes);
* :class:`Workload`: model bytes ``B``, compute ``C`` per step (forward + backward),
  per-step framework overhead ``O``, batch (a job's ``--profile-steps`` writes these);
* :class:`PsNode`: the ps apply throughput per thread ``A`` and its threads ``T`` (the
  kernels suite), the software cost ``o`` of one message on the ps, and the node's
  shared-memory bandwidth (node-local aggregation);
* :class:`Layout`: N = nodes x G workers, P ps (each on its own link, or ``beside`` the
  workers on their nodes), bucket bytes K, node-local aggregation, mode (sync, backup,
  async, ssp).

:func:`allreduce_step` projects the peer: the same workers summing the same bytes with a
bucketed all-reduce.
"""

import math
from dataclasses import dataclass, field

MODES = ("sync", "backup", "async", "ssp")
BACKWARD_SHARE = 2.0 / 3.0  # of compute: backward, during which bucketed pushes leave


@dataclass(frozen=True)
class Fabric:
    """One link: ``latency`` seconds one way, ``bandwidth`` bytes/s per direction."""

    latency: float
    bandwidth: float
    source: str = ""


@dataclass(frozen=True)
class Workload:
    """The model: ``model_bytes``, ``compute`` seconds per step, ``overhead`` s per step."""

    model_bytes: float
    compute: float
    batch: int = 1
    overhead: float = 0.0
    straggle: float = 0.0  # mean exponential straggler tail, as a fraction of compute


@dataclass(frozen=True)
class PsNode:
    """A ps: apply bytes/s per thread, threads, seconds per message, node shm bytes/s."""

    apply_rate: float = 2e9
    threads: int = 1
    msg_overhead: float = 10e-6
    shm_bandwidth: float = 1e10


@dataclass(frozen=True)
class Layout:
    """Where things run: nodes, workers per node, ps, buckets, aggregation, mode."""

    nodes: int
    workers_per_node: int = 1
    num_ps: int = 1
    bucket_bytes: int = 0
    aggregate: bool = False
    mode: str = "sync"
    replicas: int = None  # backup: gradients per step (default N - 1)
    beside: bool = False  # the ps run on the workers' nodes, one per node (P <= nodes)

    @property
    def workers(self):
        """Return N, the workers in the cluster."""
        return self.nodes * self.workers_per_node


@dataclass
class Projection:
    """The model's answer for one layout: times in seconds, the terms and the bound."""

    step_time: float
    examples_per_sec: float
    efficiency: float
    bound: str
    terms: dict = field(default_factory=dict)


def harmonic(n):
    """Return the n-th harmonic number (0 for n <= 0)."""
    return sum(1.0 / i for i in range(1, int(n) + 1))


def kth_fastest(compute, straggle, n, k):
    """Return the mean time of the k-th fastest of ``n`` workers (exponential tail)."""
    if not 1 <= k <= n:
        raise ValueError(f"expecting 1 <= k <= n, got k={k}, n={n}")
    return compute * (1.0 + straggle * (harmonic(n) - harmonic(n - k)))


def buckets_per_ps(model_bytes, num_ps, bucket_bytes):
    """Return how many buckets each ps's share travels in (1 without buckets)."""
    share = model_bytes / num_ps
    return 1 if bucket_bytes <= 0 else max(1, math.ceil(share / bucket_bytes))


def senders(layout):
    """Return S, the pushes each ps takes per step: N, or one per node with aggregation."""
    agg = layout.aggregate and layout.workers_per_node > 1 and layout.mode in ("sync",
                                                                                "backup")
    return layout.nodes if agg else layout.workers


def comm_terms(fabric, work, ps, layout, pushes):
    """Return the communication terms of one step with ``pushes`` pushes per ps (seconds).

    ``in``/``out``: the busier of a worker's link (B) and a ps's link (pushes x B/P), plus
    the ps's message handling; ``apply``: summing the pushes and applying, on the ps's
    threads; ``latency``: one way and back; ``aggregate``: the node-local sum and share.
    """
    p = layout.num_ps
    share = work.model_bytes / p
    nb = buckets_per_ps(work.model_bytes, p, layout.bucket_bytes)
    worker_link = work.model_bytes / fabric.bandwidth
    ps_link = pushes * share / fabric.bandwidth
    if layout.beside:  # a node's link carries its worker's and its ps's remote traffic
        ps_link = ((p - 1) * share + (pushes - 1) * share) / fabric.bandwidth
        worker_link = max(ps_link, worker_link if p < layout.nodes else 0.0)
    messages = pushes * nb * ps.msg_overhead
    passes = pushes + 1 if pushes > 1 else 1  # a lone push is applied where it lands
    apply = passes * share / (ps.apply_rate * ps.threads)
    agg = 0.0
    if pushes < layout.workers and layout.mode in ("sync", "backup"):
        agg = 2.0 * work.model_bytes / ps.shm_bandwidth
    # the worker's link the busier: a round of buckets goes to the P ps in turn, so the
    # first answer waits for one ps's bucket, not the round, and so does the last
    parts = p if worker_link > ps_link else 1
    return dict(worker_link=worker_link, ps_link=ps_link, messages=messages, apply=apply,
                latency=2.0 * fabric.latency, aggregate=agg, buckets=nb, round_parts=parts)


def pipelined(terms):
    """Return the ps's in-apply-out time with its buckets pipelined (see the docs)."""
    nb, parts = terms["buckets"], terms["round_parts"]
    stage_in = max(terms["worker_link"], terms["ps_link"]) + terms["messages"]
    stages = (stage_in, terms["apply"], stage_in)
    return max(stages) + (sum(stages) - max(stages)) / (nb * parts)


def project(fabric, work, ps, layout):
    """Return the :class:`Projection` of one layout (see docs/costmodel.md)."""
    if layout.mode not in MODES:
        raise ValueError(f"expecting mode in {MODES}, got {layout.mode!r}")
    n = layout.workers
    if n < 1 or layout.num_ps < 1:
        raise ValueError("expecting at least one worker and one ps")
    c, b = work.compute, work.batch
    ideal = n * b / (c * (1.0 + work.straggle) + work.overhead)  # compute only, no comm
    if layout.mode in ("async", "ssp"):
        t = comm_terms(fabric, work, ps, layout, 1)
        own = pipelined(t) + t["latency"]
        hidden = BACKWARD_SHARE * c * (1 - 1 / t["buckets"])
        cycle = c * (1.0 + work.straggle) + work.overhead + max(own - hidden,
                                                                own / t["buckets"])
        per_push = max(t["ps_link"] + t["messages"], t["apply"] / 2)  # on each ps
        cap = 1.0 / per_push if per_push > 0 else math.inf
        rate = min(n / cycle, cap)
        eps = rate * b
        bound = "ps (async pushes)" if cap < n / cycle else _bound(t, cycle, c, cycle - c)
        return Projection(n / rate, eps, min(1.0, eps / ideal), bound, dict(t, step=n / rate))
    t = comm_terms(fabric, work, ps, layout, senders(layout))
    pipe = pipelined(t)
    hidden = BACKWARD_SHARE * c * (1 - 1 / t["buckets"])
    exposed = max(pipe - hidden, pipe / t["buckets"]) + t["latency"] + t["aggregate"]
    comm = pipe + t["latency"] + t["aggregate"]
    r = n if layout.mode == "sync" else (layout.replicas or max(1, n - 1))
    compute = kth_fastest(c, work.straggle, n, r)
    step = compute + work.overhead + exposed
    eps = r * b / step
    terms = dict(t, comm=comm, exposed=exposed, compute=compute, overhead=work.overhead)
    return Projection(step, eps, min(1.0, eps / ideal), _bound(t, step, compute, exposed),
                      terms)


def allreduce_step(fabric, work, workers, bucket_bytes=0):
    """Return the step of ``workers`` summing the model with a bucketed all-reduce (s).

    Each worker's link carries 2B(N - 1)/N each way (reduce-scatter, then all-gather:
    the ring's and Rabenseifner's bytes), in 2(N - 1) rounds of a latency each; buckets
    leave as backward finishes them, so all but the last bucket's share may hide
    behind backward, as the ps design's buckets do (:func:`project`).
    """
    n = workers
    if n <= 1:
        return work.compute + work.overhead
    nb = 1 if bucket_bytes <= 0 else max(1, math.ceil(work.model_bytes / bucket_bytes))
    comm = 2.0 * work.model_bytes * (n - 1) / n / fabric.bandwidth + \
        2.0 * (n - 1) * fabric.latency
    hidden = BACKWARD_SHARE * work.compute * (1 - 1 / nb)
    return work.compute + work.overhead + max(comm - hidden, comm / nb)


def _bound(terms, step, compute, exposed):
    """Name what sets the step's pace: compute, or the largest share of the exposed time.

    The node-local sum and the latency are exposed whole; the rest of the exposed time is
    the ps pipeline's, named after its slowest stage's largest part.
    """
    if exposed <= 0.1 * step:
        return "compute"
    parts = {"worker link": terms["worker_link"], "ps link": terms["ps_link"],
             "ps message handling": terms["messages"], "ps apply": terms["apply"]}
    slowest = max(parts, key=parts.get)
    shares = {"node-local aggregation": terms["aggregate"], "latency": terms["latency"],
              slowest: exposed - terms["aggregate"] - terms["latency"]}
    return max(shares, key=shares.get)


def ps_for_links(fabric, work, layout):
    """Return the fewest ps whose links carry S x B per direction within the compute time.

    None when even one ps per sender cannot (each worker's own link then bounds the step).
    """
    pushes = senders(layout)
    if work.model_bytes / fabric.bandwidth >= work.compute:
        return None
    return max(1, math.ceil(pushes * work.model_bytes / (fabric.bandwidth * work.compute)))


# -- fitting measurements ---------------------------------------------------------------

def fit_alpha_beta(sizes, times, relative=True, nonnegative=True):
    """Fit ``time = alpha + beta * size`` by least squares; return ``(alpha, beta, max_err)``.

    ``relative`` weights each point by ``1/time`` so that small and large messages count
    alike (plain least squares lets the largest sizes decide alpha alone). ``nonnegative``
    refits a negative ``alpha`` through the origin (a latency cannot be negative).
    """
    sizes = [float(s) for s in sizes]
    times = [float(t) for t in times]
    if len(sizes) != len(times) or len(sizes) < 2:
        raise ValueError("expecting at least two (size, time) points of equal count")
    if len(set(sizes)) < 2:
        raise ValueError("expecting at least two distinct sizes")
    w = [1.0 / (t * t) if relative and t > 0 else 1.0 for t in times]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, sizes))
    sy = sum(wi * y for wi, y in zip(w, times))
    sxx = sum(wi * x * x for wi, x in zip(w, sizes))
    sxy = sum(wi * x * y for wi, x, y in zip(w, sizes, times))
    beta = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    alpha = (sy - beta * sx) / sw
    if alpha < 0 and nonnegative:
        alpha, beta = 0.0, sxy / sxx
    beta = max(beta, 0.0)
    err = max(abs(alpha + beta * x - y) / y for x, y in zip(sizes, times) if y > 0)
    return alpha, beta, err


def error_percent(measured, projected):
    """Return (projected - measured) / measured in percent."""
    return 100.0 * (projected - measured) / measured if measured else math.nan
