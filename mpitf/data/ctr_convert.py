"""Converting click-through data: Criteo's TSV, and raw ids hashed into fixed tables.

Both read and write in blocks of lines or rows (:class:`~mpitf.data.ctr.CtrWriter`), so
their input may be larger than memory.
"""

import zlib

import numpy as np

from ..config import check_int
from ..errors import ConfigurationError, DataError
from .ctr import DYNAMIC, CtrWriter, _checked, _open_ctr

__all__ = ["MISSING_RAW", "convert_criteo", "hash_ctr"]

MISSING_RAW = 1 << 32  # the raw id of a missing Criteo category: outside the 32-bit hashes
_BLOCK = 1 << 16  # lines a converter parses (rows it writes) at a time


def _count_lines(path):
    """Return the lines of a text file (a last line without a newline counts)."""
    count, last = 0, b"\n"
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


def _criteo_ids(parts, rows_per_field):
    """Return one line's 26 ids: crc32 hashed into the rows, or the raw 32-bit hashes."""
    if rows_per_field is None:  # raw: the hexadecimal hash itself, a missing one its own id
        return [int(p, 16) if p else MISSING_RAW for p in parts]
    return [1 + zlib.crc32(p.encode()) % (rows_per_field - 1) if p else 0 for p in parts]


def convert_criteo(tsv, out, rows_per_field=None, test_fraction=0.1, raw_ids=False,
                   compression=None):
    """Convert Criteo's display-advertising TSV (label, 13 ints, 26 hashed categories).

    Integer features become ``log(1 + max(x, 0))`` (missing: 0); each categorical value
    (hexadecimal, missing: its own id) is hashed with crc32 into ``rows_per_field`` rows,
    or with ``raw_ids`` kept as its own 32-bit hash (missing: ``2**32``) for tables that
    grow. The last ``test_fraction`` of the lines is the test split. The file is read and
    written in blocks of lines, so it may be larger than memory. Returns the example count.
    """
    if raw_ids:
        if rows_per_field is not None:
            raise ConfigurationError("give --rows-per-field (ids hashed into fixed tables) or "
                                     "--raw-ids (the raw hashes), not both")
    else:
        check_int("rows_per_field", rows_per_field, 2)
    if not 0 < test_fraction < 1:
        raise ConfigurationError(f"test_fraction must be in (0, 1), got {test_fraction}")
    n = _count_lines(tsv)
    if n < 2:
        with open(tsv) as f:
            first = f.readline().rstrip("\n").split("\t")
        if n and len(first) != 40:
            raise DataError(f"{tsv}:1: expecting 40 tab-separated fields (label, 13 integers, "
                            f"26 categories), got {len(first)}")
        raise DataError(f"{tsv}: needs at least 2 lines, got {n}")
    cut = n - max(1, int(round(n * test_fraction)))
    table_rows = DYNAMIC if raw_ids else [rows_per_field] * 26
    with CtrWriter(out, table_rows, {"train": cut, "test": n - cut}, 26, 13, compression) as w, \
            open(tsv) as f:
        block = ([], [], [])
        for number, line in enumerate(f, 1):
            for rows, value in zip(block, _parse(tsv, number, line,
                                                 None if raw_ids else rows_per_field)):
                rows.append(value)
            if len(block[2]) == _BLOCK or number in (cut, n):
                start = number - len(block[2])
                split, start = ("train", start) if start < cut else ("test", start - cut)
                w.write(split, start, *block)
                block = ([], [], [])
    return n


def _parse(tsv, number, line, rows_per_field):
    """Return line ``number``'s ``(ids, dense, label)``, or raise DataError naming it."""
    parts = line.rstrip("\n").split("\t")
    if len(parts) != 40:
        raise DataError(f"{tsv}:{number}: expecting 40 tab-separated fields (label, "
                        f"13 integers, 26 categories), got {len(parts)}")
    try:
        label = int(parts[0])
        dense = [np.log1p(max(int(p), 0)) if p else 0.0 for p in parts[1:14]]
    except ValueError:
        raise DataError(f"{tsv}:{number}: label and integer features must be "
                        "integers") from None
    try:
        return _criteo_ids(parts[14:], rows_per_field), dense, label
    except ValueError:
        raise DataError(f"{tsv}:{number}: with --raw-ids every category must be a "
                        "hexadecimal hash (Criteo's), got "
                        f"{next(p for p in parts[14:] if not _is_hex(p))!r}") from None


def _is_hex(text):
    try:
        int(text or "0", 16)
    except ValueError:
        return False
    return True


def hash_ctr(src, out, rows_per_field, compression=None):
    """Write ``src``'s examples to ``out`` with raw ids hashed into fixed tables (id mod R).

    The fixed-table twin of a file of raw ids, to compare tables that grow with hashed
    tables of ``rows_per_field`` rows per field. Read and written in blocks.
    """
    check_int("rows_per_field", rows_per_field, 1)
    handles = {}
    try:
        for split in ("train", "test"):
            handles[split] = _open_ctr(src, split, None, True)[:2]
        arrays = handles["train"][1]
        fields = arrays[0][1].shape[1]
        dense_dim = arrays[1][1].shape[1] if len(arrays) == 3 else 0
        sizes = {split: len(a[0][1]) for split, (_, a) in handles.items()}
        with CtrWriter(out, [rows_per_field] * fields, sizes, fields, dense_dim,
                       compression) as w:
            for split, (_, arrays) in handles.items():
                for lo in range(0, sizes[split], _BLOCK):
                    ids, dense, y = _checked(src, split, [d[lo:lo + _BLOCK] for _, d in arrays],
                                             None, None)
                    w.write(split, lo, np.mod(ids, rows_per_field), dense, y)
    finally:
        for f, _ in handles.values():
            f.close()
    return out
