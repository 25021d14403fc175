"""KDA call planner: optimal packed chunkwise-call plans for a forest of segments.

The model (``docs/design.md``, "the packed chunkwise-call model, exactly"): every segment is
semantic in exactly one *sequence*, a chain of segments each the child of the one before.  A
sequence whose first segment starts at ``p`` starts at ``s = floor(p/B)*B`` (replay ``p - s``);
when ``s > 0`` it runs in a call later than the call of the sequence holding token ``s - 1`` of
its path (the *producer* of its boundary state).  The planner minimises, lexicographically, the
number of calls and then the total replay ``R``.  ``docs/call_planner.md`` gives the algorithm
and the proof; in short:

* every new sequence can sit exactly one call after its producer's call, so a segment's call is
  ``z`` or ``z + 1`` (``delta`` 0 or 1) where ``z`` is the call of the producer of its own chunk
  boundary;
* continuing one child of every segment is never worse, so the total replay is always its
  minimum ``sum over segments of (children - 1) * replay of a child``: only the calls need
  optimising;
* the subtree of a segment needs a fixed number of calls after ``z`` ("need", one number per
  ``delta``), computed bottom-up from the children's needs in ``O(children)``; the minimum number
  of calls ``K`` is the largest need of a root; a top-down pass then continues, at every
  segment, the child of largest need.  Linear time, no recursion.

Deterministic tie-breaking (both backends): a segment with children continues the child of
largest need as a new sequence (``need[1]``), the lowest segment index on ties.  Sequences are
ordered by call, then by first segment index.

With ``replay=False`` (the ``--no-tree-replay`` ablation) a non-root sequence starts exactly at
its first segment's start, from the exact state produced by the parent's sequence in an earlier
call: the same algorithm with "the producer is always the parent" and zero replay.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .compiled import compiled

__all__ = ["CallPlan", "plan_calls", "check_inputs"]


def _as_int_array(name: str, values) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D integer array, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def check_inputs(parent, start, length, chunk_size):
    """Validate a forest description; return ``(parent, start, length)`` as int64 arrays.

    Raises ``ValueError`` naming the segment index and the field for: arrays of different
    lengths, ``parent[i]`` outside ``[-1, i)``, a root whose start is not 0, a child whose start
    is not ``start[parent] + length[parent]``, ``length[i] < 1`` and ``chunk_size < 1``.  The C++
    backend raises the same messages.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)):
        raise ValueError(f"chunk_size must be an integer, got {chunk_size!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    parent = _as_int_array("parent", parent)
    start = _as_int_array("start", start)
    length = _as_int_array("length", length)
    if not (parent.size == start.size == length.size):
        raise ValueError(
            "parent, start and length must have the same size, got "
            f"{parent.size}, {start.size}, {length.size}"
        )
    n = parent.size
    idx = np.arange(n, dtype=np.int64)
    bad = np.flatnonzero((parent < -1) | (parent >= idx))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"segment {i}: parent {int(parent[i])} must be -1 or a segment index < {i} "
            "(segments in DFS preorder, parents first)"
        )
    bad = np.flatnonzero(length < 1)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"segment {i}: length must be >= 1, got {int(length[i])}")
    roots = parent < 0
    safe_parent = np.where(roots, 0, parent)
    expected = np.where(roots, 0, start[safe_parent] + length[safe_parent]) if n else start
    bad = np.flatnonzero(start != expected)
    if bad.size:
        i = int(bad[0])
        if roots[i]:
            raise ValueError(f"segment {i}: start must be 0 for a root, got {int(start[i])}")
        p = int(parent[i])
        raise ValueError(
            f"segment {i}: start {int(start[i])} must equal start[parent] + length[parent] "
            f"= {int(expected[i])} (parent {p})"
        )
    return parent, start, length


def _frozen(arr) -> np.ndarray:
    out = np.ascontiguousarray(arr, dtype=np.int64)
    out.setflags(write=False)
    return out


@dataclass(frozen=True, eq=False)
class CallPlan:
    """A call plan: sequences grouped by call, with their segments, sources and exports.

    Sequence ``q`` (``0 <= q < num_sequences``; sequences are sorted by call, then by first
    segment index) runs in call ``seq_call[q]`` over path positions ``[seq_start[q],
    seq_end[q])``; ``[seq_start[q], seq_semantic_start[q])`` is replay.  Its segments, in path
    order, are ``seq_segments[seq_segments_offsets[q]:seq_segments_offsets[q + 1]]``, the first
    being ``seq_first_segment[q]``.  Its initial state is the zero state when ``seq_start[q] ==
    0`` (``seq_source[q] == -1``), else the state at ``seq_start[q]`` exported by sequence
    ``seq_source[q]`` of an earlier call.  The states sequence ``q`` must export are listed at
    ``seq_exports_offsets[q]:seq_exports_offsets[q + 1]`` of ``seq_export_positions`` (the
    path position ``a`` of the state, increasing) and ``seq_export_segment`` (the segment
    holding token ``a - 1``).  ``call_offsets`` is the CSR of sequences per call and
    ``segment_sequence[i]`` the sequence in which segment ``i`` is semantic.
    """

    num_calls: int
    replay_tokens: int
    chunk_size: int
    replay: bool
    call_offsets: np.ndarray
    seq_call: np.ndarray
    seq_start: np.ndarray
    seq_semantic_start: np.ndarray
    seq_end: np.ndarray
    seq_first_segment: np.ndarray
    seq_segments_offsets: np.ndarray
    seq_segments: np.ndarray
    seq_exports_offsets: np.ndarray
    seq_export_positions: np.ndarray
    seq_export_segment: np.ndarray
    seq_source: np.ndarray
    segment_sequence: np.ndarray

    ARRAY_FIELDS = (
        "call_offsets", "seq_call", "seq_start", "seq_semantic_start", "seq_end",
        "seq_first_segment", "seq_segments_offsets", "seq_segments", "seq_exports_offsets",
        "seq_export_positions", "seq_export_segment", "seq_source", "segment_sequence",
    )

    @classmethod
    def from_arrays(cls, num_calls, replay_tokens, chunk_size, replay, arrays: dict) -> "CallPlan":
        """Build a plan from a dict holding every name of ``ARRAY_FIELDS`` (arrays frozen)."""
        return cls(
            num_calls=int(num_calls),
            replay_tokens=int(replay_tokens),
            chunk_size=int(chunk_size),
            replay=bool(replay),
            **{name: _frozen(arrays[name]) for name in cls.ARRAY_FIELDS},
        )

    @property
    def num_sequences(self) -> int:
        return int(self.seq_call.size)

    @property
    def segment_call(self) -> np.ndarray:
        """Call of every segment (the call of its sequence)."""
        return self.seq_call[self.segment_sequence]

    def same_as(self, other: "CallPlan") -> bool:
        """True when both plans hold exactly the same numbers."""
        if (self.num_calls, self.replay_tokens, self.chunk_size, self.replay) != (
            other.num_calls, other.replay_tokens, other.chunk_size, other.replay
        ):
            return False
        return all(np.array_equal(getattr(self, f), getattr(other, f)) for f in self.ARRAY_FIELDS)

    def validate(self, parent, start, length, chunk_size) -> None:
        """Check every rule of the packed chunkwise-call model; raise ``AssertionError``.

        Checks, independently of how the plan was built: CSR shapes; every segment semantic in
        exactly one sequence, each sequence a parent->child chain with consistent
        ``segment_sequence``; positions ``seq_start <= seq_semantic_start < seq_end`` with
        ``seq_start = floor(p/B)*B`` (or ``p`` without replay); calls sorted, in range, none
        empty; the source of every sequence with ``s > 0`` holds token ``s - 1`` of its path and
        runs in an earlier call; exports are exactly the states some later sequence starts
        from; ``replay_tokens`` is the total replay.  It does not check optimality.
        """
        parent, start, length = check_inputs(parent, start, length, chunk_size)
        B = int(chunk_size)
        n = parent.size
        end = start + length
        nq = self.num_sequences
        assert self.chunk_size == B, "plan built for another chunk size"

        def csr(offsets, size, name):
            assert offsets.size == size + 1, f"{name}: offsets size"
            assert offsets[0] == 0 and np.all(np.diff(offsets) >= 0), f"{name}: offsets order"
            return int(offsets[-1])

        for name in ("seq_call", "seq_start", "seq_semantic_start", "seq_end",
                     "seq_first_segment", "seq_source"):
            assert getattr(self, name).size == nq, f"{name}: size {getattr(self, name).size} != {nq}"
        assert self.segment_sequence.size == n, "segment_sequence size"
        assert csr(self.seq_segments_offsets, nq, "seq_segments") == self.seq_segments.size == n
        ne = csr(self.seq_exports_offsets, nq, "seq_exports")
        assert self.seq_export_positions.size == ne == self.seq_export_segment.size
        assert csr(self.call_offsets, self.num_calls, "call_offsets") == nq

        # calls: sorted, in range, CSR consistent, no empty call
        if nq:
            assert np.all(np.diff(self.seq_call) >= 0), "sequences not grouped by call"
            assert 0 <= self.seq_call.min() and self.seq_call.max() < self.num_calls
        for c in range(self.num_calls):
            lo, hi = self.call_offsets[c], self.call_offsets[c + 1]
            assert hi > lo, f"call {c} is empty"
            assert np.all(self.seq_call[lo:hi] == c), f"call_offsets wrong at call {c}"

        # coverage and chains
        seen = np.zeros(n, dtype=bool)
        for q in range(nq):
            segs = self.seq_segments[self.seq_segments_offsets[q]:self.seq_segments_offsets[q + 1]]
            assert segs.size >= 1, f"sequence {q} is empty"
            assert segs[0] == self.seq_first_segment[q], f"sequence {q}: first segment"
            for j, g in enumerate(segs.tolist()):
                assert 0 <= g < n and not seen[g], f"segment {g} covered twice or out of range"
                seen[g] = True
                assert self.segment_sequence[g] == q, f"segment {g}: segment_sequence"
                if j:
                    assert parent[g] == segs[j - 1], f"sequence {q}: {g} does not continue {segs[j - 1]}"
            first = int(segs[0])
            assert parent[first] < 0 or self.segment_sequence[parent[first]] != q
            p = int(start[first])
            assert self.seq_semantic_start[q] == p, f"sequence {q}: semantic start"
            assert self.seq_end[q] == end[int(segs[-1])], f"sequence {q}: end"
            s = (p // B) * B if self.replay else p
            assert self.seq_start[q] == s, f"sequence {q}: start {self.seq_start[q]} != {s}"
        assert seen.all(), "some segment is in no sequence"

        # sources, calls order and exports
        needed = set()
        total_replay = 0
        for q in range(nq):
            s = int(self.seq_start[q])
            total_replay += int(self.seq_semantic_start[q]) - s
            assert int(self.seq_semantic_start[q]) - s < B, f"sequence {q}: replay >= B"
            if s == 0:
                assert self.seq_source[q] == -1, f"sequence {q}: s == 0 but has a source"
                continue
            holder = int(parent[int(self.seq_first_segment[q])])
            while holder >= 0 and start[holder] > s - 1:
                holder = int(parent[holder])
            assert holder >= 0 and start[holder] <= s - 1 < end[holder], f"sequence {q}: no token {s - 1}"
            src = int(self.segment_sequence[holder])
            assert self.seq_source[q] == src, f"sequence {q}: source {self.seq_source[q]} != {src}"
            assert self.seq_call[src] < self.seq_call[q], f"sequence {q}: source not in an earlier call"
            needed.add((src, s, holder))
        listed = set()
        for q in range(nq):
            lo, hi = self.seq_exports_offsets[q], self.seq_exports_offsets[q + 1]
            pos = self.seq_export_positions[lo:hi]
            assert np.all(np.diff(pos) > 0), f"sequence {q}: exports not increasing"
            for a, g in zip(pos.tolist(), self.seq_export_segment[lo:hi].tolist()):
                listed.add((q, a, g))
        assert listed == needed, f"exports differ: missing {needed - listed}, extra {listed - needed}"
        assert total_replay == self.replay_tokens, "replay_tokens"
        if not self.replay:
            assert total_replay == 0


def plan_calls(parent, start, length, chunk_size, *, backend: str = "auto",
               replay: bool = True) -> CallPlan:
    """Plan the KDA calls of a forest; minimum calls, then minimum replay.

    ``parent``/``start``/``length`` describe segments in DFS preorder (``parent[i] < i``, -1 for
    roots; ``start`` the path position of the segment's first token).  ``backend`` is ``"cpp"``
    (the compiled ``megatron_harts._C``), ``"python"`` (this module's reference) or ``"auto"``
    (C++ when built; without it the reference, said once by ``planner.compiled``).  Both return identical plans.
    """
    if backend not in ("auto", "cpp", "python"):
        raise ValueError(f"backend must be 'auto', 'cpp' or 'python', got {backend!r}")
    parent, start, length = check_inputs(parent, start, length, chunk_size)
    B = int(chunk_size)
    if backend != "python":
        routine = compiled("plan_calls")
        if routine is None and backend == "cpp":
            raise ImportError("plan_calls(backend='cpp'): megatron_harts._C is not built "
                              "(python setup.py build_ext --inplace)")
        if routine is not None:
            out = routine(parent, start, length, B, bool(replay))
            arrays = {name: out[name] for name in CallPlan.ARRAY_FIELDS}
            return CallPlan.from_arrays(out["num_calls"], out["replay_tokens"], B, replay, arrays)
    return _plan_python(parent, start, length, B, bool(replay))


# ---------------------------------------------------------------------------------------------
# Pure-Python reference implementation
# ---------------------------------------------------------------------------------------------

def _children_lists(parent: Sequence[int]) -> list[list[int]]:
    """Children of every segment, in increasing index order."""
    children: list[list[int]] = [[] for _ in range(len(parent))]
    for i, p in enumerate(parent):
        if p >= 0:
            children[p].append(i)
    return children


def _roles(start, length, B, replay):
    """Per segment: ``exits[i]`` (the boundary state of ``i``'s children is produced by ``i``),
    ``rep[i]`` (replay of a child of ``i`` that starts a sequence) and ``export_pos[i]`` (the
    path position of that boundary state).

    With replay the children of ``i`` start at ``e = end[i]`` and their boundary is
    ``a = floor(e/B)*B``; ``i`` holds token ``a - 1`` iff ``a > start[i]``, else the boundary
    is the one of ``i`` itself (``i`` lies inside one partial chunk).  Without replay the
    boundary is ``e`` and always produced by ``i``.
    """
    exits, rep, export_pos = [], [], []
    for st, ln in zip(start, length):
        e = st + ln
        if replay:
            a = (e // B) * B
            exits.append(a > st)
            rep.append(e - a)
            export_pos.append(a)
        else:
            exits.append(True)
            rep.append(0)
            export_pos.append(e)
    return exits, rep, export_pos


def _need(children, cont_need, new_need) -> int:
    """Slack needed to place the children of a segment (at least 0).

    A child ``c`` needs slack ``new_need[c]`` as a new sequence and ``cont_need[c] <=
    new_need[c]`` when continued; exactly one child is continued.  The best child to continue
    is one of largest ``new_need`` (it is the only one that may exceed the slack), so the need
    is ``max(cont_need[c1], m2)`` when ``c1`` is the unique argmax of ``new_need`` and ``m2``
    the largest of the others, and the maximum itself when it is attained twice.
    """
    m1 = -1
    arg = -1
    ties = 0
    m2 = -1
    for c in children:
        x = new_need[c]
        if x > m1:
            m2 = m1
            m1, arg, ties = x, c, 1
        elif x == m1:
            ties += 1
            m2 = x
        elif x > m2:
            m2 = x
    if arg < 0:
        return 0
    if ties >= 2:
        return m1
    return max(cont_need[arg], m2)


def _continued_child(children, new_need) -> int:
    """The child a segment continues: largest ``new_need``, lowest index on ties."""
    best = -1
    for c in children:
        if best < 0 or new_need[c] > new_need[best]:
            best = c
    return best


def _plan_python(parent, start, length, B: int, replay: bool) -> CallPlan:
    parent = parent.tolist()
    start = start.tolist()
    length = length.tolist()
    n = len(parent)
    children = _children_lists(parent)
    exits, rep, export_pos = _roles(start, length, B, replay)

    # bottom-up: need[d][i] = slack (calls after the producer's call z) that the subtree of i
    # needs when i runs in call z + d; K = max over roots of need[1] (roots: z = -1, d = 1)
    need0 = [0] * n
    need1 = [0] * n
    for i in range(n - 1, -1, -1):
        cs = children[i]
        if exits[i]:
            g = _need(cs, need0, need1)
            need0[i], need1[i] = g, g + 1
        else:
            need0[i] = _need(cs, need0, need1)
            need1[i] = max(1, _need(cs, need1, need1))
    K = max((need1[i] for i in range(n) if parent[i] < 0), default=0)

    # top-down: state (d, u) = (call - producer call, K - 1 - producer call) per segment
    cont = [-1] * n
    call = [0] * n
    sd = [1] * n
    su = [K] * n
    needs = (need0, need1)
    for i in range(n):
        d, u = sd[i], su[i]
        if needs[d][i] > u:
            raise AssertionError(f"planner reached an infeasible state at segment {i}")
        call[i] = K - 1 - u + d
        cs = children[i]
        if not cs:
            continue
        c = _continued_child(cs, need1)
        cont[i] = c
        if exits[i]:
            cd, cu = 0, u - d
        else:
            cd, cu = d, u
        for x in cs:
            sd[x] = cd if x == c else 1
            su[x] = cu
    return _assemble(parent, start, length, B, replay, K, cont, call, exits, export_pos)


def _assemble(parent, start, length, B, replay, K, cont, call, exits, export_pos) -> CallPlan:
    """Turn continuation choices and segment calls into the CSR plan.

    Sequences are ordered by (call, first segment index); the producer of a new sequence's
    boundary is its parent when the parent ``exits`` (or always without replay), else the
    parent's own producer.
    """
    n = len(parent)
    heads = [i for i in range(n) if parent[i] < 0 or cont[parent[i]] != i]
    heads.sort(key=lambda h: (call[h], h))
    nq = len(heads)
    seq_of = [-1] * n
    seg_off = [0]
    segs = []
    seq_end = []
    for q, h in enumerate(heads):
        x = h
        while x >= 0:
            seq_of[x] = q
            segs.append(x)
            last = x
            x = cont[x]
        seg_off.append(len(segs))
        seq_end.append(start[last] + length[last])
    producer = [-1] * n
    for i in range(n):
        p = parent[i]
        if p >= 0:
            producer[i] = p if exits[p] else producer[p]
    exports = [False] * n
    seq_source = []
    seq_start = []
    replay_total = 0
    for h in heads:
        p = start[h]
        s = (p // B) * B if replay else p
        seq_start.append(s)
        replay_total += p - s
        a = producer[h]
        if s > 0:
            seq_source.append(seq_of[a])
            exports[a] = True
        else:
            seq_source.append(-1)
    ex_off = [0]
    ex_pos = []
    ex_seg = []
    for q in range(nq):
        for x in segs[seg_off[q]:seg_off[q + 1]]:
            if exports[x]:
                ex_pos.append(export_pos[x])
                ex_seg.append(x)
        ex_off.append(len(ex_pos))
    seq_call = [call[h] for h in heads]
    call_off = [0] * (K + 1)
    for c in seq_call:
        call_off[c + 1] += 1
    for c in range(K):
        call_off[c + 1] += call_off[c]
    i64 = lambda v: np.asarray(v, dtype=np.int64)  # noqa: E731
    arrays = {
        "call_offsets": i64(call_off),
        "seq_call": i64(seq_call),
        "seq_start": i64(seq_start),
        "seq_semantic_start": i64([start[h] for h in heads]),
        "seq_end": i64(seq_end),
        "seq_first_segment": i64(heads),
        "seq_segments_offsets": i64(seg_off),
        "seq_segments": i64(segs),
        "seq_exports_offsets": i64(ex_off),
        "seq_export_positions": i64(ex_pos),
        "seq_export_segment": i64(ex_seg),
        "seq_source": i64(seq_source),
        "segment_sequence": i64(seq_of),
    }
    return CallPlan.from_arrays(K, replay_total, B, replay, arrays)
