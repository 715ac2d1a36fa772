"""The typed configuration: defaults written once, every range check, misspelt names, flags."""

import argparse
import math
import pickle
import re

import pytest

from mpitf.cli.flags import add_training_arguments, config_from_args
from mpitf.config import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_DEADLINE,
    JobConfig,
    JobFacts,
    PsAssignment,
    TrainingConfig,
    check_deadline,
    check_multiple,
    default_deadline,
)
from mpitf.errors import ConfigurationError


@pytest.fixture(autouse=True)
def _no_deadline_env(monkeypatch):
    monkeypatch.delenv("MPITF_DEADLINE", raising=False)


def parse(*flags):
    parser = argparse.ArgumentParser()
    add_training_arguments(parser)
    return parser.parse_args([str(f) for f in flags])


# -- defaults ------------------------------------------------------------------------------

def test_training_defaults():
    c = TrainingConfig()
    assert (c.mode, c.last_step, c.batch_size, c.checkpoint_dir) == ("sync", None, None, None)
    assert (c.save_checkpoint_steps, c.save_checkpoint_secs, c.max_to_keep) == (None, None, 5)
    assert (c.replicas_to_aggregate, c.deterministic, c.staleness) == (None, False, 2)
    assert (c.skip_nonfinite, c.moving_average_decay, c.seed, c.log_every) == \
        (False, None, 0, 20)
    assert (c.run_dir, c.timeline, c.clients, c.ps_strategy) == (None, None, None, None)


def test_deadline_default_and_its_environment_override(monkeypatch):
    assert DEFAULT_DEADLINE == 300.0
    assert default_deadline() == JobConfig().deadline == 300.0
    assert config_from_args(parse()).deadline == 300.0
    monkeypatch.setenv("MPITF_DEADLINE", "12.5")
    assert default_deadline() == JobConfig().deadline == 12.5
    assert config_from_args(parse()).deadline == 12.5
    assert config_from_args(parse("--deadline", 7)).deadline == 7.0  # the flag wins
    monkeypatch.setenv("MPITF_DEADLINE", "soon")
    with pytest.raises(ConfigurationError, match="MPITF_DEADLINE='soon'"):
        default_deadline()
    monkeypatch.setenv("MPITF_DEADLINE", "0")
    with pytest.raises(ConfigurationError, match="deadline must be > 0"):
        default_deadline()


def test_flag_defaults_are_the_configuration_defaults():
    config = config_from_args(parse())
    t = config.training
    defaults = TrainingConfig()
    for name in ("mode", "max_to_keep", "staleness", "seed", "log_every", "summary_every",
                 "deterministic",
                 "skip_nonfinite", "max_nonfinite_skips", "replicas_to_aggregate",
                 "moving_average_decay",
                 "save_checkpoint_steps", "save_checkpoint_secs", "timeline"):
        assert getattr(t, name) == getattr(defaults, name), name
    job = JobConfig()
    for name in ("model", "hidden", "optimizer", "lr", "lr_decay", "lr_decay_steps", "export"):
        assert getattr(config, name) == getattr(job, name), name
    assert (t.last_step, t.batch_size, t.run_dir) == (300, 32, "runs/latest")


def test_help_names_the_deadline_default():
    parser = argparse.ArgumentParser()
    add_training_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "$MPITF_DEADLINE, else 300" in text


def test_from_args_carries_every_flag():
    config = config_from_args(parse(
        "--mode", "sync", "--steps", 7, "--batch-size", 4, "--lr", 0.1, "--lr-decay", 0.5,
        "--lr-decay-steps", 3, "--optimizer", "adam", "--staleness", 0, "--deterministic",
        "--skip-nonfinite", "--max-nonfinite-skips", 7, "--moving-average-decay", 0.9,
        "--ps-strategy", "greedy",
        "--seed", 3, "--log-every", 0, "--summary-every", 7, "--run-dir", "r",
        "--checkpoint-dir", "c",
        "--checkpoint-every", 2, "--checkpoint-secs", 1.5, "--max-to-keep", 0,
        "--replicas-to-aggregate", 1, "--timeline", "t.json", "--model", "cnn",
        "--hidden", 9, "--deadline", 4, "--export", "e.npz", "--data", "d.h5",
        "--gpu-memory-fraction", 0.5))
    assert config.training == TrainingConfig(
        mode="sync", last_step=7, batch_size=4, checkpoint_dir="c", save_checkpoint_steps=2,
        save_checkpoint_secs=1.5, max_to_keep=0, replicas_to_aggregate=1, deterministic=True,
        staleness=0, skip_nonfinite=True, max_nonfinite_skips=7, moving_average_decay=0.9,
        ps_strategy="greedy",
        seed=3, log_every=0, summary_every=7, run_dir="r", timeline="t.json")
    assert (config.model, config.hidden, config.optimizer, config.lr, config.lr_decay,
            config.lr_decay_steps, config.deadline, config.export, config.data,
            config.gpu_memory_fraction) == \
        ("cnn", 9, "adam", 0.1, 0.5, 3, 4.0, "e.npz", "d.h5", 0.5)


# -- misspelt names ------------------------------------------------------------------------

def test_a_misspelt_option_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="replicas_to_agregate"):
        TrainingConfig(replicas_to_agregate=2)
    with pytest.raises(TypeError, match="stalenes"):
        TrainingConfig().replace(stalenes=1)
    with pytest.raises(TypeError, match="hiden"):
        JobConfig(hiden=3)


def test_training_session_passes_options_straight_into_the_config():
    from mpitf.worker.session import TrainingSession

    # The options are checked before the session looks at its server or model.
    with pytest.raises(TypeError, match="replicas_to_agregate"):
        TrainingSession(None, None, None, replicas_to_agregate=2)
    with pytest.raises(ConfigurationError, match="staleness must be >= 0"):
        TrainingSession(None, None, None, "ssp", staleness=-1)
    with pytest.raises(ConfigurationError, match="unknown mode 'fast'"):
        TrainingSession(None, None, None, "fast")
    with pytest.raises(TypeError, match="bogus"):
        TrainingSession(None, None, None, config=TrainingConfig(), bogus=1)


# -- every check ---------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, message", [
    ("mode", "fast", "unknown mode 'fast': use 'sync', 'async', 'ssp' or 'local'"),
    ("last_step", -1, "last_step .* >= 0"),
    ("last_step", 2.5, "last_step .* integer"),
    ("batch_size", 0, "batch_size must be >= 1"),
    ("batch_size", -3, "batch_size must be >= 1"),
    ("save_checkpoint_steps", 0, "save_checkpoint_steps .* >= 1"),
    ("save_checkpoint_secs", 0, "save_checkpoint_secs .* > 0"),
    ("save_checkpoint_secs", -1.0, "save_checkpoint_secs .* > 0"),
    ("save_checkpoint_secs", math.inf, "save_checkpoint_secs .* finite"),
    ("max_to_keep", -1, "max_to_keep must be >= 0"),
    ("replicas_to_aggregate", 0,
     r"replicas_to_aggregate \(leave it out for every worker\) must be >= 1, got 0"),
    ("staleness", -1, "staleness must be >= 0"),
    ("moving_average_decay", 0.0, r"moving_average_decay must be in \(0.0, 1.0\)"),
    ("moving_average_decay", 1.0, r"moving_average_decay must be in \(0.0, 1.0\)"),
    ("moving_average_decay", math.nan, "moving_average_decay must be a finite number"),
    ("seed", -1, "seed must be >= 0"),
    ("log_every", -1, "log_every must be >= 0"),
    ("summary_every", -1, r"summary_every \(--summary-every\) must be >= 0, got -1"),
    ("summary_every", 2.5, r"summary_every \(--summary-every\) must be an integer"),
    ("clients", (-1,), "clients must be >= 0"),
])
def test_training_checks(field, value, message):
    with pytest.raises(ConfigurationError, match=message):
        TrainingConfig(**{field: value})


@pytest.mark.parametrize("field, value, message", [
    ("model", "rnn", "unknown model 'rnn'"),
    ("hidden", 0, r"hidden units \(--hidden\) must be >= 1"),
    ("optimizer", "rmsprop", "unknown optimizer 'rmsprop'"),
    ("lr", 0.0, r"learning rate \(--lr\) must be > 0"),
    ("lr", -1.0, r"learning rate \(--lr\) must be > 0"),
    ("lr", math.nan, "finite number"),
    ("lr", math.inf, "finite number"),
    ("lr_decay", 0.0, r"--lr-decay\) must be > 0"),
    ("lr_decay_steps", 0, r"--lr-decay-steps\) must be >= 1"),
    ("deadline", 0.0, "deadline must be > 0"),
    ("deadline", -5.0, "deadline must be > 0"),
    ("gpu_memory_fraction", 0.0, r"gpu memory fraction must be in \(0.0, 1.0\]"),
    ("gpu_memory_fraction", 1.5, r"gpu memory fraction must be in \(0.0, 1.0\]"),
])
def test_job_checks(field, value, message):
    with pytest.raises(ConfigurationError, match=message):
        JobConfig(**{field: value})


def test_good_values_pass():
    TrainingConfig(mode="ssp", last_step=0, batch_size=1, save_checkpoint_steps=1,
                   save_checkpoint_secs=0.01, max_to_keep=0, replicas_to_aggregate=1,
                   staleness=0, moving_average_decay=0.5, log_every=0, summary_every=0,
                   clients=[0])
    assert TrainingConfig(clients=[0, 2]).clients == (0, 2)
    JobConfig(lr=1e-9, lr_decay=2.0, lr_decay_steps=1, deadline=0.001, hidden=1,
              gpu_memory_fraction=1.0)


def test_config_from_args_errors_are_collective():
    with pytest.raises(ConfigurationError, match="batch_size") as err:
        config_from_args(parse("--batch-size", 0))
    assert err.value.collective  # rank 0 prints it once, every rank exits 2


def test_chunk_bytes_and_deadline_checks():
    assert check_multiple("chunk_bytes", 128, 64) == 128
    for bad in (0, -64, 100, 64.0, True):
        with pytest.raises(ConfigurationError, match="chunk_bytes must be a positive multiple"):
            check_multiple("chunk_bytes", bad, 64)
    assert check_deadline(None) is None
    assert check_deadline(3) == 3.0


# -- the library refuses through the same checks -------------------------------------------

def test_library_constructors_use_the_same_checks(tmp_path):
    from mpitf.data.sharded import ShardedDataset
    from mpitf.models import MLP
    from mpitf.ps.consistency import BoundedStaleness
    from mpitf.ps.optimizers import ExponentialMovingAverage, make_optimizer
    from mpitf.runtime.server import Server

    with pytest.raises(ConfigurationError, match="^batch_size must be >= 1, got 0$"):
        ShardedDataset(str(tmp_path / "none.h5"), batch_size=0)
    with pytest.raises(ConfigurationError, match="^learning_rate must be >= 0.0, got -1$"):
        make_optimizer("sgd", -1)
    make_optimizer("none", 0.0)  # an optimizer built directly may take 0
    with pytest.raises(ConfigurationError, match=r"^moving_average_decay must be in \(0.0"):
        ExponentialMovingAverage(1.5)
    with pytest.raises(ConfigurationError, match="^staleness must be >= 0, got -1$"):
        BoundedStaleness(-1)
    with pytest.raises(ConfigurationError, match="MLP hidden units must be >= 1, got 0"):
        MLP(hidden=(0,))
    with pytest.raises(ConfigurationError, match="^deadline must be > 0.0, got 0$"):
        Server(deadline=0)


def test_configs_travel_pickled():
    c = TrainingConfig(mode="async", checkpoint_dir="/c", clients=[0])
    assert pickle.loads(pickle.dumps(c)) == c
    a = PsAssignment(slices=((0, 0, 4),), shard_size=4, dtype="<f4", num_ps=1,
                     optimizer={"name": "sgd", "learning_rate": 0.1}, chief_rank=1)
    assert pickle.loads(pickle.dumps(a)) == a
    assert (a.restore, a.deadline, a.chunk_bytes, a.total_num_replicas) == (None,) * 4


def test_deterministic_needs_sync_and_the_skip_bound_is_positive():
    with pytest.raises(ConfigurationError, match="deterministic .* needs mode 'sync', got 'async'"):
        TrainingConfig(mode="async", deterministic=True)
    assert TrainingConfig(mode="sync", deterministic=True).deterministic
    with pytest.raises(ConfigurationError, match="max_nonfinite_skips .* must be >= 1, got 0"):
        TrainingConfig(max_nonfinite_skips=0)
    assert TrainingConfig().max_nonfinite_skips == 100


def test_clipping_keeps_the_buckets():
    # the ps holds a clipped step's buckets until its last one is in (ps/clip.py)
    assert TrainingConfig(clip_norm=1.0, bucket_bytes=1 << 20).bucket_bytes == 1 << 20
    assert TrainingConfig(clip_norm=1.0).bucket_bytes == DEFAULT_BUCKET_BYTES


def test_buckets_by_default_unless_an_option_needs_one_frame():
    assert TrainingConfig().bucket_bytes == DEFAULT_BUCKET_BYTES == 2 << 20
    assert TrainingConfig(bucket_bytes=0).bucket_bytes == 0
    assert TrainingConfig(bucket_bytes=1 << 20).bucket_bytes == 1 << 20
    for one_frame in (dict(clients=(0,)), dict(aggregate_per_node=True),
                      dict(ps_replication_steps=2)):
        assert TrainingConfig(**one_frame).bucket_bytes == 0
    # a default stays a default: chosen again when an option that needs one frame is added
    assert TrainingConfig().replace(aggregate_per_node=True).bucket_bytes == 0
    assert TrainingConfig(bucket_bytes=4096).replace(seed=1).bucket_bytes == 4096
    assert TrainingConfig(bucket_bytes=4096).replace(clip_norm=1.0).bucket_bytes == 4096


def test_each_mode_answers_what_depends_on_it():
    # mpitf.modes: what the worker and the ps ask instead of testing a mode's name
    sync, asyn, ssp = (TrainingConfig(mode=m).consistency for m in ("sync", "async", "ssp"))
    local = TrainingConfig(mode="local", local_steps=3).consistency
    assert [m.clips_on_ps for m in (sync, asyn, ssp, local)] == [True, False, False, False]
    assert [m.steps_together for m in (sync, asyn, ssp, local)] == [True, False, False, True]
    assert [m.applies_locally for m in (sync, asyn, ssp, local)] == [False, False, False, True]
    # examples per global step: sync's aggregated batches, one push's, every worker's
    assert sync.examples_per_step(32, 4, None) == 128 and sync.examples_per_step(32, 4, 3) == 96
    assert asyn.examples_per_step(32, 4, None) == ssp.examples_per_step(32, 4, 3) == 32
    assert local.examples_per_step(32, 4, None) == 128
    # local pushes every K steps and at the last; the others every step
    assert [s for s in range(1, 11) if local.pushes_after(s, last_step=10)] == [3, 6, 9, 10]
    assert all(sync.pushes_after(s, 10) for s in range(1, 11))
    assert TrainingConfig(mode="local").consistency.local_steps == 4  # the default K
    assert TrainingConfig(mode="local").bucket_bytes == 0  # parameters go in one frame


def test_replication_is_checked_against_the_job_facts_once():
    """Every refusal of --ps-replication-steps comes from check_job (or the options alone)."""
    config = TrainingConfig(ps_replication_steps=2)
    config.check_job(JobFacts(num_ps=2, num_replicas=2, ulfm=True))  # what it needs: fine
    config.check_job(JobFacts(2, 2, ulfm=True, tables=True))  # tables' rows are copied too
    replication = "ps_replication_steps (--ps-replication-steps)"
    for facts, message in [
            (JobFacts(2, 2, ulfm=False), "which needs Open MPI with ULFM"),
            (JobFacts(1, 2, ulfm=True), "the job has 1 ps task: give it 2 or more, or drop the "
                                        "option"),
            (JobFacts(2, 2, ulfm=True, backends=("cupy", "numpy")),
             "does not support the cupy backend (frames and copies move through host memory); "
             "use --device cpu or drop the option")]:
        with pytest.raises(ConfigurationError, match=re.escape(message)) as err:
            config.check_job(facts)
        assert str(err.value).startswith(replication)
    for options, what in [(dict(bucket_bytes=4096), "bucket_bytes=4096 (--bucket-bytes)"),
                          (dict(aggregate_per_node=True), "aggregate_per_node")]:
        with pytest.raises(ConfigurationError, match=re.escape(f"does not support {what}")):
            TrainingConfig(ps_replication_steps=2, **options)
    # the options that need nothing of the job pass any facts
    TrainingConfig().check_job(JobFacts(1, 1, tables=True, backends=("cupy",),
                                        replica_backends=("cupy",), nodes_problem="no"))
