"""One micro-batch's forward and backward, run eagerly or replayed as a captured CUDA graph.

A small model's step is hundreds of short kernels, so the GPU waits on the host launching them
(launch-bound); a CUDA graph launches the whole forward+backward at once. The graph reads the batch
from static device buffers (each batch is copied in), accumulates gradients in place into the
parameters' preallocated .grad tensors, and adds its scaled loss into a static device scalar.
Nothing inside waits for the host. The optimizer, clipping and evaluation stay outside, eager.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from coda_train.errors import ConfigError

CUDA_GRAPHS = ("auto", "on", "off")  # trainer.cuda_graphs; auto: on for model.impl=coda on one CUDA GPU
GRAPH_IMPLS = ("coda", "eager")  # liger's fused cross-entropy reads a count back to the host: not capturable


def use_cuda_graphs(setting: str, impl: str, device: torch.device, parallel: str) -> bool:
    """trainer.cuda_graphs resolved for this run; `on` where it cannot run raises ConfigError naming the fix."""
    if setting == "auto":
        return impl == "coda" and device.type == "cuda" and parallel == "none"
    if setting == "off":
        return False
    why = []
    if device.type != "cuda":
        why.append(f"a CUDA device (this run is on {device.type})")
    if parallel != "none":
        why.append(f"one process without DDP/FSDP (trainer.parallel resolves to {parallel})")
    if impl not in GRAPH_IMPLS:
        why.append(f"model.impl in {list(GRAPH_IMPLS)} (got {impl})")
    if why:
        raise ConfigError("trainer.cuda_graphs=on needs " + " and ".join(why) + "; use trainer.cuda_graphs=auto or off")
    return True


def micro_batch(model: nn.Module, tokens: Tensor, targets: Tensor, loss_scale: Tensor | float, loss_sum: Tensor) -> None:
    """Gradients of loss * loss_scale accumulated into the parameters' .grad, and loss * loss_scale
    added to loss_sum (loss_scale = 1/grad_accum_steps: loss_sum ends as the step's mean loss)."""
    loss = model(tokens, targets) * loss_scale
    loss.backward()
    loss_sum.add_(loss.detach())


class GraphedMicroBatch:
    """micro_batch captured once for one batch shape and replayed for every micro-batch.

    Two graphs share one memory pool: `first` starts a step (its backward writes the gradients, as
    an eager backward into .grad=None would, and it restarts loss_sum), `rest` (captured only when
    a step has several micro-batches) accumulates into them. Writing rather than accumulating
    spares a zeroing pass and a read-add pass over every gradient per step. Capture needs every
    kernel compiled and every lazy cache (RoPE table, weight compute copies) built, so `warmup`
    eager iterations run first on a side stream. The graphs keep the addresses they saw: the
    gradients are the ones `first` allocated (never set them to None or replace them) and the
    parameters are only updated in place. The model's compute copies of the weights are not
    refreshed by a graph: the trainer's AdamW writes them in place as it updates the weights.
    """

    def __init__(self, model: nn.Module, tokens: Tensor, targets: Tensor, loss_scale: float,
                 accumulate: bool = False, warmup: int = 3):
        """Captures for tokens' shape, warming up on (tokens, targets); `accumulate`: also the graph
        of a step's later micro-batches."""
        device = next(model.parameters()).device
        if device.type != "cuda":
            raise ConfigError(f"CUDA graphs need a CUDA device; the model is on {device.type} "
                              "(use trainer.cuda_graphs=auto or off)")
        self.model = model
        self.tokens = tokens.to(device, copy=True)
        self.targets = targets.to(device, copy=True)
        self.loss_scale = torch.full((), loss_scale, dtype=torch.float32, device=device)
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        params = list(model.parameters())

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                for p in params:
                    p.grad = None
                self._run(first=True)
        torch.cuda.current_stream(device).wait_stream(side)
        for p in params:
            p.grad = None  # so the captured backward allocates (and then always rewrites) them
        self.first = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.first):
            self._run(first=True)
        self.params, self.grads = params, [p.grad for p in params]  # the buffers the graphs write
        self.rest = None
        if accumulate:
            self.rest = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.rest, pool=self.first.pool()):
                self._run(first=False)
        self.started = False

    def _run(self, first: bool) -> None:
        if first:
            self.loss_sum.zero_()
        micro_batch(self.model, self.tokens, self.targets, self.loss_scale, self.loss_sum)

    def set_loss_scale(self, value: float) -> None:
        """The factor every later replay multiplies the loss by (on the device: no host sync)."""
        self.loss_scale.fill_(value)

    def __call__(self, tokens: Tensor, targets: Tensor, first: bool) -> None:
        """One micro-batch on (tokens, targets): copied into the static buffers, then the graph of
        a step's first micro-batch replayed (it rewrites the gradients and loss_sum), or of a later one."""
        if tokens.shape != self.tokens.shape or targets.shape != self.targets.shape:
            raise ValueError(f"the CUDA graph was captured for batches of shape {tuple(self.tokens.shape)}, got "
                             f"{tuple(tokens.shape)} and {tuple(targets.shape)}; capture another GraphedMicroBatch "
                             "for that shape")
        if any(p.grad is not g for p, g in zip(self.params, self.grads)):
            raise RuntimeError("a parameter's .grad was replaced (e.g. zero_grad(set_to_none=True)) while its CUDA "
                               "graph is live: the graph would keep writing the old buffer")
        if not first and self.rest is None:
            raise RuntimeError("this GraphedMicroBatch was captured without accumulate=True: it has no graph for a "
                               "step's later micro-batches")
        self.tokens.copy_(tokens, non_blocking=True)
        self.targets.copy_(targets, non_blocking=True)
        (self.first if first else self.rest).replay()
