"""Megatron modules and layer specs for hybrid KDA/MLA MoE models in tree and expanded mode."""
