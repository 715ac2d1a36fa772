"""A plain-jax MLP on the digits set, trained on mpitf's parameter servers.

Run: mpiexec -n 3 python jobs/jax_mnist.py --num-ps 1 --steps 300
The loop is ``jax.value_and_grad`` and ``mpitf.jax.DistributedOptimizer``; the ps runs Adam
(``--optimizer``) with a linear warmup then cosine decay (``--lr-decay`` for TF's exponential
decay instead). The parameters are named as the reference MLP's (``hidden1/weights``, ...),
so ``--evaluator``, ``mpitf ckpt export`` and the flags of mnist_mlp work alike.
"""

import time

import numpy as np

from mpitf.cli.flags import add_training_arguments, config_from_args, report_final
from mpitf.cli.side_tasks import start_replica
from mpitf.data.sharded import ShardedDataset, load_split
from mpitf.errors import ConfigurationError
from mpitf.runtime.exits import RankParser, collective, run_job

# jax loads inside the functions (after mpitf.jax, in main): --help and a bad flag answer
# without it, seconds sooner.


def init_mlp(key, sizes):
    """Return ``{"hidden1": {"weights", "biases"}, ..., "softmax_linear": {...}}``."""
    import jax
    import jax.numpy as jnp

    names = [f"hidden{i + 1}" for i in range(len(sizes) - 2)] + ["softmax_linear"]
    keys = jax.random.split(key, len(names))
    return {name: {"weights": jax.random.normal(k, (a, b)) * np.sqrt(2.0 / a),
                   "biases": jnp.zeros(b)}
            for name, k, a, b in zip(names, keys, sizes[:-1], sizes[1:])}


def logits(params, x):
    """Return the class scores of rows ``x``: relu hidden layers, then a linear layer."""
    import jax

    layers = sorted((k for k in params if k.startswith("hidden")), key=lambda k: int(k[6:]))
    for name in layers:
        x = jax.nn.relu(x @ params[name]["weights"] + params[name]["biases"])
    return x @ params["softmax_linear"]["weights"] + params["softmax_linear"]["biases"]


def loss_fn(params, x, y):
    """Return the mean softmax cross-entropy of ``params`` on the batch."""
    import jax
    import jax.numpy as jnp

    return -jnp.mean(jax.nn.log_softmax(logits(params, x))[jnp.arange(y.shape[0]), y])


def learning_rate(config, warmup):
    """Return the ps schedule: warmup then cosine decay, or --lr-decay's exponential decay."""
    if config.lr_decay is not None:
        return {"schedule": "exponential_decay", "initial_learning_rate": config.lr,
                "decay_steps": config.lr_decay_steps, "decay_rate": config.lr_decay}
    steps = config.training.last_step
    return {"schedule": "cosine_decay", "initial_learning_rate": config.lr,
            "decay_steps": max(1, steps - warmup), "warmup_steps": warmup}


def main(argv=None):
    parser = RankParser(description=__doc__.splitlines()[0])
    add_training_arguments(parser, lr=0.003)
    parser.set_defaults(optimizer="adam")
    parser.add_argument("--warmup-steps", type=int, default=20,
                        help="steps of linear warmup before the cosine decay")
    args = parser.parse_args(argv)
    config = config_from_args(args)
    if args.model != "mlp" or args.device != "cpu":
        raise collective(ConfigurationError(  # alike on every rank: each exits 2
            "jax_mnist trains an MLP on the CPU: leave --model at mlp and --device at cpu "
            "(mnist_mlp has the CNN and the GPU path)"))
    import jax  # importing jax starts nothing: mpitf.jax sets the platform and threads

    from mpitf.jax import DistributedOptimizer
    server, path, code = start_replica(args, config, "jax_mnist")
    if code is not None:  # a ps, an evaluator or another job's task has run its part
        return code
    training = config.training
    data = ShardedDataset(path, "train", server.replica_index, server.num_replicas,
                          training.batch_size, training.seed)
    params = init_mlp(jax.random.PRNGKey(training.seed),
                      (data.x_dim, config.hidden, data.num_classes))
    opt = DistributedOptimizer(params, server, config.optimizer,
                               learning_rate=learning_rate(config, args.warmup_steps),
                               config=training, dataset=data, batch_size=data.batch_size)
    params = opt.params  # the chief's, or the checkpoint's
    grad_fn = jax.jit(jax.value_and_grad(loss_fn))
    start, first = time.monotonic(), opt.global_step
    while not opt.should_stop():
        x, y = data.next_batch()
        loss, grads = grad_fn(params, x, y)
        params = opt.step(grads, loss)
    if server.is_chief and not opt.session.requeue:
        params = opt.pull()  # async: the newest, with the other workers' last updates
        x, y = load_split(path, "test")
        test_logits = logits(params, x)
        elapsed = time.monotonic() - start
        summary = dict(step=opt.global_step, loss=opt.session.loss,
                       test_loss=float(loss_fn(params, x, y)),
                       test_accuracy=float(np.mean(np.asarray(test_logits.argmax(1)) == y)),
                       examples_per_sec=(opt.global_step - first) *
                       opt.session.examples_per_global_step / max(elapsed, 1e-9),
                       workers=server.num_replicas, mode=training.mode, framework="jax")
        report_final(config, summary, opt.session.params)
    code = opt.close()
    data.close()
    return code


def run():
    """Run the job from the command line and exit with its code (``python -m``, jobs/)."""
    run_job(main)


if __name__ == "__main__":
    run()
