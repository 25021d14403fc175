"""``harts-pretrain`` / ``pretrain_tree_gpt.py``: Megatron-style training on rollout trees.

Launch it as Megatron-LM's pretrain_gpt.py is launched (``torchrun --nproc-per-node N
pretrain_tree_gpt.py <Megatron-LM flags> --data-path PREFIX --tree-sharing windows``).  Every
failure a user can cause (flags, data, checkpoints, a non-finite loss) ends the process with
one ``error:`` line and exit status 2, never a traceback.  A checkpoint error is agreed by all
ranks (each raises the same message, naming every rank's cause): rank 0 prints it, the other
ranks exit 2 silently, so a job shows it once.
"""
from __future__ import annotations

import logging
import os
import random
import warnings
from typing import Optional, Sequence

import numpy as np
import torch

from ..cli import CliError, run

__all__ = ["main", "console_main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    # megatron-core's own notices (no Transformer Engine / Apex, deprecated defaults) are not the user's
    warnings.filterwarnings("ignore", module=r"megatron\.core")
    logging.getLogger("megatron.core").setLevel(logging.ERROR)
    # torch's notice about the ShardedTensor that megatron-core's checkpoint loading builds
    warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning)
    from ..planner.microbatch import PlanningError
    from ..rl.objectives import ObjectiveDataError
    from .arguments import parse_args
    from .checkpointing import CheckpointError
    from .data import LoaderError
    from .trainer import Trainer, TrainingError
    args = parse_args(argv)
    # the driver owns its process: Python's and numpy's RNGs are seeded too (Trainer seeds torch's)
    random.seed(args.seed)
    np.random.seed(args.seed % 2**32)
    trainer = None
    try:
        with Trainer(args) as trainer:
            trainer.train()
    except torch.OutOfMemoryError as e:
        raise CliError(out_of_memory_message(e, args, None if trainer is None else trainer.iteration)) from None
    except CheckpointError as e:
        if int(os.environ.get("RANK", "0")) != 0:
            return 2
        raise CliError(str(e)) from None
    except (TrainingError, LoaderError, ObjectiveDataError, PlanningError) as e:
        raise CliError(str(e)) from None
    return 0


def out_of_memory_message(e: BaseException, args, iteration: Optional[int]) -> str:
    """One line for a GPU out-of-memory error: where (the iteration being trained, when known), torch's
    own first line, and the flags that lower the memory a step needs."""
    tree = args.tree
    where = "while building the model" if iteration is None else f"in iteration {iteration + 1}"
    first = (str(e).strip().splitlines() or ["CUDA out of memory"])[0]
    knobs = [f"--tree-microbatch-tokens (now {tree.microbatch_tokens})"]
    if tree.piece_keep != "none":
        knobs.append(f"--tree-piece-keep none or a smaller --tree-piece-memory (now --tree-piece-keep {tree.piece_keep})")
    if args.recompute_granularity is None:
        knobs.append("--recompute-granularity full")
    return f"out of GPU memory {where}: {first} Lower the memory a step needs: " + "; ".join(knobs)


def console_main() -> None:
    """Entry point of the ``harts-pretrain`` console script."""
    run(main)
