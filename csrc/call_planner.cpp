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
//   * assembly: sequences sorted by (call, first segment) with a counting sort, CSR arrays
//     written straight into numpy-owned memory.
// Everything is O(S) time and memory, iterative (no recursion): four passes over the segments.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "planner_l2.h"

namespace py = pybind11;

namespace {

using i64 = std::int64_t;
using I64Array = py::array_t<i64, py::array::c_style | py::array::forcecast>;

// Raise ValueError with the same messages as calls.check_inputs (first offending segment of
// each check, checks in the same order).  The start check runs inside the top-down pass of
// solve(), which visits segments in increasing order after these two checks have passed.
void check_parent_and_length(const i64* parent, const i64* length, i64 n) {
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
}

[[noreturn]] void bad_start(i64 i, i64 parent, i64 got, i64 expected) {
    if (parent < 0) {
        throw py::value_error("segment " + std::to_string(i) + ": start must be 0 for a root, got " +
                              std::to_string(got));
    }
    throw py::value_error("segment " + std::to_string(i) + ": start " + std::to_string(got) +
                          " must equal start[parent] + length[parent] = " +
                          std::to_string(expected) + " (parent " + std::to_string(parent) + ")");
}

// Floor division for non-negative positions.
inline i64 align_down(i64 x, i64 b) { return (x / b) * b; }

// Running statistics of the children's need1, folded into the parent (children first).
struct Fold {
    std::int32_t m1 = -1, m2 = -1, ties = 0, arg = -1, arg_n0 = 0;
};
struct Need {
    std::int32_t n0, n1;
};
// Per-segment top-down record, packed so that a child reads its parent in one cache line.
struct Down {
    i64 end;
    std::int32_t u, call, cont, producer, seq;
    std::uint8_t d, exits, head, exports;
};

// Phase 1 (no Python objects touched): choices, calls, producers, sequence and export counts.
struct Core {
    std::int32_t K = 0;
    i64 nq = 0, n_exports = 0;
    std::vector<Down> down;
    std::vector<i64> call_offsets;  // CSR of sequences per call
};

// Invariant of the bottom-up loop: when segment i is reached, all its children (larger
// indices) have been folded into fold[i].  Invariant of the top-down loop: the record of the
// parent is final when a child is reached.
Core solve(const i64* parent, const i64* start, const i64* length, i64 n, i64 B, bool replay) {
    Core core;
    std::vector<Fold> fold(n);
    std::vector<Need> need(n);  // (need0, need1) of every segment
    std::vector<std::uint8_t> exits(n);
    std::int32_t K = 0;
    for (i64 i = n - 1; i >= 0; --i) {
        const i64 e = start[i] + length[i];
        const bool ex = replay ? align_down(e, B) > start[i] : true;
        exits[i] = ex;
        const Fold f = fold[i];
        std::int32_t g;
        if (f.arg < 0) {
            g = 0;
        } else if (f.ties >= 2) {
            g = f.m1;
        } else {
            g = std::max(f.arg_n0, f.m2);
        }
        const std::int32_t x = ex ? g + 1 : std::max<std::int32_t>(1, f.m1);
        need[i] = {g, x};
        const i64 p = parent[i];
        if (p < 0) {
            K = std::max(K, x);
            continue;
        }
        Fold& fp = fold[p];
        if (x > fp.m1) {
            fp.m2 = fp.m1;
            fp.m1 = x;
            fp.ties = 1;
            fp.arg = static_cast<std::int32_t>(i);
            fp.arg_n0 = g;
        } else if (x == fp.m1) {
            ++fp.ties;
            fp.m2 = x;
            fp.arg = static_cast<std::int32_t>(i);  // lower index wins ties (walking downwards)
            fp.arg_n0 = g;
        } else if (x > fp.m2) {
            fp.m2 = x;
        }
    }
    core.K = K;
    core.call_offsets.assign(static_cast<size_t>(K) + 1, 0);
    core.down.resize(n);
    Down* down = core.down.data();
    for (i64 i = 0; i < n; ++i) {
        Down& r = down[i];
        r.end = start[i] + length[i];
        r.cont = fold[i].arg;
        r.exits = exits[i];
        r.exports = 0;
        const i64 p = parent[i];
        std::int32_t u;
        std::uint8_t d;
        bool head;
        if (p < 0) {
            if (start[i] != 0) bad_start(i, p, start[i], 0);
            u = K;
            d = 1;
            head = true;
            r.producer = -1;
        } else {
            const Down& q = down[p];
            if (start[i] != q.end) bad_start(i, p, start[i], q.end);
            head = q.cont != i;
            if (q.exits) {
                u = q.u - q.d;
                d = head ? 1 : 0;
                r.producer = static_cast<std::int32_t>(p);
            } else {
                u = q.u;
                d = head ? 1 : q.d;
                r.producer = q.producer;
            }
        }
        if ((d ? need[i].n1 : need[i].n0) > u) {
            throw std::logic_error("call planner reached an infeasible state at segment " +
                                   std::to_string(i));
        }
        r.u = u;
        r.d = d;
        r.call = K - 1 - u + d;
        r.head = head;
        if (head) {
            ++core.call_offsets[r.call + 1];
            const i64 pos = start[i];
            if ((replay ? align_down(pos, B) : pos) > 0 && !down[r.producer].exports) {
                down[r.producer].exports = 1;
                ++core.n_exports;
            }
        }
    }
    for (std::int32_t c = 0; c < K; ++c) core.call_offsets[c + 1] += core.call_offsets[c];
    core.nq = core.call_offsets[K];
    return core;
}

// Output arrays (numpy-owned memory, filled without the GIL).
struct Out {
    i64 *seq_call, *seq_start, *seq_semantic_start, *seq_end, *seq_first_segment,
        *seq_segments_offsets, *seq_segments, *seq_exports_offsets, *seq_export_positions,
        *seq_export_segment, *seq_source, *segment_sequence;
};

// Phase 2: sequences sorted by (call, first segment) through per-call cursors; segments of a
// chain have increasing indices, so index order is path order for segments and exports.
i64 fill(Core& core, const i64* parent, const i64* start, const i64* length, i64 n, i64 B,
         bool replay, const Out& o) {
    Down* down = core.down.data();
    const i64 nq = core.nq;
    std::vector<i64> cursor(core.call_offsets.begin(), core.call_offsets.end() - 1);
    std::fill(o.seq_segments_offsets, o.seq_segments_offsets + nq + 1, 0);
    std::fill(o.seq_exports_offsets, o.seq_exports_offsets + nq + 1, 0);
    i64 replay_tokens = 0;
    for (i64 i = 0; i < n; ++i) {
        Down& r = down[i];
        i64 q;
        if (r.head) {
            q = cursor[r.call]++;
            o.seq_call[q] = r.call;
            o.seq_first_segment[q] = i;
            const i64 pos = start[i];
            const i64 s = replay ? align_down(pos, B) : pos;
            o.seq_semantic_start[q] = pos;
            o.seq_start[q] = s;
            replay_tokens += pos - s;
            o.seq_source[q] = s > 0 ? down[r.producer].seq : -1;
        } else {
            q = down[parent[i]].seq;
        }
        r.seq = static_cast<std::int32_t>(q);
        o.segment_sequence[i] = q;
        o.seq_end[q] = start[i] + length[i];  // the deepest segment of a chain comes last
        ++o.seq_segments_offsets[q + 1];
        if (r.exports) ++o.seq_exports_offsets[q + 1];
    }
    for (i64 q = 0; q < nq; ++q) {
        o.seq_segments_offsets[q + 1] += o.seq_segments_offsets[q];
        o.seq_exports_offsets[q + 1] += o.seq_exports_offsets[q];
    }
    std::vector<i64> seg_cursor(o.seq_segments_offsets, o.seq_segments_offsets + nq);
    std::vector<i64> ex_cursor(o.seq_exports_offsets, o.seq_exports_offsets + nq);
    for (i64 i = 0; i < n; ++i) {
        const Down& r = down[i];
        const i64 q = r.seq;
        o.seq_segments[seg_cursor[q]++] = i;
        if (r.exports) {
            const i64 e = start[i] + length[i];
            const i64 k = ex_cursor[q]++;
            o.seq_export_positions[k] = replay ? align_down(e, B) : e;
            o.seq_export_segment[k] = i;
        }
    }
    return replay_tokens;
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
    if (n >= (i64{1} << 31) - 1) {
        throw py::value_error("at most 2^31 - 2 segments are supported, got " + std::to_string(n));
    }
    const i64* pp = parent.data();
    const i64* sp = start.data();
    const i64* lp = length.data();
    Core core;
    {
        py::gil_scoped_release release;
        check_parent_and_length(pp, lp, n);
        core = solve(pp, sp, lp, n, chunk_size, replay);
    }
    const i64 nq = core.nq, ne = core.n_exports;
    auto arr = [](i64 size) { return py::array_t<i64>(static_cast<py::ssize_t>(size)); };
    py::dict d;
    py::array_t<i64> call_offsets = arr(core.K + 1);
    std::copy(core.call_offsets.begin(), core.call_offsets.end(), call_offsets.mutable_data());
    py::array_t<i64> a_call = arr(nq), a_start = arr(nq), a_sem = arr(nq), a_end = arr(nq),
                     a_first = arr(nq), a_segoff = arr(nq + 1), a_segs = arr(n),
                     a_exoff = arr(nq + 1), a_expos = arr(ne), a_exseg = arr(ne),
                     a_source = arr(nq), a_segseq = arr(n);
    const Out o{a_call.mutable_data(), a_start.mutable_data(), a_sem.mutable_data(),
                a_end.mutable_data(), a_first.mutable_data(), a_segoff.mutable_data(),
                a_segs.mutable_data(), a_exoff.mutable_data(), a_expos.mutable_data(),
                a_exseg.mutable_data(), a_source.mutable_data(), a_segseq.mutable_data()};
    i64 replay_tokens;
    {
        py::gil_scoped_release release;
        replay_tokens = fill(core, pp, sp, lp, n, chunk_size, replay, o);
    }
    d["num_calls"] = static_cast<i64>(core.K);
    d["replay_tokens"] = replay_tokens;
    d["call_offsets"] = call_offsets;
    d["seq_call"] = a_call;
    d["seq_start"] = a_start;
    d["seq_semantic_start"] = a_sem;
    d["seq_end"] = a_end;
    d["seq_first_segment"] = a_first;
    d["seq_segments_offsets"] = a_segoff;
    d["seq_segments"] = a_segs;
    d["seq_exports_offsets"] = a_exoff;
    d["seq_export_positions"] = a_expos;
    d["seq_export_segment"] = a_exseg;
    d["seq_source"] = a_source;
    d["segment_sequence"] = a_segseq;
    return d;
}

// Calls, replay tokens and external rows of one microbatch: the segments ``cs[0..m)`` (sorted
// forest ids) of a forest given by parent/start/length.  Mirrors CostModel._kda_python in
// megatron_harts/planner/cost_model.py: a computed segment whose parent is not computed starts
// at path position p from a producer's boundary state at a = floor(p/B)*B; it is planned as a
// root with a virtual parent of p - a tokens (replay), and positions below it are shifted by a
// (a multiple of B: every chunk boundary is kept).  External rows: the rows of the distinct
// ancestors of computed segments that are not computed themselves.  Runs without the GIL.
struct KdaCounts {
    i64 calls = 0, replay = 0, external = 0;
};

KdaCounts kda_counts(const i64* gp, const i64* gs, const i64* gl, const i64* cs, i64 m, i64 B) {
    KdaCounts out;
    if (m == 0) return out;
    std::vector<i64> par, st, ln, where(m), shift(m);
    par.reserve(2 * m);
    st.reserve(2 * m);
    ln.reserve(2 * m);
    i64 extra = 0;
    auto local = [&](i64 seg) -> i64 {  // index in computed, or -1
        const i64* it = std::lower_bound(cs, cs + m, seg);
        return (it != cs + m && *it == seg) ? static_cast<i64>(it - cs) : -1;
    };
    std::vector<i64> seen;  // external ancestors already counted (kept sorted)
    for (i64 j = 0; j < m; ++j) {
        const i64 s = cs[j];
        const i64 p = gp[s];
        const i64 jp = p >= 0 ? local(p) : -1;
        i64 a;
        if (jp >= 0) {
            a = shift[jp];
            par.push_back(where[jp]);
            st.push_back(gs[s] - a);
        } else {
            const i64 p0 = gs[s];
            a = align_down(p0, B);
            if (p0 > a) {
                par.push_back(-1);
                st.push_back(0);
                ln.push_back(p0 - a);
                extra += p0 - a;
                par.push_back(static_cast<i64>(par.size()) - 1);
                st.push_back(p0 - a);
            } else {
                par.push_back(-1);
                st.push_back(0);
            }
            for (i64 x = p; x >= 0; x = gp[x]) {  // external ancestors, each once
                if (local(x) >= 0) break;
                auto it = std::lower_bound(seen.begin(), seen.end(), x);
                if (it != seen.end() && *it == x) break;
                seen.insert(it, x);
                out.external += gl[x];
            }
        }
        shift[j] = a;
        ln.push_back(gl[s]);
        where[j] = static_cast<i64>(par.size()) - 1;
    }
    const i64 k = static_cast<i64>(par.size());
    check_parent_and_length(par.data(), ln.data(), k);
    Core core = solve(par.data(), st.data(), ln.data(), k, B, true);
    out.calls = core.K;
    for (i64 i = 0; i < k; ++i) {
        if (core.down[i].head) out.replay += st[i] - align_down(st[i], B);
    }
    out.replay += extra;
    return out;
}

void check_forest_arrays(const I64Array& parent, const I64Array& start, const I64Array& length) {
    const i64 n = parent.shape(0);
    if (parent.ndim() != 1 || start.ndim() != 1 || length.ndim() != 1 || start.shape(0) != n ||
        length.shape(0) != n) {
        throw py::value_error("parent, start and length must be 1-D arrays of one size");
    }
}

void check_chunk(i64 chunk_size) {
    if (chunk_size < 1) {
        throw py::value_error("chunk_size must be >= 1, got " + std::to_string(chunk_size));
    }
}

// Sorted, distinct ids in [0, n) (``what`` names the list in the error).
void check_sorted_ids(const i64* cs, i64 m, i64 n, const std::string& what) {
    for (i64 j = 0; j < m; ++j) {
        if (cs[j] < 0 || cs[j] >= n || (j && cs[j] <= cs[j - 1])) {
            throw py::value_error(what + " must hold sorted, distinct segment ids in [0, " +
                                  std::to_string(n) + ")");
        }
    }
}

py::tuple microbatch_kda(I64Array parent, I64Array start, I64Array length, I64Array computed,
                         i64 chunk_size) {
    check_chunk(chunk_size);
    check_forest_arrays(parent, start, length);
    if (computed.ndim() != 1) throw py::value_error("computed must be 1-D");
    const i64 n = parent.shape(0);
    const i64 m = computed.shape(0);
    check_sorted_ids(computed.data(), m, n, "computed");
    KdaCounts c;
    {
        py::gil_scoped_release release;
        c = kda_counts(parent.data(), start.data(), length.data(), computed.data(), m, chunk_size);
    }
    return py::make_tuple(c.calls, c.replay, c.external);
}

// The cost features of many microbatches in one call (CostModel.features_many; reference:
// CostModel.features per microbatch).  Microbatch j computes comp[comp_off[j]:comp_off[j+1]]
// (sorted, distinct) and owns own[own_off[j]:own_off[j+1]].  Returns int64[k, 6]: rows,
// attention pairs, KDA calls, replay tokens, logits rows, external rows (all 0 when nothing
// is computed).
py::array_t<i64> microbatch_features(I64Array parent, I64Array start, I64Array length, I64Array pairs,
                                     I64Array logits, I64Array comp_off, I64Array comp, I64Array own_off,
                                     I64Array own, i64 chunk_size) {
    check_chunk(chunk_size);
    check_forest_arrays(parent, start, length);
    const i64 n = parent.shape(0);
    if (pairs.ndim() != 1 || logits.ndim() != 1 || pairs.shape(0) != n || logits.shape(0) != n) {
        throw py::value_error("pairs and logits must be 1-D arrays of the segment count");
    }
    const i64 k = comp_off.shape(0) - 1;
    if (comp_off.ndim() != 1 || own_off.ndim() != 1 || k < 0 || own_off.shape(0) != k + 1) {
        throw py::value_error("comp_off and own_off must be offsets (1-D, one more than microbatches)");
    }
    const i64* co = comp_off.data();
    const i64* oo = own_off.data();
    const i64* cs = comp.data();
    const i64* os = own.data();
    const i64 nc = comp.shape(0), no = own.shape(0);
    for (i64 j = 0; j < k; ++j) {
        if (co[j] < 0 || co[j] > co[j + 1] || co[j + 1] > nc || oo[j] < 0 || oo[j] > oo[j + 1] ||
            oo[j + 1] > no) {
            throw py::value_error("offsets must be non-decreasing and within the id arrays");
        }
        check_sorted_ids(cs + co[j], co[j + 1] - co[j], n, "computed");
        for (i64 x = oo[j]; x < oo[j + 1]; ++x) {
            if (os[x] < 0 || os[x] >= n) throw py::value_error("owned ids must lie in [0, segments)");
        }
    }
    py::array_t<i64> out({k, static_cast<i64>(6)});
    i64* o = out.mutable_data();
    {
        py::gil_scoped_release release;
        const i64* gl = length.data();
        const i64* gpairs = pairs.data();
        const i64* glog = logits.data();
        for (i64 j = 0; j < k; ++j) {
            microbatch_feature_row(parent.data(), start.data(), gl, gpairs, glog, cs + co[j], co[j + 1] - co[j],
                                   os + oo[j], oo[j + 1] - oo[j], chunk_size, o + 6 * j);
        }
    }
    return out;
}

}  // namespace

void microbatch_feature_row(const std::int64_t* parent, const std::int64_t* start, const std::int64_t* length,
                            const std::int64_t* pairs, const std::int64_t* logits, const std::int64_t* comp,
                            std::int64_t m, const std::int64_t* own, std::int64_t mo, std::int64_t chunk_size,
                            std::int64_t* out) {
    std::fill(out, out + 6, 0);
    if (m == 0) return;
    for (i64 x = 0; x < m; ++x) {
        out[0] += length[comp[x]];
        out[1] += pairs[comp[x]];
    }
    const KdaCounts kc = kda_counts(parent, start, length, comp, m, chunk_size);
    out[2] = kc.calls;
    out[3] = kc.replay;
    for (i64 x = 0; x < mo; ++x) out[4] += logits[own[x]];
    out[5] = kc.external;
}

PYBIND11_MODULE(_C, m) {
    m.doc() = "megatron_harts C++ core: the KDA call planner and the microbatch KDA cost features";
    m.def("plan_calls", &plan_calls, py::arg("parent"), py::arg("start"), py::arg("length"),
          py::arg("chunk_size"), py::arg("replay") = true,
          "Optimal KDA call plan of a forest (see megatron_harts.planner.calls.plan_calls). "
          "Returns a dict of int64 CSR arrays plus num_calls and replay_tokens; raises "
          "ValueError naming the segment and field on bad input.");
    m.def("microbatch_kda", &microbatch_kda, py::arg("parent"), py::arg("start"), py::arg("length"),
          py::arg("computed"), py::arg("chunk_size"),
          "(calls, replay tokens, external rows) of the microbatch computing the sorted segment ids "
          "`computed` of a forest (see megatron_harts.planner.cost_model.CostModel.kda).");
    m.def("microbatch_features", &microbatch_features, py::arg("parent"), py::arg("start"),
          py::arg("length"), py::arg("pairs"), py::arg("logits"), py::arg("comp_off"), py::arg("comp"),
          py::arg("own_off"), py::arg("own"), py::arg("chunk_size"),
          "int64[k, 6] cost features (rows, attention pairs, KDA calls, replay tokens, logits rows, "
          "external rows) of k microbatches given as CSR arrays of computed (sorted) and owned "
          "segment ids (see megatron_harts.planner.cost_model.CostModel.features_many).");
    register_l2(m);
}
