"""Tree-mode operators.  Each has a plain-torch reference beside its fast path, under one
interface, and tests pinning equality with per-trajectory (expanded) computation.

Modules (import from them directly; this package re-exports nothing, so that a module and
the function it is named after never shadow each other):

- ``tree_attention``: full attention over visible rows (reference / chunked SDPA / FlexAttention /
  varlen over key paths).
- ``key_paths``: the varlen backend's runs of rows and their gathered keys.
- ``path_conv``: KDA's causal short convolution along each row's path.
- ``kda`` and ``tree_kda``: the KDA core and its executor over a call plan.
- ``logprobs``: multi-target log-probs from (vocab-parallel) output layers.
- ``moe``: occurrence-weighted MoE statistics (aux losses, tokens per expert).
- ``kda_elementwise``, ``router_topk``, ``moe_gather``: fused Triton kernels for the KDA layer's
  elementwise chains, the sigmoid router's top-k and the MoE gather-and-sum, each beside its torch
  reference (``models.common.use_fused_kernels`` decides where they run).
- ``fa4_blocks``, ``interval_attention``: tree attention over tiles (flash-attn-4's block-sparse
  kernels; Triton interval kernels).
- ``kda_fla``, ``kda_state_grad``: the KDA core on fla's kernels and the state-gradient kernel.
- ``triton_launch``, ``triton_tuning``: launching tuned Triton kernels directly; capping autotuning.
"""
