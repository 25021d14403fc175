"""L2: cross-microbatch sharing in windows the schedule runs, placed on DP replicas in slots.

Input: an L1 plan.  Its recomputed segments are the shared prefixes (computed in two or more
L1 microbatches).  The window schedule (``microbatch.replica_windows``) reads a consumer's
context only from one earlier microbatch of the same replica that is not itself a consumer,
and recomputes any other, so L2 plans only such windows (every window runs as planned):

1. *Units* (``window_units``): per tree, the shared set ``U`` (closed under ancestors) gives
   a **core**: ``U`` when it fits the row budget, else its most shared top that fits.  The
   subtrees hanging below the core are **items** (cut by L1's split when larger than the
   budget, the core's rows counting as external).  A tree is produced when its core has at
   least ``min_producer_rows`` rows and core plus items compute fewer tokens (KDA replay
   included) than its L1 pieces; else its L1 pieces are **free** units (no external context).
2. *Windows* (``pack_windows``): each produced tree is one window on one replica, the trees
   assigned largest first (core, items and replay) to the least-loaded replica.  The core
   goes alone into a fresh microbatch (its producer; one core per producer, so a producer's
   exports are one tree's prefix), its items best-fit into the window's microbatches (the
   producer itself: local rows; or its consumers, later microbatches of the replica that
   read nothing else) under the microbatch target, a new consumer opened when none can take
   one.  An item that would push its replica past its share of the step goes to the
   least-loaded replica with its root path recomputed (no window) when that replica ends
   lower.  Free pieces last, best fit under the target.  On several replicas with few
   windows (at most ``WINDOW_SPLIT_PER_REPLICA`` per replica), the units are also packed with
   the windows costlier than a part (``WINDOW_SPLIT_SHARES``) of a replica's work split
   (``split_windows``; packed by the spreading packer): a cut at a branch point of the core
   makes a second window, whose producer recomputes the path above the cut (it reads
   nothing) and owns the core below it, and whose consumers (the items below the cut) read
   that producer's rows; a replica then computes the shared top once per window instead of
   once per microbatch.  The plan names the path's owner (the tree's first window, on another
   replica, run in an earlier slot: those producers lead their replicas) as a producer of
   those consumers too; the schedule reads all of their context from their own producer,
   which computes it.  One replica: everything by rows (fullest first), and a free piece
   that fits nowhere puts its top into the spare rows of a microbatch that reads nothing,
   the rest reading it from the next microbatch.
3. *Variants* (several replicas): the packing as it is; its windows leveled (a window's
   items spread over its microbatches, largest first to the least loaded); its light
   microbatches (under half the target, producing for nobody) dissolved into others under
   the target (items of a window into the window, else with their root path recomputed);
   both.
4. *Order*: on one replica each producer is followed by its consumers, so a producer's
   exports live only while its own window runs (one core's rows exported at a time).  On
   several, a replica's microbatches run costliest first (the slots line up across replicas),
   each producer moved just before its first consumer.
5. *Candidates*: slot counts from the row bound to ``WINDOW_EXTRA_SLOTS`` above it and the
   target tolerances ``WINDOW_TOLERANCES`` (a larger one skipped where the smaller turned
   nothing away) give a few packings; on several replicas the spreading packer
   (``pack_spread``: cores lead their replicas, several to a producer, items wherever the
   load is lowest) adds its own.  Each is estimated from its microbatch loads (per-microbatch
   terms included); on several replicas the best few are also refined by the balance pass
   (``rebalance``: a local search moving and swapping units and whole windows toward even
   slots, never computing more tokens).  On several replicas with few slots of work
   (``ITEM_CUT_SLOTS``), the units are also made with their items larger than parts
   ``ITEM_CUTS`` of the row budget cut (L1's split below the item's root, a cut no shorter
   than its longest path): an item as large as a microbatch otherwise sets its slot's
   maximum alone (the balance pass refines only their best packing).  Per base unit set (the units, and each cut of them, with their split
   windows), only the best ``ASSEMBLED`` by that estimate that compute no more tokens than
   L1 (and a refined one no more than the packing it refines) are judged exactly, none
   estimated over ``ASSEMBLE_MARGIN`` longer than the best plan so far.
6. *Spending*: where the best plan has few slots (``BALANCE_SPEND_SLOTS``) and enough
   microbatches (``BALANCE_SPEND_BINS``), its packing (before its balance pass) is refined again
   by the balance pass allowed to compute parts ``BALANCE_SPEND`` of the tokens the plan saves
   against L1 more: a slot evened out by a unit whose root path is recomputed, or one no longer
   read from a producer, can shorten the step; such a plan is judged like the others (no more
   tokens than L1, the shortest step wins).  Where that packing has split windows, it is also refined
   by the pass that moves their items too (``rebalance(split=True)``, ``BALANCE_SPLIT``: they stay
   in their window, in a microbatch that reads their producer; the other passes leave them where the
   packer put them), its slots' imbalance weighed more; where its plan wins, the plan it beat is
   evened out by the last pass too, and the split pass's plan is kept only where it still wins.
   One of these passes, and on packings of at least
   ``BALANCE_MORE_BINS`` microbatches a second pass over the best packing of step 5, score the
   slots in the order the plan runs (``rebalance(ordered=True)``: producers before their first
   consumer, where costliest first alone would misalign a slot that starts a window).
7. *One slot, few slots* (``l2_oneslot``): where a base's units fit in one slot (several replicas),
   ``pack_one_slot`` searches their assignment to the ``dp`` microbatches directly (every item away
   from its core recomputes its root path there; the packers then try 2 and 3 slots only) and its
   packing is judged with the others (a base it leads is not refined by the balance pass); the
   chosen plan of 2..``SEARCH_SLOTS`` slots is searched again unit by unit from its own assignment
   (``search_slots``: cores stay, items read their producers where the schedule would), kept where
   its exact (step, tokens) is lower.

L2 never computes more tokens than its L1 input, and its plan never has a longer modelled
step (sum over slots of the costliest microbatch) than L1's: the candidate with the shortest
modelled step (then the fewest tokens) among those computing no more tokens than L1 wins,
else (tiny trees where replay outweighs the rows saved; batches so small that a window on one
replica idles the others) the L1 microbatches are returned with L1's placement.

Independent passes over packings (each base's balance passes, the spending passes, the rival's
last pass) run side by side on up to ``threads.PLAN_THREADS`` threads (``concurrently``; the compiled
searches release the GIL); their results are taken in the order one after another would give them,
so the plan does not depend on the thread count.
"""
from __future__ import annotations

import math
import time

import numpy as np
from typing import Optional, Tuple

from .cost_model import CostModel, ForestIndex
from .l1 import plan_l1
from .l2_balance import (BALANCE_MORE_BINS, BALANCE_MOVES, BALANCE_PACKINGS, BALANCE_SLOTS, BALANCE_SWAP_BINS,
                         BALANCE_WEIGHT, BALANCE_WIDE, numbered_units, rebalance)
from .l2_even import EVEN_BINS, EVEN_SPEND, even_slots
from .l2_oneslot import pack_one_slot, search_slots
from .l2_packing import estimate_step, packed_rows
from .l2_search import l1_as_l1l2
from .l2_spread import pack_spread
from .l2_units import split_windows, unit_arrays, window_units
from .l2_windows import pack_windows
from .metrics import slot_balance
from .microbatch import (MicrobatchPlan, PlanningError, assemble_plan, gc_paused, packing_key,
                         slot_step)
from .threads import concurrently, plan_threads

__all__ = ["plan_l2", "plan_harts", "window_units", "split_windows", "pack_windows", "pack_spread", "window_plan",
           "step_cost", "window_key", "estimate_step", "rebalance", "numbered_units", "unit_arrays",
           "BALANCE_MOVES", "BALANCE_SLOTS", "BALANCE_WEIGHT", "BALANCE_PACKINGS",
           "BALANCE_MORE_BINS", "BALANCE_SWAP_BINS",
           "BALANCE_WIDE", "ASSEMBLE_MARGIN", "ITEM_CUTS", "ITEM_CUT_SLOTS"]

#: the window packer's slot counts above its row bound, and its microbatch target tolerances
WINDOW_EXTRA_SLOTS = 2
WINDOW_TOLERANCES = (0.01, 0.05)
#: ``split_windows``' shares: a window costlier than this part of a replica's work is split
WINDOW_SPLIT_SHARES = (0.5, 0.35)
#: windows are split only when there are at most this many per replica (more balance as they are)
WINDOW_SPLIT_PER_REPLICA = 2.5
#: packings judged exactly (the best by their estimated step that compute no more tokens than
#: L1; at most twice as many are assembled)
ASSEMBLED = 2
#: a packing estimated longer than the best plan so far (L1's, then the judged ones) by more than
#: this part is not assembled (estimates err by at most 1.1% on the benchmark batches)
ASSEMBLE_MARGIN = 0.015
#: on several replicas the units are also made with every item of more rows than these parts of
#: the row budget cut (its subtree split as L1 splits pieces, a cut no shorter than its longest
#: path), when the units' row bound is at most ``ITEM_CUT_SLOTS`` slots (with more microbatches
#: per replica the whole items balance as well)
ITEM_CUTS = (0.7,)
ITEM_CUT_SLOTS = 16
#: the best plan's packing (before its balance pass) is evened out again by the balance pass allowed
#: to compute these parts of the tokens the plan saves against L1 more (a slot evened out by a path
#: recomputed or a unit read from no producer), where the plan has at most ``BALANCE_SPEND_SLOTS``
#: slots and at least ``BALANCE_SPEND_BINS`` microbatches (smaller: planning time counts more, the passes
#: cost 2-3 ms on Step-wise 512, where OR-Tools+FFD takes 20-36 ms); each
#: entry (part, ordered): ``ordered`` scores the slots in the order the plan runs (``rebalance``).  A third
#: entry (0.2, False) changed no benchmark plan's step, compression or balance (DP 8 at 256-2048 trajectories,
#: DP 2/4 at 256 and 1024, both schemes) and cost Tree-Step 256 DP 8 a 7 ms pass
BALANCE_SPEND = ((0.1, False), (0.2, True))
#: ... and, where that packing has split windows, by the balance pass that moves their items too
#: (``rebalance(split=True)``; the passes above leave them where the packer put them): entries (part, ordered,
#: weight), ``weight`` the objective's weight of the slots' imbalance.  Tree-Step 256 DP 8 (split windows, most
#: items theirs): step 10.451 -> 10.329, balance 97.45/96.17 -> 98.19/97.41%, compression 2.033 -> 2.042; weights
#: 1 and 2 gave a packing judged 10.447 / 10.442 (10.402 at 4), spending 0.2 one of 10.614
BALANCE_SPLIT = ((0.1, False, 4.0),)
#: the balance pass of each base's best packing tries swaps in packings of up to this many microbatches
#: (the others: ``BALANCE_SWAP_BINS``); more cost time (a swap is tried per pair of entries) and, on
#: Tree-Step 2048 DP 8 (376 microbatches), gave a packing whose estimate beat better ones
BALANCE_SWAP_BINS_FIRST = 128
BALANCE_SPEND_SLOTS = 16
BALANCE_SPEND_BINS = 24
#: ... and, below ``BALANCE_MORE_BINS`` microbatches, only when the plan's mean slot balance is below this
#: (Tree-Step 256 DP 4, 98.6%: its passes found nothing and took 15 of its 37 ms)
BALANCE_SPEND_BELOW = 0.98
#: the chosen plan of at most this many slots (more than one) has its units searched again, every slot at once
#: (``l2_oneslot.search_slots``)
SEARCH_SLOTS = 2


@gc_paused
def plan_l2(forest, l1: MicrobatchPlan, *, cost_model: Optional[CostModel] = None,
            index: Optional[ForestIndex] = None, min_producer_rows: Optional[int] = None) -> MicrobatchPlan:
    """Refine an L1 plan (module docstring).  ``plan_seconds`` counts L2 alone.

    ``min_producer_rows``: a tree's shared prefix shorter than this stays recomputed (default:
    the KDA chunk size).
    """
    t0 = time.perf_counter()
    model, ix, keep = l1_as_l1l2(forest, l1, cost_model, index)
    dp, M = l1.num_replicas, l1.row_budget
    mpr = model.chunk_size if min_producer_rows is None else int(min_producer_rows)
    keep_tokens = keep.tokens_computed
    plan, plan_key = keep, (step_cost(keep), keep_tokens)
    plan_packed = None  # the packing the best plan so far is assembled from, before the balance pass (None: L1's)
    rival = None  # where the split windows' spending pass gave the plan: the plan it beat (evened out too)
    units = window_units(ix, l1, model, mpr)
    if dp == 1 or any(u.kind == "core" for u in units):  # one replica: free pieces may fill spare rows
        bases = [units]  # the units, and on several replicas those with their largest items cut
        if 1 < dp and math.ceil(math.ceil(sum(u.rows for u in units) / M) / dp) <= ITEM_CUT_SLOTS:
            largest = max((u.rows for u in units if u.kind == "item"), default=0)
            for part in ITEM_CUTS:
                if largest > part * M:
                    bases.append(window_units(ix, l1, model, mpr, item_rows=int(part * M)))
        unit_sets = []  # (units, the base they come from)
        for b, us in enumerate(bases):
            unit_sets.append((us, b))
            n_windows = sum(u.kind == "core" for u in us)
            if 1 < dp and n_windows <= WINDOW_SPLIT_PER_REPLICA * dp:  # few windows: split the costliest
                for share in WINDOW_SPLIT_SHARES:
                    split = split_windows(ix, us, model, dp, share)
                    if split is not None:
                        unit_sets.append((split, b))
        overhead = model.coefficients.microbatch + model.coefficients.kda_call
        packs = []
        estimates = set()  # the estimates in packs
        family = {}  # a packing (its id) -> the base of its units
        arrays_of = {}  # a packer's packing (its id) -> unit_arrays of its units (None: DP 1)
        searched = set()  # the one-slot packings (their ids): a local search's optimum, not refined again
        units_of = {}  # a packing (its id) -> the units it packs
        arrays_by = {}  # a unit list (its id) -> its unit_arrays (DP > 1)
        for us, base in unit_sets:
            S_w = max(1, math.ceil(math.ceil(sum(u.rows for u in us) / M) / dp))
            # one replica: no target (every slot count packs the same); several: the spreading
            # packer too, and a larger tolerance only where the smaller one turned a placement away
            # (split windows: the spreading packer alone; the window packer's plans of them lost
            # to it on every benchmark batch)
            arrays = unit_arrays(us) if dp > 1 else None
            arrays_by[id(us)] = arrays
            one_slot = None  # one slot: the assignment searched directly (the packers then try 2 and 3 slots)
            if 1 < dp and S_w == 1 and us is bases[base]:
                one_slot = pack_one_slot(ix, us, dp, M, model, keep_tokens, arrays)
                if one_slot is not None:  # judged even where a packer's has its estimate (it may compute less)
                    packs.append((estimate_step(one_slot, dp, overhead), len(packs), one_slot))
                    family[id(one_slot)] = base
                    arrays_of[id(one_slot)] = None
                    units_of[id(one_slot)] = us
                    searched.add(id(one_slot))
            for packer in (pack_windows,) if dp == 1 else (pack_spread,) if us is not bases[base] else \
                    (pack_windows, pack_spread):
                slots = range(S_w, S_w + WINDOW_EXTRA_SLOTS + 1 if dp > 1 else S_w + 1)
                if one_slot is not None:
                    slots = range(2, 2 + WINDOW_EXTRA_SLOTS)
                # per slot count the tolerances in order, a larger one only where the smaller
                # turned a placement away (else it packs the same)
                for packed in packer.many(ix, us, dp, M, slots, WINDOW_TOLERANCES, arrays):
                    est = estimate_step(packed, dp, overhead)
                    if est not in estimates:  # the same packing again (tolerance unused)
                        estimates.add(est)
                        packs.append((est, len(packs), packed))
                        family[id(packed)] = base
                        arrays_of[id(packed)] = arrays
                        units_of[id(packed)] = us
        packs.sort(key=lambda p: p[:2])

        def of(base):  # the packings of one base's units, best estimate first
            return [p for p in packs if family[id(p[2])] == base]

        refined = {}  # a refined packing -> the packing it refines
        if dp > 1 and BALANCE_MOVES and packs:  # each base's best packings evened out per slot (side by side)
            jobs = []  # (base, packing, swap_bins, ordered)
            for base in range(len(bases)):
                mine = of(base)
                if not mine or id(mine[0][2]) in searched:
                    continue  # the one-slot search's packing leads: a finer search than the pass already ran
                mine = [p for p in mine if id(p[2]) not in searched]
                many = base == 0 and len(mine[0][2][0]) >= BALANCE_MORE_BINS
                k = BALANCE_PACKINGS[many]
                for j, (_, _, packed) in enumerate(mine[:k]):
                    # the best one: swaps in more microbatches, and with many microbatches also refined
                    # with the objective in run order (producers first)
                    for ordered in (False, True) if j == 0 and many else (False,):
                        jobs.append((base, packed, BALANCE_SWAP_BINS_FIRST if j == 0 else None, ordered))

            def balanced(job):
                _, packed, swap_bins, ordered = job
                return rebalance(ix, packed, dp, M, overhead, swap_bins=swap_bins, ordered=ordered,
                                 arrays=arrays_of[id(packed)])

            for (base, packed, _, _), even in zip(jobs, concurrently(balanced, jobs)):
                if even is not None:
                    refined[id(even)] = packed
                    family[id(even)] = base
                    units_of[id(even)] = units_of[id(packed)]
                    packs.append((estimate_step(even, dp, overhead), len(packs), even))
            packs.sort(key=lambda p: p[:2])
        keys = {}  # a packing (its id) -> its plan's (step, tokens) or None (over the budget)
        kept = {}  # a packing (its id) -> what judging it left for its assembly

        def judge(packed):
            if id(packed) not in keys:
                kept[id(packed)] = keep = {}
                keys[id(packed)] = window_key(ix, packed, dp=dp, M=M, model=model, keep=keep)
            return keys[id(packed)]

        best = None  # the packing the best plan so far is assembled from (None: L1's plan)
        for base in range(len(bases)):  # each base's best packings by estimate judged exactly
            judged = 0
            for est, _, packed in of(base)[:2 * ASSEMBLED]:
                if judged == ASSEMBLED or est > plan_key[0] * (1.0 + ASSEMBLE_MARGIN):
                    break  # the rest estimated longer than the best plan by more than estimates err
                if packed_rows(ix, packed) > keep_tokens:
                    continue  # more rows than L1's tokens: never a candidate (not judged)
                key = judge(packed)
                if key is None or key[1] > keep_tokens:
                    continue  # not a candidate: the next packing by estimate is judged instead
                if id(packed) in refined and key[1] > packed_rows(ix, refined[id(packed)]):
                    # the balance pass never computes more tokens (exactly; its source's rows bound its tokens)
                    src = judge(refined[id(packed)])
                    if src is not None and key[1] > src[1]:
                        continue
                judged += 1
                if key < plan_key:
                    best, plan_key, plan_packed = packed, key, refined.get(id(packed), packed)
        plan_units = None  # the units the best plan packs (None: L1's plan)
        if best is not None:
            plan = window_plan(ix, best, dp=dp, M=M, model=model, keep=kept[id(best)])
            plan_units = units_of[id(best)]
        n_mb = len(plan.microbatches)
        if plan_packed is not None and plan.num_slots <= BALANCE_SPEND_SLOTS and n_mb >= BALANCE_SPEND_BINS and \
                (n_mb >= BALANCE_MORE_BINS or float(slot_balance(plan).mean()) < BALANCE_SPEND_BELOW):
            # the best plan's packing evened out again, spending parts of what it saves against L1
            src, saved = plan_packed, keep_tokens - plan_key[1]
            tries = [(part, ordered, None, False) for part, ordered in BALANCE_SPEND]
            if any(u.upper >= 0 for u in units_of[id(src)]):
                tries += [(part, ordered, weight, True) for part, ordered, weight in BALANCE_SPLIT]
            found = {False: (None, plan_key), True: (None, plan_key)}  # per split: the best packing and its key

            def spent(t):
                part, ordered, weight, split = t
                spend = int(part * saved)
                return rebalance(ix, src, dp, M, overhead, spend, ordered=ordered, arrays=arrays_of.get(id(src)),
                                 weight=weight, split=split) if spend > 0 else None

            for (part, ordered, weight, split), even in zip(tries, concurrently(spent, tries)):
                key = None if even is None else window_key(ix, even, dp=dp, M=M, model=model)
                if key is not None and key[1] <= keep_tokens and key < found[split][1]:
                    found[split] = (even, key)
            if found[False][0] is not None:
                plan, plan_key = window_plan(ix, found[False][0], dp=dp, M=M, model=model), found[False][1]
            if found[True][0] is not None and found[True][1] < plan_key:
                # the split windows' items moved: the plan without that pass stays a rival through the last pass
                rival = plan
                plan, plan_key = window_plan(ix, found[True][0], dp=dp, M=M, model=model), found[True][1]
        if plan_units is not None and dp > 1 and 1 < plan.num_slots <= SEARCH_SLOTS:
            # few slots: the plan's units searched again, every slot at once (the one-slot packer's descent)
            packed = search_slots(ix, plan_units, plan, model, keep_tokens, arrays_by.get(id(plan_units)))
            judged = {}
            key = None if packed is None else window_key(ix, packed, dp=dp, M=M, model=model, keep=judged)
            if key is not None and key[1] <= keep_tokens and key < plan_key:
                got = window_plan(ix, packed, dp=dp, M=M, model=model, keep=judged)
                if got is not None:
                    plan, plan_key, rival = got, key, None
    if dp > 1 and max(len(p.microbatches) for p in (plan, rival or plan)) >= EVEN_BINS:
        # the chosen plan's slots evened out per segment

        def evened(p):
            if len(p.microbatches) < EVEN_BINS:
                return p
            even = even_slots(ix, p, model, int(EVEN_SPEND * (keep_tokens - p.tokens_computed)))
            if even is not None and even.tokens_computed <= keep_tokens and step_cost(even) <= step_cost(keep):
                return even
            return p

        if rival is None:
            plan = evened(plan)
        else:  # the split windows' pass gave the plan: kept where it beats the plan it beat once both are evened out
            # (the plan as it is evened out only where it beats the evened rival already; with threads to
            # spare both are evened out side by side)
            plan_even = None
            if plan_threads(2) > 1:
                rival, plan_even = concurrently(evened, [rival, plan])
            else:
                rival = evened(rival)
            beats = (step_cost(plan), plan.tokens_computed) < (step_cost(rival), rival.tokens_computed)
            plan = (plan_even if plan_even is not None else evened(plan)) if beats else rival
            if (step_cost(rival), rival.tokens_computed) < (step_cost(plan), plan.tokens_computed):
                plan = rival
    plan.plan_seconds = time.perf_counter() - t0
    return plan


def step_cost(plan: MicrobatchPlan) -> float:
    """Modelled step time: sum over slots of the costliest microbatch of the slot (an idle replica
    counting 0.0: the maximum of ``plan.cost_matrix()`` per slot, summed as numpy sums it)."""
    R, S = plan.slots.shape
    mbs = plan.microbatches
    return slot_step(R, S, [m.slot for m in mbs], [m.cost for m in mbs])


def plan_harts(forest, dp: int, row_budget: int, *, cost_model: Optional[CostModel] = None,
               index: Optional[ForestIndex] = None, **l2_options) -> Tuple[MicrobatchPlan, MicrobatchPlan]:
    """(L1 plan, L1+L2 plan).  The L1+L2 plan's ``plan_seconds`` includes L1's time."""
    ix = index if index is not None else ForestIndex(forest)
    l1 = plan_l1(forest, dp, row_budget, cost_model=cost_model, index=ix)
    l2 = plan_l2(forest, l1, cost_model=cost_model, index=ix, **l2_options)
    l2.plan_seconds += l1.plan_seconds
    return l1, l2


def _order(packed):
    """``plan_order`` of a packing: a compiled packing's own (``_C.L2Packing.plan_order``), else
    None (``assemble_plan`` and ``packing_key`` then compute it from the groups and placement)."""
    return None if isinstance(packed, tuple) else packed.plan_order()


def window_plan(ix: ForestIndex, packed, *, dp: int, M: int, model: CostModel,
                keep: Optional[dict] = None) -> Optional[MicrobatchPlan]:
    """``pack_windows``' result assembled (None when a microbatch exceeds the budget).  ``keep``:
    what ``window_key(..., keep=keep)`` of the same packing left (reused)."""
    order = _order(packed) if keep is None else keep["order"]
    try:
        return assemble_plan(ix, None if order else packed[0], None if order else packed[1],
                             planner="harts_l1l2", dp=dp, row_budget=M, cost_model=model,
                             order=order, keep=keep)
    except PlanningError:
        return None


def window_key(ix: ForestIndex, packed, *, dp: int, M: int, model: CostModel,
               keep: Optional[dict] = None) -> Optional[Tuple[float, int]]:
    """``(step_cost, tokens_computed)`` of ``window_plan``'s plan of a packing without assembling it
    (``microbatch.packing_key``; None where ``window_plan`` returns None).  ``keep``: a dict it
    leaves the plan order and core output in, for ``window_plan`` of the same packing."""
    order = _order(packed)
    return packing_key(ix, None if order else packed[0], None if order else packed[1], dp=dp,
                       row_budget=M, cost_model=model, order=order, keep=keep)
