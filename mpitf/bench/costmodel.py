"""An alpha-beta model of parameter-server training: fit the link, project step times.

Pure functions, no MPI. The link is what ``mpitf.bench.pushpull`` measures between one
worker and one ps: a round trip of ``B`` bytes each way takes ``alpha + beta * B``
seconds. The ps also spends ``gamma`` seconds per byte on each gradient it takes in
(accumulate and apply; the axpy figure of the same benchmark).

For ``N`` workers, ``P`` ps and a model of ``M`` bytes split evenly over the ps, each ps
link serialises the ``N`` pushes and replies of ``M/P`` bytes that make a step, so

* ``link(N, P) = alpha + (beta + gamma) * N * M / P`` (latency once: requests pipeline);
* sync: ``step = compute_N + link(N, P)``, where ``compute_N`` is the slowest of ``N``
  workers; ``N * batch`` examples per step;
* backup (``R`` of ``N``): ``step = compute_R + link(N, P)`` (the dropped pushes still cross
  the link), ``R * batch`` examples per step;
* async: no barrier; each worker runs ``compute + link(1, P)`` per step, but the ps link
  passes at most ``P / ((beta + gamma) * M)`` pushes a second, whoever sends them.

Compute times are a constant ``c`` plus an exponential straggler tail of mean ``s * c``
(``s = 0``: identical workers); the k-th fastest of ``N`` then takes
``c + s * c * (H_N - H_{N-k})`` on average, ``H`` the harmonic numbers.
"""

import math
from dataclasses import dataclass

MODES = ("sync", "backup", "async")


@dataclass(frozen=True)
class LinkFit:
    """A fitted link: ``time = alpha + beta * bytes`` for a round trip of ``bytes`` each way."""

    alpha: float  # seconds
    beta: float  # seconds per byte (each way)
    gamma: float = 0.0  # ps seconds per byte of gradient taken in (apply)
    points: int = 0
    max_rel_error: float = 0.0

    @property
    def bandwidth(self):
        """Return the round-trip bandwidth in bytes/s counting both directions (2 / beta)."""
        return 2.0 / self.beta if self.beta > 0 else math.inf

    def time(self, nbytes):
        """Return the modelled round-trip time of ``nbytes`` each way."""
        return self.alpha + self.beta * nbytes


def fit_alpha_beta(sizes, times, relative=True):
    """Fit ``time = alpha + beta * size`` by least squares; return a :class:`LinkFit`.

    Args:
        sizes: bytes per point.
        times: seconds per point.
        relative: weight each point by ``1/time`` so that small and large messages count
            alike (plain least squares lets the largest sizes decide alpha alone).
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
    det = sw * sxx - sx * sx
    beta = (sw * sxy - sx * sy) / det
    alpha = (sy - beta * sx) / sw
    if alpha < 0:  # latency cannot be negative: refit the slope through the origin
        alpha = 0.0
        beta = sxy / sxx
    beta = max(beta, 0.0)
    err = max(abs(alpha + beta * x - y) / y for x, y in zip(sizes, times) if y > 0)
    return LinkFit(alpha, beta, 0.0, len(sizes), err)


def with_apply_cost(fit, sizes, axpy_times):
    """Return ``fit`` with ``gamma`` (ps seconds per byte applied) fitted through the origin."""
    sxx = sum(float(s) ** 2 for s in sizes)
    sxy = sum(float(s) * float(t) for s, t in zip(sizes, axpy_times))
    gamma = sxy / sxx if sxx > 0 else 0.0
    return LinkFit(fit.alpha, fit.beta, max(gamma, 0.0), fit.points, fit.max_rel_error)


def harmonic(n):
    """Return the n-th harmonic number (0 for n <= 0)."""
    return sum(1.0 / i for i in range(1, int(n) + 1))


def kth_fastest(compute, straggle, n, k):
    """Return the mean time of the k-th fastest of ``n`` workers (see the module notes)."""
    if not 1 <= k <= n:
        raise ValueError(f"expecting 1 <= k <= n, got k={k}, n={n}")
    return compute * (1.0 + straggle * (harmonic(n) - harmonic(n - k)))


def link_time(fit, model_bytes, num_workers, num_ps):
    """Return the seconds one ps link needs for a step of ``num_workers`` pushes and replies."""
    per_ps = model_bytes / max(1, num_ps)
    return fit.alpha + (fit.beta + fit.gamma) * num_workers * per_ps


def compute_per_example(fit, model_bytes, batch, examples_per_sec, num_ps=1):
    """Return the compute seconds per example implied by a 1-worker run's throughput."""
    step = batch / examples_per_sec
    compute = step - link_time(fit, model_bytes, 1, num_ps)
    return max(compute, 0.05 * step) / batch  # never below 5 % of the step: noise guard


def project(fit, mode, num_workers, num_ps, model_bytes, batch, per_example, replicas=None,
            straggle=0.0):
    """Return the projected step time, examples/sec and efficiency of one configuration.

    Args:
        fit: the :class:`LinkFit`.
        mode: "sync", "backup" or "async".
        num_workers: workers in the cluster.
        num_ps: ps tasks in the cluster.
        model_bytes: bytes of the whole model (split evenly over the ps).
        batch: examples per worker step.
        per_example: compute seconds per example (:func:`compute_per_example`).
        replicas: backup mode: gradients per step (default ``num_workers - 1``, at least 1).
        straggle: mean of the exponential straggler tail, as a fraction of compute.
    Returns a dict: step_time, examples_per_sec, efficiency, link_time, compute_time,
    link_bound (True where the ps link, not compute, sets the pace).
    """
    if mode not in MODES:
        raise ValueError(f"expecting mode in {MODES}, got {mode!r}")
    n, p = int(num_workers), int(num_ps)
    if n < 1 or p < 1:
        raise ValueError("expecting at least one worker and one ps")
    c = per_example * batch
    link = link_time(fit, model_bytes, n, p)
    if mode == "async":
        mean_c = c * (1.0 + straggle)
        per_push = (fit.beta + fit.gamma) * model_bytes / p
        worker_rate = n / (mean_c + link_time(fit, model_bytes, 1, p))
        link_rate = 1.0 / per_push if per_push > 0 else math.inf
        rate = min(worker_rate, link_rate)
        eps = rate * batch
        step = n / rate  # seconds between one worker's pushes
        compute, bound = mean_c, link_rate < worker_rate
    else:
        r = n if mode == "sync" else (replicas or max(1, n - 1))
        compute = kth_fastest(c, straggle, n, r)
        step = compute + link
        eps = r * batch / step
        bound = link - fit.alpha > compute
    single = batch / (c * (1.0 + straggle) + link_time(fit, model_bytes, 1, p))
    return dict(step_time=step, examples_per_sec=eps, efficiency=eps / (n * single),
                link_time=link, compute_time=compute, link_bound=bool(bound))


def saturation_workers(fit, model_bytes, num_ps, compute):
    """Return the worker count at which one ps link takes as long as a step's compute."""
    per_worker = (fit.beta + fit.gamma) * model_bytes / max(1, num_ps)
    return math.inf if per_worker <= 0 else compute / per_worker


def ps_needed(fit, model_bytes, num_workers, compute):
    """Return the fewest ps for which the ps link time stays below the compute time."""
    if compute <= fit.alpha:
        return math.inf  # latency alone exceeds compute: no number of ps helps
    need = (fit.beta + fit.gamma) * num_workers * model_bytes / (compute - fit.alpha)
    return max(1, math.floor(need) + 1)


def error_percent(measured, projected):
    """Return (projected - measured) / measured in percent."""
    return 100.0 * (projected - measured) / measured if measured else math.nan


def projection_table(fit, per_example, batch, model_sizes, workers=(1, 8, 64, 512, 4096),
                     ps=(1, 16, 64)):
    """Return projection rows for larger clusters: mode, model, N, P, ex/s, efficiency."""
    rows = []
    for name, mbytes in model_sizes.items():
        for n in workers:
            for p in ps:
                for mode in MODES:
                    if mode == "backup" and n == 1:
                        continue
                    pr = project(fit, mode, n, p, mbytes, batch, per_example)
                    rows.append(dict(model=name, model_bytes=mbytes, mode=mode, workers=n,
                                     ps=p, **pr))
    return rows
