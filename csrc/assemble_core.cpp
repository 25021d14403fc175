// L2 slot fill, last-slot compaction and per-slot rebalance: the C++ core of
// megatron_harts.planner.l2 (the Python reference beside it: _fill, _compact and _rebalance in
// megatron_harts/planner/l2.py; tests/test_microbatch_planner.py holds the two equal).
//
// Same algorithm, same tie-breaking (Python's stable sorts are std::stable_sort on the same
// keys, "first of the minimum" scans keep the first index) and the same floating-point
// operations in the same order, so the outputs are identical, floats included: the loads per
// slot, the members of every microbatch in insertion order, and the recomputed ancestors of
// atoms placed by recomputation.  Per-slot work is O(atoms * dp); everything is iterative.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "planner_l2.h"

namespace py = pybind11;

namespace {

using i64 = std::int64_t;
using I64Array = py::array_t<i64, py::array::c_style | py::array::forcecast>;
using F64Array = py::array_t<double, py::array::c_style | py::array::forcecast>;

constexpr double kInf = std::numeric_limits<double>::infinity();

// Atoms (n), their children and owned segments as CSR arrays, their subtree statistics, and
// the per-segment arrays the recomputation walk reads.
struct Atoms {
    i64 n = 0, num_trees = 0, num_segments = 0;
    const i64 *parent, *rows, *tree, *kid_off, *kid, *seg_off, *seg, *height, *rows_below, *tree_rank;
    const double *cost, *below;
    const i64 *seg_parent, *seg_len;
    const double* seg_cost;
};

struct Result {
    std::vector<i64> slot_of, mb_of;
    std::vector<std::vector<double>> loads;            // per slot, per microbatch
    std::vector<std::vector<std::vector<i64>>> members;  // per slot, per microbatch, insertion order
    std::vector<std::pair<i64, std::vector<i64>>> extra;  // atom -> recomputed ancestors, in order
    std::vector<char> is_extra;
};

// _fill: slot after slot (step 3 of l2.py's module docstring).
void fill(const Atoms& at, i64 dp, i64 M, i64 S, double eps, double reserve, double remaining,
          bool use_recompute, Result& res) {
    const i64 n = at.n;
    res.slot_of.assign(n, -1);
    res.mb_of.assign(n, -1);
    res.is_extra.assign(n, 0);
    std::vector<i64>& slot_of = res.slot_of;
    std::vector<i64>& mb_of = res.mb_of;
    std::vector<i64> pending;
    for (i64 a = 0; a < n; ++a) {
        if (at.parent[a] < 0) pending.push_back(a);
    }
    std::vector<i64> opened(at.num_trees, -1);
    i64 n_opened = 0;
    // have[b] of the Python reference: segment s is in it iff stamp[b * S_seg + s] == slot
    std::vector<i64> stamp;
    if (use_recompute && dp > 1) stamp.assign(dp * at.num_segments, -1);
    i64 k = 0, placed = 0;
    std::vector<i64> keys_i;
    std::vector<char> keys_b;
    while (placed < n) {
        const i64 left = S - k;
        double hi, lo;
        if (left > 1 && dp > 1) {
            const double tau = remaining / (static_cast<double>(dp) * (static_cast<double>(left - 1) + reserve));
            hi = tau * (1.0 + eps);
            lo = tau * (1.0 - eps);
        } else {
            hi = lo = kInf;
        }
        const i64 big = n_opened;
        if (left <= 1 && dp > 1) {
            std::stable_sort(pending.begin(), pending.end(),
                             [&](i64 x, i64 y) { return -at.below[x] < -at.below[y]; });
        } else {
            // (chain shorter than the slots left, open-tree order or big + tree rank, -cost)
            auto b_key = [&](i64 a) { return at.height[a] + 1 < left; };
            auto i_key = [&](i64 a) {
                const i64 t = at.tree[a];
                return opened[t] >= 0 ? opened[t] : big + at.tree_rank[t];
            };
            std::stable_sort(pending.begin(), pending.end(), [&](i64 x, i64 y) {
                const bool bx = b_key(x), by = b_key(y);
                if (bx != by) return bx < by;
                const i64 ix = i_key(x), iy = i_key(y);
                if (ix != iy) return ix < iy;
                return -at.cost[x] < -at.cost[y];
            });
        }
        std::vector<double> loads(dp, 0.0);
        std::vector<i64> rws(dp, 0);
        std::vector<std::vector<i64>> members(dp);
        std::vector<i64> nxt;
        i64 full = 0;
        const bool track = use_recompute && dp > 1 && left > 1;
        auto mark = [&](i64 b, i64 s) { stamp[b * at.num_segments + s] = k; };
        auto mark_atom = [&](i64 b, i64 x) {
            for (i64 j = at.seg_off[x]; j < at.seg_off[x + 1]; ++j) mark(b, at.seg[j]);
        };
        auto run_queue = [&](std::vector<std::pair<i64, i64>> queue) {
            std::vector<i64> bundle;
            while (!queue.empty()) {
                const i64 a = queue.back().first, only = queue.back().second;
                queue.pop_back();
                const bool whole = left == 1 && at.kid_off[a + 1] > at.kid_off[a];
                const double bc = whole ? at.below[a] : at.cost[a];
                const i64 br = whole ? at.rows_below[a] : at.rows[a];
                i64 best = -1;
                const i64 b0 = only >= 0 ? only : 0, b1 = only >= 0 ? only + 1 : dp;
                for (i64 b = b0; b < b1; ++b) {
                    if (rws[b] + br > M) continue;
                    if (loads[b] > 0 && loads[b] + bc > hi) continue;
                    if (best < 0 || loads[b] < loads[best]) best = b;
                }
                if (best < 0) {
                    nxt.push_back(a);
                    continue;
                }
                const bool was_full = loads[best] >= lo;
                bundle.assign(1, a);
                if (whole) {
                    for (std::size_t i = 0; i < bundle.size(); ++i) {
                        const i64 x = bundle[i];
                        for (i64 j = at.kid_off[x]; j < at.kid_off[x + 1]; ++j) bundle.push_back(at.kid[j]);
                    }
                }
                for (i64 x : bundle) {
                    members[best].push_back(x);
                    slot_of[x] = k;
                    mb_of[x] = best;
                    if (track) mark_atom(best, x);
                }
                loads[best] += bc;
                rws[best] += br;
                if (!was_full && loads[best] >= lo) ++full;
                placed += static_cast<i64>(bundle.size());
                remaining -= bc;
                if (opened[at.tree[a]] < 0) opened[at.tree[a]] = n_opened++;
                if (bundle.size() == 1) {
                    for (i64 j = at.kid_off[a]; j < at.kid_off[a + 1]; ++j) queue.emplace_back(at.kid[j], best);
                }
            }
        };
        for (i64 a0 : pending) {
            if (full == dp) {
                nxt.push_back(a0);
                continue;
            }
            run_queue({{a0, -1}});
        }
        if (use_recompute && dp > 1 && left > 1 && full < dp) {
            std::vector<i64> blocked;
            for (i64 a : nxt) {
                const i64 p = at.parent[a];
                if (p >= 0 && slot_of[p] == k) blocked.push_back(a);
            }
            std::stable_sort(blocked.begin(), blocked.end(),
                             [&](i64 x, i64 y) { return -at.below[x] < -at.below[y]; });
            std::vector<i64> under, segs;
            for (i64 a : blocked) {
                if (slot_of[a] >= 0) continue;
                under.clear();
                for (i64 b = 0; b < dp; ++b) {
                    if (loads[b] < lo) under.push_back(b);
                }
                std::stable_sort(under.begin(), under.end(), [&](i64 x, i64 y) { return loads[x] < loads[y]; });
                if (under.empty()) break;
                for (i64 b : under) {
                    if (loads[b] + at.cost[a] > hi || rws[b] + at.rows[a] > M) continue;
                    // the ancestors of atom a that microbatch b lacks (recompute() of plan_l2)
                    segs.clear();
                    i64 r_add = 0;
                    double c_add = 0.0;
                    i64 x = at.seg_parent[at.seg[at.seg_off[a]]];
                    while (x >= 0 && stamp[b * at.num_segments + x] != k) {
                        segs.push_back(x);
                        r_add += at.seg_len[x];
                        c_add += at.seg_cost[x];
                        x = at.seg_parent[x];
                    }
                    if (c_add > at.below[a] || rws[b] + at.rows[a] + r_add > M ||
                        loads[b] + at.cost[a] + c_add > hi) {
                        continue;
                    }
                    const bool was_full = loads[b] >= lo;
                    members[b].push_back(a);
                    slot_of[a] = k;
                    mb_of[a] = b;
                    mark_atom(b, a);
                    for (i64 s : segs) mark(b, s);
                    res.extra.emplace_back(a, segs);
                    res.is_extra[a] = 1;
                    loads[b] += at.cost[a] + c_add;
                    rws[b] += at.rows[a] + r_add;
                    if (!was_full && loads[b] >= lo) ++full;
                    placed += 1;
                    remaining -= at.cost[a];
                    std::vector<std::pair<i64, i64>> queue;
                    for (i64 j = at.kid_off[a]; j < at.kid_off[a + 1]; ++j) queue.emplace_back(at.kid[j], b);
                    run_queue(std::move(queue));
                    break;
                }
            }
            std::vector<i64> kept;
            for (i64 a : nxt) {
                if (slot_of[a] < 0) kept.push_back(a);
            }
            nxt.swap(kept);
        }
        pending.swap(nxt);
        if (k > 4 * (S + n)) throw std::logic_error("L2 fill made no progress");  // a bug, never a silent loop
        res.loads.push_back(std::move(loads));
        res.members.push_back(std::move(members));
        ++k;
    }
}

// _compact: dissolve the last slot into holes of earlier slots while all of its atoms fit.
void compact(const Atoms& at, i64 M, double tol, Result& res) {
    auto& loads_all = res.loads;
    auto& members_all = res.members;
    auto& slot_of = res.slot_of;
    auto& mb_of = res.mb_of;
    while (loads_all.size() > 1) {
        const i64 L = static_cast<i64>(loads_all.size()) - 1;
        std::vector<i64> todo;
        for (const auto& mem : members_all[L]) todo.insert(todo.end(), mem.begin(), mem.end());
        for (i64 a : todo) {
            if (res.is_extra[a]) return;
        }
        std::vector<i64> depth(at.n, 0);
        for (i64 a : todo) {
            i64 d = 0;
            for (i64 x = at.parent[a]; x >= 0 && slot_of[x] == L; x = at.parent[x]) ++d;
            depth[a] = d;
        }
        std::stable_sort(todo.begin(), todo.end(), [&](i64 x, i64 y) {
            if (depth[x] != depth[y]) return depth[x] < depth[y];
            return -at.cost[x] < -at.cost[y];
        });
        std::vector<double> caps(L);
        std::vector<std::vector<i64>> rws(L);
        for (i64 j = 0; j < L; ++j) {
            caps[j] = *std::max_element(loads_all[j].begin(), loads_all[j].end()) * (1.0 + tol);
            for (const auto& mem : members_all[j]) {
                i64 r = 0;
                for (i64 a : mem) r += at.rows[a];
                rws[j].push_back(r);
            }
        }
        struct Move {
            i64 a, k0, b0, j, b;
        };
        std::vector<Move> moves;
        bool ok = true;
        for (i64 a : todo) {
            const i64 p = at.parent[a];
            i64 bj = -1, bb = -1;
            double best_left = 0.0;
            for (i64 j = L - 1; j >= 0; --j) {
                if (p >= 0 && slot_of[p] > j) break;
                const auto& loads = loads_all[j];
                for (i64 b = 0; b < static_cast<i64>(loads.size()); ++b) {
                    if (p >= 0 && slot_of[p] == j && mb_of[p] != b) continue;
                    const double left = caps[j] - loads[b] - at.cost[a];
                    if (left < 0 || rws[j][b] + at.rows[a] > M) continue;
                    if (bj < 0 || left < best_left) {
                        bj = j;
                        bb = b;
                        best_left = left;
                    }
                }
            }
            if (bj < 0) {
                ok = false;
                break;
            }
            moves.push_back({a, slot_of[a], mb_of[a], bj, bb});
            loads_all[bj][bb] += at.cost[a];
            rws[bj][bb] += at.rows[a];
            members_all[bj][bb].push_back(a);
            slot_of[a] = bj;
            mb_of[a] = bb;
        }
        if (!ok) {
            for (auto it = moves.rbegin(); it != moves.rend(); ++it) {
                loads_all[it->j][it->b] -= at.cost[it->a];
                auto& mem = members_all[it->j][it->b];
                mem.erase(std::find(mem.begin(), mem.end(), it->a));
                slot_of[it->a] = it->k0;
                mb_of[it->a] = it->b0;
            }
            return;
        }
        loads_all.pop_back();
        members_all.pop_back();
    }
}

struct Group {
    std::vector<i64> atoms;
    double cost;
    i64 rows, parent;
};

// _rebalance: per slot, move or swap local groups between the costliest microbatch and the
// cheapest one that can take them while the slot's maximum drops.
void rebalance(const Atoms& at, i64 M, i64 rounds, Result& res) {
    auto& slot_of = res.slot_of;
    auto& mb_of = res.mb_of;
    const bool any_extra = !res.extra.empty();
    for (i64 k = 0; k < static_cast<i64>(res.loads.size()); ++k) {
        auto& loads = res.loads[k];
        auto& members = res.members[k];
        const i64 dp = static_cast<i64>(loads.size());
        if (dp < 2) continue;
        auto groups = [&](i64 b) {
            std::vector<Group> out;
            if (any_extra) {
                for (i64 a : members[b]) {
                    if (res.is_extra[a]) return out;  // what the recomputed ancestors stop at must stay
                }
            }
            for (i64 a : members[b]) {
                const i64 p = at.parent[a];
                if ((p >= 0 && slot_of[p] == k && mb_of[p] == b) || res.is_extra[a]) continue;
                Group g{{a}, 0.0, 0, p};
                for (std::size_t i = 0; i < g.atoms.size(); ++i) {
                    const i64 y = g.atoms[i];
                    for (i64 j = at.kid_off[y]; j < at.kid_off[y + 1]; ++j) {
                        const i64 x = at.kid[j];
                        if (slot_of[x] == k && mb_of[x] == b) g.atoms.push_back(x);
                    }
                }
                for (i64 x : g.atoms) {
                    g.cost += at.cost[x];
                    g.rows += at.rows[x];
                }
                out.push_back(std::move(g));
            }
            return out;
        };
        auto movable = [&](i64 p, i64 b) {
            return p < 0 || slot_of[p] < k || (slot_of[p] == k && mb_of[p] == b);
        };
        std::vector<i64> rws(dp, 0);
        for (i64 b = 0; b < dp; ++b) {
            for (i64 a : members[b]) rws[b] += at.rows[a];
        }
        std::vector<i64> order(dp);
        for (i64 round = 0; round < rounds; ++round) {
            i64 bmax = 0;
            for (i64 b = 1; b < dp; ++b) {
                if (loads[b] > loads[bmax]) bmax = b;
            }
            const double hi_load = loads[bmax];
            const std::vector<Group> gmax = groups(bmax);
            const Group *bx = nullptr, *by = nullptr;
            std::vector<Group> gmin;
            i64 bmin = -1;
            for (i64 b = 0; b < dp; ++b) order[b] = b;
            std::stable_sort(order.begin(), order.end(), [&](i64 x, i64 y) { return loads[x] < loads[y]; });
            for (i64 cand : order) {
                if (cand == bmax || hi_load - loads[cand] <= 0) break;
                bmin = cand;
                gmin = groups(bmin);
                double best_new = hi_load - 1e-12 * std::max(1.0, hi_load);
                for (const Group& gx : gmax) {
                    if (!movable(gx.parent, bmin)) continue;
                    const double cx = gx.cost;
                    if (rws[bmin] + gx.rows <= M) {
                        const double nw = std::max(hi_load - cx, loads[bmin] + cx);
                        if (nw < best_new) {
                            bx = &gx;
                            by = nullptr;
                            best_new = nw;
                        }
                    }
                    for (const Group& gy : gmin) {
                        const double cy = gy.cost;
                        if (cy >= cx || !movable(gy.parent, bmax)) continue;
                        if (rws[bmin] + gx.rows - gy.rows > M || rws[bmax] - gx.rows + gy.rows > M) continue;
                        const double nw = std::max(hi_load - cx + cy, loads[bmin] + cx - cy);
                        if (nw < best_new) {
                            bx = &gx;
                            by = &gy;
                            best_new = nw;
                        }
                    }
                }
                if (bx != nullptr) break;
            }
            if (bx == nullptr) break;
            const std::pair<const Group*, std::pair<i64, i64>> steps[2] = {{bx, {bmax, bmin}}, {by, {bmin, bmax}}};
            for (const auto& st : steps) {
                if (st.first == nullptr) continue;
                const i64 src = st.second.first, dst = st.second.second;
                for (i64 a : st.first->atoms) {
                    auto& ms = members[src];
                    ms.erase(std::find(ms.begin(), ms.end(), a));
                    members[dst].push_back(a);
                    mb_of[a] = dst;
                    loads[src] -= at.cost[a];
                    loads[dst] += at.cost[a];
                    rws[src] -= at.rows[a];
                    rws[dst] += at.rows[a];
                }
            }
        }
    }
}

// The features of every microbatch of the fill (fill_step_tokens' numbers): microbatch (k, b)
// owns its atoms' segments and computes them with their recomputed segments and the ancestors
// recomputed for them.  Returns int64[slots, dp, 6] (zeros for an empty microbatch).
py::array_t<i64> fill_features(const Atoms& at, const i64* rec_off, const i64* rec, const i64* start,
                               const i64* pairs, const i64* logits, i64 dp, i64 chunk_size, const Result& res) {
    const i64 S = static_cast<i64>(res.members.size());
    py::array_t<i64> out({S, dp, static_cast<i64>(6)});
    i64* o = out.mutable_data();
    std::vector<const std::vector<i64>*> extra_of(at.n, nullptr);
    for (const auto& e : res.extra) extra_of[e.first] = &e.second;
    std::vector<i64> own, rc, comp;
    for (i64 k = 0; k < S; ++k) {
        for (i64 b = 0; b < dp; ++b) {
            own.clear();
            rc.clear();
            for (i64 a : res.members[k][b]) {
                own.insert(own.end(), at.seg + at.seg_off[a], at.seg + at.seg_off[a + 1]);
                rc.insert(rc.end(), rec + rec_off[a], rec + rec_off[a + 1]);
                if (extra_of[a]) rc.insert(rc.end(), extra_of[a]->begin(), extra_of[a]->end());
            }
            std::sort(own.begin(), own.end());
            std::sort(rc.begin(), rc.end());
            rc.erase(std::unique(rc.begin(), rc.end()), rc.end());
            comp.clear();
            std::set_union(own.begin(), own.end(), rc.begin(), rc.end(), std::back_inserter(comp));
            comp.erase(std::unique(comp.begin(), comp.end()), comp.end());
            microbatch_feature_row(at.seg_parent, start, at.seg_len, pairs, logits, comp.data(),
                                   static_cast<i64>(comp.size()), own.data(), static_cast<i64>(own.size()),
                                   chunk_size, o + 6 * (k * dp + b));
        }
    }
    return out;
}

template <typename T>
const T* checked(const py::array_t<T, py::array::c_style | py::array::forcecast>& a, i64 size, const char* name) {
    if (a.ndim() != 1 || a.shape(0) != size) {
        throw py::value_error(std::string(name) + " must be a 1-D array of " + std::to_string(size) + " entries");
    }
    return a.data();
}

// The Python entry point: fill, then compact, then rebalance (plan_l2's attempt()).
py::tuple l2_fill(I64Array parent, F64Array cost, I64Array rows, I64Array tree, I64Array kid_off, I64Array kid,
                  I64Array seg_off, I64Array seg, I64Array height, F64Array below, I64Array rows_below,
                  I64Array tree_rank, I64Array seg_parent, I64Array seg_len, F64Array seg_cost, i64 dp, i64 M,
                  i64 S, double eps, double reserve, double remaining, bool recompute, double compact_tol,
                  i64 rounds, I64Array rec_off, I64Array rec, I64Array seg_start, I64Array seg_pairs,
                  I64Array seg_logits, i64 chunk_size) {
    Atoms at;
    at.n = parent.shape(0);
    at.num_trees = tree_rank.shape(0);
    at.num_segments = seg_parent.shape(0);
    const i64 n = at.n;
    if (dp < 1 || S < 1) throw py::value_error("dp and S must be >= 1");
    at.parent = checked(parent, n, "parent");
    at.cost = checked(cost, n, "cost");
    at.rows = checked(rows, n, "rows");
    at.tree = checked(tree, n, "tree");
    at.kid_off = checked(kid_off, n + 1, "kid_off");
    at.kid = checked(kid, kid.shape(0), "kid");
    at.seg_off = checked(seg_off, n + 1, "seg_off");
    at.seg = checked(seg, seg.shape(0), "seg");
    at.height = checked(height, n, "height");
    at.below = checked(below, n, "below");
    at.rows_below = checked(rows_below, n, "rows_below");
    at.tree_rank = checked(tree_rank, at.num_trees, "tree_rank");
    at.seg_parent = checked(seg_parent, at.num_segments, "seg_parent");
    at.seg_len = checked(seg_len, at.num_segments, "seg_len");
    at.seg_cost = checked(seg_cost, at.num_segments, "seg_cost");
    for (i64 a = 0; a < n; ++a) {
        const i64 p = at.parent[a], t = at.tree[a];
        if (p < -1 || p >= n || t < 0 || t >= at.num_trees || at.kid_off[a] > at.kid_off[a + 1] ||
            at.seg_off[a] >= at.seg_off[a + 1]) {
            throw py::value_error("atom " + std::to_string(a) + ": bad parent, tree, children or segments");
        }
    }
    if (at.kid_off[0] != 0 || at.kid_off[n] != kid.shape(0) || at.seg_off[0] != 0 || at.seg_off[n] != seg.shape(0)) {
        throw py::value_error("kid_off / seg_off must be offsets into kid / seg");
    }
    for (i64 j = 0; j < kid.shape(0); ++j) {
        if (at.kid[j] < 0 || at.kid[j] >= n) throw py::value_error("kid ids must be atoms");
    }
    for (i64 j = 0; j < seg.shape(0); ++j) {
        if (at.seg[j] < 0 || at.seg[j] >= at.num_segments) throw py::value_error("seg ids must be segments");
    }
    for (i64 s = 0; s < at.num_segments; ++s) {
        if (at.seg_parent[s] < -1 || at.seg_parent[s] >= s) throw py::value_error("seg_parent must precede");
    }
    const i64* r_off = checked(rec_off, n + 1, "rec_off");
    const i64* r_ids = checked(rec, rec.shape(0), "rec");
    const i64* g_start = checked(seg_start, at.num_segments, "seg_start");
    const i64* g_pairs = checked(seg_pairs, at.num_segments, "seg_pairs");
    const i64* g_logits = checked(seg_logits, at.num_segments, "seg_logits");
    if (chunk_size < 1) throw py::value_error("chunk_size must be >= 1");
    if (r_off[0] != 0 || r_off[n] != rec.shape(0)) throw py::value_error("rec_off must be offsets into rec");
    for (i64 a = 0; a < n; ++a) {
        if (r_off[a] > r_off[a + 1]) throw py::value_error("rec_off must be non-decreasing");
    }
    for (i64 j = 0; j < rec.shape(0); ++j) {
        if (r_ids[j] < 0 || r_ids[j] >= at.num_segments) throw py::value_error("rec ids must be segments");
    }
    Result res;
    fill(at, dp, M, S, eps, reserve, remaining, recompute, res);
    compact(at, M, compact_tol, res);
    rebalance(at, M, rounds, res);
    py::dict extra;
    for (const auto& e : res.extra) extra[py::int_(e.first)] = py::cast(e.second);
    py::array_t<i64> feats = fill_features(at, r_off, r_ids, g_start, g_pairs, g_logits, dp, chunk_size, res);
    return py::make_tuple(py::cast(res.slot_of), py::cast(res.mb_of), py::cast(res.loads), py::cast(res.members),
                          extra, feats);
}

// assemble_plan's per-microbatch work (megatron_harts.planner.microbatch: _assemble_core_python is
// the reference, a test holds the two equal).  Microbatch j (in plan order) gets the owned ids
// own[own_off[j]:own_off[j+1]] and recomputed ids rec[...] (any order, duplicates allowed):
//   * owned = sorted distinct ids; recomputed = sorted distinct ids not owned here;
//   * owner of a segment = the last microbatch that owns it;
//   * external context: walking up from the parent of every computed segment (in id order)
//     through segments neither computed here nor seen yet, each segment is read from its owner
//     (-1: nobody), entries sorted by producer, their segments sorted;
//   * the cost features of (computed, owned) and the rows of the recomputed segments.
// Returns (own_off, own, rec_off, rec, features int64[k, 6], rec_rows, ext_off (entries per
// microbatch), ext_producer, ext_seg_off, ext_seg, ext_rows).
py::tuple assemble_core(I64Array parent, I64Array start, I64Array length, I64Array pairs, I64Array logits,
                        I64Array own_off, I64Array own, I64Array rec_off, I64Array rec, i64 chunk_size) {
    const i64 S = parent.shape(0);
    const i64* gp = checked(parent, S, "parent");
    const i64* gs = checked(start, S, "start");
    const i64* gl = checked(length, S, "length");
    const i64* gpairs = checked(pairs, S, "pairs");
    const i64* glog = checked(logits, S, "logits");
    const i64 k = own_off.shape(0) - 1;
    if (k < 0 || rec_off.shape(0) != k + 1) throw py::value_error("own_off and rec_off must be offsets of one size");
    const i64* oo = checked(own_off, k + 1, "own_off");
    const i64* ro = checked(rec_off, k + 1, "rec_off");
    const i64* os = checked(own, own.shape(0), "own");
    const i64* rs = checked(rec, rec.shape(0), "rec");
    if (chunk_size < 1) throw py::value_error("chunk_size must be >= 1");
    if (oo[0] != 0 || oo[k] != own.shape(0) || ro[0] != 0 || ro[k] != rec.shape(0)) {
        throw py::value_error("own_off / rec_off must be offsets into own / rec");
    }
    for (i64 j = 0; j < k; ++j) {
        if (oo[j] > oo[j + 1] || ro[j] > ro[j + 1]) throw py::value_error("offsets must be non-decreasing");
    }
    for (i64 x = 0; x < own.shape(0); ++x) {
        if (os[x] < 0 || os[x] >= S) throw py::value_error("owned ids must be segments");
    }
    for (i64 x = 0; x < rec.shape(0); ++x) {
        if (rs[x] < 0 || rs[x] >= S) throw py::value_error("recomputed ids must be segments");
    }
    for (i64 s = 0; s < S; ++s) {
        if (gp[s] < -1 || gp[s] >= s) throw py::value_error("parent must precede every segment");
    }
    std::vector<std::vector<i64>> owns(k), recs(k);
    std::vector<i64> owner(S, -1);
    for (i64 j = 0; j < k; ++j) {
        auto& o = owns[j];
        o.assign(os + oo[j], os + oo[j + 1]);
        std::sort(o.begin(), o.end());
        o.erase(std::unique(o.begin(), o.end()), o.end());
        auto& r = recs[j];
        std::vector<i64> tmp(rs + ro[j], rs + ro[j + 1]);
        std::sort(tmp.begin(), tmp.end());
        tmp.erase(std::unique(tmp.begin(), tmp.end()), tmp.end());
        std::set_difference(tmp.begin(), tmp.end(), o.begin(), o.end(), std::back_inserter(r));
        for (i64 x : o) owner[x] = j;
    }
    std::vector<i64> own_off2(k + 1, 0), rec_off2(k + 1, 0), own2, rec2, rec_rows(k, 0), ext_off(k + 1, 0);
    std::vector<i64> ext_prod, ext_seg_off(1, 0), ext_seg, ext_rows;
    py::array_t<i64> feats({k, static_cast<i64>(6)});
    i64* fo = feats.mutable_data();
    std::vector<i64> mark(S, -1), seen(S, -1), comp;
    std::vector<std::pair<i64, i64>> ext;  // (producer, segment)
    for (i64 j = 0; j < k; ++j) {
        const auto& o = owns[j];
        const auto& r = recs[j];
        own2.insert(own2.end(), o.begin(), o.end());
        rec2.insert(rec2.end(), r.begin(), r.end());
        own_off2[j + 1] = static_cast<i64>(own2.size());
        rec_off2[j + 1] = static_cast<i64>(rec2.size());
        for (i64 x : r) rec_rows[j] += gl[x];
        comp.clear();
        std::merge(o.begin(), o.end(), r.begin(), r.end(), std::back_inserter(comp));
        for (i64 x : comp) mark[x] = j;
        ext.clear();
        for (i64 x : comp) {
            for (i64 a = gp[x]; a >= 0 && mark[a] != j && seen[a] != j; a = gp[a]) {
                seen[a] = j;
                ext.emplace_back(owner[a], a);
            }
        }
        std::sort(ext.begin(), ext.end());
        for (std::size_t e = 0; e < ext.size(); ++e) {
            if (e == 0 || ext[e].first != ext[e - 1].first) {
                if (e) ext_seg_off.push_back(static_cast<i64>(ext_seg.size()));
                ext_prod.push_back(ext[e].first);
                ext_rows.push_back(0);
            }
            ext_seg.push_back(ext[e].second);
            ext_rows.back() += gl[ext[e].second];
        }
        if (!ext.empty()) ext_seg_off.push_back(static_cast<i64>(ext_seg.size()));
        ext_off[j + 1] = static_cast<i64>(ext_prod.size());
        microbatch_feature_row(gp, gs, gl, gpairs, glog, comp.data(), static_cast<i64>(comp.size()), o.data(),
                               static_cast<i64>(o.size()), chunk_size, fo + 6 * j);
    }
    auto arr = [](const std::vector<i64>& v) {
        py::array_t<i64> a(static_cast<py::ssize_t>(v.size()));
        std::copy(v.begin(), v.end(), a.mutable_data());
        return a;
    };
    return py::make_tuple(arr(own_off2), arr(own2), arr(rec_off2), arr(rec2), feats, arr(rec_rows), arr(ext_off),
                          arr(ext_prod), arr(ext_seg_off), arr(ext_seg), arr(ext_rows));
}

}  // namespace

void register_l2(pybind11::module_& m) {
    m.def("assemble_core", &assemble_core, py::arg("parent"), py::arg("start"), py::arg("length"),
          py::arg("pairs"), py::arg("logits"), py::arg("own_off"), py::arg("own"), py::arg("rec_off"),
          py::arg("rec"), py::arg("chunk_size"),
          "assemble_plan's per-microbatch work (megatron_harts.planner.microbatch._assemble_core_python): "
          "owned / recomputed ids, cost features, recomputed rows and external context as CSR arrays.");
    m.def("l2_fill", &l2_fill, py::arg("parent"), py::arg("cost"), py::arg("rows"), py::arg("tree"),
          py::arg("kid_off"), py::arg("kid"), py::arg("seg_off"), py::arg("seg"), py::arg("height"),
          py::arg("below"), py::arg("rows_below"), py::arg("tree_rank"), py::arg("seg_parent"),
          py::arg("seg_len"), py::arg("seg_cost"), py::arg("dp"), py::arg("M"), py::arg("S"), py::arg("eps"),
          py::arg("reserve"), py::arg("remaining"), py::arg("recompute"), py::arg("compact_tol"),
          py::arg("rounds"), py::arg("rec_off"), py::arg("rec"), py::arg("seg_start"), py::arg("seg_pairs"),
          py::arg("seg_logits"), py::arg("chunk_size"),
          "L2's slot fill, last-slot compaction and rebalance (megatron_harts.planner.l2: _fill, _compact, "
          "_rebalance, same outputs): (slot_of, mb_of, loads per slot, members per slot, extra, features): "
          "features int64[slots, dp, 6] of every microbatch of the fill (CostModel.features order).");
}
