"""What a job reports at its end: the final line, summary.json, the test-split evaluation."""

import os


def report_final(config, summary, params=None, to_host=None):
    """Print ``final: {json}``, write RUN_DIR/summary.json, export params if --export."""
    import json

    print("final: " + json.dumps(summary), flush=True)
    if config.export and params is not None:
        import numpy as np

        to_host = to_host or np.asarray
        np.savez(config.export, **{k: to_host(v) for k, v in params.items()})
    run_dir = config.training.run_dir
    if run_dir:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return summary


def evaluate_session(sess, config, path, **extra):
    """Evaluate the newest parameters on the test split; return the summary (ps counters too)."""
    from ..data.sharded import load_split

    elapsed = sess.elapsed  # training alone: the evaluation is not in the rate
    x_test, y_test = load_split(path, "test")
    test_loss, test_acc = sess.evaluate(x_test, y_test,
                                        average=config.training.moving_average_decay is not None)
    counters = sess.client.ps_counters()
    summary = dict(step=sess.global_step, loss=sess.loss, test_loss=test_loss,
                   test_accuracy=test_acc,
                   ps=len(set(sess.client.link.ranks)),  # a lost ps's buddy serves both
                   examples_per_sec=sess.examples_seen / elapsed if elapsed > 0 else 0.0,
                   # every ps counts each skip of every worker: one ps's count is the total
                   nonfinite_skipped=max((c["nonfinite_skipped"] for c in counters),
                                         default=sess.nonfinite_skipped),
                   stale_dropped=sum(c["stale_dropped"] for c in counters),
                   max_staleness=max((c["max_staleness"] for c in counters), default=0),
                   max_lead=max((c["max_lead"] for c in counters), default=0),
                   fan_in=max(c["fan_in"] for c in counters),  # ranks pushing to a ps
                   pushes_received=max(c["pushes_received"] for c in counters),
                   bucket_bytes=sess.config.bucket_bytes)  # the default depends on the nodes
    summary.update(extra)
    if "workers" in summary:  # the workers alive at the end (ULFM: a lost one not replaced)
        summary["workers"] -= max(c.get("workers_lost", 0) for c in counters)
    if config.export:
        sess.client.pull()  # evaluation may have pulled the average
    return summary
