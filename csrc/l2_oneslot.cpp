// L2's unit search over (replica, slot) microbatches (megatron_harts.planner.l2_oneslot: the one-slot packer and
// search_slots; _search_python is its reference, step for step: the same start, the same changes tried in the
// same order, the same floating-point sums).
#include "planner_l2.h"

#include <limits>

namespace py = pybind11;
using i64 = std::int64_t;

namespace {

constexpr double kEps = 1e-12;
constexpr double kPrune = 1e-9;
constexpr double kInf = std::numeric_limits<double>::infinity();

// (rows over the budget, step, sum of squares) lower than the second triple (steps within kEps equal, then
// the squares by more than kEps): _better of the reference.
bool better(i64 over, double mx, double sq, i64 over0, double mx0, double sq0) {
    if (over != over0) return over < over0;
    return mx < mx0 - kEps || (mx <= mx0 + kEps && sq < sq0 - kEps);
}

struct Search {
    i64 S;
    const i64* kind;
    const i64* win;
    const double* cost;
    const i64* rows;
    const double* replay;
    const i64* path_off;
    const i64* path;
    const i64* length;
    const double* body;
    std::vector<i64> smark, wmark, core_bin;
    i64 stamp = 0;

    // (cost, rows) of microbatch bin holding the units of a, then b, then c (in that order); false once its
    // cost passes cap (costs only add up: such a change is never taken).  An item reads its window's producer
    // when that runs earlier on the replica, this microbatch produces nothing and reads no other producer (the
    // first such item's); else it recomputes its root path (each segment once).
    bool measure(i64 bin, const std::vector<i64>& a, const std::vector<i64>& b, const std::vector<i64>& c,
                 double cap, double& out_c, i64& out_r) {
        const i64 st = ++stamp;
        double cs = 0.0;
        i64 r = 0;
        bool prod = false;
        const std::vector<i64>* parts[3] = {&a, &b, &c};
        for (const auto* p : parts) {
            for (i64 u : *p) {
                cs += cost[u];
                r += rows[u];
                if (kind[u] == 0) {
                    wmark[win[u]] = st;
                    prod = true;
                }
            }
        }
        if (cs > cap) return false;
        const i64 rb = bin / S, kb = bin % S;
        i64 reads = -1;
        for (const auto* p : parts) {
            for (i64 u : *p) {
                if (kind[u] != 1 || wmark[win[u]] == st) continue;
                const i64 pb = core_bin[win[u]];
                if (S > 1 && !prod && pb >= 0 && pb / S == rb && pb % S < kb && (reads < 0 || reads == pb)) {
                    reads = pb;
                    cs += replay[u];
                } else {
                    for (i64 q = path_off[u]; q < path_off[u + 1]; ++q) {
                        const i64 s = path[q];
                        if (smark[s] != st) {
                            smark[s] = st;
                            cs += body[s];
                            r += length[s];
                        }
                    }
                }
                if (cs > cap) return false;
            }
        }
        out_c = cs;
        out_r = r;
        return true;
    }
};

// A change's measured costs and rows, x's and y's side each: 0 not measured, 1 measured (exact), 2 its cost
// passed the cap xcap / ycap (then it passes any lower cap too; a higher cap measures again).
struct Eval {
    double lx = 0.0, ly = 0.0, xcap = 0.0, ycap = 0.0;
    i64 rx = 0, ry = 0;
    char xs = 0, ys = 0;
};

// The changes between microbatches x and y, measured at versions (vx, vy) of the two.
struct PairCache {
    i64 vx = -1, vy = -1;
    std::vector<Eval> ev;
};

using I64Array = py::array_t<i64, py::array::c_style | py::array::forcecast>;
using F64Array = py::array_t<double, py::array::c_style | py::array::forcecast>;

}  // namespace

static py::tuple l2_slot_search(I64Array kind_a, I64Array win_a, F64Array cost_a, I64Array rows_a, F64Array replay_a,
                                I64Array path_off_a, I64Array path_a, I64Array length_a, F64Array body_a, i64 dp,
                                i64 S, i64 M, i64 max_rows, i64 steps, I64Array start_a) {
    const i64 n = kind_a.ndim() == 1 ? kind_a.shape(0) : -1;
    const i64 NS = length_a.ndim() == 1 ? length_a.shape(0) : -1;
    if (n < 0 || NS < 0) throw py::value_error("kind and length must be 1-D arrays");
    if (dp < 1 || S < 1) throw py::value_error("dp and S must be >= 1");
    const i64 nb = dp * S;
    Search o;
    o.S = S;
    o.kind = checked_vector(kind_a, n, "kind");
    o.win = checked_vector(win_a, n, "win");
    o.cost = checked_vector(cost_a, n, "cost");
    o.rows = checked_vector(rows_a, n, "rows");
    o.replay = checked_vector(replay_a, n, "replay");
    o.path_off = checked_vector(path_off_a, n + 1, "path_off");
    const i64 np_ = path_a.ndim() == 1 ? path_a.shape(0) : -1;
    o.path = checked_vector(path_a, np_, "path");
    o.length = checked_vector(length_a, NS, "length");
    o.body = checked_vector(body_a, NS, "body");
    const i64 ns = start_a.ndim() == 1 ? start_a.shape(0) : -1;
    const i64* start = checked_vector(start_a, ns, "start");
    if (ns != 0 && ns != n) throw py::value_error("start must be empty or hold one microbatch per unit");
    if (ns == 0 && S != 1) throw py::value_error("a search from no start needs one slot");
    if (o.path_off[0] != 0 || o.path_off[n] != np_) throw py::value_error("path_off must run from 0 to len(path)");
    i64 nw = 0;
    for (i64 u = 0; u < n; ++u) {
        if (o.win[u] < 0) throw py::value_error("win must be >= 0");
        if (o.path_off[u + 1] < o.path_off[u]) throw py::value_error("path_off must not decrease");
        if (ns && (start[u] < 0 || start[u] >= nb)) throw py::value_error("start out of range");
        nw = std::max(nw, o.win[u] + 1);
    }
    for (i64 q = 0; q < np_; ++q) {
        if (o.path[q] < 0 || o.path[q] >= NS) throw py::value_error("path segment out of range");
    }
    o.smark.assign(NS, 0);
    o.wmark.assign(nw, 0);
    o.core_bin.assign(nw, -1);
    const std::vector<i64> none;
    std::vector<i64> one(1);

    std::vector<std::vector<i64>> ent(nb);
    std::vector<double> load(nb, 0.0);
    std::vector<i64> nrows(nb, 0);
    bool ok = true;
    {
        py::gil_scoped_release release;
        double c = 0.0;
        i64 r = 0;
        if (ns == 0) {  // one slot: decreasing standalone cost, each unit to the microbatch it leaves cheapest
            std::vector<double> alone(n);
            for (i64 u = 0; u < n; ++u) {
                one[0] = u;
                o.measure(0, one, none, none, kInf, c, r);
                alone[u] = c;
            }
            std::vector<i64> order(n);
            for (i64 u = 0; u < n; ++u) order[u] = u;
            std::sort(order.begin(), order.end(), [&](i64 a, i64 b) {
                if (alone[a] != alone[b]) return alone[a] > alone[b];
                return a < b;
            });
            for (i64 u : order) {
                one[0] = u;
                i64 best_b = -1;
                double best_c = 0.0;
                for (i64 b = 0; b < nb; ++b) {
                    o.measure(b, ent[b], one, none, kInf, c, r);
                    if (r <= M && (best_b < 0 || c < best_c)) {
                        best_b = b;
                        best_c = c;
                    }
                }
                if (best_b < 0) {
                    ok = false;
                    break;
                }
                ent[best_b].push_back(u);
                load[best_b] = best_c;
                o.measure(best_b, ent[best_b], none, none, kInf, c, r);
                nrows[best_b] = r;
            }
        } else {
            for (i64 u = 0; u < n; ++u) {
                ent[start[u]].push_back(u);
                if (o.kind[u] == 0) o.core_bin[o.win[u]] = start[u];
            }
            for (i64 b = 0; b < nb; ++b) {
                o.measure(b, ent[b], none, none, kInf, c, r);
                load[b] = c;
                nrows[b] = r;
            }
        }
        if (ok) {
            std::vector<std::vector<i64>> groups, rests;
            std::vector<i64> gwin;  // windows in first-appearance order
            std::vector<i64> yrest, best_x_list, best_y_list, slot_bins(dp);
            std::vector<std::vector<i64>> top(S);
            std::vector<double> csum(nb), gcost, mk(S);
            std::vector<char> in_g(n, 0);
            std::vector<i64> ver(nb, 0);  // a microbatch's version: changed by each step that changes it
            std::vector<PairCache> pc(nb * nb);
            for (i64 it = 0; it < steps; ++it) {
                i64 total = 0;
                for (i64 r2 : nrows) total += r2;
                const i64 over = total > max_rows ? total - max_rows : 0;  // rows past the budget
                for (i64 k = 0; k < S; ++k) {  // per slot its costliest microbatch, and its three costliest
                    double mx = 0.0;
                    for (i64 rr = 0; rr < dp; ++rr) {
                        const double v = load[rr * S + k];
                        mx = v > mx ? v : mx;
                        slot_bins[rr] = rr * S + k;
                    }
                    mk[k] = mx;
                    std::stable_sort(slot_bins.begin(), slot_bins.end(),
                                     [&](i64 a, i64 b) { return load[a] > load[b]; });
                    top[k].assign(slot_bins.begin(), slot_bins.begin() + std::min<i64>(3, dp));
                }
                double step = 0.0;
                for (double v : mk) step += v;
                double sq = 0.0;
                for (double v : load) sq += v * v;
                // each microbatch's units' costs alone (no root paths, no replay): lower bounds of the costs a
                // change leaves, so that a change the search would refuse anyway is not measured (kPrune: far
                // above the rounding of these sums; the result is the reference's either way)
                for (i64 b = 0; b < nb; ++b) {
                    double cs = 0.0;
                    for (i64 u : ent[b]) cs += o.cost[u];
                    csum[b] = cs;
                }
                bool found = false;
                double b_st = 0.0, b_sq = 0.0, b_lx = 0.0, b_ly = 0.0;
                i64 b_x = -1, b_y = -1, b_over = 0, b_rx = 0, b_ry = 0;
                for (i64 x = 0; x < nb; ++x) {
                    const std::vector<i64>& ex = ent[x];
                    const i64 kx = x % S;
                    // the groups that may leave x: each unit alone (cores only on one slot), then the items of
                    // each window (two or more) together; vectors reused (their capacity kept) across steps
                    std::size_t ng = 0;
                    auto next_group = [&]() -> std::vector<i64>& {
                        if (groups.size() == ng) groups.emplace_back();
                        std::vector<i64>& g = groups[ng++];
                        g.clear();
                        return g;
                    };
                    for (i64 u : ex) {
                        if (S == 1 || o.kind[u] != 0) next_group().push_back(u);
                    }
                    gwin.clear();
                    for (i64 u : ex) {
                        if (o.kind[u] == 1 && std::find(gwin.begin(), gwin.end(), o.win[u]) == gwin.end())
                            gwin.push_back(o.win[u]);
                    }
                    for (i64 w : gwin) {
                        std::vector<i64>& g = next_group();
                        for (i64 u : ex) {
                            if (o.kind[u] == 1 && o.win[u] == w) g.push_back(u);
                        }
                        if (g.size() < 2) --ng;
                    }
                    // per group: x without it, and its units' costs
                    if (rests.size() < ng) rests.resize(ng);
                    if (gcost.size() < ng) gcost.resize(ng);
                    for (std::size_t gi = 0; gi < ng; ++gi) {
                        double cg = 0.0;
                        for (i64 u : groups[gi]) {
                            cg += o.cost[u];
                            in_g[u] = 1;
                        }
                        gcost[gi] = cg;
                        rests[gi].clear();
                        for (i64 u : ex) {
                            if (!in_g[u]) rests[gi].push_back(u);
                        }
                        for (i64 u : groups[gi]) in_g[u] = 0;
                    }
                    for (i64 y = 0; y < nb; ++y) {
                        const i64 ky = y % S;
                        if (y == x || load[x] <= load[y]) continue;
                        double ox = 0.0, oy = 0.0;  // the costliest of x's and y's slots but x and y
                        for (i64 b : top[kx]) {
                            if (b != x && b != y) {
                                ox = load[b];
                                break;
                            }
                        }
                        for (i64 b : top[ky]) {
                            if (b != x && b != y) {
                                oy = load[b];
                                break;
                            }
                        }
                        const std::vector<i64>& ey = ent[y];
                        const i64 ny = static_cast<i64>(ey.size());
                        // the step and the sum of squared costs once x costs lx and y costs ly
                        const auto after = [&](double lx, double ly, double& ts, double& tq) {
                            double nx = ox > lx ? ox : lx;
                            if (ky == kx) {
                                nx = nx > ly ? nx : ly;
                                ts = step - mk[kx] + nx;
                            } else {
                                const double nyc = oy > ly ? oy : ly;
                                ts = step - mk[kx] - mk[ky] + nx + nyc;
                            }
                            tq = sq - load[x] * load[x] - load[y] * load[y] + lx * lx + ly * ly;
                        };
                        PairCache& pcache = pc[x * nb + y];
                        if (pcache.vx != ver[x] || pcache.vy != ver[y]) {
                            pcache.vx = ver[x];
                            pcache.vy = ver[y];
                            pcache.ev.assign(ng * (ny + 1), Eval());
                        }
                        for (std::size_t gi = 0; gi < ng; ++gi) {
                            const std::vector<i64>& g = groups[gi];
                            const std::vector<i64>& rest = rests[gi];
                            const double cg = gcost[gi];
                            for (i64 j = -1; j < ny; ++j) {
                                // j < 0: the group moved to y; else swapped with y's unit j (no core on several slots)
                                if (j >= 0 && S > 1 && o.kind[ey[j]] == 0) continue;
                                const double cap = over > 0 ? kInf : (!found || b_st > step ? step : b_st) + kEps;
                                if (over == 0) {
                                    const double cv = j < 0 ? 0.0 : o.cost[ey[j]];
                                    double tsb, tqb;
                                    after(csum[x] - cg + cv, csum[y] - cv + cg, tsb, tqb);
                                    if (tsb > cap + kPrune || (tsb >= step - kEps + kPrune && tqb >= sq - kEps + kPrune))
                                        continue;
                                }
                                // the change's exact costs and rows, measured once while x and y stay as they are
                                // (a cost past cap is refused as the reference's measure refuses it: measure stops
                                // only where its cost passes the cap, so a value it returned is exact)
                                Eval& e = pcache.ev[gi * (ny + 1) + (j + 1)];
                                if (e.xs == 0 || (e.xs == 2 && cap > e.xcap)) {
                                    if (j >= 0) one[0] = ey[j];
                                    if (o.measure(x, rest, j < 0 ? none : one, none, cap, e.lx, e.rx)) {
                                        e.xs = 1;
                                    } else {
                                        e.xs = 2;
                                        e.xcap = cap;
                                    }
                                }
                                if (e.xs == 2 || e.rx > M || e.lx > cap) continue;
                                if (e.ys == 0 || (e.ys == 2 && cap > e.ycap)) {
                                    if (j >= 0) {
                                        yrest.assign(ey.begin(), ey.begin() + j);
                                        yrest.insert(yrest.end(), ey.begin() + j + 1, ey.end());
                                    }
                                    if (o.measure(y, j < 0 ? ey : yrest, g, none, cap, e.ly, e.ry)) {
                                        e.ys = 1;
                                    } else {
                                        e.ys = 2;
                                        e.ycap = cap;
                                    }
                                }
                                if (e.ys == 2 || e.ry > M || e.ly > cap) continue;
                                const i64 rx = e.rx, ry = e.ry;
                                double ts, tq;
                                after(e.lx, e.ly, ts, tq);
                                i64 to = total - nrows[x] - nrows[y] + rx + ry - max_rows;
                                to = to > 0 ? to : 0;
                                if (better(to, ts, tq, over, step, sq) &&
                                    (!found || better(to, ts, tq, b_over, b_st, b_sq))) {
                                    found = true;
                                    b_over = to;
                                    b_st = ts;
                                    b_sq = tq;
                                    b_x = x;
                                    b_y = y;
                                    b_lx = e.lx;
                                    b_ly = e.ly;
                                    b_rx = rx;
                                    b_ry = ry;
                                    best_x_list = rest;
                                    if (j < 0) {
                                        best_y_list = ey;
                                    } else {
                                        best_x_list.push_back(ey[j]);
                                        best_y_list.assign(ey.begin(), ey.begin() + j);
                                        best_y_list.insert(best_y_list.end(), ey.begin() + j + 1, ey.end());
                                    }
                                    best_y_list.insert(best_y_list.end(), g.begin(), g.end());
                                }
                            }
                        }
                    }
                }
                if (!found) break;
                ent[b_x] = best_x_list;
                ent[b_y] = best_y_list;
                ++ver[b_x];
                ++ver[b_y];
                load[b_x] = b_lx;
                load[b_y] = b_ly;
                nrows[b_x] = b_rx;
                nrows[b_y] = b_ry;
            }
        }
    }
    std::vector<i64> off(1, 0), units;
    if (ok) {
        for (i64 b = 0; b < nb; ++b) {
            units.insert(units.end(), ent[b].begin(), ent[b].end());
            off.push_back(static_cast<i64>(units.size()));
        }
    }
    return py::make_tuple(int64_array(off), int64_array(units));
}

void register_one_slot(py::module_& m) {
    m.def("l2_slot_search", &l2_slot_search, py::arg("kind"), py::arg("win"), py::arg("cost"), py::arg("rows"),
          py::arg("replay"), py::arg("path_off"), py::arg("path"), py::arg("length"), py::arg("body"), py::arg("dp"),
          py::arg("S"), py::arg("M"), py::arg("max_rows"), py::arg("steps"), py::arg("start"),
          "L2's unit search over dp * S microbatches (planner.l2_oneslot._search_python is its reference): "
          "(offsets, units) of microbatch r * S + k's units in entry order; offsets [0] alone when a unit fits "
          "nowhere (one slot, start empty).");
}
