"""KDA over a rollout tree: run a call plan, hand boundary states on differentiably.

Given the compact rows of a microbatch (segments laid out as ``seg_row``,
``seg_start``, ``seg_length``, ``seg_parent``) and a ``CallPlan`` of the
packed chunkwise-call model (planner/calls.py), ``build_kda_schedule``
precomputes, once per microbatch, for every call: which row feeds each
position of each sequence (replay positions read ancestor rows), which
positions are semantic and where their outputs go, which exported state
starts each sequence, and which states it must export.  ``tree_kda`` then
runs the calls in order with a KDA backend; exported states stay in the
autograd graph, so consumers' gradients reach the producing call.

Invariants kept:

- every row's output is written by exactly one sequence (the one in which its
  segment is semantic);
- a sequence starting at aligned position s>0 gets the state its source
  sequence had after its token s-1, computed in an earlier call; with replay,
  its chunks are [s, s+B), [s+B, s+2B)..., which are the chunks of expanded
  per-trajectory training, so the reference backend reproduces expanded
  outputs bitwise (shared/DESIGN.md, invariant 2).

Backends share this interface: ``reference`` (ops/kda.py ``kda_chunked``, any
device).  A GPU backend plugs in through ``KDA_BACKENDS``: a function with the
signature of ``kda_chunked``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from .kda import kda_chunked

KDA_BACKENDS: Dict[str, Callable] = {"reference": kda_chunked}


@dataclass
class KdaCall:
    """One packed call: N sequences padded to T positions (a multiple of the chunk size)."""
    rows: torch.Tensor          # long [N, T]: row feeding each position (0 at padding)
    valid: torch.Tensor         # bool [N, T]: inside the sequence (replay or semantic)
    out_index: torch.Tensor     # long [M]: flat n*T+t of semantic positions
    out_rows: torch.Tensor      # long [M]: rows those outputs belong to
    init_slot: torch.Tensor     # long [N]: exported-state slot starting each sequence, -1 = zero state
    export_seq: torch.Tensor    # long [P]: sequence (in this call) of each export
    export_offset: torch.Tensor  # long [P]: tokens of that sequence before the exported state
    export_slot: torch.Tensor   # long [P]: global slot of each export


@dataclass
class KdaSchedule:
    calls: List[KdaCall]
    chunk_size: int
    num_rows: int
    num_slots: int
    replay_tokens: int
    replay: bool

    def to(self, device) -> "KdaSchedule":
        calls = [KdaCall(**{f: getattr(c, f).to(device) for f in KdaCall.__dataclass_fields__}) for c in self.calls]
        return KdaSchedule(calls, self.chunk_size, self.num_rows, self.num_slots, self.replay_tokens, self.replay)


def _path_rows(seg_parent, seg_start, seg_length, seg_row, first_seg: int, lo: int) -> np.ndarray:
    """Rows of path positions [lo, start[first_seg]) above ``first_seg`` (the replay rows)."""
    parts = []
    p = int(seg_parent[first_seg])
    end = int(seg_start[first_seg])
    while end > lo:
        if p < 0:
            raise ValueError(f"segment {first_seg}: replay from {lo} reaches above the root")
        a = max(lo, int(seg_start[p]))
        off = a - int(seg_start[p])
        parts.append(np.arange(int(seg_row[p]) + off, int(seg_row[p]) + off + (end - a)))
        end = a
        p = int(seg_parent[p])
    return np.concatenate(parts[::-1]) if parts else np.zeros(0, dtype=np.int64)


def build_kda_schedule(seg_parent, seg_start, seg_length, seg_row, plan, *,
                       device: Optional[torch.device] = None) -> KdaSchedule:
    """Index tensors of every call of ``plan`` over rows laid out by ``seg_row``."""
    seg_parent, seg_start, seg_length, seg_row = (np.asarray(x, dtype=np.int64)
                                                  for x in (seg_parent, seg_start, seg_length, seg_row))
    B = int(plan.chunk_size)
    num_rows = int((seg_row + seg_length).max()) if seg_row.size else 0
    # slot of every export, and the slot each sequence starts from
    slot_of = {}
    for q in range(len(plan.seq_start)):
        a, b = int(plan.seq_exports_offsets[q]), int(plan.seq_exports_offsets[q + 1])
        for e in range(a, b):
            slot_of[(q, int(plan.seq_export_positions[e]))] = e
    calls = []
    for c in range(int(plan.num_calls)):
        seqs = range(int(plan.call_offsets[c]), int(plan.call_offsets[c + 1]))
        row_lists, init, exp_seq, exp_off, exp_slot = [], [], [], [], []
        for n, q in enumerate(seqs):
            s = int(plan.seq_start[q])
            first = int(plan.seq_first_segment[q])
            segs = plan.seq_segments[plan.seq_segments_offsets[q]:plan.seq_segments_offsets[q + 1]]
            replay_rows = _path_rows(seg_parent, seg_start, seg_length, seg_row, first, s)
            sem_rows = np.concatenate([np.arange(seg_row[i], seg_row[i] + seg_length[i]) for i in segs])
            row_lists.append((replay_rows, sem_rows))
            src = int(plan.seq_source[q])
            if src < 0:
                init.append(-1)
            else:
                key = (src, s)
                if key not in slot_of:
                    raise ValueError(f"plan: sequence {q} starts at {s} from sequence {src}, which does not "
                                     "export that state")
                init.append(slot_of[key])
            a, b = int(plan.seq_exports_offsets[q]), int(plan.seq_exports_offsets[q + 1])
            for e in range(a, b):
                exp_seq.append(n)
                exp_off.append(int(plan.seq_export_positions[e]) - s)
                exp_slot.append(e)
        lengths = [len(r) + len(m) for r, m in row_lists]
        T = max(lengths)
        T += (-T) % B
        N = len(row_lists)
        rows = np.zeros((N, T), dtype=np.int64)
        valid = np.zeros((N, T), dtype=bool)
        out_index, out_rows = [], []
        for n, (rr, sr) in enumerate(row_lists):
            allr = np.concatenate([rr, sr])
            rows[n, : len(allr)] = allr
            valid[n, : len(allr)] = True
            out_index.append(n * T + len(rr) + np.arange(len(sr)))
            out_rows.append(sr)
        t = lambda x, dt=torch.long: torch.as_tensor(np.asarray(x), dtype=dt, device=device)  # noqa: E731
        calls.append(KdaCall(rows=t(rows), valid=t(valid, torch.bool), out_index=t(np.concatenate(out_index)),
                             out_rows=t(np.concatenate(out_rows)), init_slot=t(init),
                             export_seq=t(np.array(exp_seq, dtype=np.int64)),
                             export_offset=t(np.array(exp_off, dtype=np.int64)),
                             export_slot=t(np.array(exp_slot, dtype=np.int64))))
    covered = sum(int(c.out_rows.numel()) for c in calls)
    if covered != num_rows:
        raise ValueError(f"plan covers {covered} rows, the layout has {num_rows}")
    return KdaSchedule(calls=calls, chunk_size=B, num_rows=num_rows, num_slots=int(plan.seq_exports_offsets[-1]),
                       replay_tokens=int(plan.replay_tokens), replay=bool(plan.replay))


def tree_kda(q, k, v, g, beta, schedule: KdaSchedule, *, scale: Optional[float] = None,
             backend: str = "reference") -> torch.Tensor:
    """KDA outputs [R, H, V] of every row; inputs are per row: q, k, g [R, H, K], v [R, H, V], beta [R, H]."""
    if backend not in KDA_BACKENDS:
        raise ValueError(f"backend must be one of {sorted(KDA_BACKENDS)}, got {backend!r}")
    R, H, K = q.shape
    if R != schedule.num_rows:
        raise ValueError(f"inputs have {R} rows, the schedule {schedule.num_rows}")
    run = KDA_BACKENDS[backend]
    V = v.shape[-1]
    slots: List[Optional[torch.Tensor]] = [None] * schedule.num_slots
    out = v.new_zeros(R, H, V)
    for call in schedule.calls:
        N, T = call.rows.shape
        mask = call.valid.unsqueeze(-1).unsqueeze(-1)

        def gather(x):
            y = x[call.rows]              # [N, T, H, D] or [N, T, H]
            m = mask if y.dim() == 4 else mask.squeeze(-1)
            return torch.where(m, y, torch.zeros((), dtype=y.dtype, device=y.device))

        init = None
        if bool((call.init_slot >= 0).any()):
            zero = q.new_zeros(H, K, V, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
            init = torch.stack([zero if s < 0 else slots[s] for s in call.init_slot.tolist()])
        o, states = run(gather(q), gather(k), gather(v), gather(g), gather(beta), chunk_size=schedule.chunk_size,
                        scale=scale, initial_state=init, state_index=call.export_seq,
                        state_offset=call.export_offset)
        for p, s in enumerate(call.export_slot.tolist()):
            slots[s] = states[p]
        out = out.index_copy(0, call.out_rows, o.reshape(N * T, H, V)[call.out_index])
    return out
