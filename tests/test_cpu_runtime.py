"""The CPU shim for megatron-core (testing/cpu_runtime.py): what it redirects works like the CUDA
original where libraries use it, and everything is restored on exit."""
import numpy as np
import torch

from megatron_cpu import megatron_cpu


def test_streams_optimizer_tensors_and_host_copies_inside_and_restored_outside():
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.transformer.moe import token_dispatcher
    originals = (torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream, optimizer.torch,
                 optimizer.clip_grad_by_total_norm_fp32, token_dispatcher.maybe_move_tensor_to_cpu)
    with megatron_cpu():
        # a class, as libraries annotate with it (``torch.cuda.Stream | None`` at import time)
        assert isinstance(torch.cuda.Stream | None, object)
        s = torch.cuda.Stream()
        assert s is torch.cuda.current_stream()
        with torch.cuda.stream(s):
            s.wait_stream(torch.cuda.current_stream())
            s.record_event().synchronize()
        # CUDA-literal tensors of megatron's optimizer land on the CPU
        t = optimizer.torch.tensor([1.0], dtype=torch.float, device="cuda")
        assert t.device.type == "cpu"
        # the all-to-all dispatcher's split sizes come back as numpy arrays
        splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
        assert isinstance(splits, np.ndarray) and splits.tolist() == [3, 1]
        # clipping scales gradients of any dtype by max_norm / (norm + 1e-6) when below 1
        p = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
        p.grad = torch.full((4,), 2.0, dtype=torch.float64)
        optimizer.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)
        torch.testing.assert_close(p.grad, torch.full((4,), 2.0 / (4.0 + 1e-6), dtype=torch.float64))
    assert (torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream, optimizer.torch,
            optimizer.clip_grad_by_total_norm_fp32, token_dispatcher.maybe_move_tensor_to_cpu) == originals
    assert clip_grads.torch is torch


def test_free_port_lies_below_the_ephemeral_range():
    """A rendezvous port comes from below the OS's ephemeral range (where connections' local ends and
    binds to port 0 go, so nothing else is handed it before the rendezvous binds it), and is bindable."""
    import socket

    from megatron_harts.testing.cpu_runtime import _ephemeral_low, free_port
    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1
    for port in ports:
        if low is not None:
            assert 10000 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
