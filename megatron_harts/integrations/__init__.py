"""Adapters that let RL frameworks drive megatron_harts (above ``training`` in the layering).

``integrations.verl``: a verl ``BaseEngine`` backed by the tree trainer (docs/verl.md); it imports
verl, so it is imported only by name (``megatron_harts.integrations.verl``) or through verl's plugin
entry point, never from here.
"""
