// L2's balance pass: the C++ core of megatron_harts.planner.l2_balance.rebalance (the Python reference
// beside it: _rebalance_python; tests/test_microbatch_planner.py holds the two equal, floats
// included: every floating-point operation below runs in the reference's order).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <map>
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

using Entry = L2Entry;

using Units = L2Units;

// Counts keyed by id, entries removed at zero (the reference's dicts): a few keys per bin, kept sorted
// in one vector (iterated in key order; no allocation per key, as every try adds and removes some).
class Counts {
   public:
    using Item = std::pair<i64, i64>;
    using iterator = std::vector<Item>::iterator;
    using const_iterator = std::vector<Item>::const_iterator;

    i64& operator[](i64 k) {
        auto it = lower(k);
        if (it == v_.end() || it->first != k) it = v_.insert(it, Item{k, 0});
        return it->second;
    }
    iterator find(i64 k) {
        auto it = lower(k);
        return it != v_.end() && it->first == k ? it : v_.end();
    }
    const_iterator find(i64 k) const {
        auto it = std::lower_bound(v_.begin(), v_.end(), k, [](const Item& a, i64 x) { return a.first < x; });
        return it != v_.end() && it->first == k ? it : v_.end();
    }
    void erase(iterator it) { v_.erase(it); }
    iterator begin() { return v_.begin(); }
    iterator end() { return v_.end(); }
    const_iterator begin() const { return v_.begin(); }
    const_iterator end() const { return v_.end(); }

   private:
    iterator lower(i64 k) {
        return std::lower_bound(v_.begin(), v_.end(), k, [](const Item& a, i64 x) { return a.first < x; });
    }
    std::vector<Item> v_;
};
// per bin and segment: how many of the bin's entries recompute it (dense: looked up on every try)
using Dense = std::vector<int32_t>;

inline i64 get(const Counts& c, i64 k) {
    auto it = c.find(k);
    return it == c.end() ? 0 : it->second;
}

template <typename Map>
inline void decrement(Map& c, i64 k) {
    auto it = c.find(k);
    if (--it->second == 0) c.erase(it);
}

double slot_objective(const std::vector<const std::vector<double>*>& cs, i64 dp, double tau, double weight) {
    std::size_t S = 0;
    for (auto* c : cs) S = std::max(S, c->size());
    double f = 0.0;
    const double w = weight * tau;
    for (std::size_t k = 0; k < S; ++k) {
        double mx = 0.0, sm = 0.0;
        for (auto* c : cs) {
            if (k < c->size()) {
                const double v = (*c)[k];
                sm += v;
                if (v > mx) mx = v;
            }
        }
        if (mx > 0.0) f += mx + w * (1.0 - sm / (static_cast<double>(dp) * mx));
    }
    return f;
}

// The best change one step of the search has found so far (the reference's ``best`` tuple): kind 0 a
// move of entries idxs of bin x to bin y, 1 a swap of entry i of x and entry j of y, 2 block x to replica
// y, 3 blocks x and y swapping replicas; delta its tokens.  Invariant: f is the lowest objective offered
// and below the objective now by more than 1e-12; among equal ones the first offered stays (strict
// comparisons, as in the reference).
struct Best {
    bool have = false;
    double f = 0.0;
    i64 delta = 0, kind = 0, x = 0, y = 0, i = 0, j = 0;
    std::vector<i64> idxs;

    bool beats(double f_new, double f_now) const { return f_new < f_now - 1e-12 && (!have || f_new < f); }

    void set(double f_new, i64 delta_new, i64 kind_new, i64 x_new, i64 y_new, i64 i_new, i64 j_new,
             const std::vector<i64>* idxs_new) {
        have = true;
        f = f_new;
        delta = delta_new;
        kind = kind_new;
        x = x_new;
        y = y_new;
        i = i_new;
        j = j_new;
        if (idxs_new) idxs = *idxs_new;
    }
};

class Bins {
   public:
    Bins(const Units& u, const i64* length, i64 num_segments, std::vector<i64> rep,
         const std::vector<std::vector<Entry>>& ent, i64 dp)
        : U(u), length(length), dp(dp), n(static_cast<i64>(rep.size())), rep(std::move(rep)), ent(n), load(n, 0.0),
          rows(n, 0), own_sum(n, 0), replay(n, 0), cnt(n, Dense(num_segments, 0)), nseg(num_segments), owner(num_segments, -1), win_t(n), path_t(n), reads(n),
          is_prod(n, false) {
        for (i64 b = 0; b < n; ++b)
            for (const Entry& e : ent[b])
                if (U.kind[e.unit] == 0) prod[U.win[e.unit]] = b;
        for (auto& kv : prod) is_prod[kv.second] = true;
        overlap.assign(U.kind.size(), false);
        for (std::size_t k = 0; k < U.kind.size(); ++k)
            for (i64 i = U.rec_off[k]; i < U.rec_off[k + 1] && !overlap[k]; ++i)
                for (i64 q = U.path_off[k]; q < U.path_off[k + 1]; ++q)
                    if (U.rec[i] == U.path[q]) {
                        overlap[k] = true;
                        break;
                    }
        for (i64 b = 0; b < n; ++b)
            for (const Entry& e : ent[b]) add(b, static_cast<i64>(this->ent[b].size()), e.unit, e.path, e.cost);
    }

    i64 open(i64 r) {
        rep.push_back(r);
        ent.emplace_back();
        load.push_back(0.0);
        rows.push_back(0);
        own_sum.push_back(0);
        replay.push_back(0);
        cnt.emplace_back(nseg, 0);
        win_t.emplace_back();
        path_t.emplace_back();
        reads.emplace_back();
        is_prod.push_back(false);
        return n++;
    }

    void add(i64 b, i64 j, i64 k, bool path, double c) {
        Dense& cn = cnt[b];
        ent[b].insert(ent[b].begin() + j, Entry{k, path, c});
        load[b] += c;
        for (i64 i = U.own_off[k]; i < U.own_off[k + 1]; ++i) {
            const i64 s = U.own[i];
            if (cn[s]) rows[b] -= length[s];
            owner[s] = b;
        }
        rows[b] += U.own_rows[k];
        own_sum[b] += U.own_rows[k];
        auto walk = [&](const i64* seq, i64 lo, i64 hi) {
            for (i64 i = lo; i < hi; ++i) {
                const i64 s = seq[i];
                if (cn[s]++ == 0 && owner[s] != b) rows[b] += length[s];
            }
        };
        walk(U.rec, U.rec_off[k], U.rec_off[k + 1]);
        if (path) walk(U.path, U.path_off[k], U.path_off[k + 1]);
        if (U.kind[k] == 2) return;
        if (path) {
            ++path_t[b][U.tree[k]];
            return;
        }
        ++win_t[b][U.tree[k]];
        const i64 p = prod.at(U.win[k]);
        if (U.kind[k] == 1 && p != b) {
            ++reads[b][p];
            replay[b] += U.replay[k];
        }
    }

    Entry take(i64 b, i64 j) {
        const Entry e = ent[b][j];
        ent[b].erase(ent[b].begin() + j);
        const i64 k = e.unit;
        Dense& cn = cnt[b];
        load[b] -= e.cost;
        if (ent[b].empty()) load[b] = 0.0;
        auto walk = [&](const i64* seq, i64 lo, i64 hi) {
            for (i64 i = lo; i < hi; ++i) {
                const i64 s = seq[i];
                if (--cn[s] == 0 && owner[s] != b) rows[b] -= length[s];
            }
        };
        walk(U.rec, U.rec_off[k], U.rec_off[k + 1]);
        if (e.path) walk(U.path, U.path_off[k], U.path_off[k + 1]);
        rows[b] -= U.own_rows[k];
        own_sum[b] -= U.own_rows[k];
        for (i64 i = U.own_off[k]; i < U.own_off[k + 1]; ++i) {
            const i64 s = U.own[i];
            owner[s] = -1;
            if (cn[s]) rows[b] += length[s];
        }
        if (U.kind[k] != 2) {
            decrement(e.path ? path_t[b] : win_t[b], U.tree[k]);
            const i64 p = prod.at(U.win[k]);
            if (!e.path && U.kind[k] == 1 && p != b) {
                decrement(reads[b], p);
                replay[b] -= U.replay[k];
            }
        }
        return e;
    }

    // How unit k would sit in bin y: (path recomputed, cost); false where it may not.
    bool mode(i64 k, i64 y, bool& path, double& cost) const {
        if (U.kind[k] == 2) {
            path = false;
            cost = U.cost[k];
            return true;
        }
        const i64 p = prod.at(U.win[k]);
        if (rep[y] == rep[p]) {
            if (y == p) {
                path = false;
                cost = U.cost[k];
                return true;
            }
            bool only = true;
            for (auto& kv : reads[y])
                if (kv.first != p) only = false;
            if (!is_prod[y] && get(path_t[y], U.tree[k]) == 0 && only) {
                path = false;
                cost = U.cost[k] + U.replay_cost[k];
                return true;
            }
        }
        if (U.upper[k] >= 0 || get(win_t[y], U.tree[k]) != 0) return false;
        i64 extra = 0;
        const Dense& cn = cnt[y];
        for (i64 i = U.path_off[k]; i < U.path_off[k + 1]; ++i)
            if (!cn[U.path[i]]) extra += length[U.path[i]];
        path = true;
        cost = U.cost[k] + U.path_cost[k] * static_cast<double>(extra) / static_cast<double>(std::max<i64>(1, U.path_rows[k]));
        return true;
    }

    // Entry j of x moved alone to y (root path recomputed there when path_y), without moving it:
    // rows y gains (exactly) and a lower bound of the tokens x and y gain together; false for a
    // unit whose recomputed segments and root path overlap (not bounded).
    bool move_bound(i64 x, i64 j, i64 y, bool path_y, i64& gain, i64& delta) const {
        const Entry& e = ent[x][j];
        const i64 k = e.unit;
        if (overlap[k]) return false;
        const Dense& cx = cnt[x];
        const Dense& cy = cnt[y];
        i64 loss = U.own_rows[k];
        auto lost = [&](const i64* seq, i64 lo, i64 hi) {
            for (i64 i = lo; i < hi; ++i) {
                const i64 s = seq[i];
                if (cx[s] == 1 && owner[s] != x) loss += length[s];
            }
        };
        lost(U.rec, U.rec_off[k], U.rec_off[k + 1]);
        if (e.path) lost(U.path, U.path_off[k], U.path_off[k + 1]);
        if (!e.path && U.kind[k] == 1 && prod.at(U.win[k]) != x) loss += U.replay[k];
        gain = U.own_rows[k];
        for (i64 i = U.own_off[k]; i < U.own_off[k + 1]; ++i)
            if (cy[U.own[i]]) gain -= length[U.own[i]];
        auto won = [&](const i64* seq, i64 lo, i64 hi) {
            for (i64 i = lo; i < hi; ++i) {
                const i64 s = seq[i];
                if (!cy[s] && owner[s] != y) gain += length[s];
            }
        };
        won(U.rec, U.rec_off[k], U.rec_off[k + 1]);
        if (path_y) won(U.path, U.path_off[k], U.path_off[k + 1]);
        const i64 rp = (!path_y && U.kind[k] == 1 && prod.at(U.win[k]) != y) ? U.replay[k] : 0;
        delta = gain + rp - loss;
        return true;
    }

    // A lower bound of the tokens x and y gain when entry i of x and entry j of y swap bins (as
    // _Bins.swap_bound); false when a unit's recomputed segments and root path overlap.
    bool swap_bound(i64 x, i64 i, i64 y, i64 j, i64& lb) const {
        lb = 0;
        const i64 as[2] = {x, y}, is[2] = {i, j}, bs[2] = {y, x};
        for (int q = 0; q < 2; ++q) {
            const i64 a = as[q], bb = bs[q];
            const Entry& e = ent[a][is[q]];
            const i64 k = e.unit;
            if (overlap[k]) return false;
            const Dense& ca = cnt[a];
            const Dense& cb = cnt[bb];
            lb -= U.own_rows[k];
            auto lost = [&](const i64* seq, i64 lo, i64 hi) {
                for (i64 t = lo; t < hi; ++t) {
                    const i64 s = seq[t];
                    if (ca[s] == 1 && owner[s] != a) lb -= length[s];
                }
            };
            lost(U.rec, U.rec_off[k], U.rec_off[k + 1]);
            if (e.path) lost(U.path, U.path_off[k], U.path_off[k + 1]);
            if (!e.path && U.kind[k] == 1 && prod.at(U.win[k]) != a) lb -= U.replay[k];
            lb += U.own_rows[k];
            for (i64 t = U.own_off[k]; t < U.own_off[k + 1]; ++t)
                if (cb[U.own[t]]) lb -= length[U.own[t]];
            for (i64 t = U.rec_off[k]; t < U.rec_off[k + 1]; ++t) {
                const i64 s = U.rec[t];
                if (!cb[s] && owner[s] != bb) lb += length[s];
            }
        }
        return true;
    }

    bool give(i64 y, i64 k) {
        bool path;
        double c;
        if (!mode(k, y, path, c)) return false;
        add(y, static_cast<i64>(ent[y].size()), k, path, c);
        return true;
    }

    // The bins `live` in blocks that may change replicas together: a producer with the bins reading
    // it, a bin reading and producing nothing alone; blocks holding a split window's unit left out.
    // Each block sorted, blocks by their first bin.
    std::vector<std::vector<i64>> blocks(const std::vector<i64>& live) const {
        std::unordered_map<i64, i64> root;
        for (i64 b : live) root[b] = b;
        auto find = [&](i64 b) {
            while (root[b] != b) b = root[b];
            return b;
        };
        for (i64 b : live)
            for (auto& kv : reads[b]) {
                const i64 rb = find(b), rp = find(kv.first);
                if (rb != rp) root[std::max(rb, rp)] = std::min(rb, rp);
            }
        std::map<i64, std::vector<i64>> out;
        std::vector<i64> split;
        for (i64 b : live) {
            const i64 r = find(b);
            out[r].push_back(b);
            for (const Entry& e : ent[b])
                if (U.upper[e.unit] >= 0) split.push_back(r);
        }
        std::vector<std::vector<i64>> res;
        for (auto& kv : out)
            if (std::find(split.begin(), split.end(), kv.first) == split.end()) res.push_back(kv.second);
        return res;
    }

    std::vector<double> costs(i64 r, double overhead) const {
        std::vector<double> out;
        costs_into(r, overhead, out);
        return out;
    }

    // costs(r, overhead) written into out (its storage reused: the search scores many changes).
    void costs_into(i64 r, double overhead, std::vector<double>& out) const {
        out.clear();
        if (ordered) {
            scratch.clear();
            for (i64 b = 0; b < n; ++b)
                if (rep[b] == r && !ent[b].empty()) scratch.push_back(b);
            ordered_costs(scratch, overhead, out);
            return;
        }
        for (i64 b = 0; b < n; ++b)
            if (rep[b] == r && !ent[b].empty()) out.push_back(load[b] + overhead);
        std::sort(out.begin(), out.end(), std::greater<double>());
    }

    // The costs of one replica's bins `bs` (load + overhead) in the order rebalance runs them: costliest
    // first, each producer just before its first reader (the reference's _Bins.costs with ordered set).
    void ordered_costs(std::vector<i64>& bs, double overhead, std::vector<double>& out) const {
        std::sort(bs.begin(), bs.end(), [&](i64 a, i64 b) { return load[a] > load[b] || (load[a] == load[b] && a < b); });
        if (static_cast<i64>(done.size()) < n) done.resize(n, 0);
        for (i64 b : bs) {
            if (done[b]) continue;
            for (const auto& kv : reads[b]) {
                const i64 p = kv.first;
                if (!done[p]) {
                    out.push_back(load[p] + overhead);
                    done[p] = 1;
                }
            }
            out.push_back(load[b] + overhead);
            done[b] = 1;
        }
        for (i64 b : bs) {
            done[b] = 0;
            for (const auto& kv : reads[b]) done[kv.first] = 0;
        }
    }

    std::vector<std::vector<i64>> groups(i64 b) const {
        std::vector<std::vector<i64>> out;
        std::vector<std::pair<std::pair<bool, i64>, std::vector<i64>>> by;
        for (i64 j = 0; j < static_cast<i64>(ent[b].size()); ++j) {
            const Entry& e = ent[b][j];
            const i64 k = e.unit;
            if (U.kind[k] == 0 || (U.upper[k] >= 0 && !split)) continue;
            out.push_back({j});
            if (U.kind[k] == 2 || e.path) {
                const std::pair<bool, i64> key{U.kind[k] == 2, U.win[k]};
                auto it = std::find_if(by.begin(), by.end(), [&](const auto& g) { return g.first == key; });
                if (it == by.end()) {
                    by.push_back({key, {j}});
                } else {
                    it->second.push_back(j);
                }
            }
        }
        for (auto& g : by)
            if (g.second.size() > 1) out.push_back(g.second);
        return out;
    }

    const Units& U;
    const i64* length;
    i64 dp, n;
    std::vector<i64> rep;
    std::vector<std::vector<Entry>> ent;
    std::vector<double> load;
    std::vector<i64> rows, own_sum, replay;  // own_sum: rows of owned segments (rows >= own_sum)
    std::vector<Dense> cnt;
    i64 nseg;
    std::vector<i64> owner;
    std::vector<Counts> win_t, path_t, reads;
    std::unordered_map<i64, i64> prod;
    std::vector<bool> is_prod;
    std::vector<bool> overlap;  // per unit: its recomputed segments and root path share one
    bool ordered = false;  // costs in the order the plan runs (producers first), not only costliest first
    bool split = false;    // split windows' items may leave their bins too (groups)
    mutable std::vector<i64> scratch;
    mutable std::vector<char> done;
};

// The search of megatron_harts.planner.l2_balance._rebalance_python, step for step.
py::tuple l2_rebalance(I64Array length_a, I64Array ints_a, F64Array flts_a, I64Array own_off_a, I64Array own_a,
                       I64Array rec_off_a, I64Array rec_a, I64Array path_off_a, I64Array path_a, I64Array rep_a,
                       I64Array ent_off_a, I64Array ent_unit_a, I64Array ent_path_a, F64Array ent_cost_a, i64 dp,
                       i64 M, double overhead, i64 moves, i64 n_slots, double weight, i64 swap_bins, i64 wide,
                       i64 spend, bool ordered, bool split) {
    const i64 nu = l2_check_unit_arrays(ints_a, 7, flts_a, own_off_a, own_a, rec_off_a, rec_a, path_off_a, path_a,
                                        length_a.shape(0), -1);
    const i64 n = rep_a.shape(0);
    if (ent_off_a.shape(0) != n + 1) throw py::value_error("ent_off must have one entry per bin plus one");
    if (dp < 1) throw py::value_error("dp must be >= 1");
    const i64 num_segments = length_a.shape(0);
    Units U;
    auto ints = ints_a.unchecked<2>();
    auto flts = flts_a.unchecked<2>();
    for (i64 k = 0; k < nu; ++k) {
        U.kind.push_back(ints(k, 0));
        U.tree.push_back(ints(k, 1));
        U.win.push_back(ints(k, 2));
        U.upper.push_back(ints(k, 3));
        U.own_rows.push_back(ints(k, 4));
        U.replay.push_back(ints(k, 5));
        U.path_rows.push_back(ints(k, 6));
        U.cost.push_back(flts(k, 0));
        U.replay_cost.push_back(flts(k, 1));
        U.path_cost.push_back(flts(k, 2));
    }
    U.own_off = own_off_a.data();
    U.own = own_a.data();
    U.rec_off = rec_off_a.data();
    U.rec = rec_a.data();
    U.path_off = path_off_a.data();
    U.path = path_a.data();
    const i64* eo = ent_off_a.data();
    const i64* eu = ent_unit_a.data();
    const i64* ep = ent_path_a.data();
    const double* ec = ent_cost_a.data();
    if (eo[0] != 0 || eo[n] != ent_unit_a.shape(0) || ent_path_a.shape(0) != eo[n] || ent_cost_a.shape(0) != eo[n])
        throw py::value_error("ent_off must be offsets into ent_unit / ent_path / ent_cost");
    std::vector<std::vector<Entry>> ent0(n);
    for (i64 b = 0; b < n; ++b)
        for (i64 i = eo[b]; i < eo[b + 1]; ++i) {
            if (eu[i] < 0 || eu[i] >= nu) throw py::value_error("ent_unit out of range");
            ent0[b].push_back(Entry{eu[i], ep[i] != 0, ec[i]});
        }
    std::vector<i64> rep0(rep_a.data(), rep_a.data() + n);
    for (i64 r : rep0)
        if (r < 0 || r >= dp) throw py::value_error("rep out of range");

    std::vector<std::vector<Entry>> ent_out;
    std::vector<i64> rep_out_v;
    const i64* length = length_a.data();
    bool moved;
    {
        py::gil_scoped_release release;  // the search reads C++ copies and the lengths' buffer only
        moved = l2_rebalance_search(U, length, num_segments, rep0, ent0, dp, M, overhead, moves,
                                    n_slots, weight, swap_bins, wide, spend, ordered, split, rep_out_v, ent_out);
    }
    const i64 nb = static_cast<i64>(rep_out_v.size());
    I64Array rep_out(nb);
    std::copy(rep_out_v.begin(), rep_out_v.end(), rep_out.mutable_data());
    const py::tuple flat = l2_entry_arrays(ent_out, nb);
    return py::make_tuple(moved, rep_out, flat[0], flat[1], flat[2], flat[3]);
}

}  // namespace

// The search of megatron_harts.planner.l2_balance._rebalance_python, step for step.
bool l2_rebalance_search(const L2Units& U, const i64* length, i64 num_segments,
                         const std::vector<i64>& rep0,
                         const std::vector<std::vector<L2Entry>>& ent0, i64 dp, i64 M,
                         double overhead, i64 moves, i64 n_slots, double weight, i64 swap_bins,
                         i64 wide, i64 spend, bool ordered, bool split, std::vector<i64>& rep_out,
                         std::vector<std::vector<L2Entry>>& ent_out) {
    const i64 n = static_cast<i64>(rep0.size());
    Bins st(U, length, num_segments, rep0, ent0, dp);
    st.ordered = ordered;
    st.split = split;
    auto& rep = st.rep;
    auto& load = st.load;
    auto& ent = st.ent;
    auto& rows = st.rows;
    auto& replay = st.replay;
    double total = 0.0;
    for (double x : load) total += x;
    total += overhead * static_cast<double>(n);
    i64 most = 0;
    for (i64 r = 0; r < dp; ++r) most = std::max<i64>(most, std::count(rep.begin(), rep.end(), r));
    const double tau = total / static_cast<double>(std::max<i64>(1, dp * most));
    std::vector<std::vector<double>> costs(dp);
    for (i64 r = 0; r < dp; ++r) costs[r] = st.costs(r, overhead);
    std::vector<const std::vector<double>*> cs(dp);  // the objective's per-replica costs (storage reused)
    auto objective = [&](i64 rx, const std::vector<double>* cx, i64 ry, const std::vector<double>* cy) {
        for (i64 r = 0; r < dp; ++r) cs[r] = &costs[r];
        cs[rx] = cx;
        if (ry != rx) cs[ry] = cy;
        return slot_objective(cs, dp, tau, weight);
    };
    double f_now = objective(0, &costs[0], 0, &costs[0]);
    if (spend < 0) throw py::value_error("spend must be >= 0");
    i64 slack = spend;  // tokens the pass may add: the budget given, then what its moves save
    std::vector<i64> spare(dp);
    for (i64 r = 0; r < dp; ++r) spare[r] = st.open(r);
    std::vector<double> score_x, score_y;  // score's costs of the two replicas (storage reused)
    auto score = [&](i64 rx, i64 ry) {
        st.costs_into(rx, overhead, score_x);
        if (ry != rx) st.costs_into(ry, overhead, score_y);
        return objective(rx, &score_x, ry, ry != rx ? &score_y : &score_x);
    };
    auto tok = [&](i64 x, i64 y) { return rows[x] + replay[x] + rows[y] + replay[y]; };

    // try_move: entries idxs (ascending) of x to y.  Returns false (state restored) when not allowed;
    // else delta and the undo record.
    struct Moved {
        std::vector<std::pair<i64, Entry>> taken;
        i64 added;
    };
    auto undo_move = [&](i64 x, i64 y, const Moved& m) {
        for (i64 a = 0; a < m.added; ++a) st.take(y, static_cast<i64>(ent[y].size()) - 1);
        for (auto it = m.taken.rbegin(); it != m.taken.rend(); ++it)
            st.add(x, it->first, it->second.unit, it->second.path, it->second.cost);
    };
    auto try_move = [&](i64 x, const std::vector<i64>& idxs, i64 y, i64& delta, Moved& m) {
        // rows of y after the move >= its owned rows plus the moved units': refused without trying
        i64 own_after = st.own_sum[y];
        for (i64 j : idxs) own_after += U.own_rows[ent[x][j].unit];
        if (own_after > M) return false;
        if (idxs.size() == 1) {  // one unit: its rows and tokens bounded before trying
            bool path;
            double c;
            if (!st.mode(ent[x][idxs[0]].unit, y, path, c)) return false;
            i64 gain, lb;
            if (st.move_bound(x, idxs[0], y, path, gain, lb) && (rows[y] + gain > M || lb > slack)) return false;
        }
        const i64 before = tok(x, y);
        m.taken.clear();
        m.added = 0;
        for (auto it = idxs.rbegin(); it != idxs.rend(); ++it) m.taken.push_back({*it, st.take(x, *it)});
        for (auto it = m.taken.rbegin(); it != m.taken.rend(); ++it) {
            if (!st.give(y, it->second.unit)) break;
            ++m.added;
        }
        if (m.added < static_cast<i64>(m.taken.size()) || rows[y] > M) {
            undo_move(x, y, m);
            return false;
        }
        delta = tok(x, y) - before;
        return true;
    };
    struct Swapped {
        Entry eu, ev;
        bool okv, oku;
    };
    auto undo_swap = [&](i64 x, i64 i, i64 y, i64 j, const Swapped& s) {
        if (s.oku) st.take(y, static_cast<i64>(ent[y].size()) - 1);
        if (s.okv) st.take(x, static_cast<i64>(ent[x].size()) - 1);
        st.add(y, j, s.ev.unit, s.ev.path, s.ev.cost);
        st.add(x, i, s.eu.unit, s.eu.path, s.eu.cost);
    };
    auto try_swap = [&](i64 x, i64 i, i64 y, i64 j, i64& delta, Swapped& s) {
        {
            const i64 ou = U.own_rows[ent[x][i].unit], ov = U.own_rows[ent[y][j].unit];
            if (st.own_sum[x] - ou + ov > M || st.own_sum[y] - ov + ou > M) return false;
            i64 lb;  // more tokens than the moves before saved: not tried
            if (st.swap_bound(x, i, y, j, lb) && lb > slack) return false;
        }
        const i64 before = tok(x, y);
        s.eu = st.take(x, i);
        s.ev = st.take(y, j);
        s.okv = st.give(x, s.ev.unit);
        s.oku = s.okv && st.give(y, s.eu.unit);
        if (!s.oku || rows[x] > M || rows[y] > M) {
            undo_swap(x, i, y, j, s);
            return false;
        }
        delta = tok(x, y) - before;
        return true;
    };
    auto movable = [&](i64 k) { return U.kind[k] != 0 && (split || U.upper[k] < 0); };

    bool moved = false;
    bool wide_now = false;  // this step's sources: the bins above their slot's mean in every unbalanced slot
    for (i64 it = 0; it < moves; ++it) {
        const i64 n = st.n;
        std::vector<std::vector<i64>> order(dp);
        for (i64 b = 0; b < n; ++b)
            if (!ent[b].empty()) order[rep[b]].push_back(b);
        std::size_t S = 0;
        for (auto& o : order) {
            std::sort(o.begin(), o.end(), [&](i64 a, i64 b) { return load[a] != load[b] ? load[a] > load[b] : a < b; });
            S = std::max(S, o.size());
        }
        struct Slot {
            double ratio;
            i64 k;
            std::vector<i64> above, below;
        };
        std::vector<Slot> slots;
        for (std::size_t k = 0; k < S; ++k) {
            std::vector<i64> bs;
            for (auto& o : order)
                if (k < o.size()) bs.push_back(o[k]);
            double mx = 0.0, sm = 0.0;
            for (i64 b : bs) {
                const double v = load[b] + overhead;
                sm += v;
                if (v > mx) mx = v;
            }
            const double ratio = sm / (static_cast<double>(dp) * mx);
            if (ratio < 1.0 - 1e-9) {
                const double mean = sm / static_cast<double>(dp);
                Slot s{ratio, static_cast<i64>(k), {}, {}};
                for (i64 b : bs) (load[b] + overhead > mean ? s.above : s.below).push_back(b);
                slots.push_back(std::move(s));
            }
        }
        std::stable_sort(slots.begin(), slots.end(), [](const Slot& a, const Slot& b) {
            return a.ratio != b.ratio ? a.ratio < b.ratio : a.k < b.k;
        });
        std::vector<i64> sources;
        for (std::size_t q = 0; q < slots.size() && (wide_now || static_cast<i64>(q) < n_slots); ++q)
            for (i64 b : slots[q].above)
                if (std::find(sources.begin(), sources.end(), b) == sources.end()) sources.push_back(b);
        std::vector<i64> live;
        for (i64 b = 0; b < n; ++b)
            if (!ent[b].empty()) live.push_back(b);
        i64 light = live[0];
        for (i64 b : live)
            if (load[b] < load[light]) light = b;
        if (!st.is_prod[light] && std::find(sources.begin(), sources.end(), light) == sources.end())
            sources.push_back(light);
        const bool swaps = static_cast<i64>(live.size()) <= swap_bins;
        std::vector<i64> dests;
        if (wide_now) {  // toward the bins below their slot's mean in the least balanced slots
            std::vector<char> low(static_cast<std::size_t>(n), 0);
            for (std::size_t q = 0; q < slots.size() && static_cast<i64>(q) < n_slots; ++q)
                for (i64 b : slots[q].below) low[b] = 1;
            for (i64 b : live)
                if (low[b]) dests.push_back(b);
        } else {
            dests = live;
        }
        dests.insert(dests.end(), spare.begin(), spare.end());
        Best best;
        // a move or swap tried (and still done): offered when its tokens fit the savings so far
        auto offer_tried = [&](i64 delta, i64 kind, i64 x, i64 y, i64 i, i64 j, const std::vector<i64>* idxs) {
            if (delta > slack) return;
            const double f = score(rep[x], rep[y]);
            if (best.beats(f, f_now)) best.set(f, delta, kind, x, y, i, j, idxs);
        };
        Moved mv;
        Swapped sw;
        for (i64 x : sources) {
            const double lx = load[x];
            double c_out = 0.0;
            for (const auto& idxs : st.groups(x)) {
                if (x != light) {
                    c_out = 0.0;
                    for (i64 j : idxs) c_out += U.cost[ent[x][j].unit];
                }
                for (i64 y : dests) {
                    if (y == x || (x != light && load[y] + c_out >= lx)) continue;
                    i64 delta;
                    if (!try_move(x, idxs, y, delta, mv)) continue;
                    offer_tried(delta, 0, x, y, 0, 0, &idxs);
                    undo_move(x, y, mv);
                }
            }
            if (!swaps) continue;
            for (i64 i = 0; i < static_cast<i64>(ent[x].size()); ++i) {
                const i64 ku = ent[x][i].unit;
                if (!movable(ku)) continue;
                const double cu = U.cost[ku];
                for (i64 y : live) {
                    if (y == x) continue;
                    for (i64 j = 0; j < static_cast<i64>(ent[y].size()); ++j) {
                        const i64 kv = ent[y][j].unit;
                        if (!movable(kv)) continue;
                        const double d = cu - U.cost[kv];
                        if (d <= 0.0 || load[y] + d >= lx) continue;
                        i64 delta;
                        if (!try_swap(x, i, y, j, delta, sw)) continue;
                        offer_tried(delta, 1, x, y, i, j, nullptr);
                        undo_swap(x, i, y, j, sw);
                    }
                }
            }
        }
        // whole blocks (a producer with its consumers, or a bin reading and producing nothing; none
        // holding a split window's unit) to another replica, or two blocks swapping replicas
        const std::vector<std::vector<i64>> blocks = st.blocks(live);
        // the scores read each replica's live bins (as st.costs: load + overhead, costliest first)
        // from lists made once here, not from a scan of every bin per score
        std::vector<std::vector<i64>> on(dp);
        for (i64 b : live) on[rep[b]].push_back(b);
        std::vector<char> mark(st.n, 0);  // 1: a bin of the block leaving, 2: of the block arriving
        std::vector<double> cx, cy;
        std::vector<i64> block_bins;
        auto block_costs = [&](i64 r, const std::vector<i64>* gain, std::vector<double>& out) {
            out.clear();
            if (ordered) {
                block_bins.clear();
                for (i64 b : on[r])
                    if (!mark[b]) block_bins.push_back(b);
                if (gain)
                    for (i64 b : *gain) block_bins.push_back(b);
                st.ordered_costs(block_bins, overhead, out);
                return;
            }
            for (i64 b : on[r])
                if (!mark[b]) out.push_back(load[b] + overhead);
            if (gain)
                for (i64 b : *gain) out.push_back(load[b] + overhead);
            std::sort(out.begin(), out.end(), std::greater<double>());
        };
        for (i64 a = 0; a < static_cast<i64>(blocks.size()); ++a) {
            const auto& ba = blocks[a];
            const i64 rx = rep[ba[0]];
            for (i64 b : ba) mark[b] = 1;
            block_costs(rx, nullptr, cx);
            for (i64 b : ba) mark[b] = 0;
            for (i64 r2 = 0; r2 < dp; ++r2) {
                if (r2 == rx) continue;
                block_costs(r2, &ba, cy);
                const double f = objective(rx, &cx, r2, &cy);
                if (best.beats(f, f_now)) best.set(f, 0, 2, a, r2, 0, 0, nullptr);
            }
            for (i64 c = a + 1; c < static_cast<i64>(blocks.size()); ++c) {
                const auto& bc = blocks[c];
                const i64 ry = rep[bc[0]];
                if (ry == rx) continue;
                std::vector<double> sx, sy;
                for (i64 b : ba) mark[b] = 1;
                block_costs(rx, &bc, sx);
                for (i64 b : ba) mark[b] = 0;
                for (i64 b : bc) mark[b] = 1;
                block_costs(ry, &ba, sy);
                for (i64 b : bc) mark[b] = 0;
                const double f = objective(rx, &sx, ry, &sy);
                if (best.beats(f, f_now)) best.set(f, 0, 3, a, c, 0, 0, nullptr);
            }
        }
        if (!best.have) {
            if (wide_now || wide <= 0 || static_cast<i64>(slots.size()) <= n_slots) break;
            wide_now = true;  // stuck: the next step takes its sources from every unbalanced slot
            --wide;
            continue;
        }
        wide_now = false;
        if (best.kind >= 2) {
            f_now = best.f;
            const i64 rx = rep[blocks[best.x][0]];
            const i64 ry = best.kind == 2 ? best.y : rep[blocks[best.y][0]];
            for (i64 b : blocks[best.x]) rep[b] = ry;
            if (best.kind == 3)
                for (i64 b : blocks[best.y]) rep[b] = rx;
            costs[rx] = st.costs(rx, overhead);
            costs[ry] = st.costs(ry, overhead);
            moved = true;
            continue;
        }
        f_now = best.f;
        const i64 rx = rep[best.x];
        const i64 ry = rep[best.y];
        i64 delta;
        if (best.kind == 0)
            try_move(best.x, best.idxs, best.y, delta, mv);
        else
            try_swap(best.x, best.i, best.y, best.j, delta, sw);
        slack -= best.delta;
        costs[rx] = st.costs(rx, overhead);
        costs[ry] = st.costs(ry, overhead);
        moved = true;
        for (i64 r = 0; r < dp; ++r)
            if (!ent[spare[r]].empty()) spare[r] = st.open(r);
    }
    const i64 nb = st.n;
    rep_out.assign(rep.begin(), rep.begin() + nb);
    ent_out.assign(ent.begin(), ent.begin() + nb);
    return moved;
}

py::tuple l2_entry_arrays(const std::vector<std::vector<L2Entry>>& ent, i64 nb) {
    I64Array off(nb + 1);
    i64 total = 0;
    for (i64 b = 0; b < nb; ++b) total += static_cast<i64>(ent[b].size());
    I64Array unit(total), path(total);
    F64Array cost(total);
    auto* oo = off.mutable_data();
    auto* uo = unit.mutable_data();
    auto* po = path.mutable_data();
    auto* co = cost.mutable_data();
    oo[0] = 0;
    i64 w = 0;
    for (i64 b = 0; b < nb; ++b) {
        for (const L2Entry& e : ent[b]) {
            uo[w] = e.unit;
            po[w] = e.path ? 1 : 0;
            co[w] = e.cost;
            ++w;
        }
        oo[b + 1] = w;
    }
    return py::make_tuple(off, unit, path, cost);
}

void register_rebalance(py::module_& m) {
    m.def("l2_rebalance", &l2_rebalance, py::arg("length"), py::arg("ints"), py::arg("flts"), py::arg("own_off"),
          py::arg("own"), py::arg("rec_off"), py::arg("rec"), py::arg("path_off"), py::arg("path"), py::arg("rep"),
          py::arg("ent_off"), py::arg("ent_unit"), py::arg("ent_path"), py::arg("ent_cost"), py::arg("dp"),
          py::arg("M"), py::arg("overhead"), py::arg("moves"), py::arg("n_slots"), py::arg("weight"),
          py::arg("swap_bins"), py::arg("wide"), py::arg("spend"), py::arg("ordered"), py::arg("split") = false,
          "L2's balance pass (see megatron_harts.planner.l2_balance.rebalance; _rebalance_python is the reference): "
          "units (kind, tree, window, upper window, owned rows, replay tokens, path rows; cost, replay cost, "
          "path cost; owned / recomputed / path segments as CSR) in bins (replica, entries: unit, path "
          "recomputed, cost).  Returns (moved, rep, ent_off, ent_unit, ent_path, ent_cost).");
}
