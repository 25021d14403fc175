// L1's planning core (megatron_harts.planner.l1: split_tree, split_piece, _piece_costs, balance_pieces,
// pack_pieces, place_sorted and plan_l1's choice among its split variants), step for step the same as the
// Python reference: the same pieces in the same order, the same floats summed in the same order, the same
// bins and placement.  Registered into megatron_harts._C by register_packing (csrc/l2_packing.cpp).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <queue>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "planner_l2.h"

namespace py = pybind11;

namespace {

using i64 = std::int64_t;
using I64Array = py::array_t<i64, py::array::c_style | py::array::forcecast>;
using F64Array = py::array_t<double, py::array::c_style | py::array::forcecast>;

// Children lists as CSR: the children of p are ids[off[p]:off[p + 1]] (ascending).
struct Kids {
    std::vector<i64> off, ids;
    const i64* begin(i64 p) const { return ids.data() + off[p]; }
    const i64* end(i64 p) const { return ids.data() + off[p + 1]; }
};

// Kids of m positions from par[p] (the parent's position, -1: none; parents precede children).
Kids kids_of(const std::vector<i64>& par) {
    const std::size_t m = par.size();
    Kids k;
    k.off.assign(m + 1, 0);
    for (std::size_t p = 0; p < m; ++p)
        if (par[p] >= 0) ++k.off[par[p] + 1];
    for (std::size_t p = 0; p < m; ++p) k.off[p + 1] += k.off[p];
    k.ids.resize(k.off[m]);
    std::vector<i64> fill(k.off.begin(), k.off.end() - 1);
    for (std::size_t p = 0; p < m; ++p)
        if (par[p] >= 0) k.ids[fill[par[p]]++] = static_cast<i64>(p);
    return k;
}

// a piece: owned segments, recomputed segments, rows (l1.Piece)
struct Piece {
    std::vector<i64> own, rec;
    i64 rows = 0;
};

struct L1 {
    const i64 *parent, *start, *length, *pairs, *logits;
    i64 n, chunk;
    double mb, row, pair, call, replay, logit;  // CostCoefficients in CostModel.cost's order
    std::vector<i64> sub_rows, sub_size;
    Kids children;  // ascending ids (ForestIndex.children)

    // The bottom-up cut of l1._split over local positions 0..m-1 (segment ids seg[p], ascending), processed
    // in decreasing order, with in-set children kids[p] (positions, ascending), subtree rows subr[p], roots,
    // recomputed flags and whole(p) (the piece of a subtree that fits).
    template <class Whole>
    std::vector<Piece> split(const std::vector<i64>& seg, const Kids& kids,
                             const std::vector<i64>& subr, const std::vector<char>& root,
                             const std::vector<char>& recf, Whole whole, i64 M) const {
        const i64 m = static_cast<i64>(seg.size());
        std::vector<Piece> result;
        std::vector<std::vector<Piece>> groups(m);
        for (i64 p = m - 1; p >= 0; --p) {
            const i64 s = seg[p];
            if (start[s] + subr[p] <= M) {
                if (root[p]) result.push_back(whole(p));
                continue;
            }
            std::vector<Piece> items;
            for (const i64* cp = kids.begin(p); cp != kids.end(p); ++cp) {
                const i64 c = *cp;
                if (start[seg[c]] + subr[c] <= M) {
                    items.push_back(whole(c));
                } else {
                    for (auto& g : groups[c]) items.push_back(std::move(g));
                    groups[c].clear();
                }
            }
            const i64 ls = length[s];
            const i64 cap = M - start[s] - ls;
            std::stable_sort(items.begin(), items.end(), [](const Piece& a, const Piece& b) { return a.rows > b.rows; });
            std::vector<std::vector<i64>> bins;
            std::vector<i64> loads;
            for (i64 i = 0; i < static_cast<i64>(items.size()); ++i) {
                const i64 r = items[i].rows;
                bool placed = false;
                for (std::size_t j = 0; j < bins.size(); ++j) {
                    if (loads[j] + r <= cap) {
                        bins[j].push_back(i);
                        loads[j] += r;
                        placed = true;
                        break;
                    }
                }
                if (!placed) {
                    if (r > cap) {
                        throw std::runtime_error("a piece of " + std::to_string(r) +
                                                 " rows does not fit under segment " + std::to_string(s));
                    }
                    bins.push_back({i});
                    loads.push_back(r);
                }
            }
            if (bins.empty()) {
                throw std::runtime_error("segment " + std::to_string(s) + ": " + std::to_string(start[s] + ls) +
                                         " rows on its path exceed the budget " + std::to_string(M));
            }
            std::vector<Piece> out;
            for (std::size_t j = 0; j < bins.size(); ++j) {
                Piece q;
                for (i64 i : bins[j]) q.own.insert(q.own.end(), items[i].own.begin(), items[i].own.end());
                for (i64 i : bins[j]) q.rec.insert(q.rec.end(), items[i].rec.begin(), items[i].rec.end());
                ((j == 0 && !recf[p]) ? q.own : q.rec).push_back(s);
                q.rows = ls + loads[j];
                out.push_back(std::move(q));
            }
            if (root[p]) {
                for (auto& q : out) result.push_back(std::move(q));
            } else {
                groups[p] = std::move(out);
            }
        }
        return result;
    }

    // l1.split_tree
    std::vector<Piece> split_tree(i64 r, i64 end, i64 M) const {
        if (sub_rows[r] <= M) {
            Piece q;
            for (i64 x = r; x < end; ++x) q.own.push_back(x);
            q.rows = sub_rows[r];
            return {q};
        }
        const i64 m = end - r;
        std::vector<i64> seg(m), subr(m);
        Kids kids;  // the tree's slice of the forest's children, as positions
        kids.off.resize(m + 1);
        for (i64 p = 0; p <= m; ++p) kids.off[p] = children.off[r + p] - children.off[r];
        kids.ids.assign(children.begin(r), children.end(end - 1));
        for (i64& c : kids.ids) c -= r;
        std::vector<char> root(m, 0), recf(m, 0);
        for (i64 p = 0; p < m; ++p) {
            seg[p] = r + p;
            subr[p] = sub_rows[r + p];
        }
        root[0] = 1;
        auto whole = [&](i64 p) {
            Piece q;
            const i64 x = r + p;
            for (i64 y = x; y < x + sub_size[x]; ++y) q.own.push_back(y);
            q.rows = sub_rows[x];
            return q;
        };
        return split(seg, kids, subr, root, recf, whole, M);
    }

    // l1.split_piece
    std::vector<Piece> split_piece(const Piece& pc, i64 M) const {
        std::vector<i64> seg(pc.own);
        seg.insert(seg.end(), pc.rec.begin(), pc.rec.end());
        std::sort(seg.begin(), seg.end());
        const i64 m = static_cast<i64>(seg.size());
        auto pos = [&](i64 x) -> i64 {  // the position of segment x in seg (-1: not in the set)
            auto it = std::lower_bound(seg.begin(), seg.end(), x);
            return (it != seg.end() && *it == x) ? static_cast<i64>(it - seg.begin()) : -1;
        };
        std::vector<char> recf(m, 0), root(m, 0);
        for (i64 x : pc.rec) recf[pos(x)] = 1;
        std::vector<i64> subr(m), par(m, -1);
        for (i64 p = 0; p < m; ++p) {
            subr[p] = length[seg[p]];
            if (parent[seg[p]] >= 0) par[p] = pos(parent[seg[p]]);
        }
        for (i64 p = m - 1; p >= 0; --p) {
            if (par[p] >= 0) subr[par[p]] += subr[p];
        }
        const Kids kids = kids_of(par);
        for (i64 p = 0; p < m; ++p)
            if (par[p] < 0) root[p] = 1;
        auto whole = [&](i64 p) {
            std::vector<i64> out, stack{p};
            while (!stack.empty()) {
                const i64 x = stack.back();
                stack.pop_back();
                out.push_back(x);
                stack.insert(stack.end(), kids.begin(x), kids.end(x));
            }
            Piece q;
            for (i64 x : out) (recf[x] ? q.rec : q.own).push_back(seg[x]);
            q.rows = subr[p];
            return q;
        };
        return split(seg, kids, subr, root, recf, whole, M);
    }

    // l1._piece_cost: CostModel.cost of the piece's features less the per-microbatch term (the products and
    // sums rounded one by one, as Python evaluates them: no fused multiply-add)
#if defined(__GNUC__) && !defined(__clang__)
    __attribute__((optimize("fp-contract=off")))
#endif
    double cost(const Piece& pc) const {
        std::vector<i64> comp(pc.own);
        comp.insert(comp.end(), pc.rec.begin(), pc.rec.end());
        std::sort(comp.begin(), comp.end());
        i64 f[6];
        microbatch_feature_row(parent, start, length, pairs, logits, comp.data(), static_cast<i64>(comp.size()),
                               pc.own.data(), static_cast<i64>(pc.own.size()), chunk, f);
        const double c = f[0] == 0 ? 0.0
                                   : mb + row * static_cast<double>(f[0]) + pair * static_cast<double>(f[1]) +
                                         call * static_cast<double>(f[2]) + replay * static_cast<double>(f[3]) +
                                         logit * static_cast<double>(f[4]);
        return c - mb;
    }

    i64 depth(const Piece& pc) const {  // l1.piece_depth
        i64 d = 0;
        bool first = true;
        for (const auto* v : {&pc.own, &pc.rec}) {
            for (i64 x : *v) {
                if (first || start[x] + length[x] > d) d = start[x] + length[x];
                first = false;
            }
        }
        return d;
    }
};

i64 ffd_count(std::vector<i64> sizes, i64 cap) {  // l1._ffd_count
    std::sort(sizes.begin(), sizes.end(), std::greater<i64>());
    std::vector<i64> loads;
    for (i64 x : sizes) {
        bool placed = false;
        for (auto& l : loads) {
            if (l + x <= cap) {
                l += x;
                placed = true;
                break;
            }
        }
        if (!placed) loads.push_back(x);
    }
    return static_cast<i64>(loads.size());
}

i64 ceil_div(i64 a, i64 b) { return (a + b - 1) / b; }  // a >= 0, b >= 1: Python's -(-a // b)

// (l1.plan_l1's pieces, bins and placement) of a forest: returns the chosen variant's bins as CSR
// (owned offsets, owned ids, recomputed offsets, recomputed ids) and placement int64[bins, 2].
py::tuple l1_plan(I64Array parent_a, I64Array start_a, I64Array length_a, I64Array pairs_a, I64Array logits_a,
                  I64Array tree_offsets_a, F64Array coef_a, i64 chunk, i64 dp, i64 M, F64Array factors_a) {
    const i64 n = parent_a.shape(0);
    if (parent_a.ndim() != 1 || start_a.ndim() != 1 || length_a.ndim() != 1 || pairs_a.ndim() != 1 ||
        logits_a.ndim() != 1 || start_a.shape(0) != n || length_a.shape(0) != n || pairs_a.shape(0) != n ||
        logits_a.shape(0) != n) {
        throw py::value_error("parent, start, length, pairs and logits must be 1-D arrays of the segment count");
    }
    if (coef_a.ndim() != 1 || coef_a.shape(0) != 6) throw py::value_error("coef must hold 6 coefficients");
    if (dp < 1 || chunk < 1 || factors_a.ndim() != 1) {
        throw py::value_error("dp and chunk_size must be >= 1, factors 1-D");
    }
    const i64 T = tree_offsets_a.shape(0) - 1;
    const i64* toff = tree_offsets_a.data();
    if (tree_offsets_a.ndim() != 1 || T < 0 || toff[0] != 0 || toff[T] != n) {
        throw py::value_error("tree_offsets must run from 0 to the segment count");
    }
    L1 F;
    F.parent = parent_a.data();
    F.start = start_a.data();
    F.length = length_a.data();
    F.pairs = pairs_a.data();
    F.logits = logits_a.data();
    F.n = n;
    F.chunk = chunk;
    const double* co = coef_a.data();
    F.mb = co[0], F.row = co[1], F.pair = co[2], F.call = co[3], F.replay = co[4], F.logit = co[5];
    for (i64 t = 0; t < T; ++t) {
        if (toff[t + 1] < toff[t]) throw py::value_error("tree_offsets must be non-decreasing");
    }
    for (i64 s = 0; s < n; ++s) {
        if (F.parent[s] >= s || F.parent[s] < -1) throw py::value_error("parents must precede their children");
    }
    F.sub_rows.assign(F.length, F.length + n);
    F.sub_size.assign(n, 1);
    for (i64 s = n - 1; s >= 0; --s) {
        if (F.parent[s] >= 0) {
            F.sub_rows[F.parent[s]] += F.sub_rows[s];
            F.sub_size[F.parent[s]] += F.sub_size[s];
        }
    }
    F.children = kids_of(std::vector<i64>(F.parent, F.parent + n));

    std::vector<Piece> pool;
    std::vector<double> pool_cost;
    for (i64 t = 0; t < T; ++t) {
        if (toff[t + 1] == toff[t]) continue;
        for (auto& q : F.split_tree(toff[t], toff[t + 1], M)) pool.push_back(std::move(q));
    }
    const i64 nbase = static_cast<i64>(pool.size());
    for (i64 i = 0; i < nbase; ++i) pool_cost.push_back(F.cost(pool[i]));
    std::vector<i64> base_rows;
    for (i64 i = 0; i < nbase; ++i) base_rows.push_back(pool[i].rows);
    const i64 K = dp * std::max<i64>(1, ceil_div(ffd_count(base_rows, M), dp));
    std::unordered_map<i64, std::vector<i64>> memo;  // a split piece -> its parts (itself alone: no split)

    const double* fac = factors_a.data();
    const i64 nf = dp > 1 ? factors_a.shape(0) : 1;
    bool have_best = false;
    double best_step = 0.0;
    i64 best_rows = 0;
    std::vector<i64> best_pieces;
    std::vector<std::vector<i64>> best_bins;
    std::vector<std::pair<i64, i64>> best_place;
    std::vector<std::vector<i64>> tried;
    for (i64 v = 0; v < nf; ++v) {
        const bool has_factor = dp > 1 && fac[v] >= 0.0;  // negative: None
        const double factor = has_factor ? fac[v] : 0.0;
        // balance_pieces
        std::vector<i64> pieces(nbase);
        for (i64 i = 0; i < nbase; ++i) pieces[i] = i;
        std::vector<char> stuck(nbase, 0);
        const i64 limit = 8 * K + 8 * nbase;
        for (i64 it = 0; it < limit; ++it) {
            i64 cand = -1;
            for (i64 i = 0; i < static_cast<i64>(pieces.size()); ++i) {
                if (!stuck[i] && (cand < 0 || pool_cost[pieces[i]] > pool_cost[pieces[cand]])) cand = i;
            }
            if (cand < 0) break;
            double total = 0.0;
            for (i64 q : pieces) total += pool_cost[q];
            const double tau = total / static_cast<double>(K);
            if (static_cast<i64>(pieces.size()) >= K &&
                (dp == 1 || !has_factor || pool_cost[pieces[cand]] <= factor * tau)) {
                break;
            }
            const i64 pid = pieces[cand];
            auto got = memo.find(pid);
            if (got == memo.end()) {
                const Piece& pc = pool[pid];
                const i64 mrows = std::max(F.depth(pc), ceil_div(pc.rows, 2));
                std::vector<i64> parts;
                if (mrows < pc.rows) {
                    std::vector<Piece> split = F.split_piece(pc, mrows);
                    if (split.size() >= 2) {
                        for (auto& q : split) {
                            parts.push_back(static_cast<i64>(pool.size()));
                            pool.push_back(std::move(q));
                        }
                        for (i64 q : parts) pool_cost.push_back(F.cost(pool[q]));
                    } else {
                        parts.push_back(pid);
                    }
                } else {
                    parts.push_back(pid);
                }
                got = memo.emplace(pid, std::move(parts)).first;
            }
            const std::vector<i64>& parts = got->second;
            if (parts.size() < 2) {
                stuck[cand] = 1;
                continue;
            }
            pieces.erase(pieces.begin() + cand);
            pieces.insert(pieces.begin() + cand, parts.begin(), parts.end());
            stuck.erase(stuck.begin() + cand);
            stuck.insert(stuck.begin() + cand, parts.size(), 0);
        }
        if (std::find(tried.begin(), tried.end(), pieces) != tried.end()) continue;  // same pieces: same bins
        tried.push_back(pieces);
        // pack_pieces (min_bins = K)
        const i64 np = static_cast<i64>(pieces.size());
        std::vector<std::vector<i64>> bins;
        if (np > 0) {
            std::vector<i64> order(np);
            for (i64 i = 0; i < np; ++i) order[i] = i;
            std::stable_sort(order.begin(), order.end(), [&](i64 a, i64 b) {
                const double ca = pool_cost[pieces[a]], cb = pool_cost[pieces[b]];
                if (ca != cb) return ca > cb;
                return pool[pieces[a]].rows > pool[pieces[b]].rows;
            });
            i64 Kb = K;
            while (true) {
                using Entry = std::pair<double, i64>;
                std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
                for (i64 j = 0; j < Kb; ++j) heap.push({0.0, j});
                bins.assign(Kb, {});
                std::vector<i64> brows(Kb, 0);
                bool ok = true;
                for (i64 i : order) {
                    const i64 r = pool[pieces[i]].rows;
                    std::vector<Entry> aside;
                    bool placed = false;
                    while (!heap.empty()) {
                        Entry e = heap.top();
                        heap.pop();
                        if (brows[e.second] + r <= M) {
                            bins[e.second].push_back(i);
                            brows[e.second] += r;
                            heap.push({e.first + pool_cost[pieces[i]], e.second});
                            placed = true;
                            break;
                        }
                        aside.push_back(e);
                    }
                    for (auto& e : aside) heap.push(e);
                    if (!placed) {
                        ok = false;
                        break;
                    }
                }
                if (ok) break;
                Kb += dp;
            }
        }
        const i64 nb = static_cast<i64>(bins.size());
        std::vector<double> loads(nb);
        for (i64 b = 0; b < nb; ++b) {
            double s = 0.0;
            for (i64 i : bins[b]) s += pool_cost[pieces[i]];
            loads[b] = s + (bins[b].empty() ? 0.0 : F.mb);
        }
        // place_sorted
        std::vector<i64> ord(nb);
        for (i64 b = 0; b < nb; ++b) ord[b] = b;
        std::stable_sort(ord.begin(), ord.end(), [&](i64 a, i64 b) { return loads[a] > loads[b]; });
        std::vector<std::pair<i64, i64>> place(nb);
        for (i64 j = 0; j < nb; ++j) place[ord[j]] = {j % dp, j / dp};
        std::vector<i64> slot_seen;  // slots in first-appearance order
        std::vector<double> slot_max;
        std::unordered_map<i64, i64> slot_at;
        for (i64 b = 0; b < nb; ++b) {
            const i64 k = place[b].second;
            auto it = slot_at.find(k);
            if (it == slot_at.end()) {
                slot_at[k] = static_cast<i64>(slot_max.size());
                slot_max.push_back(loads[b] > 0.0 ? loads[b] : 0.0);
            } else if (loads[b] > slot_max[it->second]) {
                slot_max[it->second] = loads[b];
            }
        }
        double step = 0.0;
        for (double x : slot_max) step += x;
        i64 rows = 0;
        for (i64 q : pieces) rows += pool[q].rows;
        if (!have_best || step < best_step || (step == best_step && rows < best_rows)) {
            have_best = true;
            best_step = step;
            best_rows = rows;
            best_pieces = pieces;
            best_bins = bins;
            best_place = place;
        }
    }
    const i64 nb = static_cast<i64>(best_bins.size());
    std::vector<i64> own_off{0}, own, rec_off{0}, rec;
    for (const auto& b : best_bins) {
        for (i64 i : b) {
            const Piece& pc = pool[best_pieces[i]];
            own.insert(own.end(), pc.own.begin(), pc.own.end());
        }
        for (i64 i : b) {
            const Piece& pc = pool[best_pieces[i]];
            rec.insert(rec.end(), pc.rec.begin(), pc.rec.end());
        }
        own_off.push_back(static_cast<i64>(own.size()));
        rec_off.push_back(static_cast<i64>(rec.size()));
    }
    py::array_t<i64> pl({static_cast<py::ssize_t>(nb), static_cast<py::ssize_t>(2)});
    auto P = pl.mutable_unchecked<2>();
    for (i64 b = 0; b < nb; ++b) {
        P(b, 0) = best_place[b].first;
        P(b, 1) = best_place[b].second;
    }
    return py::make_tuple(int64_array(own_off), int64_array(own), int64_array(rec_off), int64_array(rec), pl);
}

}  // namespace

void register_l1(py::module_& m) {
    m.def("l1_plan", &l1_plan, py::arg("parent"), py::arg("start"), py::arg("length"), py::arg("pairs"),
          py::arg("logits"), py::arg("tree_offsets"), py::arg("coef"), py::arg("chunk_size"), py::arg("dp"),
          py::arg("M"), py::arg("factors"),
          "L1's pieces, bins and placement (megatron_harts.planner.l1.plan_l1's Python path, the same values): "
          "coef = the cost coefficients (microbatch, row, attention pair, KDA call, replay token, logits row), "
          "factors = SPLIT_FACTORS (negative: None).  Returns (owned offsets, owned, recomputed offsets, "
          "recomputed, placement int64[bins, 2]).");
}
