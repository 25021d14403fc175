// Plan assembly core (csrc/assemble_core.cpp), registered into megatron_harts._C by call_planner.cpp;
// register_l2 also registers L2's balance pass (csrc/l2_rebalance.cpp), spreading packer
// (csrc/l2_spread.cpp) and window packer (csrc/l2_windows.cpp).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

void register_l2(pybind11::module_& m);
void register_rebalance(pybind11::module_& m);
void register_spread(pybind11::module_& m);
void register_windows(pybind11::module_& m);

// Cost features of one microbatch computing comp[0..m) (sorted, distinct) and owning own[0..mo):
// out = rows, attention pairs, KDA calls, replay tokens, logits rows, external rows
// (CostModel.features; defined in call_planner.cpp).
void microbatch_feature_row(const std::int64_t* parent, const std::int64_t* start, const std::int64_t* length,
                            const std::int64_t* pairs, const std::int64_t* logits, const std::int64_t* comp,
                            std::int64_t m, const std::int64_t* own, std::int64_t mo, std::int64_t chunk_size,
                            std::int64_t* out);

// One entry of a microbatch in L2's compiled packers (csrc/l2_rebalance.cpp, csrc/l2_spread.cpp,
// csrc/l2_windows.cpp): a unit (its number), whether its root path is recomputed there, its cost.
struct L2Entry {
    std::int64_t unit;
    bool path;
    double cost;
};

// The entries of bins [0, nb) as flat arrays, the packers' output format: (offsets [nb + 1], unit, path
// (0/1), cost per entry) (defined in l2_rebalance.cpp).
pybind11::tuple l2_entry_arrays(const std::vector<std::vector<L2Entry>>& ent, std::int64_t nb);
