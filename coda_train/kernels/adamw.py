"""AdamW over fp32 master weights as one pass per parameter group (Triton on CUDA; plain torch elsewhere).

torch's fused AdamW reads p, g, m, v and writes p, m, v. Around it, a training step used to clip
the gradients in place (a read and a write of every gradient) and, after the update, cast each
weight to its compute copy (a second read of the weight). This pass multiplies each gradient by the
clip factor as it loads it and writes the bf16 compute copy of each weight that has one from the
value it just computed: 30 bytes a parameter where clip, AdamW and cast took 42 (28 where they took
36, for a weight without a copy). Same math as torch's fused AdamW (decoupled weight decay, bias
corrections from the per-parameter step count; found_inf skips the step and leaves the step count
alone), same state. adamw_update_reference is the same step in plain torch (the oracle, and the
CPU path); tests/test_optimizer.py checks both against torch's own AdamW.

Importing this module imports only torch; Triton loads at the first launch.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
from torch import Tensor

from .declare import TRITON_FP_FUSION

# Launch settings, read at each launch (scripts/bench_optimizer.py --sweep sets them to time others)
BLOCK = 2048  # elements a program updates at a time: 16 a thread at 4 warps (128-bit loads of fp32)
NUM_WARPS = 4  # 2048 x 4 was 9 % faster than 4096 x 8 at 1B and 8B (H200, docs/kernels.md)
CHUNKS = 1  # BLOCKs a program updates, one after the other (2 measured no faster)
ALIGNED = True  # False: no alignment hints even where they hold (half the speed on the H200)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def adamw_kernel(addresses, numels, block_tensor, block_start, grad_factor_ptr, found_inf_ptr,
                     lr, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, lr_weight_decay,
                     HAS_FACTOR: tl.constexpr, HAS_FOUND_INF: tl.constexpr, ALIGNED: tl.constexpr,
                     GRAD_ALIGN: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
        if HAS_FOUND_INF:
            if tl.load(found_inf_ptr) != 0:  # a non-finite step: nothing changes
                return
        pid = tl.program_id(0)
        t = tl.load(block_tensor + pid).to(tl.int64)
        first = tl.multiple_of(tl.load(block_start + pid), BLOCK)  # programs start at multiples of BLOCK
        numel = tl.load(numels + t)
        row = addresses + t * 6  # p, g, m, v, copy (0: none), step
        p_ptr = tl.load(row + 0).to(tl.pointer_type(tl.float32))
        g_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
        m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
        v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
        copy_address = tl.load(row + 4)
        c_ptr = copy_address.to(tl.pointer_type(tl.bfloat16))
        if ALIGNED:  # values read from memory carry no alignment: say it, or no access is vectorized
            numel = tl.multiple_of(numel, 8)  # the mask then holds over groups of 8 elements
            p_ptr = tl.multiple_of(p_ptr, 16)
            m_ptr = tl.multiple_of(m_ptr, 16)
            v_ptr = tl.multiple_of(v_ptr, 16)
            c_ptr = tl.multiple_of(c_ptr, 16)
        if GRAD_ALIGN > 4:  # the gradient apart: FSDP2 places its views at any 4-byte offset
            g_ptr = tl.multiple_of(g_ptr, GRAD_ALIGN)
        step = tl.load(tl.load(row + 5).to(tl.pointer_type(tl.float32)))
        step_size = lr / (1.0 - libdevice.pow(beta1, step))
        bias_correction2_sqrt = tl.sqrt(1.0 - libdevice.pow(beta2, step))
        factor = tl.load(grad_factor_ptr) if HAS_FACTOR else 1.0
        for chunk in tl.static_range(CHUNKS):
            offs = first + chunk * BLOCK + tl.arange(0, BLOCK)
            mask = offs < numel
            p = tl.load(p_ptr + offs, mask=mask)
            g = tl.load(g_ptr + offs, mask=mask)
            m = tl.load(m_ptr + offs, mask=mask)
            v = tl.load(v_ptr + offs, mask=mask)
            if HAS_FACTOR:
                g = g * factor  # the clip factor, as clip_grads_with_norm_ would have applied it
            if lr_weight_decay != 0.0:  # as torch: without decay an inf weight stays inf, not NaN
                p = p - lr_weight_decay * p  # decoupled weight decay
            m = beta1 * m + one_minus_beta1 * g
            v = beta2 * v + one_minus_beta2 * g * g
            p = p - step_size * m / (tl.sqrt(v) / bias_correction2_sqrt + eps)
            tl.store(p_ptr + offs, p, mask=mask)
            tl.store(m_ptr + offs, m, mask=mask)
            tl.store(v_ptr + offs, v, mask=mask)
            if copy_address != 0:
                tl.store(c_ptr + offs, p.to(tl.bfloat16), mask=mask)

    return adamw_kernel


@functools.cache
def _blocks(numels: tuple[int, ...], device: torch.device, block: int) -> tuple[Tensor, Tensor, Tensor]:
    """numels, and for each program its tensor and first element: the same every step, built once."""
    tensor, start = [], []
    for i, n in enumerate(numels):
        count = -(-n // block)
        tensor += [i] * count
        start += range(0, count * block, block)
    as_device = functools.partial(torch.tensor, dtype=torch.int64, device=device)
    return as_device(numels), as_device(tensor).to(torch.int32), as_device(start)


@functools.lru_cache(maxsize=16)
def _address_table(rows: tuple[tuple[int, ...], ...], device: torch.device) -> Tensor:
    """The kernel's address rows on the device, copied once per distinct table: a run's tensors keep
    their addresses from step to step (eager steps get their new gradients back at the old ones from
    the caching allocator), so a step pays no pinned-memory allocation or copy for it."""
    pinned = device.type == "cuda"
    return torch.tensor(rows, dtype=torch.int64, pin_memory=pinned).to(device, non_blocking=pinned)


def adamw_update_reference(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                           exp_avg_sqs: Sequence[Tensor], steps: Sequence[Tensor],
                           copies: Sequence[Optional[Tensor]], *,
                           lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                           grad_factor: Optional[Tensor] = None, found_inf: Optional[Tensor] = None) -> None:
    """adamw_update in plain torch, any device: the oracle of the kernel, and the CPU path. found_inf
    selects the old values on the device (no host read), as the kernel's early return leaves them.
    Writes go through .data, so, as the kernel's, they move no version counter."""
    _check_lengths(params, grads, exp_avgs, exp_avg_sqs, steps, copies)
    for p, g, m, v, step, copy in zip(params, grads, exp_avgs, exp_avg_sqs, steps, copies):
        step.add_(1)
        if grad_factor is not None:
            g = g * grad_factor
        step_size = lr / (1.0 - beta1 ** step)
        bias_correction2_sqrt = (1.0 - beta2 ** step).sqrt()
        new_p = p - (lr * weight_decay) * p if weight_decay != 0 else p
        new_m = beta1 * m + (1.0 - beta1) * g
        new_v = beta2 * v + (1.0 - beta2) * g * g
        new_p = new_p - step_size * new_m / (new_v.sqrt() / bias_correction2_sqrt + eps)
        skip = None if found_inf is None else found_inf != 0  # selected on the device, no host read
        for old, new in ((p, new_p), (m, new_m), (v, new_v)):
            old.data.copy_(new if found_inf is None else torch.where(skip, old, new))
        if found_inf is not None:
            step.sub_(found_inf)
        if copy is not None:
            copy.data.copy_(p if found_inf is None else torch.where(skip, copy, p))


def _check_lengths(params: Sequence[Tensor], *lists: Sequence) -> None:
    if any(len(x) != len(params) for x in lists):
        raise ValueError(f"adamw_update: {len(params)} parameters but lists of {[len(x) for x in lists]}")


def adamw_update(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
                 exp_avg_sqs: Sequence[Tensor], steps: Sequence[Tensor], copies: Sequence[Optional[Tensor]], *,
                 lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                 grad_factor: Optional[Tensor] = None, found_inf: Optional[Tensor] = None) -> None:
    """One AdamW step in place over contiguous fp32 tensors of one device (CUDA: the kernel, one
    launch per alignment class (_launch_rows): one in all where every tensor is 16-byte aligned with
    a multiple of 8 elements; elsewhere adamw_update_reference), moving no version counter: the step counts
    (fp32, 0-dim, on the device) advance by one unless found_inf is set; each gradient is multiplied
    by grad_factor (a 0-dim fp32 device tensor) as it is read and left as it was; copies[i], where
    not None, receives params[i] rounded to bf16 after an applied update (a skipped one leaves it)."""
    _check_lengths(params, grads, exp_avgs, exp_avg_sqs, steps, copies)
    if not params:
        return
    if not params[0].is_cuda:
        return adamw_update_reference(params, grads, exp_avgs, exp_avg_sqs, steps, copies, lr=lr, beta1=beta1,
                                      beta2=beta2, eps=eps, weight_decay=weight_decay, grad_factor=grad_factor,
                                      found_inf=found_inf)
    n = len(params)
    device = params[0].device
    rows = []  # the kernel's address table: p, g, m, v, copy (0: none), step count
    for i, (p, g, m, v, s, c) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, steps, copies)):
        if not all(t.is_cuda and t.device == device and t.dtype == torch.float32 and t.is_contiguous()
                   for t in (p, g, m, v, s)) or not p.shape == g.shape == m.shape == v.shape or s.numel() != 1:
            raise ValueError(f"adamw_update: tensor {i} must have contiguous float32 parameter, gradient and moments "
                             f"of one shape and a one-element float32 step count, all on {device}")
        if c is not None and (c.dtype != torch.bfloat16 or c.shape != p.shape or not c.is_contiguous()
                              or c.device != device):
            raise ValueError(f"adamw_update: copy {i} must be a contiguous bfloat16 tensor of shape "
                             f"{tuple(p.shape)} on {device}")
        rows.append((p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), 0 if c is None else c.data_ptr(),
                     s.data_ptr()))
    launches = _launch_rows(rows, [p.numel() for p in params])
    torch._foreach_add_(list(steps), 1)
    dummy = steps[0]  # a pointer for the absent optional arguments (never read)
    for (aligned, grad_align), (part_rows, part_numels) in launches.items():
        numels, block_tensor, block_start = _blocks(tuple(part_numels), device, BLOCK * CHUNKS)
        addresses = _address_table(tuple(part_rows), device)
        _kernel()[(block_tensor.numel(),)](
            addresses, numels, block_tensor, block_start,
            dummy if grad_factor is None else grad_factor, dummy if found_inf is None else found_inf,
            lr, beta1, beta2, 1.0 - beta1, 1.0 - beta2, eps, lr * weight_decay,
            HAS_FACTOR=grad_factor is not None, HAS_FOUND_INF=found_inf is not None, ALIGNED=aligned,
            GRAD_ALIGN=grad_align, BLOCK=BLOCK, CHUNKS=CHUNKS, num_warps=NUM_WARPS,
            enable_fp_fusion=TRITON_FP_FUSION)
    if found_inf is not None:  # as torch's fused AdamW: the count advances only on an applied step
        torch._foreach_sub_(list(steps), [found_inf] * n)


def _launch_rows(rows: list[tuple[int, ...]], numels: list[int]) -> dict[tuple[bool, int], tuple[list, list]]:
    """The launches of one update: (ALIGNED, GRAD_ALIGN) -> their address rows and element counts.
    16-byte accesses need the weight, moments and copy 16-byte aligned and a multiple of 8 elements
    (a bf16 copy's vector) under each mask: a tensor's first multiple of 8 elements runs hinted, its
    last numel % 8 as a row of its own, unhinted. The gradient's alignment is its own (16, 8 or 4
    bytes): FSDP2 reduce-scatters every gradient of a unit into one buffer, so a shard of an odd size
    (a norm's, over 3 ranks) shifts every gradient after it, while its weights and moments stay aligned."""
    launches: dict[tuple[bool, int], tuple[list, list]] = {}

    def add(key: tuple[bool, int], row: tuple[int, ...], numel: int) -> None:
        part_rows, part_numels = launches.setdefault(key, ([], []))
        part_rows.append(row)
        part_numels.append(numel)

    for row, numel in zip(rows, numels):
        p, g, m, v, c, s = row
        body = numel - numel % 8
        if not ALIGNED or any(address % 16 for address in (p, m, v, c)):  # (c 0: no copy)
            add((False, 4), row, numel)
            continue
        if body:
            add((True, 16 if g % 16 == 0 else 8 if g % 8 == 0 else 4), row, body)
        if numel % 8:
            add((False, 4), (p + 4 * body, g + 4 * body, m + 4 * body, v + 4 * body, c and c + 2 * body, s),
                numel % 8)
    return launches
