"""The CODA epilogue programs, written with quack's ``@gemm_epilogue`` frontend.

Each program is a plain function called once per accumulator element (or per adjacent-column
pair in ``acc_pair`` mode) at trace time; its parameters after ``acc`` are the epilogue operands
(row vector ``(1, N)``, column vector ``(1, M)``, tile ``(M, N)``, scalar), and it returns the
values to store (``"D"`` and declared tile outputs) and to reduce (declared sinks). quack lowers
the function onto its Hopper GEMM; everything runs in fp32 registers before the single rounding
store. Programs are module globals so quack's compile cache can re-import them by name.

Vocabulary (quack.epilogue.ops): RowVecLoad / ColVecLoad (vector loads), TileLoad (inferred for
(M, N) operands, or ``c`` = the GEMM C operand), TileStore (``outputs=``), ColVecReduce (per-row
partial sums over each N tile -> (M, n_tiles)), RowVecReduce (per-column partial sums over each
M tile -> (m_tiles, N)), OnlineLSEReduce (running max / sum-exp per row and N tile),
ColVecSelect (pick the target column per row).
"""

from __future__ import annotations

import hashlib
import inspect

import cutlass.cute as cute
from cutlass import BFloat16, Boolean, Float32
from cutlass._mlir_helpers import math as mlir_math
from cutlass.cutlass_dsl import dsl_user_op

import quack
from quack.activation import sigmoid as _sigmoid, swiglu as _swiglu
from quack.epilogue.frontend import gemm_epilogue, pack, unpack
from quack.epilogue.ops import (
    ColVecLoad,
    ColVecReduce,
    ColVecSelect,
    OnlineLSEReduce,
    RowVecLoad,
    RowVecReduce,
)
from quack.epilogue.math import pexp2
from quack.epilogue.rotary import rotary_cos_sin_load
from quack.epilogue.scaled_exp import LOG2E, MaxLog2
from quack.operand_transform import a_transform

_QUACK_VERSION = quack.__version__


class _Library:
    """A math helper built on cutlass' ``dsl_user_op`` as an epilogue dependency with a fixed cache
    identity. quack keys its kernel cache on a deep fingerprint of each epilogue fn; such helpers
    capture a ContextVar that the fingerprint rejects (on Python 3.12), so we key them by (module,
    name, quack version) and, for a helper of this package, the hash of its source."""

    def __init__(self, fn):
        self.fn = fn
        self.source_hash = None
        if fn.__module__ == __name__:  # ours: an edit must change the key (quack's own follow its version)
            self.source_hash = hashlib.sha256(inspect.getsource(inspect.unwrap(fn)).encode()).hexdigest()[:16]

    def __call__(self, *args):
        return self.fn(*args)

    def __quack_semantic_key__(self):
        return (self.fn.__module__, self.fn.__qualname__, _QUACK_VERSION, self.source_hash)


swiglu = _Library(_swiglu)  # silu(gate) * up


def as_stored(v):
    """Round an fp32 value to bf16 and back: the value exactly as the bf16 output stores it, so
    statistics computed next to the store see the same x that later kernels read."""
    return v.to(BFloat16).to(Float32)


# F1: qkv = RoPE(r * h W^T) on the q/k columns, r * h W^T on the v columns, in one launch. `cs` is
# the interleaved (cos, sin) table with one row per token row (position = row % T expanded on the
# host, head_dim wide; the table op repeats it across heads), `r` the row scale, `rot` 1 on the
# rotated columns and 0 on the v columns, where (c, s) becomes (1, 0): the identity, exactly.
@gemm_epilogue(ops={"cs": rotary_cos_sin_load("cs"), "r": ColVecLoad("r"), "rot": RowVecLoad("rot")}, mode="acc_pair")
def rowscale_rope(acc, cs, r, rot):
    y0, y1 = unpack(acc * r)
    c, s = unpack(cs)
    m, _ = unpack(rot)
    c, s = m * c + (1.0 - m), m * s
    return {"D": pack(y0 * c - y1 * s, y0 * s + y1 * c)}


# L (inference logits): y = r * acc.
@gemm_epilogue(ops={"r": ColVecLoad("r")})
def rowscale(acc, r):
    return {"D": acc * r}


# F3/F6: x = residual + a W^T (C operand), stored bf16; h = x * gamma; per-tile sum of x^2.
@gemm_epilogue(
    outputs=("h",),
    ops={"gamma": RowVecLoad("gamma")},
    reduces={"sumsq": ColVecReduce("sumsq", scaled=True)},
)
def residual_rmsnorm_partial(acc, c, gamma):
    x = as_stored(acc + c)
    return {"D": x, "h": x * gamma, "sumsq": (x, x)}


# F5: [gate | up] = r * h W_gu^T, a = silu(gate) * up. quack's concat_layout reads the weight's
# [gate | up] row halves pair-interleaved (no copy), so gate column j and up column j arrive as one
# accumulator pair; the rounded gate and a (from the rounded gate and the fp32 up: one rounding, so
# a / gate in B1 is as accurate as a stored up) go to two half-width stores. up is not stored
# (docs/design.md, "SwiGLU: two stored tiles each way").
_GATE_FLOOR = 2.0 ** -100  # reference.GATE_FLOOR: a gate below it in magnitude is stored as +2^-100, so a keeps up


@dsl_user_op
@cute.jit
def _floor_gate(gate: Float32, *, loc=None, ip=None):
    return Float32(_GATE_FLOOR) if Boolean(abs(gate) < _GATE_FLOOR) else gate  # as the reference: a NaN gate stays NaN


floor_gate = _Library(_floor_gate)


@gemm_epilogue(outputs=("gate", "a"), ops={"r": ColVecLoad("r")}, mode="acc_pair")
def rowscale_swiglu(acc, r):
    g, u = unpack(acc * r)
    g = floor_gate(as_stored(g))  # reference.floor_gate
    return {"gate": g, "a": swiglu(g, u)}


# H (evaluation): logits y = r * h W_lm^T never leave the chip: online (max, sum-exp) partials per N tile and
# the target column's logit. No D store.
_target = ColVecLoad("target")


@gemm_epilogue(
    ops={"r": ColVecLoad("r")},
    outs={"lse": OnlineLSEReduce("lse"), "target_logit": ColVecSelect("target_logit", idx_op=_target)},
    extra_ops=(_target,),
)
def rowscale_lse_target(acc, r):
    y = acc * r
    return {"lse": y, "target_logit": y}


# H (training): y = r * h W_lm^T stored as e = 2^t, t = y log2e - k, k = round(max y log2e) per row and
# N tile (quack's MaxLog2 prepass over the accumulator, so |e| <= sqrt 2), with per-tile sums of e and
# e*t and the target logit. k is per whole tile_N (a multiple of the contract's 128-column group;
# the op hands each group its tile's k: reference.exp_stats_per_group).
def _rowscale_logits(acc, r):
    return {"k": acc * r}


@dsl_user_op
@cute.jit
def _log2_excess(y: Float32, k: Float32, *, loc=None, ip=None):
    # one rounding (reference._log2_excess): t is small near the row's largest logit, y log2e is not
    return mlir_math.fma(y, Float32(LOG2E), -k, loc=loc, ip=ip)


log2_excess = _Library(_log2_excess)
_exp_offset = MaxLog2("k")
_target_exp = ColVecLoad("target")


@gemm_epilogue(
    ops={"k": _exp_offset, "r": ColVecLoad("r")},
    prepass=_rowscale_logits,
    prepass_outs=("k",),
    reduces={"sum_exp": ColVecReduce("sum_exp"), "sum_exp_t": ColVecReduce("sum_exp_t", scaled=True)},
    outs={"target_logit": ColVecSelect("target_logit", idx_op=_target_exp)},
    extra_ops=(_exp_offset.out("k_out"), _target_exp),
)
def rowscale_exp_target(acc, k, r):
    y = acc * r
    t = log2_excess(y, k)
    e = pexp2(t)
    return {"D": e, "sum_exp": e, "sum_exp_t": (e, t), "target_logit": y}


# H'' operands: the strip of powers of two (H') scales e as the mainloop loads it (register-sourced A):
# per (row, 64-wide K tile) in the dgrad (A = e), per (64 rows, k) in the weight gradient (A = e^T).
@a_transform(vec_size=8, args={"u": "colvec_ktile"})
def strip_scale_rows(x, u):
    return x * u


@a_transform(vec_size=8, args={"u": "kvec_m64"})
def strip_scale_cols(x, u):
    return x * u


# B1: acc = g_out W_down = g_a; dSwiGLU from F5's gate and a (two tile loads): q = up * sigmoid(gate)
# = a / gate, g_gate = g_a q (1 + gate (1 - sigmoid)), g_up = g_a silu(gate); stores r*g_gate and r*g_up
# into the halves of one (M, 2F) buffer (no D: a is F5's); per-tile partials of sum g_gu * gu, whose up
# half is g_up * up = g_a * a. Scalars: SM90's frontend calls it once per element.
_FLT_MIN = 1.1754943508222875e-38  # below it (0 or subnormal) the ftz rcp would give inf: q = 0 (reference.up_times_sigmoid)


@dsl_user_op
@cute.jit
def _dswiglu_from_a(gate: Float32, a: Float32, dout: Float32, *, loc=None, ip=None):
    sig = _sigmoid(gate)
    rcp_gate = mlir_math.rcp(gate, approx=True, ftz=True, loc=loc, ip=ip)
    q = Float32(0.0) if Boolean(abs(gate) < _FLT_MIN) else a * rcp_gate  # as the reference: a NaN gate gives NaN
    dup = (gate * sig) * dout
    dgate = q * (1.0 + gate - gate * sig) * dout
    return dgate, dup


dswiglu_from_a = _Library(_dswiglu_from_a)


@gemm_epilogue(
    outputs=("g_gate", "g_up"),
    ops={"r": ColVecLoad("r")},
    reduces={"stat": ColVecReduce("stat")},
)
def dswiglu_rowscale_stat(acc, gate, a, r):
    dg, du = dswiglu_from_a(gate, a, acc)
    return {"g_gate": dg * r, "g_up": du * r, "stat": dg * gate + acc * a}


# B3/B6b: acc = (r g_y) W = g_h; g_x = residual_grad (C) + gamma*acc + c*x; per-M-tile
# partials of g_gamma = sum_rows acc * x. (quack.epilogue.library.rms_bwd_apply_epi is the same
# program; ours names the operands after the op.)
@gemm_epilogue(
    ops={"gamma": RowVecLoad("gamma"), "coef": ColVecLoad("coef")},
    reduces={"g_gamma": RowVecReduce("g_gamma", scaled=True)},
)
def rmsnorm_backward(acc, c, x, gamma, coef):
    return {"D": acc * gamma + x * coef + c, "g_gamma": (acc, x)}


# H'': acc = (strip (x) e) W_lm; g_h = v*acc (v: the per-row factor that H', cross_entropy_exp_backward,
# makes from H's sums: grad_scale r 2^k_max e^-L);
# g_x = gamma*g_h + c*x (no residual: the LM head ends the graph); partials of g_gamma = sum g_h*x.
@gemm_epilogue(
    ops={"gamma": RowVecLoad("gamma"), "coef": ColVecLoad("coef"), "v": ColVecLoad("v")},
    reduces={"g_gamma": RowVecReduce("g_gamma", scaled=True)},
)
def rowscale_rmsnorm_backward(acc, x, gamma, coef, v):
    g_h = acc * v
    return {"D": g_h * gamma + x * coef, "g_gamma": (g_h, x)}


# matmul / matmul_tn on quack: D = acc (stored in D's dtype: bf16, or fp32 for weight gradients); with
# add_to_output, matmul_tn_exp_add's D += acc (the TMA reduce-add store).
@gemm_epilogue()
def plain(acc):
    return {"D": acc}
