"""What every L2 packing shares: its form, its slot order with split windows' path owners, its estimate.

A packing is ``(groups, placement, loads, entries)``: per microbatch its (owned, recomputed)
segment ids and its (replica, slot), per replica the estimated costs of its microbatches in slot
order, per microbatch its entries ``(unit, extra segments recomputed, estimated cost)``.
Invariant of ``_after_owners``: a microbatch reading a split window's path runs in a later slot
than the producers owning that path.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

from .compiled import compiled
from .l2_units import unit_arrays

__all__ = ["estimate_step", "packed_rows", "CompiledPacker"]


class CompiledPacker:
    """An L2 packer called as ``packer(ix, units, dp, M, S, eps=0.01, arrays=None)``, returning
    (packings, bound): its compiled core ``_C.<name>`` when built (and ``dp >= min_dp``), else its
    Python ``reference`` (the same values; tests hold them equal).  ``arrays``: ``unit_arrays(units)``
    when the caller has them.  ``fast`` is the compiled core (None: the reference only)."""

    def __init__(self, name: str, reference: Callable, min_dp: int = 1, doc: str = ""):
        self.fast = compiled(name)
        self.fast_many = compiled(name + "_many")
        self.reference = reference
        self.min_dp = min_dp
        self.__name__ = reference.__name__.strip("_").replace("_python", "")
        self.__doc__ = doc

    def __call__(self, ix, units, dp: int, M: int, S: int, eps: float = 0.01, arrays=None):
        if self.fast is not None and dp >= self.min_dp:
            packings, bound = self.fast(units, ix.length, *(arrays if arrays is not None else unit_arrays(units)),
                                        dp, M, S, eps)
            return [p for p in packings if p is not None], bool(bound)
        return self.reference(ix, units, dp, M, S, eps)

    def many(self, ix, units, dp: int, M: int, slots, epss, arrays=None) -> list:
        """The packings of ``self(ix, units, dp, M, S, eps, arrays)`` for every ``S`` of ``slots``
        and, per ``S``, the tolerances ``epss`` in order, the next one only while ``bound`` (a
        placement turned away: a larger tolerance may pack differently), concatenated: one call of
        the compiled ``_C.<name>_many`` when built (this loop is its reference)."""
        if self.fast is not None and self.fast_many is not None and dp >= self.min_dp:
            return self.fast_many(units, ix.length, *(arrays if arrays is not None else unit_arrays(units)),
                                  dp, M, list(slots), list(epss))
        out = []
        for S in slots:
            for eps in epss:
                packings, bound = self(ix, units, dp, M, S, eps, arrays)
                out.extend(packings)
                if not bound:
                    break  # the target turned nothing away: a larger one packs the same
        return out


def _after_owners(seqs: List[List[int]], after: Dict[int, set]) -> Optional[List[List[int]]]:
    """Per replica, its microbatches ``seqs[r]`` in slot order, with every microbatch ``b`` of
    ``after`` in a later slot than the microbatches ``after[b]`` (producers owning the root
    path of a split window, on other replicas): those producers lead their replicas (in their
    order), then every slot takes the first microbatch in order that may run there.  None
    when a replica is left with microbatches none of which may run in its next slot."""
    if not after:
        return seqs
    lead = set().union(*after.values())
    pos: Dict[int, int] = {}
    heads = []
    for seq in seqs:
        head = [b for b in seq if b in lead]
        for k, b in enumerate(head):
            pos[b] = k
        heads.append(head)
    out = []
    for seq, head in zip(seqs, heads):
        rest = [b for b in seq if b not in lead]
        new = list(head)
        while rest:
            k = len(new)
            i = next((i for i, b in enumerate(rest) if b not in after or all(pos[q] < k for q in after[b])), -1)
            if i < 0:
                return None
            new.append(rest.pop(i))
        out.append(new)
    return out


def packed_rows(ix, packed) -> int:
    """Rows a packing computes (owned and recomputed segments of every microbatch): a lower bound of
    the tokens its plan computes (KDA replay adds to them).  A compiled packer's packing
    (``_C.L2Packing``) sums them itself, the same number as ``_packed_rows_python``."""
    if isinstance(packed, tuple):
        return _packed_rows_python(ix, packed)
    return packed.rows(ix.length)


def _packed_rows_python(ix, packed) -> int:
    """Reference of ``packed_rows`` (and of ``_C.L2Packing.rows``)."""
    length = ix.length_list
    return int(sum([length[x] for own_rec in packed[0] for g in own_rec for x in g]))


def estimate_step(packed, dp: int, overhead: float) -> float:
    """Estimated step of a packing: per slot the costliest microbatch, every microbatch paying
    ``overhead`` (the per-microbatch terms the unit costs leave out).  A compiled packer's packing
    (``_C.L2Packing``) computes it itself, the same floats as ``_estimate_step_python``."""
    if isinstance(packed, tuple):
        return _estimate_step_python(packed, dp, overhead)
    return packed.estimate_step(overhead)


def _estimate_step_python(packed, dp: int, overhead: float) -> float:
    """Reference of ``estimate_step`` (and of ``_C.L2Packing.estimate_step``)."""
    loads = packed[2]
    S = max((len(l) for l in loads), default=0)
    # each replica's costs padded with 0.0 (an idle replica) to S slots, summed slot by slot in order
    padded = [[x + overhead for x in l] + [0.0] * (S - len(l)) for l in loads]
    total = 0
    for slot in zip(*padded):
        total += max(slot)
    return total
