"""Train a hybrid KDA/MLA MoE model on rollout trees: a drop-in for Megatron-LM's pretrain_gpt.py.

    torchrun --nproc-per-node 8 pretrain_tree_gpt.py <Megatron-LM flags> \\
        --data-path rollouts --tree-sharing windows --tree-microbatch-tokens 32768

``--tree-sharing off`` trains the same model trajectory by trajectory (the expanded baseline).
``python pretrain_tree_gpt.py --help`` lists every flag.  Same as the ``harts-pretrain`` command.
"""
from megatron_harts.training.pretrain import console_main

if __name__ == "__main__":
    console_main()
