// L2's last pass: the C++ core of megatron_harts.planner.l2_even.even_slots (the Python reference beside it:
// _even_python; tests/test_l2_even.py holds the two equal: every floating-point operation below runs in the
// reference's order).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "planner_l2.h"

namespace py = pybind11;

namespace {

using i64 = std::int64_t;
using I64Array = py::array_t<i64, py::array::c_style | py::array::forcecast>;
using F64Array = py::array_t<double, py::array::c_style | py::array::forcecast>;

constexpr std::int8_t kNone = 0, kOwn = 1, kRec = 2, kExt = 3;

// The pass's microbatches (l2_even._State): per microbatch and segment its state and its count of present
// children (dense, microbatches x segments), rows, attention pairs, logits rows, owned count, estimated cost;
// move() logs every change so that undo() restores it.
class State {
   public:
    State(i64 S, i64 n, const i64* parent, const i64* length, const i64* pairs, const i64* logits,
          const i64* sub_size, double c_row, double c_pair, double c_logit)
        : rows(n, 0), pr(n, 0), lg(n, 0), n_own(n, 0), cost(n, 0.0), is_prod(n, false),
          pinned(static_cast<std::size_t>(S * n), 0), owned(n), reads(n, -1), owner(S, -1), S_(S), parent_(parent),
          length_(length), pairs_(pairs), logits_(logits), sub_size_(sub_size), c_row_(c_row), c_pair_(c_pair),
          c_logit_(c_logit), st_(static_cast<std::size_t>(S * n), kNone), cc_(static_cast<std::size_t>(S * n), 0) {}

    std::int8_t& st(i64 b, i64 s) { return st_[static_cast<std::size_t>(b * S_ + s)]; }
    std::int32_t& cc(i64 b, i64 s) { return cc_[static_cast<std::size_t>(b * S_ + s)]; }

    // Microbatch b's owned and recomputed segments; externals and child counts derived (the reference's init).
    void load(i64 b, const i64* own, i64 no, const i64* rec, i64 nr) {
        std::vector<i64> present;
        for (i64 i = 0; i < no; ++i) {
            const i64 s = own[i];
            st(b, s) = kOwn;
            rows[b] += length_[s];
            pr[b] += pairs_[s];
            lg[b] += logits_[s];
        }
        for (i64 i = 0; i < nr; ++i) {
            const i64 s = rec[i];
            st(b, s) = kRec;
            rows[b] += length_[s];
            pr[b] += pairs_[s];
        }
        n_own[b] = no;
        for (i64 i = 0; i < no; ++i) owner[own[i]] = b;
        present.assign(own, own + no);
        present.insert(present.end(), rec, rec + nr);
        std::sort(present.begin(), present.end());
        for (i64 s : present) {
            for (i64 a = parent_[s]; a >= 0 && st(b, a) == kNone; a = parent_[a]) st(b, a) = kExt;
        }
        for (i64 s = 0; s < S_; ++s) {
            if (st(b, s) != kNone && parent_[s] >= 0) ++cc(b, parent_[s]);
        }
        refresh(b);
    }

    // The owned list of b (sorted), rebuilt from its states.
    void refresh(i64 b) {
        owned[b].clear();
        for (i64 s = 0; s < S_; ++s) {
            if (st(b, s) == kOwn) owned[b].push_back(s);
        }
    }

    // The piece of x rooted at s into seg (l2_even._State.piece); false when it is none.
    bool piece(i64 x, i64 s, std::vector<i64>& seg) {
        seg.clear();
        if (st(x, s) != kOwn) return false;
        for (i64 d = s; d < s + sub_size_[s]; ++d) {
            const std::int8_t v = st(x, d);
            if (v == kNone) continue;
            if (v != kOwn || pinned[static_cast<std::size_t>(x * S_ + d)]) return false;
            seg.push_back(d);
        }
        return static_cast<i64>(seg.size()) < n_own[x];
    }

    // Move piece seg from x to y (l2_even._State.move): true with the rows both gain together in `gain`, or
    // false (the caller undoes it).
    bool move(i64 x, const std::vector<i64>& seg, i64 y, i64 M, i64& gain) {
        const i64 s = seg[0];
        if (st(y, s) != kNone) return false;
        scalars(x);
        scalars(y);
        i64 d_rows_x = 0, d_pr_x = 0, d_lg = 0;
        for (i64 d : seg) {
            set(x, d, kNone, 0);
            d_rows_x -= length_[d];
            d_pr_x -= pairs_[d];
            d_lg += logits_[d];
        }
        for (i64 a = parent_[s]; a >= 0; a = parent_[a]) {
            const std::int32_t c = cc(x, a) - 1;
            const std::int8_t v = st(x, a);
            if (c > 0 || v == kOwn) {
                set(x, a, v, c);
                break;
            }
            if (v == kRec) {
                if (is_prod[x]) return false;
                d_rows_x -= length_[a];
                d_pr_x -= pairs_[a];
            }
            set(x, a, kNone, 0);
        }
        i64 d_rows_y = 0, d_pr_y = 0;
        for (i64 d : seg) {  // children inside the piece, counted on the fly (the piece is in id order)
            set(y, d, kOwn, 0);
            own_by(d, y);
            d_rows_y += length_[d];
            d_pr_y += pairs_[d];
        }
        for (std::size_t i = 1; i < seg.size(); ++i) ++cc(y, parent_[seg[i]]);
        missing_.clear();  // the root path's segments y neither computes nor reads, bottom up
        i64 a = parent_[s];
        for (; a >= 0 && st(y, a) == kNone; a = parent_[a]) missing_.push_back(a);
        const i64 p = reads[y];
        bool read = p >= 0 && (a < 0 || st(y, a) == kExt);
        for (i64 m : missing_) read = read && owner[m] == p;
        for (i64 m : missing_) {
            if (read) {  // read from y's producer, which owns them: they stay there
                set(y, m, kExt, 1);
                pin(p, m);
            } else {
                set(y, m, kRec, 1);
                d_rows_y += length_[m];
                d_pr_y += pairs_[m];
            }
        }
        if (a >= 0) set(y, a, st(y, a), cc(y, a) + 1);
        if (rows[y] + d_rows_y > M) return false;
        rows[x] += d_rows_x;
        pr[x] += d_pr_x;
        lg[x] -= d_lg;
        n_own[x] -= static_cast<i64>(seg.size());
        rows[y] += d_rows_y;
        pr[y] += d_pr_y;
        lg[y] += d_lg;
        n_own[y] += static_cast<i64>(seg.size());
        cost[x] += c_row_ * static_cast<double>(d_rows_x) + c_pair_ * static_cast<double>(d_pr_x) -
                   c_logit_ * static_cast<double>(d_lg);
        cost[y] += c_row_ * static_cast<double>(d_rows_y) + c_pair_ * static_cast<double>(d_pr_y) +
                   c_logit_ * static_cast<double>(d_lg);
        gain = d_rows_x + d_rows_y;
        return true;
    }

    std::size_t mark() const { return log_.size(); }

    void undo(std::size_t mark) {
        while (log_.size() > mark) {
            const Log& e = log_.back();
            if (e.b == -1) {
                owner[e.s] = e.rows;
            } else if (e.b == -2) {
                pinned[static_cast<std::size_t>(e.rows * S_ + e.s)] = 0;
            } else if (e.s < 0) {
                rows[e.b] = e.rows;
                pr[e.b] = e.pr;
                lg[e.b] = e.lg;
                n_own[e.b] = e.n_own;
                cost[e.b] = e.cost;
            } else {
                st(e.b, e.s) = e.state;
                cc(e.b, e.s) = e.count;
            }
            log_.pop_back();
        }
    }

    void forget() { log_.clear(); }

    std::vector<i64> rows, pr, lg, n_own;
    std::vector<double> cost;
    std::vector<bool> is_prod;
    std::vector<std::uint8_t> pinned;  // microbatches x segments
    std::vector<std::vector<i64>> owned;
    std::vector<i64> reads, owner;

   private:
    struct Log {
        i64 b, s;
        std::int8_t state;
        std::int32_t count;
        i64 rows, pr, lg, n_own;
        double cost;
    };

    void set(i64 b, i64 s, std::int8_t state, std::int32_t count) {
        log_.push_back(Log{b, s, st(b, s), cc(b, s), 0, 0, 0, 0, 0.0});
        st(b, s) = state;
        cc(b, s) = state == kNone ? 0 : count;
    }
    // log kinds as the reference's: b == -1 an owner change (rows: the old owner), b == -2 a pin (rows: its
    // microbatch), s == -1 the scalars of b, else the state and count of (b, s)
    void own_by(i64 s, i64 b) {
        log_.push_back(Log{-1, s, 0, 0, owner[s], 0, 0, 0, 0.0});
        owner[s] = b;
    }
    void pin(i64 b, i64 s) {
        std::uint8_t& v = pinned[static_cast<std::size_t>(b * S_ + s)];
        if (v) return;
        log_.push_back(Log{-2, s, 0, 0, b, 0, 0, 0, 0.0});
        v = 1;
    }
    void scalars(i64 b) { log_.push_back(Log{b, -1, 0, 0, rows[b], pr[b], lg[b], n_own[b], cost[b]}); }

    i64 S_;
    const i64 *parent_, *length_, *pairs_, *logits_, *sub_size_;
    double c_row_, c_pair_, c_logit_;
    std::vector<std::int8_t> st_;
    std::vector<std::int32_t> cc_;
    std::vector<Log> log_;
    std::vector<i64> missing_;
};

void check_csr(const i64* off, const i64* ids, i64 size, i64 n, i64 S, const char* name) {
    if (off[0] != 0 || off[n] != size) throw py::value_error(std::string(name) + ": offsets do not match");
    for (i64 i = 1; i <= n; ++i) {
        if (off[i] < off[i - 1]) throw py::value_error(std::string(name) + ": offsets do not match");
    }
    for (i64 i = 0; i < size; ++i) {
        if (ids[i] < 0 || ids[i] >= S) throw py::value_error(std::string(name) + ": segment out of range");
    }
}

// l2_even._even_python, change for change: returns (moved, owned CSR offsets, ids, recomputed CSR offsets, ids).
py::tuple l2_even(const I64Array& parent_a, const I64Array& length_a, const I64Array& pairs_a,
                  const I64Array& logits_a, const I64Array& sub_size_a, const I64Array& rep_a,
                  const I64Array& slot_a, const I64Array& own_off_a, const I64Array& own_a,
                  const I64Array& rec_off_a, const I64Array& rec_a, const F64Array& cost_a,
                  const I64Array& is_prod_a, const I64Array& pin_off_a, const I64Array& pin_a,
                  const I64Array& reads_a, i64 dp, i64 S,
                  i64 M, double c_row, double c_pair, double c_logit, i64 moves, i64 n_slots, double weight,
                  i64 spend) {
    const i64 G = parent_a.shape(0);
    const i64* parent = checked_vector(parent_a, G, "parent");
    const i64* length = checked_vector(length_a, G, "length");
    const i64* pairs = checked_vector(pairs_a, G, "pairs");
    const i64* logits = checked_vector(logits_a, G, "logits");
    const i64* sub_size = checked_vector(sub_size_a, G, "sub_size");
    const i64 n = rep_a.shape(0);
    const i64* rep = checked_vector(rep_a, n, "rep");
    const i64* slot = checked_vector(slot_a, n, "slot");
    const i64* own_off = checked_vector(own_off_a, n + 1, "own_off");
    const i64* own = checked_vector(own_a, -1, "own");
    const i64* rec_off = checked_vector(rec_off_a, n + 1, "rec_off");
    const i64* rec = checked_vector(rec_a, -1, "rec");
    const double* cost0 = checked_vector(cost_a, n, "cost");
    const i64* is_prod = checked_vector(is_prod_a, n, "is_prod");
    const i64* pin_off = checked_vector(pin_off_a, n + 1, "pin_off");
    const i64* pin = checked_vector(pin_a, -1, "pin");
    const i64* reads = checked_vector(reads_a, n, "reads");
    check_csr(own_off, own, own_a.shape(0), n, G, "own");
    check_csr(rec_off, rec, rec_a.shape(0), n, G, "rec");
    check_csr(pin_off, pin, pin_a.shape(0), n, G, "pin");
    if (dp < 1 || S < 1) throw py::value_error("dp and S must be positive");
    for (i64 b = 0; b < n; ++b) {
        if (rep[b] < 0 || rep[b] >= dp || slot[b] < 0 || slot[b] >= S || reads[b] < -1 || reads[b] >= n) {
            throw py::value_error("microbatch " + std::to_string(b) + ": replica or slot out of range");
        }
    }
    for (i64 s = 0; s < G; ++s) {
        if (parent[s] >= s || sub_size[s] < 1 || s + sub_size[s] > G) {
            throw py::value_error("segment " + std::to_string(s) + ": not in preorder");
        }
    }
    std::vector<i64> oo(1, 0), o, ro(1, 0), r;  // the result: owned and recomputed segments, CSR
    bool moved = false;
    {
        py::gil_scoped_release release;  // the search reads its own state and the inputs' buffers only
        State st(G, n, parent, length, pairs, logits, sub_size, c_row, c_pair, c_logit);
        std::vector<i64> grid(static_cast<std::size_t>(S * dp), -1);
        for (i64 b = 0; b < n; ++b) {
            if (grid[static_cast<std::size_t>(slot[b] * dp + rep[b])] >= 0) {
                throw py::value_error("two microbatches at replica " + std::to_string(rep[b]) + ", slot " +
                                      std::to_string(slot[b]));
            }
            grid[static_cast<std::size_t>(slot[b] * dp + rep[b])] = b;
            st.cost[b] = cost0[b];
            st.is_prod[b] = is_prod[b] != 0;
            st.reads[b] = reads[b];
            for (i64 i = pin_off[b]; i < pin_off[b + 1]; ++i) st.pinned[static_cast<std::size_t>(b * G + pin[i])] = 1;
            st.load(b, own + own_off[b], own_off[b + 1] - own_off[b], rec + rec_off[b], rec_off[b + 1] - rec_off[b]);
        }
        double total = 0.0;
        for (i64 b = 0; b < n; ++b) total += st.cost[b];
        const double tau = total / static_cast<double>(dp * S);
        std::vector<std::vector<i64>> by_rep(static_cast<std::size_t>(dp));
        for (i64 k = 0; k < S; ++k) {
            for (i64 r = 0; r < dp; ++r) {
                const i64 b = grid[static_cast<std::size_t>(k * dp + r)];
                if (b >= 0) by_rep[static_cast<std::size_t>(r)].push_back(b);
            }
        }
        auto slot_stats = [&](i64 k) {  // (costliest entry, summed cost) of slot k; an idle entry counts 0
            double mx = 0.0, sm = 0.0;
            for (i64 r = 0; r < dp; ++r) {
                const i64 i = grid[static_cast<std::size_t>(k * dp + r)];
                const double v = i < 0 ? 0.0 : st.cost[i];
                sm += v;
                if (v > mx) mx = v;
            }
            return std::make_pair(mx, sm);
        };
        auto slot_f = [&](i64 k) {
            const auto [mx, sm] = slot_stats(k);
            return mx > 0.0 ? mx + weight * tau * (1.0 - sm / (static_cast<double>(dp) * mx)) : 0.0;
        };
        std::vector<double> base(static_cast<std::size_t>(S));
        auto delta = [&](i64 x, i64 y) {
            const i64 kx = slot[x], ky = slot[y];
            if (kx == ky) return slot_f(kx) - base[kx];
            return slot_f(kx) - base[kx] + slot_f(ky) - base[ky];
        };
        auto slot_max = [&](i64 k) { return slot_stats(k).first; };
        std::vector<double> base_mx(static_cast<std::size_t>(S));
        auto shorter = [&](i64 x, i64 y) {  // the change just made shortens the estimated step (the slots' maxima)
            const i64 kx = slot[x], ky = slot[y];
            if (kx == ky) return slot_max(kx) < base_mx[kx] - 1e-12;
            return slot_max(kx) + slot_max(ky) < base_mx[kx] + base_mx[ky] - 1e-12;
        };
        i64 added = 0;
        std::vector<i64> seg, seg2;
        std::vector<std::pair<i64, i64>> tries, swaps;
        std::vector<std::tuple<double, i64, double>> bal;
        struct Piece {
            i64 root;
            std::vector<i64> seg;
            i64 rows;
        };
        std::vector<std::vector<Piece>> cache(static_cast<std::size_t>(n));
        std::vector<i64> cache_stamp(static_cast<std::size_t>(n), -1);
        i64 stamp = -1;
        for (i64 step = 0; step < moves; ++step) {
            for (i64 k = 0; k < S; ++k) base[k] = slot_f(k);
            for (i64 k = 0; k < S; ++k) base_mx[k] = slot_max(k);
            bal.clear();
            for (i64 k = 0; k < S; ++k) {
                const auto [mx, sm] = slot_stats(k);
                if (mx > 0.0 && sm / (static_cast<double>(dp) * mx) < 1.0 - 1e-9) {
                    bal.emplace_back(sm / (static_cast<double>(dp) * mx), k, sm / static_cast<double>(dp));
                }
            }
            std::sort(bal.begin(), bal.end());
            tries.clear();
            swaps.clear();
            const std::size_t nb = std::min(bal.size(), static_cast<std::size_t>(std::max<i64>(0, n_slots)));
            for (std::size_t q = 0; q < nb; ++q) {
                const i64 k = std::get<1>(bal[q]);
                const double mean = std::get<2>(bal[q]);
                for (i64 r = 0; r < dp; ++r) {
                    const i64 x = grid[static_cast<std::size_t>(k * dp + r)];
                    if (x < 0 || st.cost[x] <= mean) continue;
                    for (i64 r2 = 0; r2 < dp; ++r2) {
                        const i64 y = grid[static_cast<std::size_t>(k * dp + r2)];
                        if (y >= 0 && y != x && st.cost[y] < st.cost[x]) {
                            tries.emplace_back(x, y);
                            swaps.emplace_back(x, y);
                        }
                    }
                    for (i64 y : by_rep[static_cast<std::size_t>(rep[x])]) {
                        if (y == x) continue;
                        tries.emplace_back(x, y);
                        if (st.cost[y] < st.cost[x]) swaps.emplace_back(x, y);
                    }
                }
                for (i64 r = 0; r < dp; ++r) {
                    const i64 y = grid[static_cast<std::size_t>(k * dp + r)];
                    if (y < 0 || st.cost[y] >= mean) continue;
                    for (i64 x : by_rep[static_cast<std::size_t>(rep[y])]) {
                        if (x == y) continue;
                        tries.emplace_back(x, y);
                        if (st.cost[x] > st.cost[y]) swaps.emplace_back(x, y);
                    }
                }
            }
            // each microbatch's pieces this step (root, segments, rows), built on first use
            ++stamp;
            auto pieces = [&](i64 b) -> const std::vector<Piece>& {
                if (cache_stamp[b] != stamp) {
                    cache_stamp[b] = stamp;
                    cache[b].clear();
                    for (i64 s : st.owned[b]) {
                        if (!st.piece(b, s, seg)) continue;
                        i64 rows = 0;
                        for (i64 d : seg) rows += length[d];
                        cache[b].push_back(Piece{s, seg, rows});
                    }
                }
                return cache[b];
            };
            bool found = false;
            double best_d = 0.0;
            i64 bx = -1, bs = -1, by = -1, bt = -1;
            for (const auto& [x, y] : tries) {
                for (const Piece& p : pieces(x)) {
                    const std::size_t m = st.mark();
                    i64 got = 0;
                    if (st.move(x, p.seg, y, M, got) && added + got <= spend && (got <= 0 || shorter(x, y))) {
                        const double d = delta(x, y);
                        if (d < -1e-12 && (!found || d < best_d)) {
                            found = true;
                            best_d = d;
                            bx = x, bs = p.root, by = y, bt = -1;
                        }
                    }
                    st.undo(m);
                }
            }
            for (const auto& [x, y] : swaps) {
                const std::vector<Piece>& px = pieces(x);
                const std::vector<Piece>& py = pieces(y);
                const double gap = st.cost[x] - st.cost[y];
                for (const Piece& p : px) {
                    const i64 s = p.root;
                    for (const Piece& q : py) {
                        const i64 t = q.root;
                        if (q.rows >= p.rows || c_row * static_cast<double>(p.rows - q.rows) >= gap ||
                            (t <= s && s < t + sub_size[t]) || (s <= t && t < s + sub_size[s])) {
                            continue;  // x gives rows, less than the gap's worth; disjoint subtrees
                        }
                        const std::size_t m = st.mark();
                        i64 got = 0, got2 = 0;
                        if (st.move(x, p.seg, y, M, got) && st.move(y, q.seg, x, M, got2) &&
                            added + got + got2 <= spend && (got + got2 <= 0 || shorter(x, y))) {
                            const double d = delta(x, y);
                            if (d < -1e-12 && (!found || d < best_d)) {
                                found = true;
                                best_d = d;
                                bx = x, bs = s, by = y, bt = t;
                            }
                        }
                        st.undo(m);
                    }
                }
            }
            if (!found) break;
            st.piece(bx, bs, seg);
            const bool two = bt >= 0 && st.piece(by, bt, seg2);
            i64 got = 0;
            st.move(bx, seg, by, M, got);
            added += got;
            if (two) {
                st.move(by, seg2, bx, M, got);
                added += got;
            }
            st.forget();
            st.refresh(bx);
            st.refresh(by);
            moved = true;
        }
        for (i64 b = 0; b < n; ++b) {
            for (i64 s = 0; s < G; ++s) {
                if (st.st(b, s) == kOwn) o.push_back(s);
                if (st.st(b, s) == kRec) r.push_back(s);
            }
            oo.push_back(static_cast<i64>(o.size()));
            ro.push_back(static_cast<i64>(r.size()));
        }
    }
    return py::make_tuple(moved, int64_array(oo), int64_array(o), int64_array(ro), int64_array(r));
}

}  // namespace

void register_even(pybind11::module_& m) {
    m.def("l2_even", &l2_even, py::arg("parent"), py::arg("length"), py::arg("pairs"), py::arg("logits"),
          py::arg("sub_size"), py::arg("rep"), py::arg("slot"), py::arg("own_off"), py::arg("own"),
          py::arg("rec_off"), py::arg("rec"), py::arg("cost"), py::arg("is_prod"), py::arg("pin_off"),
          py::arg("pin"), py::arg("reads"), py::arg("dp"), py::arg("S"), py::arg("M"), py::arg("c_row"), py::arg("c_pair"),
          py::arg("c_logit"), py::arg("moves"), py::arg("n_slots"), py::arg("weight"), py::arg("spend"),
          "L2's last pass (megatron_harts.planner.l2_even._even_python, change for change): (moved, owned "
          "segments as CSR offsets and ids, recomputed segments likewise) per microbatch, sorted.");
}
