"""Runtime patches of megatron-core: one module each, version-guarded, applied explicitly."""
