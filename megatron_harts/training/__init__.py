"""The training driver: --tree-sharing arguments, tree data loader, training loop."""
