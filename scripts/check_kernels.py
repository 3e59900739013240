"""Correctness of every `cute` op against the reference oracle, on an H200 (sm_90).

For each op and each preset width (tiny, llama3_125m, llama3_1b, llama3_8b) at a ragged row count:
  * inputs are random, made once in bf16 (fp32 for row statistics, int64 for tokens);
  * oracle   = reference op on the same values in float64 on the GPU;
  * baseline = reference op run in bf16 (for attention also torch SDPA in bf16, the eager op);
  * cute     = the cute op, every output and partial buffer NaN-poisoned before the run.
Partial-sum outputs (any P) are compared after summing over P. Error is the relative Frobenius
error vs the oracle; an op passes when cute has no NaN/inf and err(cute) <= 1.5 * err(baseline)
+ 1e-4. Prints one compact table; --out DIR writes the full log and JSON there.

  python scripts/check_kernels.py [--presets tiny,llama3_1b] [--ops gemm_rowscale_rope,...] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from coda_train.kernels import reference as ref  # noqa: E402
from coda_train.model.config import PRESETS  # noqa: E402

# (preset, M rows, T seq_len): M is not a multiple of the 128-row tile; M % T == 0.
SHAPES = {
    "tiny": (1000, 250),
    "llama3_125m": (1000, 500),
    "llama3_1b": (4095, 819),
    "llama3_8b": (1000, 1000),
}
# output indices that are (M, P) partial sums: compared after .sum(-1)
PARTIALS = {
    "embedding_rmsnorm_partial": (2,),
    "gemm_residual_rmsnorm_partial": (2,),
    "gemm_cross_entropy_backward": (1,),
    "gemm_dswiglu_rowscale_stat": (2,),
    "rope_backward_rowscale_stat": (1,),
}
RATIO, ATOL = 1.5, 1e-4


def make_inputs(op: str, cfg, M: int, T: int, dev, gen):
    """Op inputs: bf16 activations/weights, fp32 statistics, python ints."""
    d, H, G, Fd, V = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size
    hd = d // H
    qkv_dim = (H + 2 * G) * hd
    bf, f32 = torch.bfloat16, torch.float32

    def randn(*s, scale=1.0, dtype=bf):
        return (torch.randn(*s, generator=gen, device=dev) * scale).to(dtype)

    def pos(*s):  # row scales r ~ 1/rms
        return (0.5 + torch.rand(*s, generator=gen, device=dev)).to(f32)

    w = lambda n, k: randn(n, k, scale=k ** -0.5)  # noqa: E731
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, device=dev, dtype=torch.float64) / hd))
    ang = torch.arange(T, device=dev, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = ang.cos().to(f32), ang.sin().to(f32)
    tokens = torch.randint(0, V, (M,), generator=gen, device=dev)
    n_rope = (H + G) * hd
    if op == "embedding_rmsnorm_partial":
        return dict(tokens=tokens, emb=randn(V, d), gamma=1 + randn(d, scale=0.1, dtype=f32))
    if op == "rstd_from_partials":
        return dict(sumsq_partials=torch.rand(M, 7, generator=gen, device=dev) * d, dim=d, eps=cfg.norm_eps)
    if op == "gemm_rowscale_rope":
        return dict(h=randn(M, d), r=pos(M), w=w(qkv_dim, d), cos=cos, sin=sin, n_rope_cols=n_rope)
    if op == "attention":
        return dict(qkv=randn(M, qkv_dim), n_heads=H, n_kv_heads=G, seq_len=T)
    if op == "gemm_residual_rmsnorm_partial":
        return dict(a=randn(M, H * hd), w=w(d, H * hd), residual=randn(M, d), gamma=1 + randn(d, scale=0.1, dtype=f32))
    if op == "gemm_rowscale_swiglu":
        return dict(h=randn(M, d), r=pos(M), w_gate_up=w(2 * Fd, d))
    if op == "gemm_rowscale_cross_entropy":
        return dict(h=randn(M, d), r=pos(M), w_lm=w(V, d, ) * 4, targets=tokens)
    if op == "gemm_cross_entropy_backward":
        h, r, w_lm = randn(M, d), pos(M), w(V, d) * 4
        lse, _ = ref.gemm_rowscale_cross_entropy(h.double(), r.double(), w_lm.double(), tokens)
        return dict(h=h, r=r, w_lm=w_lm, targets=tokens, lse=lse.float(),
                    grad_scale=torch.tensor(1.0 / M, device=dev))
    if op == "gemm_dswiglu_rowscale_stat":
        return dict(g_out=randn(M, d), w_down=w(d, Fd), gu=randn(M, 2 * Fd), r=pos(M))
    if op == "attention_backward":
        qkv = randn(M, qkv_dim)
        o, lse = ref.attention(qkv.double(), H, G, T)
        return dict(g_o=randn(M, H * hd), qkv=qkv, o=o.to(bf), lse=lse.float(), n_heads=H, n_kv_heads=G, seq_len=T)
    if op == "rope_backward_rowscale_stat":
        return dict(g_qkv=randn(M, qkv_dim), qkv=randn(M, qkv_dim), r=pos(M), cos=cos, sin=sin, n_rope_cols=n_rope)
    if op == "rmsnorm_backward_coeff":
        return dict(stat_partials=torch.randn(M, 5, generator=gen, device=dev), r=pos(M), dim=d)
    if op == "gemm_rmsnorm_backward":
        return dict(g_y_scaled=randn(M, qkv_dim), w=w(qkv_dim, d), residual_grad=randn(M, d), x=randn(M, d),
                    gamma=1 + randn(d, scale=0.1, dtype=f32), c=randn(M, scale=0.01, dtype=f32))
    if op == "gemm_rmsnorm_backward(no residual)":
        return dict(g_y_scaled=randn(M, 2 * Fd), w=w(2 * Fd, d), residual_grad=None, x=randn(M, d),
                    gamma=1 + randn(d, scale=0.1, dtype=f32), c=randn(M, scale=0.01, dtype=f32))
    if op == "matmul":
        return dict(a=randn(M, H * hd), b=w(H * hd, d))
    if op == "matmul_tn":
        return dict(a=randn(M, d), b=randn(M, 2 * Fd))
    if op == "embedding_backward":
        return dict(tokens=tokens, g_x=randn(M, d), vocab_size=V)
    raise KeyError(op)


OPS = ["embedding_rmsnorm_partial", "rstd_from_partials", "gemm_rowscale_rope", "attention",
       "gemm_residual_rmsnorm_partial", "gemm_rowscale_swiglu", "gemm_rowscale_cross_entropy",
       "gemm_cross_entropy_backward", "gemm_dswiglu_rowscale_stat", "attention_backward",
       "rope_backward_rowscale_stat", "rmsnorm_backward_coeff", "gemm_rmsnorm_backward",
       "gemm_rmsnorm_backward(no residual)", "matmul", "matmul_tn", "embedding_backward"]


def _to64(v):
    return v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v


def _outs(op, res):
    res = res if isinstance(res, tuple) else (res,)
    return tuple(t.sum(-1) if i in PARTIALS.get(op.split("(")[0], ()) else t for i, t in enumerate(res))


def _sdpa(inp):
    """The eager bf16 attention (torch SDPA, GQA) as a second baseline, forward or backward."""
    qkv, H, G, T = inp["qkv"], inp["n_heads"], inp["n_kv_heads"], inp["seq_len"]
    M = qkv.shape[0]
    hd = qkv.shape[1] // (H + 2 * G)
    x = qkv.detach().clone().requires_grad_("g_o" in inp)
    q, k, v = (t.reshape(M // T, T, -1, hd).transpose(1, 2) for t in x.split([H * hd, G * hd, G * hd], 1))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2).reshape(M, -1)
    if "g_o" not in inp:
        return (o.detach(),)
    o.backward(inp["g_o"])
    return (x.grad,)


def rel(x, y):
    x, y = x.double(), y.double()
    return float((x - y).norm() / y.norm().clamp_min(1e-300))


def check(op, preset, cute, log):
    cfg = PRESETS[preset]
    M, T = SHAPES[preset]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1234)
    inp = make_inputs(op, cfg, M, T, dev, gen)
    fn = op.split("(")[0]
    oracle = _outs(op, getattr(ref, fn)(**{k: _to64(v) for k, v in inp.items()}))
    base = _outs(op, getattr(ref, fn)(**inp))
    if fn in ("attention", "attention_backward"):
        sd = _sdpa(inp)
    torch.cuda.synchronize()
    t0 = time.time()
    got = _outs(op, getattr(cute, fn)(**inp))
    torch.cuda.synchronize()
    dt = time.time() - t0
    rows = []
    for i, (g, o, b) in enumerate(zip(got, oracle, base)):
        finite = bool(torch.isfinite(g).all()) if torch.isfinite(o).all() else True
        shape_ok = tuple(g.shape) == tuple(o.shape)
        e_c = rel(g, o) if shape_ok else math.inf
        e_b = rel(b, o)
        if fn in ("attention", "attention_backward") and i == 0:
            e_b = max(e_b, rel(sd[0], o))
        ok = finite and shape_ok and e_c <= RATIO * e_b + ATOL and g.dtype == b.dtype
        rows.append(dict(op=op, preset=preset, out=i, M=M, ok=ok, finite=finite, err_cute=e_c, err_base=e_b,
                         dtype=str(g.dtype).replace("torch.", ""), shape=list(g.shape), first_call_s=round(dt, 2)))
        log.write(json.dumps(rows[-1]) + "\n")
    return rows


MODEL_CASES = {  # preset, overrides, (batch, seq)
    "tiny": ("tiny", {}, (4, 256)),
    "llama3_1b_2layer": ("llama3_1b", {"n_layers": 2}, (2, 1024)),
}


def check_model(name, log):
    """Whole model: CODA on cute vs CODA on reference vs eager, all in bf16 compute with fp32
    master weights, against eager in float64 (the oracle). Pass: loss and every gradient of the
    cute run no worse than 1.5 x the eager bf16 error + 1e-4 (relative), and finite."""
    from coda_train import kernels
    from coda_train.model import build_model, preset

    p, over, (B, T) = MODEL_CASES[name]
    cfg = preset(p, **over)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    oracle = build_model(cfg, "eager").to(dev).double()
    oracle.compute_dtype = torch.float64
    gen = torch.Generator(device=dev).manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (B, T), generator=gen, device=dev)
    targets = tokens.roll(-1, dims=1)

    def run(impl, backend):
        model = build_model(cfg, impl).to(dev)
        model.load_state_dict({k: v.float() for k, v in oracle.state_dict().items()})
        model.compute_dtype = torch.bfloat16
        with kernels.use_backend(backend):
            loss = model(tokens, targets)
            loss.backward()
        torch.cuda.synchronize()
        out = {"loss": loss.detach().reshape(1)}
        out.update({n: q.grad for n, q in model.named_parameters()})
        del model
        return out

    loss = oracle(tokens, targets)
    loss.backward()
    ref64 = {"loss": loss.detach().reshape(1)}
    ref64.update({n: q.grad for n, q in oracle.named_parameters()})
    runs = {"cute": run("coda", "cute"), "reference": run("coda", "reference"), "eager": run("eager", "reference")}
    rows = []
    for n in ref64:
        errs = {k: rel(v[n], ref64[n]) for k, v in runs.items()}
        finite = bool(torch.isfinite(runs["cute"][n]).all())
        ok = finite and errs["cute"] <= RATIO * errs["eager"] + ATOL
        rows.append(dict(model=name, tensor=n, ok=ok, finite=finite, **{f"err_{k}": e for k, e in errs.items()}))
        log.write(json.dumps(rows[-1]) + "\n")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default=",".join(SHAPES))
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--models", default=",".join(MODEL_CASES), help="whole-model checks ('' for none)")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU (Hopper)"
    from coda_train import kernels

    kernels.set_backend("cute")
    import coda_train.kernels.cute as cute
    import coda_train.kernels.cute._launch as launch

    launch.POISON = True
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "check_kernels.jsonl"), "w")
    table = open(os.path.join(args.out, "check_kernels.txt"), "w")
    results, failures = [], []
    t_start = time.time()
    for preset in args.presets.split(","):
        for op in args.ops.split(","):
            try:
                rows = check(op, preset, cute, log)
            except Exception as e:  # keep going: one table for everything
                tb = traceback.format_exc()
                log.write(json.dumps(dict(op=op, preset=preset, error=tb)) + "\n")
                rows = [dict(op=op, preset=preset, out=0, ok=False, err_cute=math.nan, err_base=math.nan,
                             dtype="-", shape=[], first_call_s=0, error=f"{type(e).__name__}: {str(e)[:300]}")]
                print(f"ERROR {op} {preset}: {tb[-1500:]}", flush=True)
            results += rows
            for r in rows:
                line = (f"{'ok ' if r['ok'] else 'BAD'} {r['preset']:12s} {r['op']:36s} out{r['out']} "
                        f"cute {r['err_cute']:.2e} base {r['err_base']:.2e} {r['dtype']:9s} {r['first_call_s']:6.2f}s"
                        + (f"  {r['error']}" if "error" in r else ""))
                table.write(line + "\n")
                if not r["ok"]:
                    print(line, flush=True)
                    failures.append(r)
    log.close()
    table.close()
    log2 = open(os.path.join(args.out, "check_model.jsonl"), "w")
    # compact summary: per op and preset, worst err(cute)/err(base) over the outputs
    presets = args.presets.split(",")
    print(f"\n{'op':36s} " + " ".join(f"{p[:11]:>11s}" for p in presets) + "   (worst err_cute/err_base; * = fail)")
    for op in args.ops.split(","):
        cells = []
        for p in presets:
            rs = [r for r in results if r["op"] == op and r["preset"] == p]
            if any("error" in r for r in rs):
                cells.append("ERROR")
                continue
            ratio = max(r["err_cute"] / max(r["err_base"], 1e-12) for r in rs)
            cells.append(f"{ratio:.2f}{'' if all(r['ok'] for r in rs) else '*'}")
        print(f"{op:36s} " + " ".join(f"{c:>11s}" for c in cells))
    model_rows = []
    for name in filter(None, args.models.split(",")):
        try:
            rows = check_model(name, log2)
        except Exception as e:
            tb = traceback.format_exc()
            print(f"ERROR model {name}: {tb[-1500:]}", flush=True)
            rows = [dict(model=name, tensor="-", ok=False, finite=False, err_cute=math.nan, err_reference=math.nan,
                         err_eager=math.nan, error=f"{type(e).__name__}: {e}")]
        model_rows += rows
        worst = max(rows, key=lambda r: r["err_cute"] / max(r["err_eager"], 1e-12) if r["finite"] else math.inf)
        loss = next((r for r in rows if r["tensor"] == "loss"), worst)
        print(f"model {name:18s} {'ok ' if all(r['ok'] for r in rows) else 'BAD'} {sum(r['ok'] for r in rows)}/{len(rows)} "
              f"| loss err cute {loss['err_cute']:.1e} ref {loss['err_reference']:.1e} eager {loss['err_eager']:.1e} "
              f"| worst grad {worst['tensor']}: cute {worst['err_cute']:.1e} ref {worst['err_reference']:.1e} "
              f"eager {worst['err_eager']:.1e}", flush=True)
        failures += [dict(preset=name, op="model:" + r["tensor"], out=0, err_cute=r["err_cute"], err_base=r["err_eager"])
                     for r in rows if not r["ok"]]
    log2.close()
    with open(os.path.join(args.out, "check_kernels.json"), "w") as f:
        json.dump(dict(results=results, models=model_rows, seconds=time.time() - t_start,
                       device=torch.cuda.get_device_name()), f, indent=1)
    print(f"\n{len(results) - len(failures)}/{len(results)} outputs ok in {time.time() - t_start:.0f}s "
          f"on {torch.cuda.get_device_name()}")
    for r in failures:
        print(f"  FAIL {r['preset']} {r['op']} out{r['out']}: cute {r['err_cute']:.2e} vs base {r['err_base']:.2e}"
              + (f" {r.get('error', '')}" if "error" in r else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
