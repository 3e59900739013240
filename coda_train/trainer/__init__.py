"""The trainer: loop (setup, steps, stopping), optim (AdamW, schedules), checkpoint (atomic save,
verified resume), metrics (metrics.jsonl, wandb)."""

from .checkpoint import CheckpointError
from .loop import EXIT_BAD_INPUT, EXIT_NON_FINITE, NonFiniteError, train

__all__ = ["CheckpointError", "EXIT_BAD_INPUT", "EXIT_NON_FINITE", "NonFiniteError", "train"]
