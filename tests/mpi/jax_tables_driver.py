"""mpitf.jax tables under mpiexec: 1 ps + W workers train one table (each example's 3 rows,
summed) and a dense layer from a plain ``jax.grad`` loop; each worker also trains the same
model in plain jax with the whole table on the W batches' mean gradient, updating the
rows a step looks up by the ps's rule (written here in numpy), and prints how far the two
are apart (``maxrel``: the dense parameters and every row, read back from the ps).
``--bad id`` looks up an id outside the table at step 3; ``--grows``: the table grows
(``num_embeddings=None``), its ids large int64 values (:func:`key`), its rows drawn on the
ps and read back before the first step."""

from ps_first import serve_if_ps

SERVER = serve_if_ps() if __name__ == "__main__" else None  # a ps serves, exits: no framework

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import mpitf.jax as mj
from mpitf import abort_on_error

ROWS, DIM, BATCH, PER = 40, 4, 8, 3
UNUSED = 5  # the last rows: no step looks them up
LR = {"sgd": 0.5, "adagrad": 0.2}


def key(ids, grows):
    """Return the ids the worker looks up: a growing table's are large int64 values."""
    return ids * 7919 + 10**12 if grows else ids


def say(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def loss_fn(params, rows, inverse, y):
    """Cross-entropy of a linear layer over each example's summed rows."""
    h = rows[inverse].sum(1)
    logits = h @ params["w"] + params["b"]
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(len(y)), y])


grad_fn = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))


def batch(step, worker=0, bad=None):
    rng = np.random.default_rng(100 + step + 1000 * worker)
    ids = np.minimum(rng.zipf(1.3, (BATCH, PER)) - 1, ROWS - 1 - UNUSED)
    if bad == "id":
        ids[1, 2] = ROWS + 3
    return ids, rng.integers(0, 3, BATCH)


class Reference:
    """The model in plain jax: the whole table's gradient, the ps's rule on its rows."""

    def __init__(self, name, params, table, workers):
        self.name, self.workers = name, workers
        self.params = {k: np.array(v) for k, v in params.items()}
        self.table = np.array(table, dtype=np.float32)
        self.accum = {k: np.full_like(v, 0.1) for k, v in self.params.items()}
        self.accum["table"] = np.full_like(self.table, 0.1)

    def update(self, p, g, accum):
        lr = np.float32(LR[self.name])
        if self.name == "sgd":
            p -= lr * g
        else:  # tf.train.AdagradOptimizer, as the ps
            accum += g * g
            p -= lr * g / np.sqrt(accum)

    def step(self, s):
        g, gt, seen = {k: 0.0 for k in self.params}, 0.0, []
        for w in range(self.workers):  # the mean gradient, as the ps applies it
            ids, y = batch(s, w)
            _, (gw, gtw) = grad_fn({k: jnp.asarray(v) for k, v in self.params.items()},
                                   jnp.asarray(self.table), jnp.asarray(ids), jnp.asarray(y))
            g = {k: g[k] + np.asarray(gw[k]) / self.workers for k in g}
            gt, seen = gt + np.asarray(gtw) / self.workers, seen + [ids]
        for k, p in self.params.items():
            self.update(p, g[k], self.accum[k])
        present = np.unique(np.concatenate(seen))  # the sparse rule: the rows looked up
        rows, accum = self.table[present], self.accum["table"][present]
        self.update(rows, np.asarray(gt)[present], accum)
        self.table[present], self.accum["table"][present] = rows, accum


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--optimizer", default="sgd", choices=sorted(LR))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--initial", action="store_true", help="the chief gives the table's rows")
    p.add_argument("--bad", default=None)
    p.add_argument("--grows", action="store_true", help="a table that grows")
    p.add_argument("--num-ps", type=int, default=1)  # read by serve_if_ps
    p.add_argument("--max-ids", type=int, default=BATCH * PER,
                   help="the table's max_ids (fewer than a step's: its buffers grow)")
    args = p.parse_args()
    with abort_on_error():
        server = SERVER
        workers = server.num_replicas
        rng = np.random.default_rng(0)
        params = {"w": jnp.asarray(rng.normal(0, 0.5, (DIM, 3)).astype(np.float32)),
                  "b": jnp.zeros(3)}
        initial = rng.normal(0, 0.3, (ROWS, DIM)).astype(np.float32) if args.initial else None
        table = mj.Table("user", None if args.grows else ROWS, DIM, initial=initial,
                         max_ids=args.max_ids)
        opt = mj.DistributedOptimizer(params, server, args.optimizer, LR[args.optimizer],
                                      tables=[table], deterministic=True,
                                      last_step=args.steps)
        everyone = key(np.arange(ROWS), args.grows)
        start = np.asarray(opt.table_rows("user", everyone))
        if initial is not None:
            assert np.array_equal(start, initial)
        ref = Reference(args.optimizer, opt.params, start, workers)
        k = server.replica_index
        params = opt.params
        while not opt.should_stop():
            s = opt.global_step
            ids, y = batch(s, k, args.bad if s == 3 else None)
            rows, inverse = opt.lookup("user", key(ids, args.grows))
            loss, (g, g_rows) = grad_fn(params, rows, inverse, jnp.asarray(y))
            params = opt.step(g, loss, table_grads={"user": g_rows})
            ref.step(s)
        rows = np.asarray(opt.table_rows("user", everyone))
        opt.close()
        pairs = [(np.asarray(params[k]), ref.params[k]) for k in ref.params]
        pairs.append((rows, ref.table))
        worst = max(float(np.linalg.norm(a - b) / np.linalg.norm(b)) for a, b in pairs)
        moved = float(np.abs(rows - start).max())
        untouched = int((rows == start).all(1).sum())
        say(f"worker {k}: step {opt.global_step} maxrel: {worst:.3g} moved: {moved:.3g} "
            f"untouched: {untouched}")


if __name__ == "__main__":
    main()
