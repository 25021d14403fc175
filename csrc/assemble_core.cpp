// assemble_plan's per-microbatch work: the C++ core of megatron_harts.planner.microbatch.assemble_plan
// (the Python reference beside it: _assemble_core_python; tests/test_microbatch_planner.py holds
// the two equal, floats included).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "planner_l2.h"

namespace py = pybind11;

namespace {

using i64 = std::int64_t;
using I64Array = py::array_t<i64, py::array::c_style | py::array::forcecast>;

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
    const i64* gp = checked_vector(parent, S, "parent");
    const i64* gs = checked_vector(start, S, "start");
    const i64* gl = checked_vector(length, S, "length");
    const i64* gpairs = checked_vector(pairs, S, "pairs");
    const i64* glog = checked_vector(logits, S, "logits");
    const i64 k = own_off.shape(0) - 1;
    if (k < 0 || rec_off.shape(0) != k + 1) throw py::value_error("own_off and rec_off must be offsets of one size");
    const i64* oo = checked_vector(own_off, k + 1, "own_off");
    const i64* ro = checked_vector(rec_off, k + 1, "rec_off");
    const i64* os = checked_vector(own, own.shape(0), "own");
    const i64* rs = checked_vector(rec, rec.shape(0), "rec");
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
    return py::make_tuple(int64_array(own_off2), int64_array(own2), int64_array(rec_off2), int64_array(rec2), feats,
                          int64_array(rec_rows), int64_array(ext_off), int64_array(ext_prod), int64_array(ext_seg_off),
                          int64_array(ext_seg), int64_array(ext_rows));
}

}  // namespace

void register_l2(pybind11::module_& m) {
    m.def("assemble_core", &assemble_core, py::arg("parent"), py::arg("start"), py::arg("length"),
          py::arg("pairs"), py::arg("logits"), py::arg("own_off"), py::arg("own"), py::arg("rec_off"),
          py::arg("rec"), py::arg("chunk_size"),
          "assemble_plan's per-microbatch work (megatron_harts.planner.microbatch._assemble_core_python): "
          "owned / recomputed ids, cost features, recomputed rows and external context as CSR arrays.");
    register_forest_index(m);
    register_l1(m);
    register_l2_search(m);
}
