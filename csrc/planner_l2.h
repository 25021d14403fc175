// Plan assembly core (csrc/assemble_core.cpp), registered into megatron_harts._C by call_planner.cpp;
// register_l2 also registers L2's balance pass (csrc/l2_rebalance.cpp), spreading packer
// (csrc/l2_spread.cpp), window packer (csrc/l2_windows.cpp), last pass (csrc/l2_even.cpp) and one-slot
// packer (csrc/l2_oneslot.cpp).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
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
void register_rebalance(pybind11::module_& m);
void register_spread(pybind11::module_& m);
void register_windows(pybind11::module_& m);
void register_even(pybind11::module_& m);
// L2's one-slot packer search (csrc/l2_oneslot.cpp), registered by register_l2.
void register_one_slot(pybind11::module_& m);
// L2's local search (csrc/l2_search.cpp), registered by register_l2.
void register_l2_search(pybind11::module_& m);
// L1's planning core (csrc/l1_plan.cpp), registered by register_packing (csrc/l2_packing.cpp).
void register_l1(pybind11::module_& m);
// The forest index (csrc/forest_index.cpp), registered by register_packing.
// Nonzero bytes of m[0..n) (defined in forest_index.cpp).
std::int64_t l2_count_nonzero(const std::uint8_t* m, std::int64_t n);
void register_forest_index(pybind11::module_& m);
// The loss-mask exceptions' targets (megatron_harts.planner.cost_model._exception_targets_python)
// of a forest of S segments, N trajectories, U rows and E exceptions (et, ep, ev): added[S] and
// delta[N] written; raises ValueError on an exception out of range (defined in forest_index.cpp).
void l2_exception_core(std::int64_t S, std::int64_t N, std::int64_t U, std::int64_t E,
                       const std::int64_t* parent, const std::int64_t* start,
                       const std::int64_t* length, const std::int64_t* seg_row,
                       const std::int64_t* leaf, const std::uint8_t* mask, const std::int64_t* last,
                       const std::int64_t* et, const std::int64_t* ep, const std::uint8_t* ev,
                       std::int64_t* added, std::int64_t* delta);

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

// Units as L2's balance pass reads them (numbered 0..): per unit its kind (0 core, 1 item, 2 free),
// tree, window, upper window, owned rows, replay tokens, path rows, cost, replay cost, path cost,
// and its owned / recomputed / path segments as CSR (offsets per unit into the id arrays).
struct L2Units {
    std::vector<std::int64_t> kind, tree, win, upper, own_rows, replay, path_rows;
    std::vector<double> cost, replay_cost, path_cost;
    const std::int64_t *own_off, *own, *rec_off, *rec, *path_off, *path;
};

// The balance pass's search (megatron_harts.planner.l2_balance._rebalance_python, step for step) on
// bins (replica rep0[b], entries ent0[b]) of units U: returns whether it moved anything, and the
// bins after it in rep_out / ent_out (bins it opened included; defined in l2_rebalance.cpp).
bool l2_rebalance_search(const L2Units& U, const std::int64_t* length, std::int64_t num_segments,
                         const std::vector<std::int64_t>& rep0,
                         const std::vector<std::vector<L2Entry>>& ent0, std::int64_t dp,
                         std::int64_t M, double overhead, std::int64_t moves, std::int64_t n_slots,
                         double weight, std::int64_t swap_bins, std::int64_t wide,
                         std::int64_t spend, bool ordered, bool split, std::vector<std::int64_t>& rep_out,
                         std::vector<std::vector<L2Entry>>& ent_out);

// The entries of bins [0, nb) as flat arrays, the balance pass's output format: (offsets [nb + 1], unit, path
// (0/1), cost per entry) (defined in l2_rebalance.cpp).
pybind11::tuple l2_entry_arrays(const std::vector<std::vector<L2Entry>>& ent, std::int64_t nb);

// Per replica its bins in slot order, with every bin of `after` in a later slot than the producers it
// names (owners of a split window's path, on other replicas): those lead their replicas, then each slot
// takes the first bin in order that may run there (megatron_harts.planner.l2_packing._after_owners).
// False when a replica is left with bins none of which may run in its next slot (defined in
// l2_packing.cpp).
bool l2_after_owners(std::vector<std::vector<std::int64_t>>& seqs,
                     const std::unordered_map<std::int64_t, std::vector<std::int64_t>>& after);

// One CSR of unit_arrays (own, rec or path segments of nu units): raises ValueError "<name>: offsets do not
// match" unless off[0] == 0 and off[nu] == size, "<name>: segment out of range" unless every ids[i] lies in
// [0, num_segments) (defined in l2_packing.cpp; the compiled balance pass and both packers check with it).
void l2_check_unit_csr(const std::int64_t* off, const std::int64_t* ids, std::int64_t size, std::int64_t nu,
                       std::int64_t num_segments, const char* name);

// The shape checks of unit_arrays as the compiled balance pass and both packers read them (int64 / float64
// arrays, already converted): ints [units, int_cols], flts [units, 3], the three CSRs (l2_check_unit_csr;
// segments in [0, num_segments)), and `objects` unit objects per row unless it is negative.  Raises
// ValueError naming what is wrong; returns the unit count (defined in l2_packing.cpp).
std::int64_t l2_check_unit_arrays(const pybind11::array& ints, std::int64_t int_cols, const pybind11::array& flts,
                                  const pybind11::array& own_off, const pybind11::array& own,
                                  const pybind11::array& rec_off, const pybind11::array& rec,
                                  const pybind11::array& path_off, const pybind11::array& path,
                                  std::int64_t num_segments, std::int64_t objects);

// The bins seqs[r][k] (replica r, slot k) as the Python packers return a packing: a sequence (groups:
// (owned, recomputed) tuples, placement: (replica, slot), loads: per replica its bins' loads in slot
// order, entries: per bin (unit object, its path or (), cost)), units[k] the unit numbered k; each part
// built on its first read (an L2Packing; defined in l2_packing.cpp, registered by register_packing).
pybind11::object l2_packing_object(const std::vector<std::vector<std::int64_t>>& seqs,
                                   const std::vector<std::vector<std::int64_t>>& own_l,
                                   const std::vector<std::vector<std::int64_t>>& rec_l,
                                   const std::vector<double>& load, const std::vector<std::vector<L2Entry>>& ent,
                                   const pybind11::list& units);
void register_packing(pybind11::module_& m);

// A packer's packings over slot counts `slots` and tolerances `epss` as plan_l2 asks for them
// (megatron_harts.planner.l2_packing.CompiledPacker.many): per slot count the tolerances in order,
// the next one only while the packer's bound flag says a placement was turned away; the packings
// that are not None, in that order (defined in l2_packing.cpp).
pybind11::list l2_pack_many(const std::function<pybind11::tuple(std::int64_t, double)>& pack,
                            const std::vector<std::int64_t>& slots,
                            const std::vector<double>& epss);
