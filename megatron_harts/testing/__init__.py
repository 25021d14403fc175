"""Harness code that runs the model outside a training launcher and measures it.

- fidelity.py: tree mode against expanded mode (and transformers' Kimi-Linear) on the same
  weights: the runs, the bf16 oracle (:func:`~.fidelity.upcast_model`), the differences and their
  verdict; behind tools/verify_fidelity.py, the benchmarks' cosine checks and the trainer's probe.
- cpu_runtime.py: :func:`~.cpu_runtime.megatron_cpu_runtime`, a single-process megatron-core world on
  CPU as an explicit context manager (the trainer on CPU, tools, the test shim; nothing is applied
  at import), and :func:`~.cpu_runtime.single_process_megatron`, which picks it or the CUDA setup.

The package sits above ``models`` (it builds and runs models) and below ``training``: nothing in
``models`` imports it.
"""
