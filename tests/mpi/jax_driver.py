"""mpitf.jax under mpiexec: 1 ps + W workers train a small MLP from a plain ``jax.grad``
loop; each worker also trains it in one process with the ps's update rule (written here
in numpy) on the W batches' mean gradient and prints how far the two are apart
(``maxrel: X``). ``--break`` hands step() a bad gradient pytree at step 2. ``--local K``:
local SGD (each worker steps its own copy with the rule, the ps averages the copies every
K steps); the reference then keeps one copy per worker, and the chief prints the ps's
push counts (``pushes: N applied: M``). ``--clip X``: the session's clip_norm,
optax.clip_by_global_norm(X) of the mean gradient (the reference clips its mean as the
ps does: scale X / (norm + 1e-6) when below 1)."""

from ps_first import serve_if_ps

SERVER = serve_if_ps() if __name__ == "__main__" else None  # a ps serves, exits: no framework

import argparse
import hashlib
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from mpitf import abort_on_error
from mpitf.jax import DistributedOptimizer

LR = {"adamw": 0.01, "momentum": 0.05}
OPTIONS = {"adamw": dict(weight_decay=0.1), "momentum": dict(momentum=0.9)}
DECAY = 30  # cosine decay steps after 5 warmup steps (the ps runs the schedule)


def say(line):
    """Print ``line`` in one write: ranks share mpiexec's stdout, and print() writes the
    text and its newline apart, so another rank's line could land between them."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def init():
    rng = np.random.default_rng(0)  # numpy's: jax.random would compile, seconds per rank
    normal = [jnp.asarray(rng.normal(0, 0.3, s).astype(np.float32)) for s in ((8, 16), (16, 3))]
    return {"layers": [{"w": normal[0], "b": jnp.zeros(16)}, {"w": normal[1], "b": jnp.zeros(3)}]}


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["layers"][0]["w"] + params["layers"][0]["b"])
    logits = h @ params["layers"][1]["w"] + params["layers"][1]["b"]
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(len(y)), y])


grad_fn = jax.jit(jax.value_and_grad(loss_fn))


def batches(step, workers):
    rng = np.random.default_rng(1000 + step)
    return (rng.normal(size=(workers, 10, 8)).astype(np.float32),
            rng.integers(0, 3, size=(workers, 10)))


def schedule(step, base):
    if step < 5:
        return base * (step + 1) / 5
    p = min(step - 5, DECAY) / DECAY
    return base * 0.5 * (1.0 + math.cos(math.pi * p))


class Reference:
    """The ps's rule in numpy float32, on the mean gradient of every worker's batch.

    ``local`` K: local SGD instead, each worker's copy (and slots) stepped on its own
    batch, the copies' mean put in every copy after each K-th step. ``clip``: the mean's
    global norm clipped to it (sync).
    """

    def __init__(self, name, workers, masked=False, local=0, clip=None):
        self.name, self.workers, self.local = name, workers, local
        self.clip, self.clipped = clip, 0
        names = [jax.tree_util.keystr(p) for p, _ in
                 jax.tree_util.tree_flatten_with_path(init())[0]]
        # --masked: weight decay on the matrices only; the last layer's matrix at half rate
        self.decay = [0.1 if not masked or "'w'" in n else 0.0 for n in names]
        self.scale = [0.5 if masked and n == "['layers'][1]['w']" else 1.0 for n in names]
        copies = workers if local else 1
        self.copies = [[np.array(p) for p in jax.tree_util.tree_leaves(init())]
                       for _ in range(copies)]
        self.params = self.copies[0]  # what a worker ends with (every copy, once averaged)
        self.slots = [[[np.zeros_like(p), np.zeros_like(p)] for p in self.params]
                      for _ in range(copies)]

    def _grad(self, params, x, y):
        tree = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(init()),
                                            [jnp.asarray(p) for p in params])
        _, g = grad_fn(tree, x, y)
        return [np.array(leaf) for leaf in jax.tree_util.tree_leaves(g)]

    def step(self, s):
        x, y = batches(s, self.workers)
        if self.local:  # each copy on its own batch; the mean every K steps
            for w in range(self.workers):
                self._apply(s, self.copies[w], self._grad(self.copies[w], x[w], y[w]),
                            self.slots[w])
            if (s + 1) % self.local == 0:
                for leaves in zip(*self.copies):
                    mean = sum(leaves[1:], leaves[0].copy()) / np.float32(self.workers)
                    for leaf in leaves:
                        leaf[...] = mean
            return
        grads = [np.zeros_like(p) for p in self.params]
        for w in range(self.workers):
            for acc, leaf in zip(grads, self._grad(self.params, x[w], y[w])):
                acc += leaf
        for g in grads:
            g *= np.float32(1.0 / self.workers)
        if self.clip is not None:  # the mean's global norm
            norm = math.sqrt(sum(float(np.vdot(g, g)) for g in grads))
            if self.clip / (norm + 1e-6) < 1.0:
                self.clipped += 1
                for g in grads:
                    g *= self.clip / (norm + 1e-6)
        self._apply(s, self.params, grads, self.slots[0])

    def _apply(self, s, params, grads, slots):
        for p, g, (a, b), wd, f in zip(params, grads, slots, self.decay, self.scale):
            lr = schedule(s, LR[self.name] * f)
            if self.name == "momentum":  # tf.train.MomentumOptimizer
                a *= 0.9
                a += g
                p -= a * lr
            else:  # torch.optim.AdamW's order of operations
                t = s + 1
                p *= 1.0 - lr * wd
                a += (g - a) * (1.0 - 0.9)
                b *= 0.999
                b += g * g * (1.0 - 0.999)
                denom = np.sqrt(b) / math.sqrt(1.0 - 0.999**t) + 1e-8
                p += -(lr / (1.0 - 0.9**t)) * a / denom


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--optimizer", default="adamw", choices=sorted(LR))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--break", dest="brk", default="none", choices=("none", "missing"))
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--local", type=int, default=0,
                   help="local SGD: --mode local with --local-steps K (0: deterministic sync)")
    p.add_argument("--num-ps", type=int, default=1)
    p.add_argument("--clip", type=float, default=None, help="the session's clip_norm")
    p.add_argument("--bucket-bytes", type=int, default=None, help="default: the session's")
    p.add_argument("--masked", action="store_true",
                   help="adamw: an optax-style weight-decay mask (matrices only) and the "
                        "last layer's matrix at half the rate")
    args = p.parse_args()
    with abort_on_error():
        server = SERVER
        workers = server.num_replicas
        k = server.replica_index
        params = init()
        if k != 0:  # the chief's values must win
            params = jax.tree_util.tree_map(lambda a: a + 1.0, params)
        lr = {"schedule": "cosine_decay", "initial_learning_rate": LR[args.optimizer],
              "decay_steps": DECAY, "warmup_steps": 5}
        masked = {}
        if args.masked:
            half = dict(lr, initial_learning_rate=LR[args.optimizer] * 0.5)
            masked = dict(mask=lambda t: jax.tree_util.tree_map_with_path(
                lambda path, _: jax.tree_util.keystr(path).endswith("['w']"), t),
                groups=[{"variables": ["layers/1/w"], "learning_rate": half}])
        mode = dict(mode="local", local_steps=args.local) if args.local else \
            dict(deterministic=True)
        opt = DistributedOptimizer(params, server, args.optimizer, learning_rate=lr,
                                   **OPTIONS[args.optimizer], **masked, **mode,
                                   last_step=args.steps, checkpoint_dir=args.checkpoint_dir,
                                   log_every=1, clip_norm=args.clip,
                                   bucket_bytes=args.bucket_bytes)
        params = opt.params
        ref = Reference(args.optimizer, workers, args.masked, args.local, args.clip)
        for s in range(opt.global_step):  # a resumed run: bring the reference to the step
            ref.step(s)
        while not opt.should_stop():
            s = opt.global_step
            x, y = batches(s, workers)
            loss, grads = grad_fn(params, x[k], y[k])
            if args.brk == "missing" and s == 2 and k == workers - 1:
                del grads["layers"][1]["b"]
            params = opt.step(grads, loss)
            time.sleep(args.sleep)
            ref.step(s)
        if args.local and k == 0:  # the last push was an average: every worker's is in
            (counters,) = opt.client.ps_counters()
            say(f"pushes: {counters['pushes_received']} applied: {counters['pushes_applied']}")
        code = opt.close()
        ours = [np.asarray(a) for a in jax.tree_util.tree_leaves(params)]
        worst = max(float(np.linalg.norm(a - b) / np.linalg.norm(b))
                    for a, b in zip(ours, ref.params))
        moved = max(float(np.abs(a - np.asarray(b)).max())
                    for a, b in zip(ref.params, jax.tree_util.tree_leaves(init())))
        say(f"worker {k}: step {opt.global_step} maxrel: {worst:.3g} moved: {moved:.3g}")
        if args.clip is not None:
            say(f"worker {k}: the reference clipped {ref.clipped} of {opt.global_step} steps")
        if k == 0:
            digest = hashlib.sha256(b"".join(a.tobytes() for a in ours)).hexdigest()
            say(f"names: {','.join(opt.layout.names)} digest: {digest[:16]}")
        sys.exit(code)


if __name__ == "__main__":
    main()
