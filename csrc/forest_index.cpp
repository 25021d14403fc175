// The forest index: the C++ core of megatron_harts.planner.cost_model.ForestIndex (the Python
// reference beside it: ForestIndex._build_python; tests/test_forest_index.py holds the two equal
// on every array).  Also the loss-mask exceptions' targets (_exception_targets_python), shared
// with _C.exception_targets.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "planner_l2.h"

namespace py = pybind11;
using i64 = std::int64_t;

namespace {

i64 count_nonzero(const std::uint8_t* m, i64 n);

// The loss-mask exceptions' targets (megatron_harts.planner.cost_model._exception_targets_python)
// of a forest of S segments, N trajectories, U rows and E exceptions (et, ep, ev): added[S] and
// delta[N] written; raises ValueError on an exception out of range.
void exception_targets_core(i64 S, i64 N, i64 U, i64 E, const i64* parent, const i64* start,
                       const i64* length, const i64* seg_row, const i64* leaf,
                       const std::uint8_t* mask, const i64* last, const i64* et, const i64* ep,
                       const std::uint8_t* ev, i64* added, i64* delta) {
    std::fill(added, added + S, 0);
    std::fill(delta, delta + N, 0);
    std::vector<std::uint8_t> flag(static_cast<std::size_t>(U), 0);  // rows counted in added
    std::vector<i64> path;
    i64 cur = -1, seg = -1, lo = 0, hi = 0,
        base = 0;  // seg's positions [lo, hi), its row of position 0: base
    i64 dt = 0;    // cur's delta, written back when the trajectory changes
    for (i64 i = 0; i < E; ++i) {
        const i64 t = et[i], p = ep[i];
        if (p < 1) continue;
        if (t != cur) {  // t's path segments, root first (starts increasing)
            if (t < 0 || t >= N) throw py::value_error("exception trajectory out of range");
            if (cur >= 0) delta[cur] += dt;
            dt = 0;
            path.clear();
            for (i64 x = leaf[t]; x >= 0; x = parent[x]) {
                if (x >= S || static_cast<i64>(path.size()) > S)
                    throw py::value_error("segment out of range");
                path.push_back(x);
            }
            std::reverse(path.begin(), path.end());
            cur = t;
            seg = -1;
        }
        if (seg < 0 || p < lo || p >= hi) {
            auto it = std::upper_bound(path.begin(), path.end(), p,
                                       [&](i64 v, i64 s) { return v < start[s]; });
            if (it == path.begin()) throw py::value_error("exception position out of range");
            seg = *(it - 1);
            lo = start[seg];
            hi = lo + length[seg];
            base = seg_row[seg] - lo;
            if (p >= hi || seg_row[seg] + length[seg] > U)
                throw py::value_error("exception position out of range");
        }
        // this exception and the next ones of t inside seg (at positions >= 1), without the checks
        // above; a row predicting a target only exceptions set is flagged (it lies in the segment
        // it counts for)
        const i64 first = std::max<i64>(lo, 1);
        const i64 top_parent = lo > 0 ? parent[seg] : -1;
        const bool top_counted =
            top_parent >= 0 && last[top_parent] != 0;  // by the row masks already
        const i64 top_row = top_parent >= 0 ? seg_row[top_parent] + length[top_parent] - 1 : -1;
        for (i64 q = p;;) {
            const i64 row = base + q;
            const std::uint8_t v = ev[i] != 0, m = mask[row] != 0;
            dt += static_cast<i64>(v) - static_cast<i64>(m);
            if (v > m) {
                if (q != lo)
                    flag[row - 1] = 1;
                else if (!top_counted)
                    flag[top_row] = 1;
            }
            if (i + 1 >= E || et[i + 1] != t || ep[i + 1] < first || ep[i + 1] >= hi) break;
            q = ep[++i];
        }
    }
    if (cur >= 0) delta[cur] += dt;
    for (i64 s = 0; s < S; ++s) added[s] = count_nonzero(flag.data() + seg_row[s], length[s]);
}

i64 count_nonzero(const std::uint8_t* m, i64 n) {
    i64 total = 0;
    while (n > 0) {  // blocks of at most 255 bytes summed in 8-bit lanes the compiler vectorizes
        const i64 k = std::min<i64>(n, 255);
        std::uint8_t c = 0;
        for (i64 j = 0; j < k; ++j) c += m[j] != 0;
        total += c;
        m += k;
        n -= k;
    }
    return total;
}

using I64In = py::array_t<i64, py::array::c_style | py::array::forcecast>;
using U8In = py::array_t<std::uint8_t, py::array::c_style | py::array::forcecast>;

py::array_t<i64> zeros(i64 n) {
    py::array_t<i64> a(n);
    std::fill(a.mutable_data(), a.mutable_data() + n, 0);
    return a;
}

// ForestIndex._build_python's arrays of one forest, the same values: (seg_pairs, seg_logits,
// sub_rows, sub_size, traj_targets, tree_max_path, tree_longest_traj, tree_rows, seg_tree,
// children).  Segment rows are the contiguous ranges seg_row[s] .. seg_row[s] + length[s] (in
// segment order, covering the row mask), every parent precedes its children, trees are the segment
// ranges of tree_offsets, a tree's trajectories the range seg_traj_lo/hi of its root (non-empty);
// anything else raises ValueError.
py::tuple forest_index(I64In parent_a, I64In start_a, I64In length_a, I64In row_a, I64In offsets_a,
                       U8In mask_a, I64In leaf_a, I64In traj_len_a, I64In traj_lo_a,
                       I64In traj_hi_a, I64In exc_traj_a, I64In exc_pos_a, U8In exc_value_a) {
    const i64 S = parent_a.shape(0), U = mask_a.shape(0), N = leaf_a.shape(0),
              E = exc_traj_a.shape(0);
    const i64 T = offsets_a.shape(0) - 1;
    if (start_a.shape(0) != S || length_a.shape(0) != S || row_a.shape(0) != S ||
        traj_lo_a.shape(0) != S || traj_hi_a.shape(0) != S)
        throw py::value_error("segment arrays must have one entry per segment");
    if (traj_len_a.shape(0) != N)
        throw py::value_error("trajectory arrays must have one entry per trajectory");
    if (exc_pos_a.shape(0) != E || exc_value_a.shape(0) != E)
        throw py::value_error("exception arrays must have one entry per exception");
    if (T < 0) throw py::value_error("tree_offsets must have one entry per tree plus one");
    const i64 *parent = parent_a.data(), *start = start_a.data(), *length = length_a.data(),
              *row = row_a.data();
    const i64 *off = offsets_a.data(), *leaf = leaf_a.data(), *tlen = traj_len_a.data();
    const i64 *tlo = traj_lo_a.data(), *thi = traj_hi_a.data();
    const std::uint8_t* mask = mask_a.data();
    i64 r = 0;
    for (i64 s = 0; s < S; ++s) {
        if (parent[s] >= s || parent[s] < -1)
            throw py::value_error("every parent must precede its children");
        if (row[s] != r || length[s] < 1)
            throw py::value_error("segment rows must be contiguous, in segment order");
        r += length[s];
    }
    if (r != U) throw py::value_error("the row mask must have one entry per segment row");
    if (off[0] != 0 || off[T] != S)
        throw py::value_error("tree_offsets must run from 0 to the segment count");
    for (i64 t = 0; t < T; ++t)
        if (off[t + 1] <= off[t]) throw py::value_error("every tree must hold a segment");
    for (i64 t = 0; t < N; ++t)
        if (leaf[t] < 0 || leaf[t] >= S) throw py::value_error("traj_leaf out of range");
    auto pairs_a = zeros(S), logits_a = zeros(S), sub_rows_a = zeros(S), sub_size_a = zeros(S);
    auto targets_a = zeros(N), max_path_a = zeros(T), longest_a = zeros(T), tree_rows_a = zeros(T),
         tree_a = zeros(S);
    i64 *pairs = pairs_a.mutable_data(), *logits = logits_a.mutable_data(),
        *sub_rows = sub_rows_a.mutable_data();
    i64 *sub_size = sub_size_a.mutable_data(), *targets = targets_a.mutable_data();
    i64 *max_path = max_path_a.mutable_data(), *longest = longest_a.mutable_data();
    i64 *tree_rows = tree_rows_a.mutable_data(), *seg_tree = tree_a.mutable_data();
    std::vector<i64> seg_mask(S), first(S), last(S, 0), path_mask(S), root_first(S, 0), kids(S, 0);
    for (i64 s = 0; s < S; ++s) {
        const i64 st = start[s], ln = length[s];
        pairs[s] = ln * st + ln * (ln + 1) / 2;
        seg_mask[s] = count_nonzero(mask + row[s], ln);
        first[s] = mask[row[s]];
    }
    for (i64 s = 0; s < S; ++s)
        if (parent[s] >= 0) {
            last[parent[s]] = std::max(last[parent[s]], first[s]);
            ++kids[parent[s]];
        }
    for (i64 s = 0; s < S; ++s) logits[s] = seg_mask[s] - first[s] + last[s];
    std::vector<i64> added(S), delta(N);
    if (E) {
        exception_targets_core(S, N, U, E, parent, start, length, row, leaf, mask, last.data(),
                          exc_traj_a.data(), exc_pos_a.data(), exc_value_a.data(), added.data(),
                          delta.data());
        for (i64 s = 0; s < S; ++s) logits[s] += added[s];
    }
    for (i64 s = 0; s < S; ++s) {
        sub_rows[s] = length[s];
        sub_size[s] = 1;
    }
    for (i64 s = S - 1; s >= 0; --s)
        if (parent[s] >= 0) {
            sub_rows[parent[s]] += sub_rows[s];
            sub_size[parent[s]] += sub_size[s];
        }
    for (i64 s = 0; s < S; ++s)
        path_mask[s] = seg_mask[s] + (parent[s] >= 0 ? path_mask[parent[s]] : 0);
    for (i64 t = 0; t < T; ++t) {
        const i64 root = off[t];
        root_first[root] = first[root];
        i64 rows = 0;
        for (i64 s = off[t]; s < off[t + 1]; ++s) {
            seg_tree[s] = t;
            rows += length[s];
        }
        tree_rows[t] = rows;
        const i64 lo = tlo[root], hi = thi[root];
        if (lo < 0 || hi > N || lo >= hi)
            throw py::value_error("a tree's trajectory range must be non-empty");
        i64 best = lo;
        for (i64 j = lo + 1; j < hi; ++j)
            if (tlen[j] > tlen[best]) best = j;
        max_path[t] = tlen[best];
        longest[t] = best;
    }
    for (i64 t = 0; t < N; ++t)
        targets[t] = path_mask[leaf[t]] - root_first[off[seg_tree[leaf[t]]]] + (E ? delta[t] : 0);
    py::list children(S);
    for (i64 s = 0; s < S; ++s) children[s] = py::list(kids[s]);
    std::fill(kids.begin(), kids.end(), 0);
    for (i64 s = 0; s < S; ++s)
        if (parent[s] >= 0) {
            const i64 p = parent[s];
            PyList_SET_ITEM(PyList_GET_ITEM(children.ptr(), p), kids[p]++,
                            py::int_(s).release().ptr());
        }
    return py::make_tuple(pairs_a, logits_a, sub_rows_a, sub_size_a, targets_a, max_path_a,
                          longest_a, tree_rows_a, tree_a, children);
}

// megatron_harts.planner.cost_model._exception_targets_python, the same arrays: per loss-mask exception
// (t, p, v) at p >= 1, the segment of t's path holding p (t's path read once per trajectory, searched by
// start unless p lies in the segment of the exception before), the change to t's target count and, where v
// sets a target the row mask does not, the row predicting it, counted once per segment unless the row masks
// count it already (`last`: a segment's last row counted).
py::tuple exception_targets(I64In parent_a, I64In start_a, I64In length_a, I64In seg_row_a, I64In leaf_a,
                               U8In row_mask_a, I64In last_a, I64In exc_traj_a, I64In exc_pos_a, U8In exc_value_a) {
    const i64 S = parent_a.shape(0), N = leaf_a.shape(0), U = row_mask_a.shape(0), E = exc_traj_a.shape(0);
    if (start_a.shape(0) != S || length_a.shape(0) != S || seg_row_a.shape(0) != S || last_a.shape(0) != S)
        throw py::value_error("segment arrays must have one entry per segment");
    if (exc_pos_a.shape(0) != E || exc_value_a.shape(0) != E)
        throw py::value_error("exception arrays must have one entry per exception");
    py::array_t<i64> added_a(S), delta_a(N);
    exception_targets_core(S, N, U, E, parent_a.data(), start_a.data(), length_a.data(),
                      seg_row_a.data(), leaf_a.data(), row_mask_a.data(), last_a.data(),
                      exc_traj_a.data(), exc_pos_a.data(), exc_value_a.data(),
                      added_a.mutable_data(), delta_a.mutable_data());
    return py::make_tuple(added_a, delta_a);
}

}  // namespace

void register_forest_index(py::module_& m) {
    m.def("forest_index", &forest_index, py::arg("parent"), py::arg("start"), py::arg("length"),
          py::arg("row"), py::arg("tree_offsets"), py::arg("row_loss_mask"), py::arg("traj_leaf"),
          py::arg("traj_length"), py::arg("seg_traj_lo"), py::arg("seg_traj_hi"),
          py::arg("exc_traj"), py::arg("exc_pos"), py::arg("exc_value"),
          "ForestIndex's arrays (megatron_harts.planner.cost_model.ForestIndex._build_python): "
          "(seg_pairs, "
          "seg_logits, sub_rows, sub_size, traj_targets, tree_max_path, tree_longest_traj, "
          "tree_rows, seg_tree, "
          "children lists).");
    m.def("exception_targets", &exception_targets, py::arg("parent"), py::arg("start"), py::arg("length"),
          py::arg("seg_row"), py::arg("traj_leaf"), py::arg("row_loss_mask"), py::arg("last"), py::arg("exc_traj"),
          py::arg("exc_pos"), py::arg("exc_value"),
          "(per segment its rows predicting targets only loss-mask exceptions set, per trajectory the change to "
          "its target count): megatron_harts.planner.cost_model._exception_targets_python.");
}
