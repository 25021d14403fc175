// What L2's compiled packers share (csrc/l2_windows.cpp, csrc/l2_spread.cpp): the slot order after split
// windows' path owners (megatron_harts.planner.l2_packing._after_owners) and the packing written as the
// Python packers return it.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "planner_l2.h"

namespace py = pybind11;
using i64 = std::int64_t;

void l2_check_unit_csr(const i64* off, const i64* ids, i64 size, i64 nu, i64 num_segments, const char* name) {
    if (size < 0 || off[0] != 0 || off[nu] != size) throw py::value_error(std::string(name) + ": offsets do not match");
    for (i64 i = 0; i < size; ++i)
        if (ids[i] < 0 || ids[i] >= num_segments) throw py::value_error(std::string(name) + ": segment out of range");
}

i64 l2_check_unit_arrays(const py::array& ints, i64 int_cols, const py::array& flts, const py::array& own_off,
                         const py::array& own, const py::array& rec_off, const py::array& rec,
                         const py::array& path_off, const py::array& path, i64 num_segments, i64 objects) {
    const i64 nu = ints.ndim() == 2 ? ints.shape(0) : -1;
    if (nu < 0 || ints.shape(1) != int_cols || flts.ndim() != 2 || flts.shape(0) != nu || flts.shape(1) != 3)
        throw py::value_error("ints must be int64[units, " + std::to_string(int_cols) +
                              "] and flts float64[units, 3]");
    if (objects >= 0 && objects != nu) throw py::value_error("units and ints must have one row per unit");
    if (own_off.ndim() != 1 || rec_off.ndim() != 1 || path_off.ndim() != 1 || own_off.shape(0) != nu + 1 ||
        rec_off.shape(0) != nu + 1 || path_off.shape(0) != nu + 1)
        throw py::value_error("own_off / rec_off / path_off must have one entry per unit plus one");
    const py::array* csr[3][2] = {{&own_off, &own}, {&rec_off, &rec}, {&path_off, &path}};
    const char* names[3] = {"own", "rec", "path"};
    for (int i = 0; i < 3; ++i)
        l2_check_unit_csr(static_cast<const i64*>(csr[i][0]->data()), static_cast<const i64*>(csr[i][1]->data()),
                          csr[i][1]->ndim() == 1 ? csr[i][1]->shape(0) : -1, nu, num_segments, names[i]);
    return nu;
}

py::list l2_pack_many(const std::function<py::tuple(i64, double)>& pack,
                      const std::vector<i64>& slots, const std::vector<double>& epss) {
    py::list out;
    for (i64 S : slots) {
        bool bound = true;
        for (double eps : epss) {
            if (!bound) break;  // the target turned nothing away: a larger one packs the same
            const py::tuple got = pack(S, eps);
            for (const auto& p : py::reinterpret_borrow<py::list>(got[0]))
                if (!p.is_none()) out.append(p);
            bound = got[1].cast<bool>();
        }
    }
    return out;
}

bool l2_after_owners(std::vector<std::vector<i64>>& seqs, const std::unordered_map<i64, std::vector<i64>>& after) {
    if (after.empty()) return true;
    std::unordered_set<i64> lead;
    for (const auto& kv : after)
        for (i64 q : kv.second) lead.insert(q);
    std::unordered_map<i64, i64> pos;  // a leading producer's slot on its replica
    for (const auto& seq : seqs) {
        i64 k = 0;
        for (i64 b : seq)
            if (lead.count(b)) pos[b] = k++;
    }
    for (auto& seq : seqs) {
        std::vector<i64> out, rest;
        for (i64 b : seq) (lead.count(b) ? out : rest).push_back(b);
        while (!rest.empty()) {
            const i64 k = static_cast<i64>(out.size());
            std::size_t pick = rest.size();
            for (std::size_t i = 0; i < rest.size() && pick == rest.size(); ++i) {
                auto it = after.find(rest[i]);
                bool ok = true;
                if (it != after.end())
                    for (i64 q : it->second) {
                        auto pq = pos.find(q);
                        if (pq == pos.end() || pq->second >= k) {
                            ok = false;
                            break;
                        }
                    }
                if (ok) pick = i;
            }
            if (pick == rest.size()) return false;
            out.push_back(rest[pick]);
            rest.erase(rest.begin() + static_cast<std::ptrdiff_t>(pick));
        }
        seq = std::move(out);
    }
    return true;
}

namespace {

// A packing as the Python packers return it: the sequence (groups, placement, loads, entries), each
// part built on its first read (a packer's packings are many, and most are only estimated from their
// loads).  Invariant: the parts read are exactly the tuple the reference packer returns.
class L2Packing {
   public:
    L2Packing(const std::vector<std::vector<i64>>& seqs, const std::vector<std::vector<i64>>& own_l,
              const std::vector<std::vector<i64>>& rec_l, const std::vector<double>& load,
              const std::vector<std::vector<L2Entry>>& ent, py::list units)
        : units_(std::move(units)) {
        std::size_t nb = 0, n_own = 0, n_rec = 0, n_ent = 0;  // sizes first: every vector allocated once
        for (const auto& seq : seqs) {
            nb += seq.size();
            for (i64 b : seq) {
                n_own += own_l[b].size();
                n_rec += rec_l[b].size();
                n_ent += ent[b].size();
            }
        }
        per_replica_.reserve(seqs.size());
        own_.reserve(n_own);
        rec_.reserve(n_rec);
        ent_.reserve(n_ent);
        own_off_.reserve(nb + 1);
        rec_off_.reserve(nb + 1);
        ent_off_.reserve(nb + 1);
        load_.reserve(nb);
        own_off_.push_back(0);
        rec_off_.push_back(0);
        ent_off_.push_back(0);
        for (std::size_t r = 0; r < seqs.size(); ++r) {
            per_replica_.push_back(static_cast<i64>(seqs[r].size()));
            for (i64 b : seqs[r]) {
                own_.insert(own_.end(), own_l[b].begin(), own_l[b].end());
                rec_.insert(rec_.end(), rec_l[b].begin(), rec_l[b].end());
                ent_.insert(ent_.end(), ent[b].begin(), ent[b].end());
                own_off_.push_back(own_.size());
                rec_off_.push_back(rec_.size());
                ent_off_.push_back(ent_.size());
                load_.push_back(load[b]);
            }
        }
    }

    py::object part(i64 i) {
        if (i < 0) i += 4;
        if (i < 0 || i >= 4) throw py::index_error("a packing has 4 parts");
        if (!parts_[i]) parts_[i] = build(i);
        return parts_[i];
    }

    py::tuple all() { return py::make_tuple(part(0), part(1), part(2), part(3)); }

    // megatron_harts.planner.l2_packing._estimate_step_python of this packing, the same floats: per slot
    // the costliest bin (its load plus overhead; a replica without a bin there counts 0.0), summed
    // slot by slot in order.
    double estimate_step(double overhead) const {
        i64 S = 0;
        for (i64 nr : per_replica_) S = std::max(S, nr);
        std::vector<std::size_t> first(per_replica_.size());  // a replica's first bin in load_
        std::size_t q = 0;
        for (std::size_t r = 0; r < per_replica_.size(); ++r) {
            first[r] = q;
            q += static_cast<std::size_t>(per_replica_[r]);
        }
        double total = 0.0;
        for (i64 k = 0; k < S; ++k) {
            double mx = 0.0;
            for (std::size_t r = 0; r < per_replica_.size(); ++r) {
                const double v = k < per_replica_[r] ? load_[first[r] + static_cast<std::size_t>(k)] + overhead : 0.0;
                if (r == 0 || v > mx) mx = v;
            }
            total += mx;
        }
        return total;
    }

    // megatron_harts.planner.l2_packing._packed_rows_python of this packing: the rows of every bin's owned and
    // recomputed segments (length[s] each), without building the groups.
    i64 rows(const py::array_t<i64, py::array::c_style | py::array::forcecast>& length) const {
        const i64 n = length.shape(0);
        const i64* len = length.data();
        i64 total = 0;
        for (const auto* v : {&own_, &rec_}) {
            for (i64 x : *v) {
                if (x < 0 || x >= n) throw py::value_error("a segment of the packing is out of range");
                total += len[x];
            }
        }
        return total;
    }

    // megatron_harts.planner.microbatch.plan_order(groups, placement) of this packing, the same
    // tuple: the bins owning segments ordered by (slot, replica), the slots used renumbered 0..
    // (replicas and slots as lists, the slot count, owned and recomputed segments as CSR int64
    // arrays).
    py::tuple plan_order() const {
        std::vector<std::pair<i64, i64>> keys;  // (slot, replica) of each bin owning segments
        std::vector<std::size_t> bin;
        std::size_t q = 0;
        for (std::size_t r = 0; r < per_replica_.size(); ++r)
            for (i64 k = 0; k < per_replica_[r]; ++k, ++q)
                if (own_off_[q + 1] > own_off_[q]) {
                    keys.emplace_back(k, static_cast<i64>(r));
                    bin.push_back(q);
                }
        std::vector<std::size_t> order(keys.size());
        for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
        std::sort(order.begin(), order.end(),
                  [&](std::size_t a, std::size_t b) { return keys[a] < keys[b]; });
        std::vector<i64> used;
        for (const auto& kr : keys) used.push_back(kr.first);
        std::sort(used.begin(), used.end());
        used.erase(std::unique(used.begin(), used.end()), used.end());
        py::list reps, slots;
        const auto n = static_cast<py::ssize_t>(order.size());
        py::array_t<i64> own_off(n + 1), rec_off(n + 1);
        i64 n_own = 0, n_rec = 0;
        for (std::size_t i : order) {
            n_own += static_cast<i64>(own_off_[bin[i] + 1] - own_off_[bin[i]]);
            n_rec += static_cast<i64>(rec_off_[bin[i] + 1] - rec_off_[bin[i]]);
        }
        py::array_t<i64> own(n_own), rec(n_rec);
        i64 *oo = own_off.mutable_data(), *ro = rec_off.mutable_data(), *ow = own.mutable_data();
        i64* rw = rec.mutable_data();
        oo[0] = ro[0] = 0;
        i64 j = 0;
        for (std::size_t i : order) {
            const std::size_t b = bin[i];
            reps.append(keys[i].second);
            slots.append(static_cast<i64>(
                std::lower_bound(used.begin(), used.end(), keys[i].first) - used.begin()));
            ow = std::copy(own_.begin() + static_cast<std::ptrdiff_t>(own_off_[b]),
                           own_.begin() + static_cast<std::ptrdiff_t>(own_off_[b + 1]), ow);
            rw = std::copy(rec_.begin() + static_cast<std::ptrdiff_t>(rec_off_[b]),
                           rec_.begin() + static_cast<std::ptrdiff_t>(rec_off_[b + 1]), rw);
            ++j;
            oo[j] = oo[j - 1] + static_cast<i64>(own_off_[b + 1] - own_off_[b]);
            ro[j] = ro[j - 1] + static_cast<i64>(rec_off_[b + 1] - rec_off_[b]);
        }
        return py::make_tuple(reps, slots, static_cast<i64>(used.size()), own_off, own, rec_off,
                              rec);
    }

   private:
    friend py::object l2_rebalance_packing(
        const L2Packing& p,
        const py::array_t<i64, py::array::c_style | py::array::forcecast>& length_a,
        const py::array& ints, const py::array& flts, const py::array& own_off,
        const py::array& own, const py::array& rec_off, const py::array& rec,
        const py::array& path_off, const py::array& path, i64 dp, i64 M, double overhead, i64 moves,
        i64 n_slots, double weight, i64 swap_bins, i64 wide, i64 spend, bool ordered, bool split);

    py::object build(i64 i) const {
        py::list out;
        if (i == 0) {  // groups: (owned, recomputed) per bin in slot order
            auto ids = [](const std::vector<i64>& flat, std::size_t lo, std::size_t hi) {
                py::tuple t(hi - lo);
                for (std::size_t k = lo; k < hi; ++k) t[k - lo] = py::int_(flat[k]);
                return t;
            };
            for (std::size_t q = 0; q < load_.size(); ++q)
                out.append(py::make_tuple(ids(own_, own_off_[q], own_off_[q + 1]), ids(rec_, rec_off_[q], rec_off_[q + 1])));
        } else if (i == 1) {  // placement: (replica, slot)
            for (std::size_t r = 0; r < per_replica_.size(); ++r)
                for (i64 k = 0; k < per_replica_[r]; ++k) out.append(py::make_tuple(static_cast<i64>(r), k));
        } else if (i == 2) {  // loads: per replica in slot order
            std::size_t q = 0;
            for (i64 nr : per_replica_) {
                py::list lr;
                for (i64 k = 0; k < nr; ++k) lr.append(load_[q++]);
                out.append(lr);
            }
        } else {  // entries: (unit, its path or (), cost)
            const py::tuple no_path;
            std::vector<py::object> paths(units_.size());  // each unit's path, read once
            for (std::size_t q = 0; q < load_.size(); ++q) {
                py::list es;
                for (std::size_t x = ent_off_[q]; x < ent_off_[q + 1]; ++x) {
                    const L2Entry& e = ent_[x];
                    const auto ku = static_cast<std::size_t>(e.unit);
                    py::object u = units_[ku];
                    if (e.path && !paths[ku]) paths[ku] = u.attr("path");
                    es.append(py::make_tuple(u, e.path ? paths[ku] : py::object(no_path), e.cost));
                }
                out.append(es);
            }
        }
        return std::move(out);
    }

    py::list units_;
    std::vector<i64> per_replica_;
    std::vector<i64> own_, rec_;  // per bin in slot order: own_[own_off_[q]:own_off_[q + 1]], ...
    std::vector<std::size_t> own_off_, rec_off_, ent_off_;
    std::vector<double> load_;
    std::vector<L2Entry> ent_;
    py::object parts_[4];
};

}  // namespace

py::object l2_packing_object(const std::vector<std::vector<i64>>& seqs, const std::vector<std::vector<i64>>& own_l,
                             const std::vector<std::vector<i64>>& rec_l, const std::vector<double>& load,
                             const std::vector<std::vector<L2Entry>>& ent, const py::list& units) {
    return py::cast(L2Packing(seqs, own_l, rec_l, load, ent, units));
}

namespace {

using I64In = py::array_t<i64, py::array::c_style | py::array::forcecast>;
using F64In = py::array_t<double, py::array::c_style | py::array::forcecast>;

// megatron_harts.planner.l2_balance.rebalance of a compiled packer's packing `p` (its units'
// arrays: unit_arrays of the unit list the packer was given, which p holds), the same packing or
// None: its units numbered by first appearance (l2_balance.numbered_units), the search
// (l2_rebalance_search), then the reference's output: per replica its bins costliest first, each
// producer just before its first reader, split windows' readers after their path's owners
// (l2_after_owners), owned segments in entry order and recomputed ones (with the recomputed paths)
// sorted, without what the bin owns.
py::object l2_rebalance_packing(const L2Packing& p, const I64In& length_a, const py::array& ints_o,
                                const py::array& flts_o, const py::array& own_off_o,
                                const py::array& own_o, const py::array& rec_off_o,
                                const py::array& rec_o, const py::array& path_off_o,
                                const py::array& path_o, i64 dp, i64 M, double overhead, i64 moves,
                                i64 n_slots, double weight, i64 swap_bins, i64 wide, i64 spend,
                                bool ordered, bool split) {
    const i64 nb = static_cast<i64>(p.load_.size());
    if (nb < 2 || dp < 2 || nb < dp) return py::none();
    const I64In ints_a(ints_o), own_off_a(own_off_o), own_a(own_o), rec_off_a(rec_off_o),
        rec_a(rec_o);
    const I64In path_off_a(path_off_o), path_a(path_o);
    const F64In flts_a(flts_o);
    const i64 S = length_a.shape(0);
    const i64 nu = l2_check_unit_arrays(ints_a, 8, flts_a, own_off_a, own_a, rec_off_a, rec_a,
                                        path_off_a, path_a, S, static_cast<i64>(p.units_.size()));
    auto ints = ints_a.unchecked<2>();
    auto flts = flts_a.unchecked<2>();
    // number the units by first appearance, one number per unit object (numbered_units)
    std::unordered_map<PyObject*, i64> number;
    std::vector<i64> perm;  // number -> the unit's row in the arrays (its index in p.units_)
    std::vector<i64> rep0(static_cast<std::size_t>(nb));
    std::vector<std::vector<L2Entry>> ent0(static_cast<std::size_t>(nb));
    for (i64 q = 0, r = 0, k = 0; q < nb; ++q, ++k) {
        while (k >= p.per_replica_[r]) {
            ++r;
            k = 0;
        }
        rep0[q] = r;
        for (std::size_t x = p.ent_off_[q]; x < p.ent_off_[q + 1]; ++x) {
            const L2Entry& e = p.ent_[x];
            if (e.unit < 0 || e.unit >= nu)
                throw py::value_error("an entry's unit is out of range");
            auto it =
                number.emplace(p.units_[static_cast<std::size_t>(e.unit)].ptr(), perm.size()).first;
            if (it->second == static_cast<i64>(perm.size())) perm.push_back(e.unit);
            ent0[q].push_back(L2Entry{it->second, e.path, e.cost});
        }
    }
    L2Units U;
    std::vector<i64> csr[3][2];  // own, rec, path of the numbered units: offsets, ids
    const i64* src[3][2] = {{own_off_a.data(), own_a.data()},
                            {rec_off_a.data(), rec_a.data()},
                            {path_off_a.data(), path_a.data()}};
    for (auto& c : csr) c[0].push_back(0);
    for (i64 i : perm) {
        U.kind.push_back(ints(i, 0));
        U.tree.push_back(ints(i, 1));
        U.win.push_back(ints(i, 2));
        U.upper.push_back(ints(i, 3));
        U.own_rows.push_back(ints(i, 4));
        U.replay.push_back(ints(i, 5));
        U.path_rows.push_back(ints(i, 6));
        U.cost.push_back(flts(i, 0));
        U.replay_cost.push_back(flts(i, 1));
        U.path_cost.push_back(flts(i, 2));
        for (int c = 0; c < 3; ++c) {
            csr[c][1].insert(csr[c][1].end(), src[c][1] + src[c][0][i],
                             src[c][1] + src[c][0][i + 1]);
            csr[c][0].push_back(static_cast<i64>(csr[c][1].size()));
        }
    }
    U.own_off = csr[0][0].data();
    U.own = csr[0][1].data();
    U.rec_off = csr[1][0].data();
    U.rec = csr[1][1].data();
    U.path_off = csr[2][0].data();
    U.path = csr[2][1].data();
    std::vector<i64> rep;
    std::vector<std::vector<L2Entry>> ent;
    const i64* length = length_a.data();
    bool moved;
    {
        py::gil_scoped_release release;  // the search reads C++ copies and the lengths' buffer only
        moved = l2_rebalance_search(U, length, S, rep0, ent0, dp, M, overhead, moves, n_slots,
                                    weight, swap_bins, wide, spend, ordered, split, rep, ent);
    }
    if (!moved) return py::none();
    const i64 n = static_cast<i64>(rep.size());  // bins the pass opened included
    std::unordered_map<i64, i64> prod;           // a window -> the bin of its core
    for (i64 b = 0; b < n; ++b)
        for (const L2Entry& e : ent[b])
            if (U.kind[e.unit] == 0) prod[U.win[e.unit]] = b;
    auto producer = [&](i64 win) {
        auto it = prod.find(win);
        if (it == prod.end()) throw py::value_error("a window without its core");
        return it->second;
    };
    std::vector<std::vector<i64>> reads(static_cast<std::size_t>(n));
    std::vector<double> load(static_cast<std::size_t>(n), 0.0);
    std::unordered_map<i64, std::vector<i64>> after;
    for (i64 b = 0; b < n; ++b) {
        for (const L2Entry& e : ent[b]) {
            load[b] += e.cost;
            if (U.kind[e.unit] != 1 || e.path) continue;
            const i64 w = producer(U.win[e.unit]);
            if (w != b) reads[b].push_back(w);
            if (U.upper[e.unit] >= 0 && w != b) after[b].push_back(producer(U.upper[e.unit]));
        }
        std::sort(reads[b].begin(), reads[b].end());
        reads[b].erase(std::unique(reads[b].begin(), reads[b].end()), reads[b].end());
    }
    std::vector<std::vector<i64>> seqs(static_cast<std::size_t>(dp));
    for (i64 r = 0; r < dp; ++r) {
        std::vector<char> done(static_cast<std::size_t>(n), 0);  // per replica, as the reference
        std::vector<i64> srt;
        for (i64 b = 0; b < n; ++b)
            if (rep[b] == r && !ent[b].empty()) srt.push_back(b);
        std::sort(srt.begin(), srt.end(),
                  [&](i64 a, i64 c) { return load[a] != load[c] ? load[a] > load[c] : a < c; });
        for (i64 b : srt) {
            if (done[b]) continue;
            for (i64 q : reads[b])
                if (!done[q]) {
                    seqs[r].push_back(q);
                    done[q] = 1;
                }
            seqs[r].push_back(b);
            done[b] = 1;
        }
    }
    if (!l2_after_owners(seqs, after)) return py::none();
    std::vector<std::vector<i64>> own_l(static_cast<std::size_t>(n)),
        rec_l(static_cast<std::size_t>(n));
    std::vector<char> mine(static_cast<std::size_t>(S), 0);
    for (i64 b = 0; b < n; ++b) {
        auto& own = own_l[b];
        auto& rec = rec_l[b];
        for (const L2Entry& e : ent[b]) {
            const i64 k = e.unit;
            own.insert(own.end(), U.own + U.own_off[k], U.own + U.own_off[k + 1]);
            rec.insert(rec.end(), U.rec + U.rec_off[k], U.rec + U.rec_off[k + 1]);
            if (e.path) rec.insert(rec.end(), U.path + U.path_off[k], U.path + U.path_off[k + 1]);
        }
        for (i64 x : own) mine[x] = 1;
        std::sort(rec.begin(), rec.end());
        rec.erase(std::unique(rec.begin(), rec.end()), rec.end());
        rec.erase(std::remove_if(rec.begin(), rec.end(), [&](i64 x) { return mine[x] != 0; }),
                  rec.end());
        for (i64 x : own) mine[x] = 0;
        for (L2Entry& e : ent[b]) e.unit = perm[e.unit];  // the unit's index in p.units_
    }
    return py::cast(L2Packing(seqs, own_l, rec_l, load, ent, p.units_));
}

using U8In = py::array_t<std::uint8_t, py::array::c_style | py::array::forcecast>;

// megatron_harts.planner.cost_model._exception_targets_python, the same arrays: per loss-mask exception
// (t, p, v) at p >= 1, the segment of t's path holding p (t's path read once per trajectory, searched by
// start unless p lies in the segment of the exception before), the change to t's target count and, where v
// sets a target the row mask does not, the row predicting it, counted once per segment unless the row masks
// count it already (`last`: a segment's last row counted).
py::tuple l2_exception_targets(I64In parent_a, I64In start_a, I64In length_a, I64In seg_row_a, I64In leaf_a,
                               U8In row_mask_a, I64In last_a, I64In exc_traj_a, I64In exc_pos_a, U8In exc_value_a) {
    const i64 S = parent_a.shape(0), N = leaf_a.shape(0), U = row_mask_a.shape(0), E = exc_traj_a.shape(0);
    if (start_a.shape(0) != S || length_a.shape(0) != S || seg_row_a.shape(0) != S || last_a.shape(0) != S)
        throw py::value_error("segment arrays must have one entry per segment");
    if (exc_pos_a.shape(0) != E || exc_value_a.shape(0) != E)
        throw py::value_error("exception arrays must have one entry per exception");
    py::array_t<i64> added_a(S), delta_a(N);
    l2_exception_core(S, N, U, E, parent_a.data(), start_a.data(), length_a.data(),
                      seg_row_a.data(), leaf_a.data(), row_mask_a.data(), last_a.data(),
                      exc_traj_a.data(), exc_pos_a.data(), exc_value_a.data(),
                      added_a.mutable_data(), delta_a.mutable_data());
    return py::make_tuple(added_a, delta_a);
}

}  // namespace

void register_packing(py::module_& m) {
    register_forest_index(m);  // the forest index (csrc/forest_index.cpp)
    m.def("l2_rebalance_packing", &l2_rebalance_packing, py::arg("packing"), py::arg("length"),
          py::arg("ints"), py::arg("flts"), py::arg("own_off"), py::arg("own"), py::arg("rec_off"),
          py::arg("rec"), py::arg("path_off"), py::arg("path"), py::arg("dp"), py::arg("M"),
          py::arg("overhead"), py::arg("moves"), py::arg("n_slots"), py::arg("weight"),
          py::arg("swap_bins"), py::arg("wide"), py::arg("spend"), py::arg("ordered"), py::arg("split") = false,
          "megatron_harts.planner.l2_balance.rebalance of a compiled packer's packing (the arrays: "
          "unit_arrays "
          "of its units): the refined packing (an L2Packing) or None.");
    register_l1(m);  // L1's core (csrc/l1_plan.cpp): register_l2 (assemble_core.cpp) reaches it through here
    m.def("l2_exception_targets", &l2_exception_targets, py::arg("parent"), py::arg("start"), py::arg("length"),
          py::arg("seg_row"), py::arg("traj_leaf"), py::arg("row_loss_mask"), py::arg("last"), py::arg("exc_traj"),
          py::arg("exc_pos"), py::arg("exc_value"),
          "(per segment its rows predicting targets only loss-mask exceptions set, per trajectory the change to "
          "its target count): megatron_harts.planner.cost_model._exception_targets_python.");
    py::class_<L2Packing>(
        m, "L2Packing",
        "A packing of L2's compiled packers: the sequence (groups, placement, loads, entries) "
        "the Python packers return as a tuple, each part built on its first read.")
        .def("__len__", [](const L2Packing&) { return 4; })
        .def("__getitem__", &L2Packing::part, py::arg("i"))
        .def(
            "__getitem__", [](L2Packing& p, const py::slice& sl) { return py::tuple(p.all()[sl]); },
            py::arg("s"))
        .def("__iter__", [](L2Packing& p) { return py::iter(p.all()); })
        .def("estimate_step", &L2Packing::estimate_step, py::arg("overhead"),
             "megatron_harts.planner.l2_packing.estimate_step of this packing (the same floats).")
        .def("plan_order", &L2Packing::plan_order,
             "megatron_harts.planner.microbatch.plan_order of this packing's groups and placement "
             "(the same "
             "tuple), without building them.")
        .def("rows", &L2Packing::rows, py::arg("length"),
             "megatron_harts.planner.l2_packing.packed_rows of this packing (length: the segment "
             "lengths).");
}
