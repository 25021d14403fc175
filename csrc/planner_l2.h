// What the planner's compiled parts share: array checks and conversions, and the registration of plan
// assembly (csrc/assemble_core.cpp), the forest index (csrc/forest_index.cpp), L1 (csrc/l1_plan.cpp) and L2's
// local search (csrc/l2_search.cpp) into megatron_harts._C, which call_planner.cpp defines.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

// The data of a 1-D array argument of ``size`` entries (size < 0: any length); a ValueError naming
// the argument otherwise.
template <typename A>
inline const typename A::value_type* checked_vector(const A& a, std::int64_t size, const char* name) {
    if (a.ndim() != 1 || (size >= 0 && a.shape(0) != size)) {
        throw pybind11::value_error(std::string(name) + " must be a 1-D array" +
                                    (size >= 0 ? " of " + std::to_string(size) + " entries" : std::string()));
    }
    return a.data();
}

// A new int64 numpy array holding v.
inline pybind11::array_t<std::int64_t> int64_array(const std::vector<std::int64_t>& v) {
    pybind11::array_t<std::int64_t> a(static_cast<pybind11::ssize_t>(v.size()));
    std::copy(v.begin(), v.end(), a.mutable_data());
    return a;
}

void register_l2(pybind11::module_& m);
// L2's local search (csrc/l2_search.cpp), registered by register_l2.
void register_l2_search(pybind11::module_& m);
// L1's planning core (csrc/l1_plan.cpp), registered by register_l2.
void register_l1(pybind11::module_& m);
// The forest index and the loss-mask exceptions' targets (csrc/forest_index.cpp), registered by register_l2.
void register_forest_index(pybind11::module_& m);

// Cost features of one microbatch computing comp[0..m) (sorted, distinct) and owning own[0..mo):
// out = rows, attention pairs, KDA calls, replay tokens, logits rows, external rows
// (CostModel.features; defined in call_planner.cpp).
void microbatch_feature_row(const std::int64_t* parent, const std::int64_t* start, const std::int64_t* length,
                            const std::int64_t* pairs, const std::int64_t* logits, const std::int64_t* comp,
                            std::int64_t m, const std::int64_t* own, std::int64_t mo, std::int64_t chunk_size,
                            std::int64_t* out);
