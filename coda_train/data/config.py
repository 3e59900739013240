"""Data configuration (a hydra structured config) and the one error type users see."""

import dataclasses
import glob
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

DECODE_ERRORS = ("replace", "skip_document", "strict")
EOS_TOKEN = "<|endoftext|>"  # the end-of-document token of the BPE prepare trains (tokenizer.train_bpe)
VERIFY_SHARDS = ("first_use", "always", "never")


class DataError(ValueError):
    """Bad data input or a damaged prepared folder; the message says how to fix it."""


class CacheWriteError(DataError):
    """data.cache_dir cannot be written before preparing, or a write into it failed while preparing (disk full, quota,
    read-only, permissions): the machine's state, not the input's, so train.py exits with a run dir's write failure's
    code (4), which ends a sweep."""


@dataclass
class DataConfig:
    source: str = "builtin"  # "builtin" (Python stdlib sources), a local file/dir/glob, or a hub dataset name
    format: str = "auto"  # auto|text|json|parquet|arrow|hub
    text_field: str = "text"  # column holding the document text (json/parquet/arrow/hub)
    split: str = "train"  # hub split, or the split of a DatasetDict folder saved by save_to_disk
    # hub only: the dataset's commit sha (a branch or tag name can move to other data); None -> what the hub serves now
    revision: Optional[str] = None
    streaming: bool = False  # hub only; local files are always streamed
    tokenizer: Optional[str] = None  # tokenizer.json or HF tokenizer dir; None -> train byte-level BPE
    eos_token: Optional[str] = None  # None -> the tokenizer's own EOS (tokenizer_config.json, special_tokens_map.json or a known name)
    vocab_size: int = 8192  # for a trained tokenizer
    val_fraction: float = 0.02  # fraction of documents held out for validation, spread evenly
    cache_dir: str = "data_cache"  # prepared folders live here, one per input fingerprint
    num_proc: int = 2  # tokenization processes
    max_documents: Optional[int] = None  # use only the first N non-empty documents
    tokens_per_shard: int = 2**27  # 256 MiB per uint16 shard
    decode_errors: str = "replace"  # invalid UTF-8: replace (U+FFFD) | skip_document | strict (error naming file:line)
    verify_shards: str = "first_use"  # shard sha256 check at open: first_use (remembered per file size, mtime, ctime, inode) | always | never

    def for_model(self, init_from: Optional[str]) -> "DataConfig":
        """This config as a run uses it: a run started from a Hugging Face directory (model.init_from)
        tokenizes with that model's tokenizer unless data.tokenizer names another. Training, its config
        check and the tools that reopen a run's data (coda_train/inference.py) all read it through here."""
        if init_from is None or self.tokenizer is not None:
            return self
        return dataclasses.replace(self, tokenizer=init_from)

    def with_absolute_paths(self) -> "DataConfig":
        """This config with its local paths (source, tokenizer, cache_dir) absolute, as a run records it: the tools
        that reopen its data (eval, sample, export) may run from another directory. Names (builtin, a hub
        dataset) stay as they are."""
        def absolute(value: Optional[str]) -> Optional[str]:
            if value is None:
                return None
            path = Path(value).expanduser()
            local = path.exists() or (any(c in value for c in "*?[") and path.parent.exists())
            return str(path.absolute()) if local else value
        return dataclasses.replace(self, source=absolute(self.source), tokenizer=absolute(self.tokenizer),
                                   cache_dir=str(Path(self.cache_dir).expanduser().absolute()))

    def validate(self) -> None:
        if not self.source.strip():
            raise DataError("data.source is empty: name the corpus, e.g. data.source=/path/to/corpus.jsonl (a file, "
                            "a folder or a glob; configs/data/local_files.yaml), or use data=builtin")
        if not self.cache_dir.strip():  # Path("") is the current directory: prepared folders would land among its files
            raise DataError(f"data.cache_dir={self.cache_dir!r} is empty, which would prepare data into the current "
                            f"directory ({Path.cwd()}): name a folder, e.g. data.cache_dir=data_cache (the default)")
        if self.tokenizer is not None and not self.tokenizer.strip():  # else taken for unset here, for a path elsewhere
            raise DataError(f"data.tokenizer={self.tokenizer!r} is empty: name a tokenizer.json or a Hugging Face tokenizer "
                            "directory, or leave data.tokenizer unset (null) to train a BPE")
        if self.tokenizer is None and self.eos_token not in (None, EOS_TOKEN):
            raise DataError(f"data.eos_token={self.eos_token!r} is not in the BPE this run trains, whose end-of-document "
                            f"token is {EOS_TOKEN!r}: leave data.eos_token unset, or set data.tokenizer to a "
                            "tokenizer that has it")
        formats = ("auto", "text", "json", "parquet", "arrow", "hub")
        if self.format not in formats:
            raise DataError(f"data.format={self.format!r} is not one of {formats}")
        if self.tokenizer is None and self.vocab_size < 257:
            raise DataError(f"data.vocab_size={self.vocab_size} is too small: a byte-level BPE needs 256 bytes + EOS, use >= 257")
        if not 0.0 <= self.val_fraction < 1.0:
            raise DataError(f"data.val_fraction={self.val_fraction} must be in [0, 1)")
        if self.num_proc < 1:
            raise DataError(f"data.num_proc={self.num_proc} must be >= 1")
        if self.max_documents is not None and self.max_documents < 1:
            raise DataError(f"data.max_documents={self.max_documents} must be >= 1 (or None for all)")
        if self.decode_errors not in DECODE_ERRORS:
            raise DataError(f"data.decode_errors={self.decode_errors!r} is not one of {DECODE_ERRORS}")
        if self.verify_shards not in VERIFY_SHARDS:
            raise DataError(f"data.verify_shards={self.verify_shards!r} is not one of {VERIFY_SHARDS}")
        if self.tokens_per_shard < 1:
            raise DataError(f"data.tokens_per_shard={self.tokens_per_shard} must be >= 1")
        if self.revision is not None:
            self._check_revision()

    def _check_revision(self) -> None:
        from .sources import names_hub_dataset  # sources imports this module

        if not self.revision.strip():
            raise DataError(f"data.revision={self.revision!r} is empty: set a commit sha of the hub dataset, or leave "
                            "data.revision unset (null)")
        if self.revision != self.revision.strip():  # the hub would be asked for a revision with the spaces in it
            raise DataError(f"data.revision={self.revision!r} has spaces around it: set it to {self.revision.strip()!r}")
        if names_hub_dataset(self):
            return
        refused = f"data.revision={self.revision!r} pins a Hugging Face hub dataset, but data.source={self.source!r} is"
        if self.source != "builtin" and not glob.glob(os.path.expanduser(self.source)):  # a hub name taken for a path
            raise DataError(f"{refused} read as a local path (data.format={self.format}), and there is none (cwd "
                            f"{os.getcwd()}): set data.format=hub if it is a hub dataset's name, or remove data.revision")
        # load_dataset ignores a revision for a local folder: it would pin nothing
        what = "the embedded corpus" if self.source == "builtin" else "a local file, folder or glob"
        raise DataError(f"{refused} {what}, which is identified by its files: remove data.revision (or set data.source "
                        "to the hub dataset's name)")
