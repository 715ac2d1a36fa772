"""mpitf.torch tables whose step looks up more ids than their buffers were made for.

1 ps + W workers train a DLRM-sized batch (4,096 x 26 ids a worker, in one EmbeddingBag
of 200,000 rows: about 82,000 unique ids a step, past the 65,536 of max_ids' default)
twice in one launch: with max_ids left at its default, where every rank's buffers grow,
then sized by hand (``max_ids=4096 * 26``). Deterministic sync: each training prints
``worker K: run R digest D`` of its dense parameters and the rows it looked up.
"""

from ps_first import serve_if_ps

SERVER = serve_if_ps(sessions=2) if __name__ == "__main__" else None  # ps: serve twice

import hashlib  # noqa: E402 - a ps has served and left before torch is imported
import sys  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import mpitf.torch as mt  # noqa: E402
from mpitf import abort_on_error  # noqa: E402

ROWS, DIM, BATCH, FIELDS, STEPS = 200_000, 8, 4096, 26, 3


class Click(torch.nn.Module):
    def __init__(self, max_ids):
        super().__init__()
        sized = {} if max_ids is None else {"max_ids": max_ids}
        self.emb = mt.EmbeddingBag(ROWS, DIM, mode="sum", **sized)
        self.out = torch.nn.Linear(DIM, 1)

    def forward(self, ids):
        return self.out(self.emb(ids)).squeeze(1)


def train(server, max_ids, run):
    k = server.replica_index
    torch.manual_seed(0)
    model = Click(max_ids)
    dist = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, server,
                                   deterministic=True, last_step=STEPS, log_every=0)
    looked = []
    while not dist.should_stop():
        rng = np.random.default_rng([dist.global_step, k])
        ids = torch.from_numpy(rng.integers(0, ROWS, size=(BATCH, FIELDS)))
        y = torch.from_numpy(rng.random(BATCH).astype(np.float32))
        dist.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(ids), y)
        loss.backward()
        dist.step(loss)
        looked.append(ids.reshape(-1)[:1000])
    rows = dist.table_rows("emb.weight", torch.cat(looked))
    digest = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in
                                     [*model.out.parameters(), rows])).hexdigest()
    sys.stdout.write(f"worker {k}: run {run} step {dist.global_step} digest {digest[:16]}\n")
    sys.stdout.flush()
    return dist.close()


def main():
    with abort_on_error():
        code = train(SERVER, None, "default") or train(SERVER, BATCH * FIELDS, "sized")
        sys.exit(code)


if __name__ == "__main__":
    main()
