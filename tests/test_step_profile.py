"""benchmarks/step_profile.py: the buckets of a step's device work (synthetic (name, time) lists), the
busy time of overlapping kernels, and a real profiled CPU step whose attention backward is found
through the autograd nodes its forward range created."""
import pytest
import torch

from tool_runner import load_tool


@pytest.fixture(scope="module")
def sp():
    return load_tool("step_profile", "benchmarks")


def test_buckets_by_scope_then_by_name(sp):
    work = [
        ("flash_fwd_kernel", 1.0),                                   # attention by name, forward
        ("flash_bwd_dq_dk_dv_loop_kernel", 2.0),                     # attention by name, backward
        ("triton_tem_fused_flex_attention_backward", 0.5),           # flex backward
        ("chunk_kda_fwd_kernel_o", 0.25),                            # KDA by name
        ("sm90_xmma_gemm_bf16bf16_bf16f32", 4.0),                    # a GEMM
        ("aten::mm", 0.75),                                          # a CPU GEMM
        ("elementwise_kernel", 0.125),                               # other
        ("void at::native::index_elementwise_kernel", 0.5, ("attention_forward",)),   # a gather in the range
        ("sm90_xmma_gemm_bf16bf16_bf16f32", 3.0, ("attention_backward",)),           # a GEMM in its backward
        ("elementwise_kernel", 0.25, ("kda",)),
        # the pieces' extra forward wins over the ranges inside it
        ("flash_fwd_kernel", 1.5, ("pieces_extra_forward", "attention_forward")),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", 0.5, ("pieces_extra_forward",)),
    ]
    out = sp.split_step(work, wall_seconds=20.0)
    sec = out["seconds"]
    assert sec["attention_forward"] == pytest.approx(1.5)
    assert sec["attention_backward"] == pytest.approx(5.5)
    assert sec["kda"] == pytest.approx(0.5)
    assert sec["gemm"] == pytest.approx(4.75)
    assert sec["pieces_extra_forward"] == pytest.approx(2.0)
    assert sec["other"] == pytest.approx(0.125)
    busy = sum(w[1] for w in work)
    assert out["device_seconds"] == pytest.approx(busy) == pytest.approx(out["busy_seconds"])
    assert sec["host"] == pytest.approx(20.0 - busy)
    assert sum(sec.values()) == pytest.approx(20.0)
    assert out["fraction"]["gemm"] == pytest.approx(4.75 / 20.0)
    assert tuple(sec) == sp.BUCKETS


def test_host_is_wall_less_busy_and_never_negative(sp):
    out = sp.split_step([("gemm", 3.0), ("gemm", 3.0)], wall_seconds=5.0, busy_seconds=4.0)   # overlapping
    assert out["seconds"]["gemm"] == 6.0 and out["seconds"]["host"] == pytest.approx(1.0)
    assert sp.split_step([("gemm", 6.0)], wall_seconds=5.0)["seconds"]["host"] == 0.0
    with pytest.raises(ValueError, match="wall_seconds"):
        sp.split_step([], wall_seconds=0.0)
    with pytest.raises(ValueError, match="negative"):
        sp.split_step([("x", -1.0)], wall_seconds=1.0)


def test_union_of_intervals(sp):
    # microseconds: [0, 10) and [5, 20) overlap, [30, 31) apart, [6, 8) inside
    assert sp._union_seconds([(0, 10), (30, 31), (5, 20), (6, 8)]) == pytest.approx(21e-6)
    assert sp._union_seconds([]) == 0.0


def test_a_profiled_cpu_step_finds_the_backward_of_its_ranges(sp):
    """Attention forward in its range, KDA in its range, a no_grad piece forward: the backward of
    the ranges' nodes lands in attention_backward and kda, the rest by name."""
    from torch.profiler import record_function
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(96, 96, generator=gen, requires_grad=True)
    w = torch.randn(96, 96, generator=gen, requires_grad=True)

    def step():
        h = x @ w                                                 # a GEMM outside every range
        with record_function("test.attn"):
            a = torch.softmax(h @ h.t(), -1) @ h
        with record_function("test.kda"):
            k = torch.sigmoid(a) * a
        with torch.no_grad(), record_function("test.pieces"):
            torch.tanh(h @ w)
        k.sum().backward()

    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    work, busy, unlinked = sp.profile_work(prof.events(), "cpu", "test.attn", "test.kda", "test.pieces")
    assert unlinked == 0
    kinds = {}
    for name, s, scopes in work:
        kinds.setdefault(sp.bucket(name, scopes), set()).add(name)
    assert "aten::_softmax" in kinds["attention_forward"]
    assert "aten::_softmax_backward_data" in kinds["attention_backward"]
    assert "aten::sigmoid_backward" in kinds["kda"] and "aten::sigmoid" in kinds["kda"]
    assert "aten::tanh" in kinds["pieces_extra_forward"]
    assert "aten::mm" in kinds["gemm"]                            # x @ w and its backward
    assert busy == pytest.approx(sum(w[1] for w in work))
    out = sp.split_step(work, 10.0, busy)
    assert all(out["seconds"][b] > 0 for b in ("attention_forward", "attention_backward", "kda", "gemm",
                                               "pieces_extra_forward"))
    table = sp.split_table({"kv_tree_within": out})
    assert table.splitlines()[1].startswith("kv_tree_within") and "attn bwd" in table


def test_gpu_kernels_take_their_launching_operators_scopes(sp):
    """The CUDA path on stand-in events: each kernel is in the ``kernels`` list of the operator that
    launched it (torch fills those lists from the correlation ids, whatever the version) and takes
    that operator's ranges and the backward of the nodes the attention range created; busy time is
    the union of the kernel events (the ranges' own device annotations are neither work nor busy); a
    kernel event no operator lists counts as unlinked and goes by its name; a kernel name listed more
    often than the device ran it (a copy listed under its op and its runtime call) shares the device's
    count among its listings: never double time."""
    from types import SimpleNamespace as E

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Kernel
    cpu, gpu = DeviceType.CPU, DeviceType.CUDA

    def op(name, id, parent=None, seq=-1, thread=1, fwd_thread=0, kernels=()):
        return E(name=name, id=id, cpu_parent=parent, sequence_nr=seq, thread=thread, fwd_thread=fwd_thread,
                 device_type=cpu, kernels=[Kernel(k, 0, d) for k, d in kernels])

    def kernel(name, start, end, annotation=False):
        return E(name=name, device_type=gpu, time_range=E(start=start, end=end), cpu_parent=None,
                 sequence_nr=-1, is_user_annotation=annotation)

    gemm = "sm90_xmma_gemm_bf16"
    attn = op("harts.attention", 1)
    mm = op("aten::bmm", 2, attn, seq=7, kernels=[(gemm, 10)])
    launch = op("cudaLaunchKernel", 3, mm)
    bwd = op("autograd::engine::evaluate_function: BmmBackward0", 4, seq=7, thread=2, fwd_thread=1)
    bwd_mm = op("aten::bmm", 5, bwd, kernels=[(gemm, 20)])
    pieces = op("harts.pieces_extra_forward", 6)
    lin = op("aten::addmm", 8, pieces, kernels=[(gemm, 10)])
    other = op("aten::addmm", 9, kernels=[(gemm, 1)])
    events = [attn, mm, launch, bwd, bwd_mm, pieces, lin, other,
              kernel("harts.attention", 0, 12, annotation=True),
              kernel(gemm, 0, 10), kernel(gemm, 20, 40), kernel(gemm, 35, 45), kernel(gemm, 50, 51),
              kernel("flash_bwd_kernel", 60, 70)]
    work, busy, unlinked = sp.profile_work(events, "cuda", "harts.attention", "harts.kda",
                                           "harts.pieces_extra_forward")
    assert [sp.bucket(w[0], w[2]) for w in work] == ["attention_forward", "attention_backward",
                                                     "pieces_extra_forward", "gemm", "attention_backward"]
    assert unlinked == 1 and busy == pytest.approx(46e-6)       # [0,10) + [20,45) + [50,51) + [60,70)
    out = sp.split_step(work, 1e-4, busy)
    assert out["device_seconds"] == pytest.approx(51e-6) and out["seconds"]["host"] == pytest.approx(54e-6)
    launch.kernels = [Kernel(gemm, 0, 10)]                        # the same kernel listed by its runtime call too
    work, busy, unlinked = sp.profile_work(events, "cuda", "harts.attention", "harts.kda",
                                           "harts.pieces_extra_forward")
    gemms = [w for w in work if w[0] == gemm]
    assert len(gemms) == 5 and unlinked == 1 and busy == pytest.approx(46e-6)
    assert sum(w[1] for w in gemms) == pytest.approx(0.8 * 51e-6)   # five listings of four runs


def test_device_idle_by_what_the_host_ran(sp):
    """``idle_while`` on stand-in CUDA events: the device's gaps (the ranges' device annotations are not
    work) counted by length, and their time by the innermost host event alive at points through each gap,
    named under the innermost project range or backward node above it; where no host event is alive, the
    host ran Python; the runtime calls that wait for the device are counted with their time."""
    from types import SimpleNamespace as E

    from torch.autograd import DeviceType

    def ev(name, start, end, parent=None, device=DeviceType.CPU, annotation=False):
        return E(name=name, time_range=E(start=start, end=end), cpu_parent=parent, device_type=device,
                 is_user_annotation=annotation)

    kda = ev("harts.kda", 5, 28)
    index = ev("aten::index_select", 12, 20, kda)
    node = ev("autograd::engine::evaluate_function: MmBackward0", 100, 1100)
    events = [kda, index, ev("cudaLaunchKernel", 18, 20, index), ev("cudaStreamSynchronize", 44, 50),
              node, ev("aten::mm", 1000, 1100, node),
              ev("harts.kda", 5, 28, device=DeviceType.CUDA, annotation=True)]
    events += [ev(f"kernel{i}", a, b, device=DeviceType.CUDA) for i, (a, b) in
               enumerate([(0, 10), (30, 40), (40, 45), (2045, 2050)])]
    out = sp.idle_while(events, ("harts.kda",))
    assert out["gaps"] == {"< 0.1 ms": [1, pytest.approx(20e-6)], "< 1 ms": [0, 0.0],
                           "< 10 ms": [1, pytest.approx(2000e-6)], ">= 10 ms": [0, 0.0]}
    by = dict((name, sec) for name, sec in out["by_host"])
    assert by == {"(no operator: Python)": pytest.approx(1000e-6),
                  "autograd::engine::evaluate_function: MmBackward0": pytest.approx(900e-6),
                  "MmBackward0 > aten::mm": pytest.approx(100e-6),
                  "harts.kda > aten::index_select": pytest.approx(10e-6), "harts.kda": pytest.approx(10e-6)}
    assert [name for name, _ in out["by_host"]][0] == "(no operator: Python)"
    assert out["synchronizations"] == {"count": 1, "seconds": pytest.approx(6e-6)}
    assert sp._gaps([]) == [] and sp._gaps([(0, 5), (1, 3), (5, 6)]) == []
    table = sp.idle_table({"kv_tree_within": {"idle_while": out}, "cpu": {}}, top=2)
    lines = table.splitlines()
    assert len(lines) == 3 and lines[0].startswith("kv_tree_within: device idle 0.002 s (")
    assert "1 host synchronizations waiting 0.000 s" in lines[0]
    assert lines[1].split() == ["0.001", "s", "(no", "operator:", "Python)"]
    short = sp.idle_attribution(events[:2], [(0, 100)], lambda e: e.name, top=1)
    assert short["by_host"][0][0] == "(no operator: Python)" and short["by_host"][1][0] == "(2 more)"
    assert short["by_host"][1][1] == pytest.approx(30e-6)        # harts.kda 20 us, aten::index_select 10 us
