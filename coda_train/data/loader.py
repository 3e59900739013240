"""Batches of fixed token windows in a seeded order; the position is two integers, so resuming is exact."""

from __future__ import annotations

import logging
from typing import Iterator, Optional

import numpy as np
import torch

from .config import DataError
from .shards import PreparedData

log = logging.getLogger(__name__)


GLOBAL_BATCH = "global batch (trainer.batch_size x processes x trainer.grad_accum_steps)"


def global_batch(batch_size: int, processes: int, accum_steps: int) -> str:
    """A global batch as the resume refusals name it: its three factors and their product."""
    return f"{batch_size} x {processes} x {accum_steps} = {batch_size * processes * accum_steps}"


def global_batch_refusal(saved: tuple[int, int, int], now: tuple[int, int, int]) -> Optional[tuple[tuple[str, str], str]]:
    """The resume rule for a global batch, saved and now each (batch_size, processes, grad_accum_steps): another
    micro-batch (batch_size x processes) continues the saved data order only with the same global batch, while
    another accumulation alone resumes (load_state_dict warns). None where it resumes; else the refusal's (saved, now)
    as global_batch names them, and its fix, naming the grad_accum_steps that restores the saved global batch."""
    (saved_batch_size, saved_processes, saved_accum), (batch_size, processes, accum_steps) = saved, now
    saved_micro, micro = saved_batch_size * saved_processes, batch_size * processes
    saved_global = saved_micro * saved_accum
    if saved_micro == micro or saved_global == micro * accum_steps:
        return None
    fix = f"a global batch of {saved_global} windows"
    if saved_global % micro == 0:  # reachable on this micro-batch by accumulation alone
        fix += f" (trainer.grad_accum_steps={saved_global // micro} on {processes} process{'es' * (processes > 1)})"
    return (global_batch(*saved), global_batch(*now)), fix


def _empty_val_split(data: PreparedData) -> str:
    """Why a prepared folder's val split holds no document, and the data.val_fraction that holds one out."""
    documents, fraction = data.manifest["num_documents"], data.manifest["inputs"]["val_fraction"]
    if documents == 1:
        return (f"the val split of {data.path} is empty: its corpus is one document (a text file is one document, "
                f"whatever its size) and data.val_fraction holds out whole documents, so no value of it gives a val "
                f"split; cut the file into several (e.g. split -n l/100 FILE part_) and set data.source to them, or set "
                f"trainer.eval_every=0 (no validation)")
    suggested = np.ceil(1000 / documents) / 1000  # >= 1 / documents: document i is held out when floor((i+1)f) steps up
    return (f"the val split of {data.path} is empty: data.val_fraction={fraction} of its {documents} documents holds out "
            f"none (it holds out whole documents: none of fewer than 1 / data.val_fraction); set "
            f"data.val_fraction={suggested:g} or larger, or trainer.eval_every=0 (no validation)")


class TokenLoader:
    """Window w of a shard holds tokens [w*seq_len, w*seq_len + seq_len + 1): inputs and their next-token targets.

    Each epoch visits every window once in a permutation seeded by (seed, epoch); rank r takes every world_size-th
    window of it, so ranks are disjoint and together cover the epoch. All ranks must use the same seed, and their
    states are identical, so checkpointing rank 0's state_dict() is enough. accum_steps, the micro-batches of one
    optimizer step, only tells a resume which layouts read the same windows per optimizer step (load_state_dict).
    """

    def __init__(
        self, data: PreparedData, split: str, batch_size: int, seq_len: int, seed: int, rank: int = 0, world_size: int = 1,
        accum_steps: int = 1,
    ):
        if batch_size < 1 or seq_len < 1 or seed < 0 or accum_steps < 1 or not 0 <= rank < world_size:
            settings = (f"batch_size={batch_size}, seq_len={seq_len}, seed={seed}, rank={rank}, world_size={world_size}, "
                        f"accum_steps={accum_steps}")
            raise DataError(f"invalid loader settings: {settings}; all must be positive (seed >= 0) and rank < world_size")
        self.data, self.split = data, split
        self.batch_size, self.seq_len, self.seed, self.rank, self.world_size = batch_size, seq_len, seed, rank, world_size
        self.accum_steps = accum_steps
        self.shards = data.shards(split)
        # windows never straddle shards: each shard loses < seq_len tokens, and a window is one contiguous read
        windows_per_shard = [max(0, (len(shard) - 1) // seq_len) for shard in self.shards]
        self.shard_offsets = np.cumsum([0] + windows_per_shard)  # first global window index of each shard
        self.num_windows = int(self.shard_offsets[-1])
        self.windows_per_rank = self.num_windows // world_size  # equal per rank, so all ranks take the same number of steps
        # micro-steps per epoch: whole optimizer steps, so an epoch uses the first (N // (B*W*A)) * B*W*A windows of
        # its permutation, the same for every layout of one optimizer batch (and no step straddles two epochs)
        self.steps_per_epoch = self.windows_per_rank // (batch_size * accum_steps) * accum_steps
        if self.steps_per_epoch == 0 and split == "val" and data.manifest["splits"]["val"]["num_documents"] == 0:
            raise DataError(_empty_val_split(data))  # no batch size or seq_len helps there, nor always a larger fraction
        if self.steps_per_epoch == 0:
            # a larger val split is taken from the train split: the fraction moves opposite ways for the two
            more = ("more data or a smaller data.val_fraction" if split == "train" else
                    "a larger data.val_fraction, or trainer.eval_every=0 (no validation)")
            raise DataError(
                f"the {split} split has {data.num_tokens(split)} tokens = {self.num_windows} windows of {seq_len}+1, fewer than "
                f"one batch of {batch_size} x {accum_steps} micro-batches per rank x {world_size} ranks; use a smaller "
                f"trainer.batch_size, trainer.seq_len or trainer.grad_accum_steps{', fewer processes' if world_size > 1 else ''}"
                f", {more}"
            )
        self.epoch, self.step = 0, 0
        self._order_epoch: Optional[int] = None
        self._order = np.empty(0, dtype=np.int64)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), int64 [batch_size, seq_len]; targets are the inputs shifted left by one token."""
        if self.step == self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        order = self._rank_order(self.epoch)
        windows = order[self.step * self.batch_size : (self.step + 1) * self.batch_size]
        self.step += 1
        return self._batch(windows)

    def iter_eval(self, num_batches: Optional[int] = None, every_window: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The same batches on every call (windows in storage order, disjoint per rank); does not move the training
        position. every_window (one process, num_batches None): every window of the split, the last batch partial,
        so what is evaluated does not depend on batch_size (scripts/eval.py)."""
        if every_window:
            if self.world_size != 1 or num_batches is not None:
                raise ValueError("every_window reads the whole split in one process")
            for start in range(0, self.num_windows, self.batch_size):
                yield self._batch(np.arange(start, min(start + self.batch_size, self.num_windows)))
            return
        steps = self.steps_per_epoch if num_batches is None else min(num_batches, self.steps_per_epoch)
        windows = np.arange(self.rank, self.windows_per_rank * self.world_size, self.world_size)
        for step in range(steps):
            yield self._batch(windows[step * self.batch_size : (step + 1) * self.batch_size])

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "step": self.step,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "world_size": self.world_size,
            "accum_steps": self.accum_steps,
            "num_windows": self.num_windows,
            "split": self.split,
            "tokenizer": self.data.manifest["tokenizer"]["fingerprint"],
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where the saved loader stopped; refuses states whose batches this loader cannot reproduce."""
        mine = self.state_dict()
        # rank r's micro-step s is windows r, r+W, ... of the permutation's slice [s*G, (s+1)*G), G = B*W, and an
        # epoch uses its first (N // (G*A)) * G*A windows: every layout with the same G*A reads the same windows per
        # optimizer step (with the same G, per micro-step too), e.g. a run moved to fewer GPUs, its batch made up
        # by accumulation
        layout = ("epoch", "step", "batch_size", "world_size", "accum_steps")
        differing = {k: (state.get(k), mine[k]) for k in mine if k not in layout and state.get(k) != mine[k]}
        saved_micro = state.get("batch_size", 0) * state.get("world_size", 0)
        micro = self.batch_size * self.world_size
        saved_accum = state.get("accum_steps", self.accum_steps)  # not saved before 2026-12-05: take it as unchanged
        step = state.get("step", 0)
        fixes = [f"trainer.{k}={differing[k][0]}" for k in ("seed", "seq_len") if k in differing]
        if {"num_windows", "tokenizer", "split"} & differing.keys():
            fixes.append("the run's data settings and its corpus as the run prepared it (another corpus, or other data "
                         "settings, prepare other windows)")
        if saved_micro != micro:  # (the same G with another A: the same micro-steps, as a batch-size schedule makes)
            refusal = global_batch_refusal((state.get("batch_size", 0), state.get("world_size", 0), saved_accum),
                                           (self.batch_size, self.world_size, self.accum_steps))
            if "accum_steps" not in state:  # saved before 2026-12-05: its accumulation is unknown
                differing["trainer.batch_size x processes"] = (saved_micro, micro)
                fixes.append(f"trainer.batch_size x processes = {saved_micro} and the run's own trainer.grad_accum_steps "
                             "(this checkpoint does not record it)")
            elif refusal is not None:
                differing[GLOBAL_BATCH], batch_fix = refusal
                fixes.append(batch_fix)
            elif (step * saved_micro) % micro == 0:
                step = step * saved_micro // micro  # the same windows consumed, counted in this layout's micro-steps
            else:  # a position inside one of this layout's micro-steps: the trainer saves whole optimizer steps only
                differing["trainer.batch_size x processes"] = (saved_micro, micro)
                fixes.append(f"trainer.batch_size x processes = {saved_micro} (the saved position, micro-step {step}, "
                             "ends inside one of this layout's micro-steps)")
        if differing:
            names = {"seed": "trainer.seed", "seq_len": "trainer.seq_len", "num_windows": "windows in the split (the data)",
                     "tokenizer": "the data's tokenizer", "split": "split"}
            detail = ", ".join(f"{names.get(k, k)}: saved {saved} vs now {now}" for k, (saved, now) in differing.items())
            raise DataError(f"cannot resume the data position, the loader differs from the checkpoint ({detail}); resume "
                            f"with {', '.join(fixes)}")
        if saved_micro * saved_accum != micro * self.accum_steps and self.rank == 0:  # only another accumulation gets here
            log.warning("the global batch (trainer.batch_size x processes x trainer.grad_accum_steps) is now %d windows, "
                        "was %d: each optimizer step reads more or fewer windows, and validation reads eval_batches "
                        "global batches of the new size, so val_loss from here on is over other windows than before",
                        micro * self.accum_steps, saved_micro * saved_accum)
        epoch = state.get("epoch", 0)
        if self.steps_per_epoch < step and step * micro <= self.num_windows:
            # a position this layout's epoch never reaches (it ends at its last whole optimizer step): a larger
            # grad_accum_steps than the run saved with, or a state saved before epochs were whole optimizer steps
            log.warning("the checkpoint's data position (epoch %d, micro-step %d) is past this layout's end of the epoch "
                        "(%d micro-steps of %d windows: whole optimizer steps only); continuing at the start of epoch %d",
                        epoch, step, self.steps_per_epoch, micro, epoch + 1)
            epoch, step = epoch + 1, 0
        if not (0 <= step <= self.steps_per_epoch and epoch >= 0):
            position = f"epoch={epoch} step={step}"
            raise DataError(f"loader state {position} is out of range (steps_per_epoch={self.steps_per_epoch})")
        self.epoch, self.step = int(epoch), int(step)

    def _rank_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:  # one permutation per epoch, rebuilt only when the epoch changes
            permutation = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._order = permutation[self.rank : self.windows_per_rank * self.world_size : self.world_size]
            self._order_epoch = epoch
        return self._order

    def _batch(self, windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        shard_ids = np.searchsorted(self.shard_offsets, windows, side="right") - 1
        starts = (windows - self.shard_offsets[shard_ids]) * self.seq_len
        rows = np.empty((len(windows), self.seq_len + 1), self.data.dtype)
        for row, shard_id, start in zip(rows, shard_ids, starts):
            self.shards[shard_id].read_into(row, int(start))
        if rows.size and rows.max() >= self.data.vocab_size:  # one pass over a small batch; an id past the embedding crashes
            raise self._bad_token_error(rows, shard_ids, starts)
        tokens = torch.from_numpy(rows.astype(np.int64))
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def _bad_token_error(self, rows: np.ndarray, shard_ids: np.ndarray, starts: np.ndarray) -> DataError:
        row, column = np.argwhere(rows >= self.data.vocab_size)[0]
        file = self.data.path / self.data.manifest["splits"][self.split]["shards"][shard_ids[row]]["file"]
        return DataError(
            f"shard {file} holds token id {int(rows[row, column])} at token {int(starts[row]) + int(column)}, but the "
            f"tokenizer has only {self.data.vocab_size} ids: the shard was damaged after preparation (data.verify_shards "
            f"checks checksums only once per copy, or was set to never). Delete the folder {self.data.path} and run "
            f"preparation again (python -m coda_train.data.prepare with the same data settings, or just start training again)"
        )
