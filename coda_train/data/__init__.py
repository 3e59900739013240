"""Data pipeline: raw text -> tokenizer -> token shards -> (inputs, targets) batches. See DataConfig, prepare, TokenLoader."""

from .config import CacheWriteError, DataConfig, DataError
from .loader import TokenLoader
from .shards import PreparationInterrupted, PreparedData, prepare, prepared_folder

__all__ = ["CacheWriteError", "DataConfig", "DataError", "PreparationInterrupted", "PreparedData", "TokenLoader", "prepare", "prepared_folder"]
