"""DLRM in torch on mpitf's parameter servers: the click-through model of Naumov et al. (2019).

Run: mpitf run -n 3 dlrm --data ctr.h5 --num-ps 1   (Adagrad, lr 0.02, one epoch in batches of 256
per worker, or ``--epochs N``/``--steps N``; write the data with ``mpitf data synthetic-ctr --out
ctr.h5`` or ``mpitf data criteo``).

The model is the paper's and its reference code's (facebookresearch/dlrm, ``--arch-interaction-op
dot``): a bottom MLP takes the dense features to one vector of the embedding width; each
categorical field looks up its own table (``mpitf.torch.EmbeddingBag``, ``mode="sum"``: the rows
live on the ps and only the batch's rows travel); the pairwise dot products of the bottom
vector and the fields' vectors (each pair once), beside the bottom vector, go through a top MLP
to one logit; binary cross-entropy. The tables and the MLPs train with the one torch optimizer
the job wraps (its rule applied lazily to the rows a batch touched, as torch's sparse Adagrad
does). The chief logs test AUC and log loss every ``--eval-every`` steps and prints ``final:
{json}`` with ``test_auc`` and ``test_logloss`` at the end, like ``ctr``; with ``--keep-best`` it
checkpoints at every evaluation and keeps the one of the best AUC as ``CHECKPOINT_DIR/best``.
"""

import functools

import numpy as np

from mpitf.cli.epochs import (
    add_epochs_arguments,
    config_for_epochs,
    keep_best,
    last_step_for_epochs,
)
from mpitf.cli.flags import (
    add_growth_arguments,
    add_training_arguments,
    config_from_args,
    growth_from_args,
)
from mpitf.cli.reports import report_final
from mpitf.cli.side_tasks import start_replica
from mpitf.data.ctr import CtrDataset, auc, load_ctr
from mpitf.errors import ConfigurationError
from mpitf.models.ctr import logistic_loss
from mpitf.runtime.exits import RankParser, collective, run_job

# torch loads inside the functions (after the flags are read): --help and a bad flag answer
# without it, seconds sooner.


def mlp(widths, relu_last):
    """Return Linear layers of ``widths`` with ReLU between them (and after the last if asked)."""
    import torch

    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(torch.nn.Linear(fan_in, fan_out))
        if relu_last or i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def build(table_rows, dense_dim, dim, bottom, top, embedding_bag, growth=None):
    """Return the DLRM module: ``model(dense, ids) -> logits`` (ids ``(N, fields)`` int64).

    ``growth`` (a :class:`~mpitf.tables.growth.Growth`): every table grows, any int64 id
    (``table_rows`` then only counts the fields).
    """
    import torch

    class DLRM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            # No dense features: no bottom MLP, the interactions are the tables' alone.
            self.bottom = mlp([dense_dim, *bottom, dim], True) if dense_dim else None
            if growth is None:
                self.tables = torch.nn.ModuleList(embedding_bag(rows, dim, mode="sum")
                                                  for rows in table_rows)
                for table in self.tables:  # the reference code's: small rows and dots
                    bound = float(np.sqrt(1.0 / table.num_embeddings))
                    torch.nn.init.uniform_(table.weight, -bound, bound)
            else:  # rows drawn on the ps from (seed, table, id)
                self.tables = torch.nn.ModuleList(
                    embedding_bag(None, dim, mode="sum", dynamic=growth) for _ in table_rows)
            n = len(table_rows) + (1 if dense_dim else 0)
            # each pair (i, j) with i > j once, as the reference code's interaction
            lower = torch.tril_indices(n, n, offset=-1)
            self.register_buffer("pair_i", lower[0], persistent=False)
            self.register_buffer("pair_j", lower[1], persistent=False)
            self.top = mlp([(dim if dense_dim else 0) + n * (n - 1) // 2, *top, 1], False)

        def forward(self, dense, ids):
            vectors = [table(ids[:, f:f + 1]) for f, table in enumerate(self.tables)]
            x = self.bottom(dense) if self.bottom is not None else None
            if x is not None:
                vectors.insert(0, x)
            t = torch.stack(vectors, 1)  # (N, n, dim)
            dots = torch.bmm(t, t.transpose(1, 2))[:, self.pair_i, self.pair_j]
            return self.top(dots if x is None else torch.cat([x, dots], 1)).squeeze(1)

    return DLRM()


def widths(text, flag):
    """Parse ``"64,32"`` into (64, 32); an empty string is no hidden layer."""
    try:
        values = tuple(int(w) for w in text.split(",") if w.strip())
    except ValueError:
        values = (0,)
    if any(w < 1 for w in values):
        raise collective(ConfigurationError(
            f"{flag} {text!r}: expecting layer widths >= 1 separated by commas, e.g. 64,32"))
    return values


def evaluate(model, path, batch_size, raw_ids=False):
    """Return (AUC, log loss) of ``model`` on the test split, in batches."""
    import torch

    ids, dense, y, _ = load_ctr(path, "test", raw_ids=raw_ids)
    logits = []
    with torch.no_grad():
        for lo in range(0, len(y), batch_size):
            logits.append(model(torch.from_numpy(dense[lo:lo + batch_size]),
                                torch.from_numpy(ids[lo:lo + batch_size])).numpy())
    z = np.concatenate(logits)
    return auc(y, z), logistic_loss(z, y)[0]


def _check_cluster(cluster):
    if cluster.num_tasks("ps") < 1:
        raise ConfigurationError(
            "dlrm keeps its embedding tables on ps tasks: give --num-ps 1 or more")
    if "evaluator" in cluster.jobs and cluster.num_tasks("evaluator"):
        raise ConfigurationError(
            "dlrm has no evaluator task: its chief logs test AUC and log loss every "
            "--eval-every steps; leave the evaluator out of the cluster")


def _check_data(path, batch_size, num_shards, raw_ids=False):
    load_ctr(path, "test", raw_ids=raw_ids)  # the layout, table_rows, every id, checked


def main(argv=None):
    parser = RankParser(description=__doc__.splitlines()[0])
    add_training_arguments(parser, batch_size=256, lr=0.02)
    parser.set_defaults(optimizer="adagrad")
    parser.add_argument("--embedding-dim", type=int, default=4,
                        help="values per table row, also the bottom MLP's output width")
    parser.add_argument("--bottom-mlp", default="64,32",
                        help="hidden widths of the bottom MLP (dense features), comma-separated")
    parser.add_argument("--top-mlp", default="64,32",
                        help="hidden widths of the top MLP (interactions -> logit)")
    parser.add_argument("--eval-every", type=int, default=400,
                        help="the chief logs test AUC and log loss every N steps (0: never)")
    add_growth_arguments(parser)
    add_epochs_arguments(parser)
    args = parser.parse_args(argv)
    config = config_for_epochs(config_from_args(args), args, args.eval_every)
    growth = growth_from_args(args)
    bottom, top = widths(args.bottom_mlp, "--bottom-mlp"), widths(args.top_mlp, "--top-mlp")
    if args.embedding_dim < 1:
        raise collective(ConfigurationError(
            f"--embedding-dim {args.embedding_dim}: expecting 1 or more values per row"))
    if config.optimizer not in ("adagrad", "sgd") or config.lr_decay is not None:
        raise collective(ConfigurationError(
            f"dlrm trains with --optimizer adagrad or sgd and a fixed --lr (torch's sparse "
            f"updates of its tables); got --optimizer {config.optimizer}"
            + ("" if config.lr_decay is None else f" with --lr-decay {config.lr_decay}")))
    if not config.data:
        raise collective(ConfigurationError("dlrm needs --data FILE (write one with `mpitf "
                                            "data synthetic-ctr --out FILE`)"))
    server, _, code = start_replica(args, config, "dlrm", _check_cluster,
                                    functools.partial(_check_data, raw_ids=growth is not None),
                                    tables=True)
    if code is not None:  # a ps or another job's task has run its part
        return code
    return train(server, config, args, bottom, top, growth)


def train(server, config, args, bottom, top, growth):
    """Train on this replica; the chief evaluates and reports. Return the exit code."""
    import torch

    import mpitf.torch as mt

    raw_ids = growth is not None
    dataset = CtrDataset(config.data, server.replica_index, server.num_replicas,
                         config.training.batch_size, config.training.seed, raw_ids=raw_ids)
    config = last_step_for_epochs(config, args, dataset.total_samples, server.num_replicas)
    training = config.training
    torch.manual_seed(training.seed)
    model = build(dataset.table_rows if dataset.table_rows is not None else
                  [None] * dataset.fields, dataset.dense_dim, args.embedding_dim, bottom,
                  top, mt.EmbeddingBag, growth)
    rule = torch.optim.Adagrad if config.optimizer == "adagrad" else torch.optim.SGD
    opt = rule(model.parameters(), lr=config.lr)
    dist = mt.DistributedOptimizer(opt, model, server, config=training, dataset=dataset)
    loss_fn = torch.nn.functional.binary_cross_entropy_with_logits
    last_loss = None  # no step run (resumed at the last step)
    while not dist.should_stop():
        ids, dense, y = dataset.next_batch()
        dist.zero_grad()
        loss = loss_fn(model(torch.from_numpy(dense), torch.from_numpy(ids)),
                       torch.from_numpy(y).to(torch.float32))
        loss.backward()
        dist.step(loss)
        last_loss = float(loss.item())
        step = dist.global_step
        if server.is_chief and args.eval_every and step % args.eval_every == 0 \
                and not dist.should_stop():
            test_auc, test_logloss = evaluate(model, config.data, dataset.batch_size, raw_ids)
            print(f"step {step}: test_auc = {test_auc:.4f}, test_logloss = "
                  f"{test_logloss:.4f}", flush=True)
            if args.keep_best:
                keep_best(dist.session, test_auc)
    final_auc = None
    if server.is_chief and not dist.session.requeue:
        final_auc, test_logloss = evaluate(model, config.data, dataset.batch_size, raw_ids)
        summary = dict(step=dist.global_step, loss=last_loss, test_auc=final_auc,
                       test_logloss=test_logloss, workers=server.num_replicas,
                       mode=training.mode)
        report_final(config, summary)
    dist.close()
    if args.keep_best and final_auc is not None:  # close() cut the last step's checkpoint
        keep_best(dist.session, final_auc)
    return dist.exit_code


def run():
    """Run the job from the command line and exit with its code (``python -m``, jobs/)."""
    run_job(main)


if __name__ == "__main__":
    run()
