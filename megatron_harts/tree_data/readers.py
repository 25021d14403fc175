"""Trajectory files -> validated Trajectory lists.

Formats: JSONL (``.jsonl``, ``.json``, optionally ``.gz``), one JSON object
per line, and Parquet (``.parquet``), one trajectory per row.  Fields are
documented in docs/data_format.md.  Every problem raises TreeFormatError
naming file, line (Parquet: row, 1-based), trajectory and field.
"""
from __future__ import annotations

import gzip
import json
import os
import warnings
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Iterable, List, Optional, Sequence, Set, Tuple

from .errors import TreeFormatError
from .trajectory import LOGPROB_FIELDS, Trajectory, make_trajectory

KNOWN_FIELDS = frozenset(
    ["id", "tokens", "loss_mask", *LOGPROB_FIELDS, "advantage", "reward", "weight", "group", "parent",
     "compactions"])


class UnknownFieldsWarning(UserWarning):
    """Input records carried fields megatron_harts does not use (they are ignored)."""


def _open_text(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, "r", encoding="utf-8")


def _parse_lines(path: str, first_line: int, lines: Sequence[str], vocab_size: Optional[int]
                 ) -> Tuple[List[Trajectory], Set[str]]:
    out: List[Trajectory] = []
    unknown: Set[str] = set()
    for k, text in enumerate(lines):
        line = first_line + k
        if not text.strip():
            continue
        try:
            rec = json.loads(text)
        except json.JSONDecodeError as e:
            raise TreeFormatError(_json_error(text, e), file=path, line=line) from None
        if not isinstance(rec, dict):
            raise TreeFormatError(f"expected a JSON object, got {type(rec).__name__}", file=path, line=line)
        unknown.update(k2 for k2 in rec if k2 not in KNOWN_FIELDS)
        out.append(make_trajectory(rec, file=path, line=line, vocab_size=vocab_size))
    return out, unknown


def _json_error(text: str, e: json.JSONDecodeError) -> str:
    """Where a JSON line breaks: a line cut short says so, with its length; otherwise the
    column and the text around it."""
    body = text.rstrip("\r\n")
    if e.pos >= len(body.rstrip()):
        return (f"malformed JSON: the line ends after {len(body)} characters before the object is "
                f"complete ({e.msg}): truncated line?")
    lo = max(0, e.pos - 20)
    near = body[lo: e.pos + 20]
    return f"malformed JSON at column {e.colno}: {e.msg}, near {near!r}"


def _parse_chunk(args):
    return _parse_lines(*args)


def _read_jsonl(path: str, vocab_size, workers: int, progress) -> Tuple[List[Trajectory], Set[str]]:
    try:
        with _open_text(path) as fh:
            lines = fh.readlines()
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise TreeFormatError(f"cannot read: {e}", file=path) from None
    if workers <= 1 or len(lines) < 2 * workers:
        trajs, unknown = _parse_lines(path, 1, lines, vocab_size)
        if progress:
            progress(len(lines))
        return trajs, unknown
    step = max(1, (len(lines) + 4 * workers - 1) // (4 * workers))
    chunks = [(path, a + 1, lines[a:a + step], vocab_size) for a in range(0, len(lines), step)]
    trajs: List[Trajectory] = []
    unknown: Set[str] = set()
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for (part, unk), chunk in zip(pool.map(_parse_chunk, chunks), chunks):
            trajs.extend(part)
            unknown |= unk
            if progress:
                progress(len(chunk[2]))
    return trajs, unknown


def _read_parquet(path: str, vocab_size, progress) -> Tuple[List[Trajectory], Set[str]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a broken file
        raise TreeFormatError(f"malformed Parquet: {e}", file=path) from None
    unknown = {name for name in pf.schema_arrow.names if name not in KNOWN_FIELDS}
    out: List[Trajectory] = []
    row = 0
    try:
        batches = pf.iter_batches(columns=[c for c in pf.schema_arrow.names if c in KNOWN_FIELDS])
        for batch in batches:
            for rec in batch.to_pylist():
                row += 1
                out.append(make_trajectory(rec, file=path, line=row, vocab_size=vocab_size))
            if progress:
                progress(batch.num_rows)
    except TreeFormatError:
        raise
    except Exception as e:
        raise TreeFormatError(f"malformed Parquet near row {row + 1}: {e}", file=path) from None
    return out, unknown


def read_trajectories(paths: Iterable[str], *, vocab_size: Optional[int] = None, workers: int = 1,
                      progress: Optional[Callable[[int], None]] = None) -> List[Trajectory]:
    """Read and validate every trajectory of ``paths`` (in file order).

    Unknown fields are ignored with one UnknownFieldsWarning listing them.
    """
    trajs: List[Trajectory] = []
    unknown: Set[str] = set()
    for path in paths:
        if not os.path.exists(path):
            raise TreeFormatError("no such file", file=path)
        if path.endswith(".parquet"):
            part, unk = _read_parquet(path, vocab_size, progress)
        else:
            part, unk = _read_jsonl(path, vocab_size, workers, progress)
        trajs.extend(part)
        unknown |= unk
    if unknown:
        warnings.warn("ignored unknown fields: " + ", ".join(sorted(unknown)), UnknownFieldsWarning,
                      stacklevel=2)
    return trajs


def trajectory_record(t: Trajectory) -> dict:
    """The JSON-able record of a trajectory (the inverse of make_trajectory)."""
    rec = {"id": t.id, "tokens": t.tokens.tolist(), "loss_mask": t.loss_mask.tolist()}
    for name in LOGPROB_FIELDS:
        values = getattr(t, name)
        if values is not None:
            rec[name] = [None if v != v else v for v in values.tolist()]
    if t.advantage is not None:
        rec["advantage"] = t.advantage.tolist() if hasattr(t.advantage, "tolist") else t.advantage
    for name in ("reward", "weight", "group"):
        if getattr(t, name) is not None:
            rec[name] = getattr(t, name)
    if t.parent is not None:
        rec["parent"] = {"id": t.parent[0], "at": t.parent[1]}
    if t.compactions is not None:
        rec["compactions"] = [{"at": int(p), "start": int(a), "end": int(b)} for p, a, b in t.compactions]
    return rec


def write_jsonl(trajs: Iterable[Trajectory], path: str) -> None:
    """Write trajectories as JSONL (gzip when ``path`` ends in .gz), atomically."""
    write_records((trajectory_record(t) for t in trajs), path)


def write_records(records: Iterable[dict], path: str) -> None:
    """Write JSON objects one per line (gzip when ``path`` ends in .gz), atomically: the file
    appears whole under ``path`` or not at all."""
    tmp = f"{path}.tmp.{os.getpid()}"
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(tmp, "wt", encoding="utf-8") as fh:
            for rec in records:
                fh.write(json.dumps(rec, separators=(",", ":")))
                fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
