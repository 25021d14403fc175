// What L2's compiled packers share (csrc/l2_windows.cpp, csrc/l2_spread.cpp): the slot order after split
// windows' path owners (megatron_harts.planner.l2_packing._after_owners) and the packing written as the
// Python packers return it.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "planner_l2.h"

namespace py = pybind11;
using i64 = std::int64_t;

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

py::tuple l2_packing_object(const std::vector<std::vector<i64>>& seqs, const std::vector<std::vector<i64>>& own_l,
                            const std::vector<std::vector<i64>>& rec_l, const std::vector<double>& load,
                            const std::vector<std::vector<L2Entry>>& ent, const py::list& units) {
    py::list groups, placement, loads, entries;
    const py::tuple no_path;
    std::vector<py::object> paths(units.size());  // each unit's path, read once
    for (std::size_t r = 0; r < seqs.size(); ++r) {
        py::list lr;
        const auto& seq = seqs[r];
        for (std::size_t k = 0; k < seq.size(); ++k) {
            const i64 b = seq[k];
            py::tuple own(own_l[b].size()), rec(rec_l[b].size());
            for (std::size_t i = 0; i < own_l[b].size(); ++i) own[i] = py::int_(own_l[b][i]);
            for (std::size_t i = 0; i < rec_l[b].size(); ++i) rec[i] = py::int_(rec_l[b][i]);
            groups.append(py::make_tuple(own, rec));
            placement.append(py::make_tuple(static_cast<i64>(r), static_cast<i64>(k)));
            py::list es;
            for (const L2Entry& e : ent[b]) {
                const auto ku = static_cast<std::size_t>(e.unit);
                py::object u = units[ku];
                if (e.path && !paths[ku]) paths[ku] = u.attr("path");
                es.append(py::make_tuple(u, e.path ? paths[ku] : py::object(no_path), e.cost));
            }
            entries.append(es);
            lr.append(load[b]);
        }
        loads.append(lr);
    }
    return py::make_tuple(groups, placement, loads, entries);
}
