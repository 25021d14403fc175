// L2's spreading packer: the C++ core of megatron_harts.planner.l2_spread.pack_spread (the Python reference
// beside it: _pack_spread_python; tests/test_microbatch_planner.py holds the two equal, floats
// included: every floating-point operation below runs in the reference's order).
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

inline bool has(const std::vector<i64>& v, i64 x) { return std::find(v.begin(), v.end(), x) != v.end(); }

inline void insert(std::vector<i64>& v, i64 x) {
    if (!has(v, x)) v.push_back(x);
}

// Units (the unit objects, for the entries; and as unit_arrays writes them): ints int64[units, 8] =
// kind (0 core, 1 item, 2 free), tree, window, upper window, owned rows, replay tokens, path rows,
// rows; flts float64[units, 3] = cost, replay cost, path cost; owned / recomputed / path segments as
// CSR.  Returns (packings, bound) as the reference: its one packing (groups, placement, loads,
// entries) in a list, or no packing when a split window's consumer finds no slot after its path's
// owner (_spread_output).
py::tuple l2_pack_spread(py::list units, I64Array length_a, I64Array ints_a, F64Array flts_a, I64Array own_off_a,
                         I64Array own_a, I64Array rec_off_a, I64Array rec_a, I64Array path_off_a, I64Array path_a,
                         i64 dp, i64 M, i64 S, double eps) {
    const i64 nu = l2_check_unit_arrays(ints_a, 8, flts_a, own_off_a, own_a, rec_off_a, rec_a, path_off_a, path_a,
                                        length_a.shape(0), static_cast<i64>(units.size()));
    if (dp < 1 || S < 1) throw py::value_error("dp and S must be >= 1");
    const i64* length = length_a.data();
    auto ints = ints_a.unchecked<2>();
    auto flts = flts_a.unchecked<2>();
    const i64 *own_off = own_off_a.data(), *own = own_a.data();
    const i64 *rec_off = rec_off_a.data(), *rec = rec_a.data();
    const i64 *path_off = path_off_a.data(), *path = path_a.data();
    auto kind = [&](i64 k) { return ints(k, 0); };
    auto tree = [&](i64 k) { return ints(k, 1); };
    auto win = [&](i64 k) { return ints(k, 2); };
    auto upper = [&](i64 k) { return ints(k, 3); };
    auto own_rows = [&](i64 k) { return ints(k, 4); };
    auto path_rows = [&](i64 k) { return ints(k, 6); };
    auto urows = [&](i64 k) { return ints(k, 7); };
    auto cost = [&](i64 k) { return flts(k, 0); };
    auto replay_cost = [&](i64 k) { return flts(k, 1); };
    auto path_cost = [&](i64 k) { return flts(k, 2); };

    double total = 0.0;
    for (i64 k = 0; k < nu; ++k) total += cost(k) + replay_cost(k);
    const double hi = total / static_cast<double>(dp * S) * (1.0 + eps);
    using Ent = L2Entry;
    std::vector<i64> rep, rows, reads;
    std::vector<double> load;
    std::vector<std::vector<i64>>
        have;  // b's recomputed segments, no repeats (few: membership by scan)
    std::vector<std::vector<i64>> own_l, rec_l, reads_trees, recomputes;
    std::vector<char> has_core;
    std::vector<std::vector<Ent>> ent;
    auto open_bin = [&](i64 r) {
        rep.push_back(r);
        load.push_back(0.0);
        rows.push_back(0);
        has_core.push_back(0);
        reads.push_back(-1);
        have.emplace_back();
        reads_trees.emplace_back();
        recomputes.emplace_back();
        own_l.emplace_back();
        rec_l.emplace_back();
        ent.emplace_back();
        return static_cast<i64>(rep.size()) - 1;
    };
    for (i64 b = 0; b < dp * S; ++b) open_bin(b / S);
    auto put = [&](i64 b, i64 k, bool with_path, double c) {
        ent[b].push_back(Ent{k, with_path, c});
        load[b] += c;
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
    };
    auto fewest = [&]() {
        i64 best = 0, best_n = -1;
        for (i64 q = 0; q < dp; ++q) {
            const i64 c = std::count(rep.begin(), rep.end(), q);
            if (best_n < 0 || c < best_n) {
                best = q;
                best_n = c;
            }
        }
        return best;
    };

    std::vector<std::pair<i64, i64>> win_core;  // window -> its core's bin
    auto core_bin = [&](i64 w) {
        for (auto& kv : win_core)
            if (kv.first == w) return kv.second;
        throw py::value_error("an item's window has no core");
    };
    std::vector<std::pair<i64, i64>> after;
    bool bound = false;
    std::vector<i64> cores, rest;
    for (i64 k = 0; k < nu; ++k) (kind(k) == 0 ? cores : rest).push_back(k);
    std::stable_sort(cores.begin(), cores.end(), [&](i64 a, i64 b) { return -cost(a) < -cost(b); });
    std::stable_sort(rest.begin(), rest.end(),
                     [&](i64 a, i64 b) { return -(cost(a) + replay_cost(a)) < -(cost(b) + replay_cost(b)); });
    for (i64 k : cores) {
        bool found = false;
        i64 bk = 0, bb = 0;
        double bl = 0.0;
        for (i64 r = 0; r < dp; ++r)
            for (i64 q = 0; q < S; ++q) {
                const i64 b = r * S + q;
                if (reads[b] < 0 && rows[b] + urows(k) <= M) {
                    if (!found || q < bk || (q == bk && load[b] < bl)) {
                        found = true;
                        bk = q;
                        bl = load[b];
                        bb = b;
                    }
                    break;
                }
            }
        const i64 b = found ? bb : open_bin(fewest());
        put(b, k, false, cost(k));
        has_core[b] = 1;
        win_core.push_back({win(k), b});
    }
    for (i64 k : rest) {
        const i64 p = kind(k) == 1 ? core_bin(win(k)) : -1;
        bool has_win = false, has_other = false;
        double win_v = 0.0, win_c = 0.0, oth_v = 0.0, oth_c = 0.0;
        i64 win_b = -1, oth_b = -1;
        const i64 nb = static_cast<i64>(rep.size());
        if (p >= 0) {
            for (i64 b = 0; b < nb; ++b) {
                if (rep[b] != rep[p]) continue;
                double c;
                if (b == p) {
                    c = cost(k);
                } else if (!has_core[b] && (reads[b] == -1 || reads[b] == p) && !has(recomputes[b], tree(k))) {
                    c = cost(k) + replay_cost(k);
                } else {
                    continue;
                }
                if (rows[b] + urows(k) <= M && (!has_win || load[b] + c < win_v)) {
                    has_win = true;
                    win_v = load[b] + c;
                    win_b = b;
                    win_c = c;
                }
            }
        }
        if (!has_win || win_v > hi) {
            bound = bound || has_win;
            for (i64 b = 0; b < nb; ++b) {
                i64 add;
                double c;
                if (p >= 0) {
                    if (b == p || has(reads_trees[b], tree(k))) continue;
                    i64 extra = 0;
                    for (i64 i = path_off[k]; i < path_off[k + 1]; ++i)
                        if (!has(have[b], path[i])) extra += length[path[i]];
                    add = urows(k) + extra;
                    c = cost(k) + path_cost(k) * static_cast<double>(extra) /
                                      static_cast<double>(std::max<i64>(1, path_rows(k)));
                } else {
                    i64 in = 0;
                    for (i64 i = rec_off[k]; i < rec_off[k + 1]; ++i)
                        if (has(have[b], rec[i])) in += length[rec[i]];
                    add = urows(k) - in;
                    c = cost(k);
                }
                if (rows[b] + add <= M && (!has_other || load[b] + c < oth_v)) {
                    has_other = true;
                    oth_v = load[b] + c;
                    oth_b = b;
                    oth_c = c;
                }
            }
        }
        if (has_win && (win_v <= hi || !has_other || win_v <= oth_v)) {
            put(win_b, k, false, win_c);
            if (win_b != p) {
                reads[win_b] = p;
                insert(reads_trees[win_b], tree(k));
                if (upper(k) >= 0) after.push_back({win_b, core_bin(upper(k))});
            }
        } else if (has_other) {
            put(oth_b, k, p >= 0, oth_c);
            if (p >= 0) insert(recomputes[oth_b], tree(k));
        } else if (p >= 0) {
            const i64 b = open_bin(rep[p]);
            put(b, k, false, cost(k) + replay_cost(k));
            reads[b] = p;
            insert(reads_trees[b], tree(k));
            if (upper(k) >= 0) after.push_back({b, core_bin(upper(k))});
        } else {
            const i64 b = open_bin(fewest());
            put(b, k, false, cost(k));
        }
    }
    // the reference's _spread_output: per replica its producers first, the rest costliest first, then
    // split windows' consumers after their path's owner
    const i64 nb = static_cast<i64>(rep.size());
    std::vector<std::vector<i64>> seqs(dp);
    for (i64 r = 0; r < dp; ++r) {
        std::vector<i64> rest;
        for (i64 b = 0; b < nb; ++b)
            if (rep[b] == r && !own_l[b].empty()) (has_core[b] ? seqs[r] : rest).push_back(b);
        std::stable_sort(rest.begin(), rest.end(), [&](i64 a, i64 b) { return -load[a] < -load[b]; });
        seqs[r].insert(seqs[r].end(), rest.begin(), rest.end());
    }
    std::unordered_map<i64, std::vector<i64>> aft;
    for (const auto& bq : after) {
        auto& qs = aft[bq.first];
        if (bq.second != bq.first && !has(qs, bq.second)) qs.push_back(bq.second);
    }
    py::list packings;
    if (l2_after_owners(seqs, aft)) packings.append(l2_packing_object(seqs, own_l, rec_l, load, ent, units));
    return py::make_tuple(packings, bound);
}

}  // namespace

py::list l2_pack_spread_many(py::list units, I64Array length_a, I64Array ints_a, F64Array flts_a,
                             I64Array own_off_a, I64Array own_a, I64Array rec_off_a, I64Array rec_a,
                             I64Array path_off_a, I64Array path_a, i64 dp, i64 M,
                             const std::vector<i64>& slots, const std::vector<double>& epss) {
    return l2_pack_many(
        [&](i64 S, double eps) {
            return l2_pack_spread(units, length_a, ints_a, flts_a, own_off_a, own_a, rec_off_a,
                                  rec_a, path_off_a, path_a, dp, M, S, eps);
        },
        slots, epss);
}

void register_spread(py::module_& m) {
    m.def("l2_pack_spread_many", &l2_pack_spread_many, py::arg("units"), py::arg("length"),
          py::arg("ints"), py::arg("flts"), py::arg("own_off"), py::arg("own"), py::arg("rec_off"),
          py::arg("rec"), py::arg("path_off"), py::arg("path"), py::arg("dp"), py::arg("M"),
          py::arg("slots"), py::arg("epss"),
          "l2_pack_spread over slot counts and tolerances as plan_l2 asks for them "
          "(l2_packing.CompiledPacker.many): "
          "the packings that are not None, in order.");
    m.def("l2_pack_spread", &l2_pack_spread, py::arg("units"), py::arg("length"), py::arg("ints"), py::arg("flts"),
          py::arg("own_off"), py::arg("own"), py::arg("rec_off"), py::arg("rec"), py::arg("path_off"),
          py::arg("path"), py::arg("dp"), py::arg("M"), py::arg("S"), py::arg("eps"),
          "L2's spreading packer (see megatron_harts.planner.l2_spread.pack_spread; _pack_spread_python is the "
          "reference): (packings, bound) as the reference returns them.");
}
