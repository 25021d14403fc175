"""L2's window packer (``pack_windows``): each produced tree one window on one replica.

``_C.l2_pack_windows`` is its compiled core on several replicas; ``_pack_windows_python`` its
reference (the same values, floats included; ``tests/test_l2_windows.py`` holds them equal) and
the packer on one replica.  Invariant: every window of its packings runs as the schedule runs it
(``replica_windows``): a consumer reads context only from its own window's producer, an earlier
microbatch of its replica that is not itself a consumer; an item placed away from its window
recomputes its root path and reads nothing.
"""
from __future__ import annotations

import math
from typing import Dict, List, Tuple

from .cost_model import ForestIndex
from .l2_packing import CompiledPacker, _after_owners
from .l2_units import _Unit

__all__ = ["pack_windows"]


def _pack_windows_python(ix: ForestIndex, units: List[_Unit], dp: int, M: int, S: int, eps: float = 0.01):
    """Place ``units`` into microbatches on ``dp`` replicas so that every window runs as the
    schedule runs it (``replica_windows``), with a microbatch target of the estimated cost over
    ``dp * S`` times ``1 + eps`` (none on one replica, where microbatches are filled by rows):
    steps 2-4 of the module docstring.

    Returns (packings, bound): every packing as (groups, placement, loads), ``groups`` (owned,
    recomputed) and ``placement`` (replica, slot) for ``assemble_plan``, ``loads[r]`` the
    estimated costs of replica ``r``'s microbatches in slot order; on several replicas also
    the packing leveled, with its light microbatches dissolved, and both (``_dissolve``,
    window leveling).  ``bound``: whether the target shaped a packing (else every target gives
    the same)."""
    length = ix.length_list
    total = sum(u.cost + u.replay_cost for u in units)
    tau = total / (dp * S)
    hi = tau * (1.0 + eps) if dp > 1 else math.inf
    cap = S * hi  # a replica's share of the step
    rep: List[int] = []        # per microbatch: its replica
    load: List[float] = []
    rows: List[int] = []
    have: List[set] = []
    own_l: List[List[int]] = []
    rec_l: List[List[int]] = []
    window_of: List[int] = []  # the window a microbatch belongs to (-1: none)
    units_of: List[List[_Unit]] = []
    total_r = [0.0] * dp
    blocks: List[List[List[int]]] = [[] for _ in range(dp)]  # per replica: [producer, consumers...]
    loose: List[List[int]] = [[] for _ in range(dp)]         # per replica: microbatches of no window

    def open_bin(r, tree):
        rep.append(r)
        load.append(0.0)
        rows.append(0)
        have.append(set())
        own_l.append([])
        rec_l.append([])
        window_of.append(tree)
        units_of.append([])
        return len(rep) - 1

    def put(b, u, extra_segs, cost):
        """Unit ``u`` into microbatch ``b``, recomputing ``extra_segs`` too.  ``have[b]`` holds the
        recomputed segments only (a unit's own segments are its alone, so another unit
        recomputing one of them counts its rows twice: an overestimate the plan's assembly
        drops)."""
        units_of[b].append((u, extra_segs, cost))
        load[b] += cost
        total_r[rep[b]] += cost
        add = u.own_rows
        if u.rec or extra_segs:
            hb = have[b]
            rb = rec_l[b]
            for seq in (u.rec, extra_segs):
                for x in seq:
                    if x not in hb:
                        hb.add(x)
                        rb.append(x)
                        add += length[x]
        rows[b] += add
        own_l[b].extend(u.owned)

    def path_extra(u, b):
        """Rows and cost the root path of item ``u`` adds to microbatch ``b``."""
        extra = sum([length[x] for x in u.path if x not in have[b]])
        return extra, u.path_cost * extra / max(1, u.path_rows)

    bound = False  # whether the target turned a placement away (else other targets pack the same)

    def best_fit(cands, u, cost_of, add_of):
        nonlocal bound
        best, best_key = -1, None
        for b in cands:
            c = cost_of(b)
            if rows[b] + add_of(b) > M:
                continue
            if load[b] + c > hi:
                bound = True
                continue
            key = rows[b] if dp == 1 else load[b]
            if best < 0 or key > best_key:
                best, best_key = b, key
        return best

    windows: Dict[int, List[_Unit]] = {}
    free: List[_Unit] = []
    for u in units:
        if u.kind == "free":
            free.append(u)
        else:
            windows.setdefault(u.win, []).append(u)
    win_tree = {w: us[0].tree for w, us in windows.items()}
    win_tree[-1] = -1
    has_upper = any(u.upper >= 0 for u in units)
    order = sorted(windows, key=lambda t: -sum(u.cost + u.replay_cost for u in windows[t]))
    for t in order:
        us = windows[t]
        core = next(u for u in us if u.kind == "core")
        r = total_r.index(min(total_r))
        p = open_bin(r, t)
        put(p, core, (), core.cost)
        block = [p]
        blocks[r].append(block)
        items = sorted((u for u in us if u.kind == "item"), key=lambda u: -(u.cost + u.replay_cost))
        for u in items:
            b, bk = -1, 0.0  # best_fit over the window's microbatches, inline
            cu, cr, ur = u.cost, u.cost + u.replay_cost, u.rows
            for x in block:
                if rows[x] + ur > M:
                    continue
                lx = load[x] + (cu if x == p else cr)
                if lx > hi:
                    bound = True
                    continue
                key = rows[x] if dp == 1 else load[x]
                if b < 0 or key > bk:
                    b, bk = x, key
            c = u.cost if b == p else u.cost + u.replay_cost
            if dp > 1 and total_r[r] + c > cap:  # past the replica's share: elsewhere, path recomputed?
                r2 = total_r.index(min(total_r))
                if r2 != r and total_r[r2] + u.cost + u.path_cost < total_r[r] + c:
                    b2, bk = -1, 0.0  # best_fit over replica r2's microbatches of other trees, inline
                    upath, pc, pr = u.path, u.path_cost, max(1, u.path_rows)
                    for x in range(len(rep)):
                        if rep[x] != r2 or win_tree[window_of[x]] == u.tree:
                            continue
                        hx = have[x]
                        extra = sum([length[y] for y in upath if y not in hx])
                        if rows[x] + (ur + extra) > M:
                            continue
                        if load[x] + (cu + pc * extra / pr) > hi:
                            bound = True
                            continue
                        key = rows[x] if dp == 1 else load[x]
                        if b2 < 0 or key > bk:
                            b2, bk = x, key
                    if b2 < 0 and u.rows + u.path_rows <= M:
                        b2 = open_bin(r2, -1)
                        loose[r2].append(b2)
                    if b2 >= 0:
                        put(b2, u, u.path, u.cost + path_extra(u, b2)[1])
                        continue
            if b < 0:
                b = open_bin(r, t)
                block.append(b)
                c = u.cost + u.replay_cost
            put(b, u, (), c)
    for u in sorted(free, key=lambda u: -u.cost):
        b = best_fit(range(len(rep)), u, lambda x: u.cost,
                     lambda x: u.rows - sum([length[y] for y in u.rec if y in have[x]]))
        if b < 0 and dp == 1 and not u.rec and _split_free(u, rows, M, length, blocks, loose, open_bin, put):
            continue
        if b < 0:
            r = total_r.index(min(total_r))
            b = open_bin(r, -1)
            loose[r].append(b)
        put(b, u, (), u.cost)

    def emit():
        """The packing as (groups, placement, loads) in the order of the docstring (None when a
        split window's consumer finds no slot after the producer of its path)."""
        seqs = []
        for r in range(dp):
            seq = []
            for block in blocks[r]:
                seq.append(block[0])
                seq.extend(sorted(block[1:], key=lambda b: -load[b]))
            seq.extend(sorted(loose[r], key=lambda b: -load[b]))
            seq = [b for b in seq if own_l[b]]
            if dp > 1:  # costliest first (slots line up across replicas), a producer before its consumers
                producer_of = {b: block[0] for block in blocks[r] for b in block[1:]}
                srt = sorted(seq, key=lambda b: -load[b])
                seq, done = [], set()
                for b in srt:
                    if b in done:
                        continue
                    pb = producer_of.get(b, -1)
                    if pb >= 0 and pb not in done:
                        seq.append(pb)
                        done.add(pb)
                    seq.append(b)
                    done.add(b)
            seqs.append(seq)
        producer_of_win = {window_of[block[0]]: block[0] for bl in blocks for block in bl}
        after = {}
        for b, entries in enumerate(units_of if has_upper else ()):
            for u, extra_segs, _ in entries:
                if u.upper >= 0 and not extra_segs and b != producer_of_win[u.win]:
                    after.setdefault(b, set()).add(producer_of_win[u.upper])
        seqs = _after_owners(seqs, after)
        if seqs is None:
            return None
        groups, placement, loads, entries = [], [], [], []
        for r, seq in enumerate(seqs):
            for k, b in enumerate(seq):  # assemble_plan sorts the ids
                groups.append((tuple(own_l[b]), tuple(rec_l[b])))
                placement.append((r, k))
                entries.append(list(units_of[b]))
            loads.append([load[b] for b in seq])
        return groups, placement, loads, entries

    def rebuild(b, entries):
        total_r[rep[b]] -= load[b]
        load[b], rows[b] = 0.0, 0
        have[b], own_l[b], rec_l[b], units_of[b] = set(), [], [], []
        for u, extra_segs, c in entries:
            put(b, u, extra_segs, c)

    def level(block):
        """Spread a window's items over its microbatches largest first to the least loaded
        (kept when the window's costliest microbatch gets cheaper)."""
        p, t = block[0], window_of[block[0]]
        mine = [e for b in block for e in units_of[b] if e[0].kind == "item" and e[0].win == t and not e[1]]
        if len(mine) < 2:
            return False
        spread = max(load[b] for b in block) - min(load[b] for b in block)
        if spread <= min(e[0].cost for e in mine):
            return False  # no item moved from the costliest to the cheapest would lower the maximum
        before = max(load[b] for b in block)
        snapshot = {b: list(units_of[b]) for b in block}
        for b in block:
            rebuild(b, [e for e in snapshot[b] if not (e[0].kind == "item" and e[0].win == t and not e[1])])
        for u, _, _ in sorted(mine, key=lambda e: -(e[0].cost + e[0].replay_cost)):
            best = None
            for b in block:
                c = u.cost if b == p else u.cost + u.replay_cost
                if rows[b] + u.rows <= M and (best is None or load[b] + c < best[0]):
                    best = (load[b] + c, b, c)
            if best is None:
                break
            put(best[1], u, (), best[2])
        else:
            if max(load[b] for b in block) < before:
                return True
        for b in block:
            rebuild(b, snapshot[b])
        return False

    def level_all():
        changed = False
        for bl in blocks:
            for block in bl:
                if len(block) > 1 and level(block):
                    changed = True
        if changed:
            out.append(emit())

    out = [emit()]
    if dp > 1:  # variants: leveled; light microbatches dissolved (they depend on the target); both
        state = (list(load), list(rows), [set(h) for h in have], [list(x) for x in own_l],
                 [list(x) for x in rec_l], [list(x) for x in units_of], list(total_r))
        level_all()
        load[:], rows[:], have[:], own_l[:], rec_l[:], units_of[:], total_r[:] = state
        tried, emptied = _dissolve(units_of, window_of, blocks, rep, load, rows, have, own_l, rec_l, total_r, hi, M,
                                   length, win_tree)
        bound = bound or tried
        if emptied:
            out.append(emit())
            level_all()
    return [p for p in out if p is not None], bound


def _split_free(u, rows, M, length, blocks, loose, open_bin, put) -> bool:
    """One replica: a free piece ``u`` (a tree's top, nothing recomputed) that fits no
    microbatch puts its first segments in preorder (ancestor-closed) into the spare rows of
    the microbatch with the most of them that reads nothing, which then produces them; the
    rest goes into a new microbatch right after it in its window, reading them.  The rows
    are the same (the estimate splits the piece's cost by rows; the KDA replay at the rest's
    roots is left to the exact judgement).  False when no segment fits or all of it would."""
    consumers = {b for bl in blocks for block in bl for b in block[1:]}
    cands = [b for b in range(len(rows)) if b not in consumers and rows[b] < M]
    if not cands:
        return False
    p = max(cands, key=lambda b: (M - rows[b], -b))
    room, top, used = M - rows[p], [], 0
    for x in u.owned:  # preorder: every prefix is ancestor-closed
        if used + length[x] > room:
            break
        top.append(x)
        used += length[x]
    if not top or len(top) == len(u.owned):
        return False
    inset = set(top)
    rest = [x for x in u.owned if x not in inset]
    share = used / max(1, u.rows)
    put(p, _Unit("free", u.tree, top, [], used, used, u.cost * share), (), u.cost * share)
    c = open_bin(0, -1)
    put(c, _Unit("free", u.tree, rest, [], u.rows - used, u.rows - used, u.cost * (1.0 - share)), (),
        u.cost * (1.0 - share))
    for block in blocks[0]:
        if block[0] == p:
            block.append(c)
            break
    else:
        if p in loose[0]:
            loose[0].remove(p)
        blocks[0].append([p, c])
    return True


def _dissolve(units_of, window_of, blocks, rep, load, rows, have, own_l, rec_l, total_r, hi, M,
              length, win_tree) -> Tuple[bool, bool]:
    """``pack_windows``' last step on several replicas: the lightest microbatches (under half the
    target) that produce for nobody are emptied when every unit of theirs fits elsewhere under
    the target (best fit): an item of a window into another microbatch of its window (the
    producer: local rows; a consumer: reading it), or anywhere else with its root path
    recomputed (not beside its window); a free piece anywhere.  Each success saves a
    microbatch (and a slot where its replica had the most); the state of every microbatch
    touched is restored when one unit finds no place.  Returns (whether a microbatch was light
    enough to try, whether one was emptied)."""
    producers = {block[0] for bl in blocks for block in bl if len(block) > 1}
    core_of = {block[0]: window_of[block[0]] for bl in blocks for block in bl}
    n = len(rep)
    light = sorted((b for b in range(n) if own_l[b] and b not in producers and load[b] < 0.5 * hi),
                   key=lambda b: load[b])
    gone = set()
    for b in light:
        if any(u.kind == "core" for u, _, _ in units_of[b]):
            continue  # a producer (of no consumer yet) keeps its core
        saved = {}
        moves = []
        ok = True
        for u, _, _ in units_of[b]:
            best, best_key = None, None
            for x in range(n):
                if x == b or x in gone or not own_l[x] or load[x] + u.cost > hi:
                    continue
                if u.kind == "item" and window_of[x] == u.win:
                    local = core_of.get(x, -1) == u.win
                    c = u.cost if local else u.cost + u.replay_cost
                    extra_segs, add = (), u.rows
                elif u.kind == "item":
                    if win_tree[window_of[x]] == u.tree:
                        continue  # another window of its tree: its path would sit above that window's context
                    extra_segs = u.path  # a path item (its path rows deduplicated against the microbatch's)
                    add_path = sum([length[y] for y in u.path if y not in have[x]])
                    c = u.cost + u.path_cost * add_path / max(1, u.path_rows)
                    add = u.rows + add_path
                else:
                    extra_segs, c = (), u.cost
                    add = u.rows - sum([length[y] for y in u.rec if y in have[x]])
                if rows[x] + add > M or load[x] + c > hi:
                    continue
                if best is None or load[x] > best_key:
                    best, best_key = (x, extra_segs, c), load[x]
            if best is None:
                ok = False
                break
            x, extra_segs, c = best
            if x not in saved:
                saved[x] = (load[x], rows[x], set(have[x]), len(own_l[x]), len(rec_l[x]), len(units_of[x]))
            load[x] += c
            total_r[rep[x]] += c
            hx = have[x]
            rows[x] += u.own_rows
            for seq in (u.rec, extra_segs):
                for y in seq:
                    if y not in hx:
                        hx.add(y)
                        rec_l[x].append(y)
                        rows[x] += length[y]
            own_l[x].extend(u.owned)
            units_of[x].append((u, extra_segs, c))
            moves.append(x)
        if ok:
            gone.add(b)
            total_r[rep[b]] -= load[b]
            own_l[b], rec_l[b], units_of[b] = [], [], []
            load[b], rows[b] = 0.0, 0
            continue
        for x, (ld, rw, hv, no, nr, nu) in saved.items():
            total_r[rep[x]] -= load[x] - ld
            load[x], rows[x], have[x] = ld, rw, hv
            del own_l[x][no:], rec_l[x][nr:], units_of[x][nu:]
    return bool(light), bool(gone)


pack_windows = CompiledPacker("l2_pack_windows", _pack_windows_python, min_dp=2, doc="""The window packer:
(packings, bound) of ``_pack_windows_python``, from the compiled ``_C.l2_pack_windows`` on several replicas
when it is built (the same values).""")
