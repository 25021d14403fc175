"""Memory-mapped indexed forest dataset: ``PREFIX.bin`` + ``PREFIX.idx``.

``.bin``: 16-byte header (magic ``HARTSBIN``, u32 version, u32 0), then the
row-level arrays (tokens, per-row fields), the exception tables and the compaction
events (per segment and per trajectory), each at a 64-byte aligned offset.  It is only ever memory-mapped: reading tree ``i``
touches that tree's bytes alone.

``.idx``: magic ``HARTSIDX``, u32 version, u64 length of a JSON header, the
JSON header (array directory, trajectory ids/groups/parents, statistics, size
of the .bin), the segment/trajectory/tree tables (aligned), and a trailing
CRC32 of everything before it.  Each tree has its own CRC32 over its slices of
the .bin, checked when the tree is read, so corruption is found without
reading the whole file; a truncated .bin is found on open (its size is in the
header).

Versions: 2 adds the compaction events (``seg_evt_offsets`` and ``traj_evt_offsets`` in the
index, the event arrays in the .bin); version 1 files (no events) are still read.  3 adds the
per-token ``rollout_logprobs`` and ``ref_logprobs``, each stored as ``old_logprobs`` is (row array
and exception table in the .bin, ``traj_has_*`` in the index, in the tree CRC32s) and only when
some trajectory has it; a forest with neither is written as version 2, which builds that read
versions 1 and 2 read too.

Writes are atomic: both files go to temporary names, are fsynced, then renamed
(.bin first; a stale .idx cannot pass with a new .bin since sizes and CRCs
would not match).
"""
from __future__ import annotations

import json
import os
import struct
import zlib
from typing import Dict, Optional

import numpy as np

from .errors import TreeFormatError
from .forest import EXTRA_LOGPROBS, Exceptions, Forest, build_forest
from .readers import read_trajectories

VERSION = 3
READS = (1, 2, 3)
BIN_MAGIC = b"HARTSBIN"
IDX_MAGIC = b"HARTSIDX"
_ALIGN = 64

_ROW_ARRAYS = ("tokens", "row_loss_mask", "row_old_logprobs", "row_advantage")
_EXC_FIELDS = ("exc_loss_mask", "exc_old_logprobs", "exc_advantage")
_SEG_ARRAYS = ("seg_parent", "seg_start", "seg_length", "seg_row", "seg_traj_lo", "seg_traj_hi")
_TRAJ_ARRAYS = ("traj_leaf", "traj_length", "traj_has_old_logprobs", "traj_adv_kind", "traj_advantage",
                "traj_reward", "traj_weight")
_EVT_OFFSETS = ("seg_evt_offsets", "traj_evt_offsets")      # index tables (version 2)
_EVT_ARRAYS = ("evt_at", "evt_start", "evt_end", "traj_evt")  # .bin arrays (version 2)


def _extras(f: Forest):
    """The optional log-prob fields ``f`` holds (version 3): names in EXTRA_LOGPROBS order."""
    return [name for name in EXTRA_LOGPROBS if getattr(f, f"row_{name}") is not None]


def dataset_paths(prefix: str):
    return prefix + ".bin", prefix + ".idx"


def is_dataset(path: str) -> bool:
    """True when ``path`` is a dataset prefix (or names its .bin/.idx)."""
    prefix = _strip(path)
    return os.path.exists(prefix + ".idx") and os.path.exists(prefix + ".bin")


def _strip(path: str) -> str:
    for ext in (".idx", ".bin"):
        if path.endswith(ext):
            return path[: -len(ext)]
    return path


class _Writer:
    """Appends aligned arrays to a binary file, recording a directory entry for each."""

    def __init__(self, fh, start: int):
        self.fh = fh
        self.pos = start
        self.directory: Dict[str, list] = {}

    def add(self, name: str, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr)
        pad = (-self.pos) % _ALIGN
        self.fh.write(b"\0" * pad)
        self.pos += pad
        self.directory[name] = [self.pos, arr.dtype.str, list(arr.shape)]
        data = arr.tobytes()
        self.fh.write(data)
        self.pos += len(data)


def _tree_crc(f: Forest, tokens: np.ndarray, i: int) -> int:
    """CRC32 of tree ``i``'s slices of the row arrays, exception tables and compaction events."""
    s0, s1 = int(f.tree_offsets[i]), int(f.tree_offsets[i + 1])
    r0 = int(f.seg_row[s0])
    r1 = int(f.seg_row[s1 - 1] + f.seg_length[s1 - 1])
    t0, t1 = int(f.seg_traj_lo[s0]), int(f.seg_traj_hi[s0])
    crc = 0
    extras = _extras(f)
    for arr in (tokens, f.row_loss_mask, f.row_old_logprobs, f.row_advantage,
                *(getattr(f, f"row_{name}") for name in extras)):
        crc = zlib.crc32(np.ascontiguousarray(arr[r0:r1]).tobytes(), crc)
    for name in _EXC_FIELDS + tuple(f"exc_{name}" for name in extras):
        exc: Exceptions = getattr(f, name)
        a, b = np.searchsorted(exc.traj, [t0, t1])
        for arr in (exc.traj, exc.pos, exc.value):
            crc = zlib.crc32(np.ascontiguousarray(arr[a:b]).tobytes(), crc)
    if f.has_compactions or f.traj_evt.shape[0]:
        e0, e1 = int(f.seg_evt_offsets[s0]), int(f.seg_evt_offsets[s1])
        for arr in (f.evt_at, f.evt_start, f.evt_end):
            crc = zlib.crc32(np.ascontiguousarray(arr[e0:e1]).tobytes(), crc)
        a, b = int(f.traj_evt_offsets[t0]), int(f.traj_evt_offsets[t1])
        crc = zlib.crc32(np.ascontiguousarray(f.traj_evt[a:b]).tobytes(), crc)
    return crc


def write_dataset(forest: Forest, prefix: str) -> None:
    """Write ``forest`` to ``PREFIX.bin`` / ``PREFIX.idx`` atomically."""
    bin_path, idx_path = dataset_paths(prefix)
    tmp_bin = f"{bin_path}.tmp.{os.getpid()}"
    tmp_idx = f"{idx_path}.tmp.{os.getpid()}"
    tok = forest.tokens
    tokens = tok.astype(np.int32) if (tok.size == 0 or tok.max() < 2 ** 31) else tok.astype(np.int64)
    extras = _extras(forest)
    version = VERSION if extras else 2
    try:
        with open(tmp_bin, "wb") as fh:
            fh.write(BIN_MAGIC + struct.pack("<II", version, 0))
            w = _Writer(fh, 16)
            w.add("tokens", tokens)
            for name in _ROW_ARRAYS[1:] + tuple(f"row_{name}" for name in extras):
                w.add(name, getattr(forest, name))
            for name in _EXC_FIELDS + tuple(f"exc_{name}" for name in extras):
                exc: Exceptions = getattr(forest, name)
                w.add(name + ".traj", exc.traj)
                w.add(name + ".pos", exc.pos)
                w.add(name + ".value", exc.value)
            for name in _EVT_ARRAYS:
                w.add(name, getattr(forest, name))
            fh.flush()
            os.fsync(fh.fileno())
            bin_size = w.pos
            bin_dir = w.directory

        tables = {name: getattr(forest, name) for name in _SEG_ARRAYS + _TRAJ_ARRAYS + _EVT_OFFSETS
                  + tuple(f"traj_has_{name}" for name in extras)}
        tables["tree_offsets"] = forest.tree_offsets
        tables["tree_crc"] = np.array([_tree_crc(forest, tokens, i) for i in range(forest.num_trees)],
                                      dtype=np.uint32)
        header = {
            "version": version, "bin_size": bin_size, "bin": bin_dir,
            "traj_ids": forest.traj_ids, "traj_group": forest.traj_group,
            "traj_parent": [None if p is None else list(p) for p in forest.traj_parent],
            "stats": forest.stats(),
        }
        # table offsets depend on the header length: lay tables out relative to its end
        body = bytearray()
        idx_dir = {}
        for name, arr in tables.items():
            arr = np.ascontiguousarray(arr)
            body.extend(b"\0" * ((-len(body)) % _ALIGN))
            idx_dir[name] = [len(body), arr.dtype.str, list(arr.shape)]
            body.extend(arr.tobytes())
        header["idx"] = idx_dir
        hjson = json.dumps(header, separators=(",", ":")).encode()
        head = IDX_MAGIC + struct.pack("<IQ", version, len(hjson)) + hjson
        head += b"\0" * ((-len(head)) % _ALIGN)
        blob = head + bytes(body)
        with open(tmp_idx, "wb") as fh:
            fh.write(blob)
            fh.write(struct.pack("<I", zlib.crc32(blob)))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_idx, idx_path)
    except BaseException:
        for p in (tmp_bin, tmp_idx):
            if os.path.exists(p):
                os.unlink(p)
        raise


class TreeDataset:
    """Random access to the trees of a written dataset; ``ds[i]`` is tree ``i`` as a Forest."""

    def __init__(self, path: str):
        self.prefix = _strip(path)
        self.bin_path, self.idx_path = dataset_paths(self.prefix)
        for p in (self.bin_path, self.idx_path):
            if not os.path.exists(p):
                raise TreeFormatError("no such dataset file", file=p)
        self._read_index()
        self._map_bin()

    def _fail(self, message: str, file: Optional[str] = None, field: str = "checksum"):
        return TreeFormatError(message, file=file or self.idx_path, field=field)

    def _read_index(self) -> None:
        with open(self.idx_path, "rb") as fh:
            blob = fh.read()
        if len(blob) < 24 or blob[:8] != IDX_MAGIC:
            raise self._fail("not a megatron_harts index (bad magic)", field="header")
        version, hlen = struct.unpack_from("<IQ", blob, 8)
        if version not in READS:
            raise self._fail(f"unsupported version {version} (this build reads versions "
                             f"{', '.join(map(str, READS))})", field="version")
        self.version = version
        (crc,) = struct.unpack_from("<I", blob, len(blob) - 4)
        if zlib.crc32(blob[:-4]) != crc:
            raise self._fail("index is corrupt or truncated (CRC32 mismatch)")
        header = json.loads(blob[20: 20 + hlen])
        base = 20 + hlen
        base += (-base) % _ALIGN
        self.header = header
        self._tables = {}
        for name, (off, dtype, shape) in header["idx"].items():
            count = int(np.prod(shape)) if shape else 1
            self._tables[name] = np.frombuffer(blob, dtype=np.dtype(dtype), count=count,
                                               offset=base + off).reshape(shape)

    def _map_bin(self) -> None:
        size = os.path.getsize(self.bin_path)
        if size != self.header["bin_size"]:
            raise self._fail(f"data file is {size} bytes, the index expects {self.header['bin_size']} "
                             "(truncated or from another write)", file=self.bin_path)
        with open(self.bin_path, "rb") as fh:
            head = fh.read(16)
        if head[:8] != BIN_MAGIC or struct.unpack_from("<I", head, 8)[0] != self.version:
            raise self._fail("not a megatron_harts data file (bad magic or version)", file=self.bin_path,
                             field="header")
        mm = np.memmap(self.bin_path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        self._arrays = {}
        for name, (off, dtype, shape) in self.header["bin"].items():
            dt = np.dtype(dtype)
            count = int(np.prod(shape))
            self._arrays[name] = mm[off: off + count * dt.itemsize].view(dt).reshape(shape)

    def __len__(self) -> int:
        return int(self._tables["tree_offsets"].shape[0] - 1)

    def stats(self) -> dict:
        return dict(self.header["stats"])

    def forest(self, verify: bool = True) -> Forest:
        """All trees as one Forest (arrays stay memory-mapped)."""
        if verify:
            for i in range(len(self)):
                self._verify(i)
        t = self._tables
        a = self._arrays
        ex = {name: Exceptions(a[name + ".traj"], a[name + ".pos"], a[name + ".value"])
              for name in _EXC_FIELDS}
        if self.version >= 2:
            ex.update({name: t[name] for name in _EVT_OFFSETS})
            ex.update({name: a[name] for name in _EVT_ARRAYS})
        for name in EXTRA_LOGPROBS:     # version 3, where some trajectory has the field
            if f"row_{name}" in a:
                ex.update({f"row_{name}": a[f"row_{name}"], f"traj_has_{name}": t[f"traj_has_{name}"],
                           f"exc_{name}": Exceptions(a[f"exc_{name}.traj"], a[f"exc_{name}.pos"],
                                                     a[f"exc_{name}.value"])})
        return Forest(
            tokens=a["tokens"], row_loss_mask=a["row_loss_mask"], row_old_logprobs=a["row_old_logprobs"],
            row_advantage=a["row_advantage"],
            **{name: t[name] for name in _SEG_ARRAYS + _TRAJ_ARRAYS},
            tree_offsets=t["tree_offsets"],
            traj_ids=list(self.header["traj_ids"]), traj_group=list(self.header["traj_group"]),
            traj_parent=[None if p is None else (p[0], p[1]) for p in self.header["traj_parent"]],
            **ex,
        )

    def _verify(self, i: int) -> None:
        f = self._whole()
        crc = _tree_crc(f, f.tokens, i)
        if crc != int(self._tables["tree_crc"][i]):
            raise self._fail(f"tree {i} is corrupt (CRC32 mismatch)", file=self.bin_path)

    def _whole(self) -> Forest:
        if not hasattr(self, "_forest_cache"):
            self._forest_cache = self.forest(verify=False)
        return self._forest_cache

    def __getitem__(self, i: int) -> Forest:
        if not -len(self) <= i < len(self):
            raise IndexError(f"tree {i} out of range for a dataset of {len(self)} trees")
        i %= len(self)
        self._verify(i)
        tree = self._whole().tree(i)
        tree.tokens = np.asarray(tree.tokens, dtype=np.int64)
        return tree

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]


def load_forest(path: str, *, vocab_size: Optional[int] = None, workers: int = 1) -> Forest:
    """A Forest from a dataset prefix (.bin/.idx) or from trajectory files (JSONL/Parquet)."""
    if is_dataset(path):
        return TreeDataset(path).forest()
    return build_forest(read_trajectories([path], vocab_size=vocab_size, workers=workers))
