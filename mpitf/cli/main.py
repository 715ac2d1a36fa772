"""The ``mpitf`` command: run jobs, show rank maps, prepare data, inspect checkpoints, bench.

Subcommands::

    mpitf cluster --spec SPEC [-n N] [--hosts h1,h1,h2,...]   print the rank -> task map
    mpitf run -n N [--dry-run] JOB [ARGS...]                run a job under mpiexec
    mpitf data digits|mnist|synthetic-ctr|criteo|hash-ids ... write an HDF5 data set
    mpitf ckpt ls|show|verify|export DIR ...                inspect checkpoints
    mpitf bench [--quick] [--suite S] [--models M] [--out DIR] [-n N]   run the benchmarks
    mpitf bench --plan --nodes N --model-bytes B --compute-ms C --fabric F   plan a cluster

JOB is a built-in job's name (hello, mnist_mlp, in_graph, towers, ctr: ``mpitf run -n 3
mnist_mlp --steps 50`` runs ``python -m mpitf.jobs.mnist_mlp --steps 50`` on 3 ranks), a
``.py`` script (run with this Python), or a program.

Exit codes: 0 success, 1 an error, 2 bad input (usage or configuration); ``run`` exits
with the job's own code.
"""

import argparse
import importlib.util
import os
import pkgutil
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

from .. import __version__
from ..cluster.spec import SPEC_FORMS, parse_spec
from ..errors import ConfigurationError, MpitfError
from ..runtime.exits import EXIT_ERROR, EXIT_USAGE

__all__ = ["main", "build_parser", "parse_spec"]

def _error(message, code):
    sys.stderr.write(f"mpitf: error: {message}\n")
    return code


# --- cluster ----------------------------------------------------------------------------
def cmd_cluster(args):
    """Print which rank runs which task on which host, launching nothing."""
    from ..cluster.roles import assign_roles, describe_roles

    cluster = parse_spec(args.spec)
    hosts = [h.strip() for h in args.hosts.split(",")] if args.hosts else None
    if hosts is not None and not all(hosts):
        raise ConfigurationError(f"empty host in --hosts={args.hosts!r}: expecting 'h1,h1,h2'")
    n = args.n if args.n is not None else len(hosts) if hosts else cluster.total_tasks
    if hosts is None:
        hosts = ["localhost"] * n
    elif len(hosts) != n:
        raise ConfigurationError(
            f"--hosts names {len(hosts)} ranks but -n is {n}: give one host per rank")
    roles = assign_roles(cluster, hosts)
    try:
        shown = cluster.to_string()
    except ConfigurationError:  # sparse task indices have no flag form
        shown = repr(cluster.as_dict())
    counts = ", ".join(f"{cluster.num_tasks(j)} {j}" for j in cluster.jobs)
    nodes = len(set(hosts))
    print(f"cluster: {shown}")
    print(f"{n} ranks ({counts}) on {nodes} node{'s' if nodes != 1 else ''}")
    print(describe_roles(roles, hosts))
    return 0


# --- run --------------------------------------------------------------------------------
def builtin_jobs():
    """Return the names of the built-in jobs: the modules of mpitf.jobs."""
    where = importlib.util.find_spec("mpitf.jobs").submodule_search_locations
    return sorted(m.name for m in pkgutil.iter_modules(where) if not m.name.startswith("_"))


def job_argv(job):
    """Return the argv that starts ``job``: a built-in job's name, a .py script or a program."""
    if job.endswith(".py"):
        if not os.path.isfile(job):
            raise ConfigurationError(f"no such script: {job}")
        return [sys.executable, job]
    if job in builtin_jobs():
        return [sys.executable, "-m", f"mpitf.jobs.{job}"]
    if os.sep in job or os.path.isfile(job) or shutil.which(job):
        return [job]
    raise ConfigurationError(
        f"unknown job {job!r}: expecting a built-in job ({', '.join(builtin_jobs())}), "
        "a .py script or a program")


def run_command(n, job, job_args, mpiexec=None, hosts=None, hostfile=None):
    """Return the mpiexec argv that runs ``job`` (see job_argv) on n ranks."""
    from ..runtime.launch import mpiexec_command

    return mpiexec_command(n, job_argv(job) + list(job_args), mpiexec=mpiexec, hosts=hosts,
                           hostfile=hostfile)


def _run_hosts(args):
    """Return ``--hosts`` as a list (None when not given), checked."""
    if args.hosts is None:
        return None
    hosts = [h.strip() for h in args.hosts.split(",")]
    if not all(hosts) or not all(re.fullmatch(r"[^:\s]+(:[1-9]\d*)?", h) for h in hosts):
        raise ConfigurationError(f"--hosts {args.hosts!r}: expecting host names, each with "
                                 "an optional slot count, e.g. 'n1:4,n2:4'")
    if args.hostfile is not None:
        raise ConfigurationError("give --hosts or --hostfile, not both")
    return hosts


def cmd_run(args):
    """Run a job under the installed MPI's mpiexec and return its exit code."""
    from ..runtime import job_end
    from ..runtime.launch import find_mpiexec
    from ..runtime.proxies import ProxyWatch

    if args.n < 1:
        raise ConfigurationError(f"-n {args.n}: expecting at least one rank")
    argv = job_argv(args.job)
    if os.environ.get("SLURM_JOB_ID"):
        shown = shlex.join(["python", *argv[1:]] if argv[0] == sys.executable else argv)
        sys.stderr.write(
            f"mpitf: note: this is Slurm job {os.environ['SLURM_JOB_ID']}; inside an allocation"
            f" launch with srun (srun -n {args.n} {shown} ...) so Slurm places"
            " and tracks the ranks; see slurm/README.md\n")
    try:
        mpiexec = args.mpiexec or find_mpiexec()
    except RuntimeError as exc:
        return _error(str(exc), EXIT_ERROR)
    if args.hostfile is not None and not os.path.isfile(args.hostfile):
        raise ConfigurationError(f"--hostfile {args.hostfile}: no such file")
    hosts = _run_hosts(args)
    if args.launcher is not None and hosts is None and args.hostfile is None:
        raise ConfigurationError(f"--launcher {args.launcher!r} starts the ranks of other "
                                 "hosts: give --hosts or --hostfile too")
    cmd = run_command(args.n, args.job, args.args, mpiexec=mpiexec, hosts=hosts,
                      hostfile=args.hostfile)
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    tmp = tempfile.mkdtemp(prefix="mpitf-run-")
    try:  # over hosts, each node's proxy starts through mpitf's launcher, which says
        # how it ended, so a lost node can be named (runtime/proxies.py)
        watch = ProxyWatch(tmp, mpiexec, hosts, args.n, args.launcher) \
            if hosts or args.hostfile else None
        env = dict(os.environ, **(watch.env if watch else {job_end.FOLDER: tmp}))
        with subprocess.Popen(cmd, env=env) as launcher:  # on a node of its own, the ranks
            code = job_end.wait(launcher, args.n, tmp)  # say how they ended (pids seen here)
        lost = watch.lost_node(code) if watch else None
        if lost:
            sys.stderr.write(f"mpitf: {lost}\n")
            code = code or EXIT_ERROR
    except KeyboardInterrupt:  # mpiexec got the same SIGINT and ends the ranks
        return 130
    finally:  # ignoring errors: Open MPI's mpiexec returns before its launchers end, and
        shutil.rmtree(tmp, ignore_errors=True)  # one may write the log as it is removed
    return 128 - code if code < 0 else code  # killed by a signal: the shell's convention


# --- data -------------------------------------------------------------------------------
def _report_dataset(path):
    import h5py

    with h5py.File(path, "r") as f:
        train, test = len(f["y_train"]), len(f["y_test"])
        name = f.attrs.get("name", "?")
    print(f"wrote {path}: {name}, {train} training and {test} test samples")


def cmd_data(args):
    """Write a data set in mpitf's HDF5 layout."""
    from ..data import ctr, datasets

    if args.dataset == "synthetic-ctr":
        ceiling = ctr.synthetic_ctr(args.out, args.train, args.test, args.fields, args.rows,
                                    args.dense, seed=args.seed, raw_ids=args.raw_ids,
                                    growth=args.growth, compression=args.compression)
        ids = (f"raw ids, {args.rows} live per field, {args.growth:g} new per example"
               if args.raw_ids else f"{args.fields} fields of {args.rows} rows")
        print(f"wrote {args.out}: synthetic click-through data ({ids}), {args.train} training "
              f"and {args.test} test examples; the planted model's test AUC is {ceiling:.4f}")
        return 0
    if args.dataset == "criteo":
        rows = args.rows_per_field
        if rows is None and not args.raw_ids:
            rows = 100000
        n = ctr.convert_criteo(args.tsv, args.out, rows, args.test_fraction, args.raw_ids,
                               args.compression)
        ids = "raw 32-bit hashes" if args.raw_ids else f"{rows} rows"
        print(f"wrote {args.out}: {n} Criteo examples, 26 fields of {ids}")
        return 0
    if args.dataset == "hash-ids":
        ctr.hash_ctr(args.src, args.out, args.rows_per_field, args.compression)
        print(f"wrote {args.out}: the examples of {args.src}, ids hashed into "
              f"{args.rows_per_field} rows per field (id mod rows)")
        return 0
    if args.dataset == "digits":
        out = args.out or datasets.default_data_path()
        datasets.prepare_digits(out, test_fraction=args.test_fraction, seed=args.seed,
                                compression=args.compression)
    else:
        out = args.out
        datasets.convert_mnist_idx(args.idx_dir, out, compression=args.compression)
    _report_dataset(out)
    return 0


# --- ckpt -------------------------------------------------------------------------------
def cmd_ckpt(args):
    """List, show, verify or export checkpoints (mpitf.ckpt.commands does the work)."""
    from ..ckpt import commands as ckpt_commands

    if not os.path.exists(args.dir):
        raise ConfigurationError(f"no such checkpoint directory: {args.dir}")
    if args.action == "ls":
        return ckpt_commands.cmd_ls(args.dir)
    if args.action == "show":
        return ckpt_commands.cmd_show(args.dir, step=args.step)
    if args.action == "verify":
        return ckpt_commands.cmd_verify(args.dir)
    return ckpt_commands.cmd_export(args.dir, args.out, step=args.step,
                                    write=_export_writer(args.format, args.out))


def _export_writer(fmt, out):
    """Return the writer of ``--format`` (None: an .npz); torch's is mpitf.torch's."""
    if (fmt or ("torch" if out.endswith((".pt", ".pth")) else "npz")) == "npz":
        return None
    try:  # by name: only mpitf.torch imports torch, and only when asked for
        return importlib.import_module("mpitf.torch.export").write_state_dict
    except ImportError as e:
        raise ConfigurationError(f"--format torch writes with torch, which does not import "
                                 f"here ({e}): install the torch extra, or use --format "
                                 "npz") from None


# --- bench ------------------------------------------------------------------------------
def cmd_bench(args):
    """Run the benchmark suites of mpitf.bench.runner."""
    if importlib.util.find_spec("mpitf.bench.runner") is None:
        return _error("the benchmarks (mpitf.bench.runner) are not part of this mpitf installation;"
                      " update mpitf, or run the scripts under benchmarks/ directly",
                      EXIT_ERROR)
    if args.plan:
        from ..bench import planner

        return planner.main(args)
    if args.box is not None or (args.suite == "scaling" and args.link_scaling):
        from ..bench import boxscaling

        return boxscaling.main(args)
    from ..bench import runner as bench

    code = bench.main(args)
    return 0 if code is None else code


# --- parser -----------------------------------------------------------------------------
def _bench_models(text):
    """Return ``text`` (comma-separated models of the built-in job) as a tuple, for argparse."""
    from ..config import JobConfig

    known = JobConfig.__dataclass_fields__["model"].metadata["choices"]
    models = tuple(m for m in text.split(",") if m)
    unknown = [m for m in models if m not in known]
    if not models or unknown:
        raise argparse.ArgumentTypeError(
            f"expecting models among {','.join(known)}, got {text!r}")
    return models


def _at_least_one(text):
    """Return ``text`` as an int >= 1, for argparse (which prints one usage line, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expecting a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser():
    """Return the argparse parser of the ``mpitf`` command."""
    parser = argparse.ArgumentParser(
        prog="mpitf", description="Parameter-server training on MPI: tools around the jobs.")
    parser.add_argument("--version", action="version", version=f"mpitf {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("cluster", help="print the rank -> task -> host map of a cluster spec",
                       description="Print which MPI rank runs which task, launching nothing.")
    p.add_argument("--spec", required=True, help=f"the cluster: {SPEC_FORMS}")
    p.add_argument("-n", type=int, default=None,
                   help="MPI ranks (default: one per host in --hosts, else one per task)")
    p.add_argument("--hosts", default=None,
                   help="comma-separated host of each rank, e.g. 'n1,n1,n2,n2'"
                        " (default: all 'localhost')")
    p.set_defaults(handler=cmd_cluster)

    p = sub.add_parser("run", help="run a job under mpiexec on this workstation",
                       description="Run JOB on N ranks with the installed MPI's mpiexec;"
                                   " exit with its exit code. Under Slurm, prefer srun.",
                       epilog=f"built-in jobs: {', '.join(builtin_jobs())} (each runs as"
                              " 'python -m mpitf.jobs.NAME'), e.g. 'mpitf run -n 3 mnist_mlp"
                              " --steps 50'; 'python -m mpitf.jobs.NAME --help' lists a"
                              " job's flags.")
    p.add_argument("-n", type=int, required=True, help="number of MPI ranks")
    p.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    p.add_argument("--hosts", default=None,
                   help="spread the ranks over these hosts, e.g. 'n1:4,n2:4' (NAME:SLOTS, one"
                        " slot when omitted): mpiexec's -hosts (Open MPI: --host); ranks fill"
                        " each host's slots in turn")
    p.add_argument("--hostfile", default=None,
                   help="a host file for mpiexec's -f (Open MPI: --hostfile)")
    p.add_argument("--mpiexec", default=None,
                   help="the mpiexec to use (default: the one next to this Python, else PATH)")
    p.add_argument("--launcher", default=None,
                   help="with --hosts or --hostfile: the command that starts mpiexec's proxy"
                        " on each host, called as 'LAUNCHER HOST COMMAND' (default: what"
                        " HYDRA_LAUNCHER_EXEC / PRTE_MCA_plm_ssh_agent name, else ssh); mpitf"
                        " starts it through a script that notes how each proxy ended, to name"
                        " a lost node")
    p.add_argument("job", metavar="JOB",
                   help="a built-in job's name (e.g. mnist_mlp), a .py file (run with this"
                        " Python) or a program")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the job")
    p.set_defaults(handler=cmd_run)

    p = sub.add_parser("data", help="prepare an HDF5 data set",
                       description="Write a data set in mpitf's HDF5 layout.")
    data = p.add_subparsers(dest="dataset", metavar="DATASET", required=True)
    d = data.add_parser("digits", help="scikit-learn's 8x8 digits (bundled, no download)")
    d.add_argument("--out", default=None,
                   help="output file (default: $MPITF_DATA_DIR/digits.h5 or ~/.cache/mpitf)")
    d.add_argument("--test-fraction", type=float, default=0.2,
                   help="share held out for testing (default: 0.2)")
    d.add_argument("--seed", type=int, default=0, help="shuffle seed (default: 0)")
    d = data.add_parser("mnist", help="convert the four MNIST IDX files (plain or .gz)")
    d.add_argument("--idx-dir", required=True, help="directory holding the IDX files")
    d.add_argument("--out", required=True, help="output file")
    d = data.add_parser("synthetic-ctr", help="power-law click-through data from a planted "
                        "model (prints the planted model's test AUC: the ceiling)")
    d.add_argument("--out", required=True, help="output file")
    d.add_argument("--train", type=int, default=200000, help="training examples")
    d.add_argument("--test", type=int, default=5000, help="test examples")
    d.add_argument("--fields", type=int, default=8, help="categorical fields")
    d.add_argument("--rows", type=int, default=1000, help="rows of each field's table")
    d.add_argument("--dense", type=int, default=4, help="dense features")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--raw-ids", action="store_true",
                   help="raw int64 ids of a vocabulary that grows over the file (new ids "
                        "appear, old ones fade; --rows of them live), for tables that grow")
    d.add_argument("--growth", type=float, default=0.02,
                   help="with --raw-ids: new ids per example per field (default: 0.02)")
    d = data.add_parser("criteo", help="convert Criteo's display-advertising TSV (label, 13 "
                        "integers, 26 hashed categories)")
    d.add_argument("--tsv", required=True, help="the TSV file")
    d.add_argument("--out", required=True, help="output file")
    d.add_argument("--rows-per-field", type=int, default=None,
                   help="rows each field's ids are hashed into (default: 100000)")
    d.add_argument("--raw-ids", action="store_true",
                   help="keep Criteo's raw 32-bit hashes as ids (no modulo), for tables "
                        "that grow")
    d.add_argument("--test-fraction", type=float, default=0.1,
                   help="share of the last lines held out for testing")
    d = data.add_parser("hash-ids", help="a click-through file of raw ids with its ids "
                        "hashed into fixed tables (id mod rows)")
    d.add_argument("--src", required=True, help="a file of raw ids")
    d.add_argument("--out", required=True, help="output file")
    d.add_argument("--rows-per-field", type=int, required=True,
                   help="rows of each field's fixed table")
    for d in data.choices.values():
        d.add_argument("--compression", choices=("gzip", "lzf"), default=None,
                       help="compress the file's chunks (default: none)")
    p.set_defaults(handler=cmd_data)

    p = sub.add_parser("ckpt", help="list, show, verify or export checkpoints",
                       description="Inspect the checkpoints under a directory.")
    ckpt = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    c = ckpt.add_parser("ls", help="list the checkpoints, oldest first")
    c.add_argument("dir", help="checkpoint directory")
    c = ckpt.add_parser("show", help="describe the latest checkpoint (or the one at --step)")
    c.add_argument("dir", help="checkpoint directory")
    c.add_argument("--step", type=int, default=None, help="global step of the checkpoint")
    c = ckpt.add_parser("verify", help="check every shard's checksums; exit 1 on damage")
    c.add_argument("dir", help="checkpoint directory, or one checkpoint in it")
    c = ckpt.add_parser("export", help="write a checkpoint's variables, buffers and tables "
                        "to an .npz file or a torch state_dict")
    c.add_argument("dir", help="checkpoint directory")
    c.add_argument("--out", required=True, help="output file (.npz, or .pt/.pth: torch)")
    c.add_argument("--format", choices=("npz", "torch"), default=None,
                   help="npz: one entry per name; torch: a torch.save'd state_dict of "
                   "tensors by state_dict key, each fixed table whole (rows x dim), a table "
                   "that grows as its rows (ids ascending) and '<key>/ids' (default: torch "
                   "for .pt/.pth, else npz)")
    c.add_argument("--step", type=int, default=None, help="global step of the checkpoint")
    p.set_defaults(handler=cmd_ckpt)

    p = sub.add_parser("bench", help="run the push/pull, scaling and consistency benchmarks",
                       description="Run mpitf's benchmarks and write reports.",
                       epilog="needs matplotlib for the plots: pip install 'mpitf[bench]'")
    p.add_argument("--quick", action="store_true", help="short runs, for a smoke test")
    p.add_argument("--out", default="benchmarks", help="report directory (default: benchmarks)")
    p.add_argument("--suite", choices=("pushpull", "scaling", "modes", "kernels", "fabric",
                                       "all"), default="all",
                   help="which benchmarks (default: all; fabric: a two-rank ping-pong, "
                        "written to OUT/fabric.json for --plan)")
    p.add_argument("-n", type=int, default=None, help="MPI ranks (default: the suite's own)")
    p.add_argument("--models", default="mlp,cnn", type=_bench_models,
                   help="the built-in job's models that the scaling suite and the cost "
                        "model's profiles run (default: mlp,cnn)")
    p.add_argument("--hosts", default=None,
                   help="run every suite's ranks over these hosts (mpiexec -hosts, e.g. "
                        "'n1,n2': ranks go round them), so the fabric and push/pull figures "
                        "cross the network")
    p.add_argument("--repeats", type=_at_least_one, default=None,
                   help="rounds of the job suites, each running the profiles, every scaling "
                        "point and the 1-worker modes once; a figure is its best round "
                        "(default 3, --quick 1)")
    g = p.add_argument_group("scaling over links (--suite scaling; mpitf against "
                             "MPI_Iallreduce, emulated compute; see benchmarks/README.md)")
    g.add_argument("--box", type=_at_least_one, default=None,
                   help="make a cluster in a box of this many nodes (1-16; root) and run the "
                        "scaling grid on it")
    g.add_argument("--link-scaling", action="store_true",
                   help="with --hosts: run the scaling grid over links on those hosts")
    g.add_argument("--rate", default=None,
                   help="--box: each link's rate as tc writes it (default 200mbit)")
    g.add_argument("--workers", default=None, help="worker counts (default 1,2,4,8)")
    g.add_argument("--ps", default=None,
                   help="ps counts (default 1,2,4,8; N: as many as workers)")
    g.add_argument("--placement", default=None,
                   help="own (ps on nodes of their own), beside (on the workers' nodes) or "
                        "own,beside (the default)")
    g.add_argument("--sizes", default=None,
                   help="model sizes in bytes (default 4 and 16 MiB)")
    g = p.add_argument_group("planning (no benchmark runs; see docs/costmodel.md)")
    g.add_argument("--plan", action="store_true",
                   help="recommend ps count, buckets and aggregation for a cluster")
    g.add_argument("--nodes", default=None, help="nodes running workers")
    g.add_argument("--workers-per-node", default="1", help="workers per node")
    g.add_argument("--model-bytes", default=None, help="model size, e.g. 100M, 2.5G")
    g.add_argument("--compute-ms", default=None,
                   help="compute per step per worker (forward + backward), milliseconds")
    g.add_argument("--fabric", default=None,
                   help="a fabric file (mpitf bench --suite fabric) or LATENCY_S,BYTES_PER_S")
    g.add_argument("--apply-rate", default="2G",
                   help="ps apply bytes/s per thread (kernels suite; default 2G)")
    g.add_argument("--ps-threads", default="8", help="threads per ps (default 8)")
    g.add_argument("--msg-us", default="10",
                   help="ps software time per message, microseconds (default 10)")
    g.add_argument("--shm-rate", default="10G",
                   help="node-local aggregation: shared-memory bytes/s (default 10G)")
    g.add_argument("--max-ps", default=None, help="most ps (default: --nodes)")
    g.add_argument("--plan-placement", choices=("any", "own", "beside"), default="any",
                   help="where the ps may run: on nodes of their own, beside the workers (one"
                        " ps per worker node, one worker per node), or either (default: any)")
    g.add_argument("--plan-mode", choices=("sync", "backup", "async", "ssp"), default="sync",
                   help="consistency mode to plan for (default: sync)")
    p.set_defaults(handler=cmd_bench)
    return parser


def main(argv=None):
    """Run the ``mpitf`` command and return its exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # usage errors (2), --help and --version (0)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        return args.handler(args)
    except ConfigurationError as exc:
        return _error(str(exc), EXIT_USAGE)
    except (MpitfError, OSError) as exc:
        return _error(str(exc), EXIT_ERROR)


if __name__ == "__main__":
    sys.exit(main())
