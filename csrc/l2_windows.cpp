// L2's window packer on several replicas: the C++ core of megatron_harts.planner.l2_windows.pack_windows
// (the Python reference beside it: _pack_windows_python; tests/test_l2_windows.py holds the two equal,
// floats included: every floating-point operation below runs in the reference's order, and every sort is
// stable on the reference's key).  One replica (no target; a free piece's top split into spare rows)
// stays with the reference.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "planner_l2.h"

namespace py = pybind11;

namespace {

using i64 = std::int64_t;
using I64Array = py::array_t<i64, py::array::c_style | py::array::forcecast>;
using F64Array = py::array_t<double, py::array::c_style | py::array::forcecast>;

constexpr i64 kCore = 0, kItem = 1, kFree = 2;

inline bool has(const std::vector<i64>& v, i64 x) { return std::find(v.begin(), v.end(), x) != v.end(); }

// The packer's microbatches (bins) and what its placement rules read; the reference's lists of the same
// names, one entry per bin.  have[b] is the reference's set of b's recomputed segments, as a short list
// without repeats (membership by scan: few per bin).  Invariant: rows[b] counts b's owned rows plus every
// segment of have[b] once;
// load[b] is the sum of its entries' costs in the order they were put; total_r[r] the loads put on
// replica r (less what was taken back), in that order.
struct Packer {
    const i64* length;
    py::detail::unchecked_reference<i64, 2> ints;
    py::detail::unchecked_reference<double, 2> flts;
    const i64 *own_off, *own, *rec_off, *rec, *path_off, *path;
    i64 dp, M;
    double hi = 0.0;
    bool bound = false;

    std::vector<i64> rep, rows, window_of, win_tree;  // win_tree: the tree of the bin's window (-1: none)
    std::vector<double> load, total_r;
    std::vector<std::vector<i64>> have;
    std::vector<std::vector<i64>> own_l, rec_l;
    std::vector<std::vector<L2Entry>> units_of;
    std::vector<std::vector<std::vector<i64>>> blocks;  // per replica: [producer, consumers...]
    std::vector<std::vector<i64>> loose;                // per replica: bins of no window

    i64 kind(i64 k) const { return ints(k, 0); }
    i64 tree(i64 k) const { return ints(k, 1); }
    i64 win(i64 k) const { return ints(k, 2); }
    i64 upper(i64 k) const { return ints(k, 3); }
    i64 own_rows(i64 k) const { return ints(k, 4); }
    i64 path_rows(i64 k) const { return ints(k, 6); }
    i64 urows(i64 k) const { return ints(k, 7); }
    double cost(i64 k) const { return flts(k, 0); }
    double replay_cost(i64 k) const { return flts(k, 1); }
    double path_cost(i64 k) const { return flts(k, 2); }

    i64 open_bin(i64 r, i64 window, i64 tree_of_window) {
        rep.push_back(r);
        load.push_back(0.0);
        rows.push_back(0);
        have.emplace_back();
        own_l.emplace_back();
        rec_l.emplace_back();
        window_of.push_back(window);
        win_tree.push_back(tree_of_window);
        units_of.emplace_back();
        return static_cast<i64>(rep.size()) - 1;
    }

    // Unit k into bin b, its root path recomputed too when with_path (the reference's put).
    void put(i64 b, i64 k, bool with_path, double c) {
        units_of[b].push_back(L2Entry{k, with_path && path_off[k + 1] > path_off[k], c});
        load[b] += c;
        total_r[rep[b]] += c;
        i64 add = own_rows(k);
        auto walk = [&](const i64* seq, i64 lo, i64 hi_) {
            for (i64 i = lo; i < hi_; ++i) {
                const i64 x = seq[i];
                if (!has(have[b], x)) {
                    have[b].push_back(x);
                    rec_l[b].push_back(x);
                    add += length[x];
                }
            }
        };
        walk(rec, rec_off[k], rec_off[k + 1]);
        if (with_path) walk(path, path_off[k], path_off[k + 1]);
        rows[b] += add;
        for (i64 i = own_off[k]; i < own_off[k + 1]; ++i) own_l[b].push_back(own[i]);
    }

    // Rows of unit k's root path that bin b does not recompute yet.
    i64 path_extra_rows(i64 k, i64 b) const {
        i64 extra = 0;
        for (i64 i = path_off[k]; i < path_off[k + 1]; ++i)
            if (!has(have[b], path[i])) extra += length[path[i]];
        return extra;
    }

    // Cost of unit k with `extra` rows of its root path recomputed (u.cost + u.path_cost * extra / rows).
    double path_item_cost(i64 k, i64 extra) const {
        return cost(k) + path_cost(k) * static_cast<double>(extra) / static_cast<double>(std::max<i64>(1, path_rows(k)));
    }

    i64 least_loaded_replica() const {
        i64 r = 0;
        for (i64 q = 1; q < dp; ++q)
            if (total_r[q] < total_r[r]) r = q;
        return r;
    }

    // Bin b emptied and its entries put back (the reference's rebuild).
    void rebuild(i64 b, const std::vector<L2Entry>& entries) {
        total_r[rep[b]] -= load[b];
        load[b] = 0.0;
        rows[b] = 0;
        have[b].clear();
        own_l[b].clear();
        rec_l[b].clear();
        units_of[b].clear();
        for (const L2Entry& e : entries) put(b, e.unit, e.path, e.cost);
    }

    bool window_item(const L2Entry& e, i64 t) const { return kind(e.unit) == kItem && win(e.unit) == t && !e.path; }

    // A window's items spread over its bins largest first to the least loaded, kept when the window's
    // costliest bin gets cheaper (the reference's level).
    bool level(const std::vector<i64>& block) {
        const i64 p = block[0], t = window_of[p];
        std::vector<L2Entry> mine;
        for (i64 b : block)
            for (const L2Entry& e : units_of[b])
                if (window_item(e, t)) mine.push_back(e);
        if (mine.size() < 2) return false;
        double mx = load[block[0]], mn = load[block[0]];
        for (i64 b : block) {
            mx = std::max(mx, load[b]);
            mn = std::min(mn, load[b]);
        }
        double cmin = cost(mine[0].unit);
        for (const L2Entry& e : mine) cmin = std::min(cmin, cost(e.unit));
        if (mx - mn <= cmin) return false;
        const double before = mx;
        std::vector<std::vector<L2Entry>> snapshot;
        for (i64 b : block) snapshot.push_back(units_of[b]);
        for (std::size_t q = 0; q < block.size(); ++q) {
            std::vector<L2Entry> keep;
            for (const L2Entry& e : snapshot[q])
                if (!window_item(e, t)) keep.push_back(e);
            rebuild(block[q], keep);
        }
        std::stable_sort(mine.begin(), mine.end(), [&](const L2Entry& a, const L2Entry& b) {
            return -(cost(a.unit) + replay_cost(a.unit)) < -(cost(b.unit) + replay_cost(b.unit));
        });
        bool placed_all = true;
        for (const L2Entry& e : mine) {
            const i64 k = e.unit;
            bool found = false;
            double bv = 0.0, bc = 0.0;
            i64 bb = -1;
            for (i64 b : block) {
                const double c = b == p ? cost(k) : cost(k) + replay_cost(k);
                if (rows[b] + urows(k) <= M && (!found || load[b] + c < bv)) {
                    found = true;
                    bv = load[b] + c;
                    bb = b;
                    bc = c;
                }
            }
            if (!found) {
                placed_all = false;
                break;
            }
            put(bb, k, false, bc);
        }
        if (placed_all) {
            double after = load[block[0]];
            for (i64 b : block) after = std::max(after, load[b]);
            if (after < before) return true;
        }
        for (std::size_t q = 0; q < block.size(); ++q) rebuild(block[q], snapshot[q]);
        return false;
    }

    bool level_all() {
        bool changed = false;
        for (auto& bl : blocks)
            for (auto& block : bl)
                if (block.size() > 1 && level(block)) changed = true;
        return changed;
    }

    // The lightest bins producing for nobody emptied into others under the target (the reference's
    // _dissolve).  Returns (whether a bin was light enough to try, whether one was emptied).
    std::pair<bool, bool> dissolve() {
        const i64 n = static_cast<i64>(rep.size());
        std::vector<char> producer(n, 0);
        std::vector<i64> core_of(n, -1);
        for (auto& bl : blocks)
            for (auto& block : bl) {
                if (block.size() > 1) producer[block[0]] = 1;
                core_of[block[0]] = window_of[block[0]];
            }
        std::vector<i64> light;
        for (i64 b = 0; b < n; ++b)
            if (!own_l[b].empty() && !producer[b] && load[b] < 0.5 * hi) light.push_back(b);
        std::stable_sort(light.begin(), light.end(), [&](i64 a, i64 b) { return load[a] < load[b]; });
        std::vector<char> gone(n, 0);
        bool emptied = false;
        struct Saved {
            i64 bin;
            double load;
            i64 rows;
            std::vector<i64> have;
            std::size_t no, nr, nu;
        };
        for (i64 b : light) {
            bool has_core = false;
            for (const L2Entry& e : units_of[b]) has_core = has_core || kind(e.unit) == kCore;
            if (has_core) continue;
            std::vector<Saved> saved;
            bool ok = true;
            const std::vector<L2Entry> entries = units_of[b];
            for (const L2Entry& ent : entries) {
                const i64 k = ent.unit;
                bool found = false, best_path = false;
                i64 bx = -1;
                double bc = 0.0, bkey = 0.0;
                for (i64 x = 0; x < n; ++x) {
                    if (x == b || gone[x] || own_l[x].empty() || load[x] + cost(k) > hi) continue;
                    bool with_path = false;
                    i64 add;
                    double c;
                    if (kind(k) == kItem && window_of[x] == win(k)) {
                        c = core_of[x] == win(k) ? cost(k) : cost(k) + replay_cost(k);
                        add = urows(k);
                    } else if (kind(k) == kItem) {
                        if (win_tree[x] == tree(k)) continue;
                        with_path = true;
                        const i64 add_path = path_extra_rows(k, x);
                        c = path_item_cost(k, add_path);
                        add = urows(k) + add_path;
                    } else {
                        i64 in = 0;
                        for (i64 i = rec_off[k]; i < rec_off[k + 1]; ++i)
                            if (has(have[x], rec[i])) in += length[rec[i]];
                        add = urows(k) - in;
                        c = cost(k);
                    }
                    if (rows[x] + add > M || load[x] + c > hi) continue;
                    if (!found || load[x] > bkey) {
                        found = true;
                        bx = x;
                        best_path = with_path;
                        bc = c;
                        bkey = load[x];
                    }
                }
                if (!found) {
                    ok = false;
                    break;
                }
                bool seen = false;
                for (const Saved& s : saved) seen = seen || s.bin == bx;
                if (!seen)
                    saved.push_back(Saved{bx, load[bx], rows[bx], have[bx], own_l[bx].size(), rec_l[bx].size(),
                                          units_of[bx].size()});
                put(bx, k, best_path, bc);
            }
            if (ok) {
                gone[b] = 1;
                emptied = true;
                total_r[rep[b]] -= load[b];
                own_l[b].clear();
                rec_l[b].clear();
                units_of[b].clear();
                load[b] = 0.0;
                rows[b] = 0;
                continue;
            }
            for (Saved& s : saved) {
                const i64 x = s.bin;
                total_r[rep[x]] -= load[x] - s.load;
                load[x] = s.load;
                rows[x] = s.rows;
                have[x] = std::move(s.have);
                own_l[x].resize(s.no);
                rec_l[x].resize(s.nr);
                units_of[x].resize(s.nu);
            }
        }
        return {!light.empty(), emptied};
    }
};

// The packing as the reference's emit writes it: (groups, placement, loads, entries), or None when a
// split window's consumer finds no slot after the producer of its path.
py::object emit(const Packer& P, const py::list& units, bool has_upper) {
    std::vector<std::vector<i64>> seqs;
    const auto& load = P.load;
    const std::size_t nb = P.rep.size();
    std::vector<i64> producer_of(nb, -1);  // a consumer's producer (bins of no block: -1)
    std::vector<char> done(nb, 0);
    auto by_load = [&](i64 a, i64 b) { return -load[a] < -load[b]; };
    for (i64 r = 0; r < P.dp; ++r) {
        std::vector<i64> seq0;
        for (const auto& block : P.blocks[r]) {
            seq0.push_back(block[0]);
            std::vector<i64> cons(block.begin() + 1, block.end());
            std::stable_sort(cons.begin(), cons.end(), by_load);
            seq0.insert(seq0.end(), cons.begin(), cons.end());
        }
        std::vector<i64> lo = P.loose[r];
        std::stable_sort(lo.begin(), lo.end(), by_load);
        seq0.insert(seq0.end(), lo.begin(), lo.end());
        std::vector<i64> srt;
        for (i64 b : seq0)
            if (!P.own_l[b].empty()) srt.push_back(b);
        for (const auto& block : P.blocks[r])
            for (std::size_t q = 1; q < block.size(); ++q) producer_of[block[q]] = block[0];
        std::stable_sort(srt.begin(), srt.end(), by_load);
        std::vector<i64> seq;
        for (i64 b : srt) {
            if (done[b]) continue;
            const i64 pb = producer_of[b];
            if (pb >= 0 && !done[pb]) {
                seq.push_back(pb);
                done[pb] = 1;
            }
            seq.push_back(b);
            done[b] = 1;
        }
        seqs.push_back(std::move(seq));
    }
    std::unordered_map<i64, std::vector<i64>> after;
    if (has_upper) {
        std::unordered_map<i64, i64> producer_of_win;
        for (const auto& bl : P.blocks)
            for (const auto& block : bl) producer_of_win[P.window_of[block[0]]] = block[0];
        const i64 n = static_cast<i64>(P.rep.size());
        for (i64 b = 0; b < n; ++b)
            for (const L2Entry& e : P.units_of[b])
                if (P.upper(e.unit) >= 0 && !e.path && b != producer_of_win.at(P.win(e.unit))) {
                    auto& qs = after[b];
                    const i64 q = producer_of_win.at(P.upper(e.unit));
                    if (std::find(qs.begin(), qs.end(), q) == qs.end()) qs.push_back(q);
                }
    }
    if (!l2_after_owners(seqs, after)) return py::none();
    return l2_packing_object(seqs, P.own_l, P.rec_l, P.load, P.units_of, units);
}

// Units as in l2_pack_spread (unit_arrays), plus `units` (the unit objects, for the entries).  Returns
// (packings, bound) as the reference: every packing (groups, placement, loads, entries) or None where
// the reference's emit gives None.
py::tuple l2_pack_windows(py::list units, I64Array length_a, I64Array ints_a, F64Array flts_a, I64Array own_off_a,
                          I64Array own_a, I64Array rec_off_a, I64Array rec_a, I64Array path_off_a, I64Array path_a,
                          i64 dp, i64 M, i64 S, double eps) {
    const i64 nu = l2_check_unit_arrays(ints_a, 8, flts_a, own_off_a, own_a, rec_off_a, rec_a, path_off_a, path_a,
                                        length_a.shape(0), static_cast<i64>(units.size()));
    if (dp < 2 || S < 1) throw py::value_error("dp must be >= 2 (one replica: the Python packer) and S >= 1");
    Packer P{length_a.data(),  ints_a.unchecked<2>(), flts_a.unchecked<2>(), own_off_a.data(), own_a.data(),
             rec_off_a.data(), rec_a.data(),          path_off_a.data(),    path_a.data(),    dp,
             M};
    for (i64 k = 0; k < nu; ++k)
        if (P.kind(k) < kCore || P.kind(k) > kFree) throw py::value_error("unit kind out of range");
    double total = 0.0;
    for (i64 k = 0; k < nu; ++k) total += P.cost(k) + P.replay_cost(k);
    const double tau = total / static_cast<double>(dp * S);
    P.hi = tau * (1.0 + eps);
    const double cap = static_cast<double>(S) * P.hi;
    P.total_r.assign(dp, 0.0);
    P.blocks.assign(dp, {});
    P.loose.assign(dp, {});

    // windows in first-appearance order, each with its units in unit order
    std::vector<i64> win_ids;
    std::unordered_map<i64, std::size_t> win_index;
    std::vector<std::vector<i64>> win_units;
    std::vector<i64> free;
    bool has_upper = false;
    for (i64 k = 0; k < nu; ++k) {
        has_upper = has_upper || P.upper(k) >= 0;
        if (P.kind(k) == kFree) {
            free.push_back(k);
            continue;
        }
        auto it = win_index.find(P.win(k));
        if (it == win_index.end()) {
            it = win_index.emplace(P.win(k), win_ids.size()).first;
            win_ids.push_back(P.win(k));
            win_units.emplace_back();
        }
        win_units[it->second].push_back(k);
    }
    std::vector<double> win_cost(win_ids.size(), 0.0);
    for (std::size_t w = 0; w < win_ids.size(); ++w)
        for (i64 k : win_units[w]) win_cost[w] += P.cost(k) + P.replay_cost(k);
    std::vector<std::size_t> order(win_ids.size());
    for (std::size_t w = 0; w < order.size(); ++w) order[w] = w;
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return -win_cost[a] < -win_cost[b]; });
    auto& rows = P.rows;
    auto& load = P.load;
    for (std::size_t w : order) {
        const auto& us = win_units[w];
        const i64 t = win_ids[w];
        const i64 t_tree = P.tree(us[0]);
        i64 core = -1;
        for (i64 k : us)
            if (P.kind(k) == kCore) {
                core = k;
                break;
            }
        if (core < 0) throw py::value_error("a window has no core");
        const i64 r = P.least_loaded_replica();
        const i64 p = P.open_bin(r, t, t_tree);
        P.put(p, core, false, P.cost(core));
        P.blocks[r].push_back({p});
        const std::size_t bi = P.blocks[r].size() - 1;
        std::vector<i64> items;
        for (i64 k : us)
            if (P.kind(k) == kItem) items.push_back(k);
        std::stable_sort(items.begin(), items.end(), [&](i64 a, i64 b) {
            return -(P.cost(a) + P.replay_cost(a)) < -(P.cost(b) + P.replay_cost(b));
        });
        for (i64 k : items) {
            const double cu = P.cost(k), cr = P.cost(k) + P.replay_cost(k);
            const i64 ur = P.urows(k);
            i64 b = -1;
            double bk = 0.0;
            for (i64 x : P.blocks[r][bi]) {  // best fit over the window's bins
                if (rows[x] + ur > M) continue;
                const double lx = load[x] + (x == p ? cu : cr);
                if (lx > P.hi) {
                    P.bound = true;
                    continue;
                }
                if (b < 0 || load[x] > bk) {
                    b = x;
                    bk = load[x];
                }
            }
            double c = b == p ? P.cost(k) : P.cost(k) + P.replay_cost(k);
            if (P.total_r[r] + c > cap) {  // past the replica's share: elsewhere, path recomputed?
                const i64 r2 = P.least_loaded_replica();
                if (r2 != r && P.total_r[r2] + P.cost(k) + P.path_cost(k) < P.total_r[r] + c) {
                    i64 b2 = -1;
                    const i64 nb = static_cast<i64>(P.rep.size());
                    for (i64 x = 0; x < nb; ++x) {  // best fit over replica r2's bins of other trees
                        if (P.rep[x] != r2 || P.win_tree[x] == P.tree(k)) continue;
                        const i64 extra = P.path_extra_rows(k, x);
                        if (rows[x] + (ur + extra) > M) continue;
                        if (load[x] + (cu + P.path_cost(k) * static_cast<double>(extra) /
                                                 static_cast<double>(std::max<i64>(1, P.path_rows(k)))) >
                            P.hi) {
                            P.bound = true;
                            continue;
                        }
                        if (b2 < 0 || load[x] > bk) {
                            b2 = x;
                            bk = load[x];
                        }
                    }
                    if (b2 < 0 && P.urows(k) + P.path_rows(k) <= M) {
                        b2 = P.open_bin(r2, -1, -1);
                        P.loose[r2].push_back(b2);
                    }
                    if (b2 >= 0) {
                        const i64 extra = P.path_extra_rows(k, b2);
                        P.put(b2, k, true,
                              P.cost(k) + P.path_cost(k) * static_cast<double>(extra) /
                                              static_cast<double>(std::max<i64>(1, P.path_rows(k))));
                        continue;
                    }
                }
            }
            if (b < 0) {
                b = P.open_bin(r, t, t_tree);
                P.blocks[r][bi].push_back(b);
                c = P.cost(k) + P.replay_cost(k);
            }
            P.put(b, k, false, c);
        }
    }
    std::stable_sort(free.begin(), free.end(), [&](i64 a, i64 b) { return -P.cost(a) < -P.cost(b); });
    for (i64 k : free) {
        i64 b = -1;
        double bk = 0.0;
        const i64 nb = static_cast<i64>(P.rep.size());
        for (i64 x = 0; x < nb; ++x) {  // best fit over every bin
            i64 in = 0;
            for (i64 i = P.rec_off[k]; i < P.rec_off[k + 1]; ++i)
                if (has(P.have[x], P.rec[i])) in += P.length[P.rec[i]];
            if (rows[x] + (P.urows(k) - in) > M) continue;
            if (load[x] + P.cost(k) > P.hi) {
                P.bound = true;
                continue;
            }
            if (b < 0 || load[x] > bk) {
                b = x;
                bk = load[x];
            }
        }
        if (b < 0) {
            const i64 r = P.least_loaded_replica();
            b = P.open_bin(r, -1, -1);
            P.loose[r].push_back(b);
        }
        P.put(b, k, false, P.cost(k));
    }

    py::list out;
    out.append(emit(P, units, has_upper));
    // variants: leveled; light bins dissolved (they depend on the target); both (the state before leveling
    // kept aside and moved back)
    auto load0 = P.load;
    auto rows0 = P.rows;
    auto have0 = P.have;
    auto own0 = P.own_l;
    auto rec0 = P.rec_l;
    auto units0 = P.units_of;
    auto total0 = P.total_r;
    if (P.level_all()) out.append(emit(P, units, has_upper));
    P.load = std::move(load0);
    P.rows = std::move(rows0);
    P.have = std::move(have0);
    P.own_l = std::move(own0);
    P.rec_l = std::move(rec0);
    P.units_of = std::move(units0);
    P.total_r = std::move(total0);
    const auto tried_emptied = P.dissolve();
    P.bound = P.bound || tried_emptied.first;
    if (tried_emptied.second) {
        out.append(emit(P, units, has_upper));
        if (P.level_all()) out.append(emit(P, units, has_upper));
    }
    return py::make_tuple(out, P.bound);
}

}  // namespace

py::list l2_pack_windows_many(py::list units, I64Array length_a, I64Array ints_a, F64Array flts_a,
                              I64Array own_off_a, I64Array own_a, I64Array rec_off_a,
                              I64Array rec_a, I64Array path_off_a, I64Array path_a, i64 dp, i64 M,
                              const std::vector<i64>& slots, const std::vector<double>& epss) {
    return l2_pack_many(
        [&](i64 S, double eps) {
            return l2_pack_windows(units, length_a, ints_a, flts_a, own_off_a, own_a, rec_off_a,
                                   rec_a, path_off_a, path_a, dp, M, S, eps);
        },
        slots, epss);
}

void register_windows(py::module_& m) {
    m.def("l2_pack_windows_many", &l2_pack_windows_many, py::arg("units"), py::arg("length"),
          py::arg("ints"), py::arg("flts"), py::arg("own_off"), py::arg("own"), py::arg("rec_off"),
          py::arg("rec"), py::arg("path_off"), py::arg("path"), py::arg("dp"), py::arg("M"),
          py::arg("slots"), py::arg("epss"),
          "l2_pack_windows over slot counts and tolerances as plan_l2 asks for them "
          "(l2_packing.CompiledPacker.many): "
          "the packings that are not None, in order.");
    m.def("l2_pack_windows", &l2_pack_windows, py::arg("units"), py::arg("length"), py::arg("ints"), py::arg("flts"),
          py::arg("own_off"), py::arg("own"), py::arg("rec_off"), py::arg("rec"), py::arg("path_off"),
          py::arg("path"), py::arg("dp"), py::arg("M"), py::arg("S"), py::arg("eps"),
          "L2's window packer on several replicas (see megatron_harts.planner.l2_windows.pack_windows; "
          "_pack_windows_python is the reference): (packings, bound), every packing (groups, placement, loads, "
          "entries) or None, as the reference returns them before dropping the Nones.");
}
