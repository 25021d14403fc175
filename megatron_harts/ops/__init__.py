"""Tree-mode operators.  Each has a plain-torch reference beside its fast path, under one
interface, and tests pinning equality with per-trajectory (expanded) computation."""
from .tree_attention import tree_attention, build_tree_block_mask
from .path_conv import path_conv, build_conv_taps
