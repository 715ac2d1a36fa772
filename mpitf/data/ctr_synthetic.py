"""Synthetic click-through data from a planted model: fixed tables, or raw ids that drift.

Both draw power-law ids per field and labels from the sigmoid of a planted linear model
over per-id vectors, and return that model's test AUC: the ceiling a learner can reach.
With ``raw_ids`` the vocabulary grows over the file: new ids keep appearing and old ones
fade, so tables that grow (and evict) have something to do, and each raw id's planted
vector is a hash of the id, defined for every id that ever appears.
"""

import numpy as np

from ..config import check_int
from ..errors import ConfigurationError
from .ctr import DYNAMIC, auc, write_ctr

__all__ = ["drifting_ids", "planted_vectors", "synthetic_ctr"]

_M1, _M2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), \
    np.uint64(0x9E3779B97F4A7C15)


def _mix(x):
    """Return splitmix64 of the uint64 array ``x`` (a bijection that scatters the bits)."""
    with np.errstate(over="ignore"):
        x = np.asarray(x, np.uint64) + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def _salt(*numbers):
    out = np.uint64(0)
    for n in numbers:
        out = _mix(np.uint64(out ^ np.uint64(n & 0xFFFFFFFFFFFFFFFF)))
    return out


def drifting_ids(times, fields, rows, growth, zipf, rng, seed):
    """Return raw int64 ids (len(times), fields) of a vocabulary that grows over time.

    At time t field f has ``rows + floor(t * growth)`` ids born; an example takes the id
    of age r (0: the newest) with r ~ Zipf(``zipf``) mod ``rows``, so each id is popular
    when new and fades, and about ``1 / growth`` examples carry it. Ids are a hash of
    (seed, field, birth), in [0, 2**63).
    """
    born = rows + np.floor(np.asarray(times) * growth).astype(np.int64)
    age = (rng.zipf(zipf, (len(born), fields)) - 1) % rows
    birth = born[:, None] - 1 - age
    salts = np.array([_salt(seed, 1, f) for f in range(fields)], np.uint64)
    return (_mix(birth.astype(np.uint64) ^ salts) >> np.uint64(1)).astype(np.int64)


def planted_vectors(ids, field, dim, seed):
    """Return the planted vectors (len(ids), dim) of field ``field``'s raw ids: a hash each.

    Uniform in [-sqrt(3), sqrt(3)] (unit variance) from splitmix64 of the id, per dimension.
    """
    ids = np.asarray(ids).astype(np.uint64)
    out = np.empty((len(ids), dim))
    for d in range(dim):
        h = _mix(ids ^ _salt(seed, 2, field, d)) >> np.uint64(11)
        out[:, d] = (h.astype(np.float64) * 2.0 ** -53 * 2 - 1) * np.sqrt(3.0)
    return out


def synthetic_ctr(out, train=200000, test=5000, fields=8, rows=1000, dense=4, dim=4,
                  zipf=1.2, seed=0, raw_ids=False, growth=0.02, compression=None):
    """Write power-law CTR data from a planted model; return the planted model's test AUC.

    Field f's ids are Zipf(``zipf``) over ``rows`` rows; each id has a planted vector of
    ``dim`` values and the logit is a planted MLP-free model: the sum over fields of
    ``<e_f[id], u>`` plus ``<dense, v>``; labels are drawn from its sigmoid, so its AUC on
    the test split is the ceiling a learner can reach. The default 200 000 training
    examples give the rare rows of the power law enough examples to learn: with 20 000
    (25 per row of 1000 on average, most of them on the few popular ids) a learner
    overfits the rare ids and falls well short of the ceiling (benchmarks/README.md).

    With ``raw_ids`` the ids are raw int64 of a vocabulary that grows by ``growth`` new ids
    per example per field, ``rows`` of them live at a time (:func:`drifting_ids`), each
    planted vector a hash of its id (:func:`planted_vectors`); the training split is in
    time order and the test split's examples are drawn at times spread over it, so its ids
    were live during training. The file's ``ids`` attribute is then ``"raw"``, and its
    attributes ``planted_seed``, ``planted_u`` and ``planted_v`` give the planted model:
    logit = sum_f <planted_vectors(id_f, f, dim, seed), u> / sqrt(F) + <dense, v> - 1.
    """
    for name, value in (("train", train), ("test", test), ("fields", fields), ("rows", rows)):
        check_int(name, value, 1)
    check_int("dense", dense, 0)
    rng = np.random.default_rng(seed)
    if raw_ids:
        if not growth > 0:
            raise ConfigurationError(f"growth (new ids per example) must be > 0, got {growth}")
        return _raw(out, rng, train, test, fields, rows, dense, dim, zipf, seed, growth,
                    compression)
    table_rows = [int(rows)] * fields
    planted = [rng.normal(0, 1.0, (rows, dim)) for _ in range(fields)]
    u, v = rng.normal(0, 1.0, dim), rng.normal(0, 0.5, dense)
    splits = {}
    for split, n in (("train", train), ("test", test)):
        ids = (rng.zipf(zipf, (n, fields)) - 1) % rows
        x = rng.normal(0, 1.0, (n, dense)).astype(np.float32)
        logit = sum(planted[f][ids[:, f]] @ u for f in range(fields)) / np.sqrt(fields) \
            + x @ v - 1.0
        y = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int64)
        splits[split] = (ids, x, y)
        if split == "test":
            ceiling = auc(y, logit)
    write_ctr(out, table_rows, splits, compression)
    return ceiling


def _raw(out, rng, train, test, fields, rows, dense, dim, zipf, seed, growth, compression):
    """Write the raw-id variant of :func:`synthetic_ctr`; return its ceiling."""
    u, v = rng.normal(0, 1.0, dim), rng.normal(0, 0.5, dense)
    splits = {}
    times = {"train": np.arange(train), "test": np.sort(rng.integers(0, train, test))}
    for split, t in times.items():
        ids = drifting_ids(t, fields, rows, growth, zipf, rng, seed)
        x = rng.normal(0, 1.0, (len(t), dense)).astype(np.float32)
        logit = sum(planted_vectors(ids[:, f], f, dim, seed) @ u for f in range(fields)) \
            / np.sqrt(fields) + x @ v - 1.0
        y = (rng.random(len(t)) < 1 / (1 + np.exp(-logit))).astype(np.int64)
        splits[split] = (ids, x, y)
        if split == "test":
            ceiling = auc(y, logit)
    attrs = {"live_ids": int(rows), "new_ids_per_example": float(growth), "planted_seed": seed,
             "planted_u": u, "planted_v": v}  # the planted model, for tests to rebuild
    write_ctr(out, DYNAMIC, splits, compression, attrs)
    return ceiling
