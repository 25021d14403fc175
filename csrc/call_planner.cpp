// KDA call planner: C++ core of megatron_harts.planner.calls (the module megatron_harts._C).
//
// Same algorithm, same tie-breaking and same output as the Python reference
// (megatron_harts/planner/calls.py, docs/call_planner.md):
//   * bottom-up (decreasing segment index, children before parents): need0/need1 of every
//     segment = calls needed after the producer's call z when the segment runs in call z or z+1;
//     each child is folded into its parent's running (max, second max, ties, argmax) of need1;
//   * K = max over roots of need1;
//   * top-down (increasing index): state (d, u) = (call - z, K - 1 - z), the continued child is
//     the argmax of need1 (lowest index on ties), the others start sequences in call z' + 1;
//   * assembly: sequences sorted by (call, first segment) with a counting sort, CSR arrays.
// Everything is O(S) time and memory, iterative (no recursion), one pass per step.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

using i64 = std::int64_t;
using I64Array = py::array_t<i64, py::array::c_style | py::array::forcecast>;

// Raise ValueError with the same messages as calls.check_inputs (first offending segment of
// each check, checks in the same order).
void check_inputs(const i64* parent, const i64* start, const i64* length, i64 n) {
    for (i64 i = 0; i < n; ++i) {
        if (parent[i] < -1 || parent[i] >= i) {
            throw py::value_error("segment " + std::to_string(i) + ": parent " +
                                  std::to_string(parent[i]) +
                                  " must be -1 or a segment index < " + std::to_string(i) +
                                  " (segments in DFS preorder, parents first)");
        }
    }
    for (i64 i = 0; i < n; ++i) {
        if (length[i] < 1) {
            throw py::value_error("segment " + std::to_string(i) + ": length must be >= 1, got " +
                                  std::to_string(length[i]));
        }
    }
    for (i64 i = 0; i < n; ++i) {
        const i64 p = parent[i];
        if (p < 0) {
            if (start[i] != 0) {
                throw py::value_error("segment " + std::to_string(i) +
                                      ": start must be 0 for a root, got " +
                                      std::to_string(start[i]));
            }
        } else if (start[i] != start[p] + length[p]) {
            throw py::value_error("segment " + std::to_string(i) + ": start " +
                                  std::to_string(start[i]) +
                                  " must equal start[parent] + length[parent] = " +
                                  std::to_string(start[p] + length[p]) + " (parent " +
                                  std::to_string(p) + ")");
        }
    }
}

// Floor division for non-negative positions.
inline i64 align_down(i64 x, i64 b) { return (x / b) * b; }

struct Plan {
    i64 num_calls = 0;
    i64 replay_tokens = 0;
    std::vector<i64> call_offsets, seq_call, seq_start, seq_semantic_start, seq_end,
        seq_first_segment, seq_segments_offsets, seq_segments, seq_exports_offsets,
        seq_export_positions, seq_export_segment, seq_source, segment_sequence;
};

// The planner proper.  Inputs are validated.  Invariant of the bottom-up loop: when segment i
// is reached, all its children (larger indices) have been folded into m1/m2/ties/arg[i].
Plan plan(const i64* parent, const i64* start, const i64* length, i64 n, i64 B, bool replay) {
    Plan out;
    // roles: exits[i] = the boundary state of i's children is produced by i itself
    std::vector<std::uint8_t> exits(n);
    for (i64 i = 0; i < n; ++i) {
        const i64 e = start[i] + length[i];
        exits[i] = replay ? static_cast<std::uint8_t>(align_down(e, B) > start[i]) : 1;
    }

    // bottom-up needs
    std::vector<std::int32_t> need0(n), need1(n), m1(n, -1), m2(n, -1), ties(n, 0);
    std::vector<i64> arg(n, -1);
    std::int32_t K = 0;
    for (i64 i = n - 1; i >= 0; --i) {
        const i64 a = arg[i];
        std::int32_t g;
        if (a < 0) {
            g = 0;
        } else if (ties[i] >= 2) {
            g = m1[i];
        } else {
            g = std::max(need0[a], m2[i]);
        }
        need0[i] = g;
        if (exits[i]) {
            need1[i] = g + 1;
        } else {
            need1[i] = std::max<std::int32_t>(1, m1[i]);
        }
        const i64 p = parent[i];
        if (p < 0) {
            K = std::max(K, need1[i]);
            continue;
        }
        const std::int32_t x = need1[i];
        if (x > m1[p]) {
            m2[p] = m1[p];
            m1[p] = x;
            ties[p] = 1;
            arg[p] = i;
        } else if (x == m1[p]) {
            ++ties[p];
            m2[p] = x;
            arg[p] = i;  // lower index wins ties (we walk indices downwards)
        } else if (x > m2[p]) {
            m2[p] = x;
        }
    }
    std::vector<std::int32_t>().swap(m1);
    std::vector<std::int32_t>().swap(m2);
    std::vector<std::int32_t>().swap(ties);
    const std::vector<i64>& cont = arg;  // continued child of every segment, -1 for leaves

    // top-down states and calls
    std::vector<std::int32_t> su(n), call(n);
    std::vector<std::uint8_t> sd(n);
    for (i64 i = 0; i < n; ++i) {
        const i64 p = parent[i];
        std::int32_t u;
        std::uint8_t d;
        if (p < 0) {
            u = K;
            d = 1;
        } else if (exits[p]) {
            u = su[p] - sd[p];
            d = (cont[p] == i) ? 0 : 1;
        } else {
            u = su[p];
            d = (cont[p] == i) ? sd[p] : 1;
        }
        const std::int32_t need = d ? need1[i] : need0[i];
        if (need > u) {
            throw std::logic_error("call planner reached an infeasible state at segment " +
                                   std::to_string(i));
        }
        su[i] = u;
        sd[i] = d;
        call[i] = K - 1 - u + d;
    }

    // sequences: heads sorted by (call, index) with a counting sort
    out.num_calls = K;
    out.call_offsets.assign(static_cast<size_t>(K) + 1, 0);
    std::vector<std::uint8_t> head(n);
    for (i64 i = 0; i < n; ++i) {
        const i64 p = parent[i];
        head[i] = (p < 0 || cont[p] != i) ? 1 : 0;
        if (head[i]) ++out.call_offsets[call[i] + 1];
    }
    for (i64 c = 0; c < K; ++c) out.call_offsets[c + 1] += out.call_offsets[c];
    const i64 nq = out.call_offsets[K];
    std::vector<i64> cursor(out.call_offsets.begin(), out.call_offsets.end() - 1);
    out.segment_sequence.resize(n);
    out.seq_call.resize(nq);
    out.seq_first_segment.resize(nq);
    out.seq_semantic_start.resize(nq);
    out.seq_start.resize(nq);
    out.seq_end.resize(nq);
    out.seq_source.resize(nq);
    out.seq_segments_offsets.assign(nq + 1, 0);
    out.seq_exports_offsets.assign(nq + 1, 0);
    std::vector<i64> producer(n, -1);
    std::vector<std::uint8_t> exports(n, 0);
    for (i64 i = 0; i < n; ++i) {
        const i64 p = parent[i];
        if (p >= 0) producer[i] = exits[p] ? p : producer[p];
        i64 q;
        if (head[i]) {
            q = cursor[call[i]]++;
            out.seq_call[q] = call[i];
            out.seq_first_segment[q] = i;
            const i64 pos = start[i];
            const i64 s = replay ? align_down(pos, B) : pos;
            out.seq_semantic_start[q] = pos;
            out.seq_start[q] = s;
            out.replay_tokens += pos - s;
            if (s > 0) {
                // the producer precedes i, so its sequence is already known
                out.seq_source[q] = out.segment_sequence[producer[i]];
                exports[producer[i]] = 1;
            } else {
                out.seq_source[q] = -1;
            }
        } else {
            q = out.segment_sequence[p];
        }
        out.segment_sequence[i] = q;
        out.seq_end[q] = start[i] + length[i];  // the deepest segment of a chain comes last
        ++out.seq_segments_offsets[q + 1];
    }
    for (i64 q = 0; q < nq; ++q) out.seq_segments_offsets[q + 1] += out.seq_segments_offsets[q];
    for (i64 i = 0; i < n; ++i) {
        if (exports[i]) ++out.seq_exports_offsets[out.segment_sequence[i] + 1];
    }
    for (i64 q = 0; q < nq; ++q) out.seq_exports_offsets[q + 1] += out.seq_exports_offsets[q];
    out.seq_segments.resize(n);
    const i64 n_exports = out.seq_exports_offsets[nq];
    out.seq_export_positions.resize(n_exports);
    out.seq_export_segment.resize(n_exports);
    // segments of a chain have increasing indices, so index order is path order
    std::vector<i64> seg_cursor(out.seq_segments_offsets.begin(), out.seq_segments_offsets.end() - 1);
    std::vector<i64> ex_cursor(out.seq_exports_offsets.begin(), out.seq_exports_offsets.end() - 1);
    for (i64 i = 0; i < n; ++i) {
        const i64 q = out.segment_sequence[i];
        out.seq_segments[seg_cursor[q]++] = i;
        if (exports[i]) {
            const i64 e = start[i] + length[i];
            const i64 k = ex_cursor[q]++;
            out.seq_export_positions[k] = replay ? align_down(e, B) : e;
            out.seq_export_segment[k] = i;
        }
    }
    return out;
}

py::array_t<i64> to_numpy(const std::vector<i64>& v) {
    py::array_t<i64> a(static_cast<py::ssize_t>(v.size()));
    if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(i64));
    return a;
}

py::dict plan_calls(I64Array parent, I64Array start, I64Array length, i64 chunk_size,
                    bool replay) {
    if (chunk_size < 1) {
        throw py::value_error("chunk_size must be >= 1, got " + std::to_string(chunk_size));
    }
    for (const auto* arr : {&parent, &start, &length}) {
        if (arr->ndim() != 1) throw py::value_error("parent, start and length must be 1-D arrays");
    }
    const i64 n = parent.shape(0);
    if (start.shape(0) != n || length.shape(0) != n) {
        throw py::value_error("parent, start and length must have the same size, got " +
                              std::to_string(n) + ", " + std::to_string(start.shape(0)) + ", " +
                              std::to_string(length.shape(0)));
    }
    Plan out;
    {
        const i64* pp = parent.data();
        const i64* sp = start.data();
        const i64* lp = length.data();
        py::gil_scoped_release release;
        check_inputs(pp, sp, lp, n);
        out = plan(pp, sp, lp, n, chunk_size, replay);
    }
    py::dict d;
    d["num_calls"] = out.num_calls;
    d["replay_tokens"] = out.replay_tokens;
    d["call_offsets"] = to_numpy(out.call_offsets);
    d["seq_call"] = to_numpy(out.seq_call);
    d["seq_start"] = to_numpy(out.seq_start);
    d["seq_semantic_start"] = to_numpy(out.seq_semantic_start);
    d["seq_end"] = to_numpy(out.seq_end);
    d["seq_first_segment"] = to_numpy(out.seq_first_segment);
    d["seq_segments_offsets"] = to_numpy(out.seq_segments_offsets);
    d["seq_segments"] = to_numpy(out.seq_segments);
    d["seq_exports_offsets"] = to_numpy(out.seq_exports_offsets);
    d["seq_export_positions"] = to_numpy(out.seq_export_positions);
    d["seq_export_segment"] = to_numpy(out.seq_export_segment);
    d["seq_source"] = to_numpy(out.seq_source);
    d["segment_sequence"] = to_numpy(out.segment_sequence);
    return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
    m.doc() = "megatron_harts C++ core: the KDA call planner";
    m.def("plan_calls", &plan_calls, py::arg("parent"), py::arg("start"), py::arg("length"),
          py::arg("chunk_size"), py::arg("replay") = true,
          "Optimal KDA call plan of a forest (see megatron_harts.planner.calls.plan_calls). "
          "Returns a dict of int64 CSR arrays plus num_calls and replay_tokens; raises "
          "ValueError naming the segment and field on bad input.");
}
