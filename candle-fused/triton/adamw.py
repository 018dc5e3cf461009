"""Fused in-place AdamW and the sum of squares of a gradient (for the global grad norm), in
Triton.

    g' = grad_scale g
    m  = b1 m + (1 - b1) g'                     (exp_avg, f32, in place)
    v  = b2 v + (1 - b2) g'^2                   (exp_avg_sq, f32, in place)
    p  = p (1 - lr wd) - (lr / bc1) m / (sqrt(v / bc2) + eps)     (param, f32, in place)

The CPU kernel (candle-fused/src/adamw.rs `adamw_update`) makes three passes (Candle's in-place
ops write one destination each); this kernel makes one pass, reading the gradient (in its
dtype: f32, bf16 or f16) and the three f32 tensors and writing the three. Per element the
operations and their order are the CPU's: `m * b1 + (g * gs) * (1 - b1)`, `v * b2 + (g' * g') *
(1 - b2)`, `p * decay - (m * step_size) / (sqrt(v * inv_bc2) + eps)`, every constant an f32
rounded as the CPU rounds it (the launcher gets them from
`candle_fused::cuda_kernels::adamw::scalars`), the square root and the division correctly
rounded (`sqrt_rn`, `div_rn`; Triton's defaults are approximate on the GPU), no FMA
contraction: the results are bit-identical.

Sum of squares (the CPU's `sum_of_squares`, whose square root over all gradients is
`global_norm`, and `clip_coefficient(norm, max_norm)` the `grad_scale` above): `sumsq_partial`
adds `x^2` over fixed blocks of 1024 elements in f64 (an f32 square is exact in f64) into
`PARTIAL` (`[P]` f64, `P = cdiv(E, 1024)`), and `sumsq_total` adds the partials in a fixed order
in f64 and rounds once to f32. The CPU adds the same f64 squares in another fixed order (8
lanes over blocks of 8192); both f64 sums are within ~1e-16 relative of the exact one, so the
f32 results are equal unless the sum lies within that of an f32 rounding boundary. No atomics:
the same bits on every run.

Layout contract (`candle_fused::cuda_kernels::adamw`): param, exp_avg, exp_avg_sq f32, grad in
the variant's dtype, all contiguous, flattened to `[E]`; every pointer 16-byte aligned; `E` any
value (< 2^31).
"""
import triton
import triton.language as tl


@triton.jit
def adamw_update(PARAM, GRAD, EXP_AVG, EXP_AVG_SQ, E, grad_scale, beta1, one_minus_beta1,
                 beta2, one_minus_beta2, decay, step_size, inv_bc2, eps, BLOCK: tl.constexpr):
    """Program `p`: one AdamW step on elements `[p * BLOCK, (p + 1) * BLOCK)`, in place."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < E
    g = tl.load(GRAD + offs, mask=mask, other=0.0).to(tl.float32) * grad_scale
    m = tl.load(EXP_AVG + offs, mask=mask, other=0.0)
    v = tl.load(EXP_AVG_SQ + offs, mask=mask, other=0.0)
    p = tl.load(PARAM + offs, mask=mask, other=0.0)
    m = m * beta1 + g * one_minus_beta1
    v = v * beta2 + (g * g) * one_minus_beta2
    denom = tl.sqrt_rn(v * inv_bc2) + eps
    p = p * decay - tl.div_rn(m * step_size, denom)
    tl.store(EXP_AVG + offs, m, mask=mask)
    tl.store(EXP_AVG_SQ + offs, v, mask=mask)
    tl.store(PARAM + offs, p, mask=mask)


@triton.jit
def sumsq_partial(X, PARTIAL, E, BLOCK: tl.constexpr):
    """Program `p`: `PARTIAL[p] = sum x^2` over elements `[p * BLOCK, (p + 1) * BLOCK)`, in f64."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < E, other=0.0).to(tl.float64)
    tl.store(PARTIAL + pid, tl.sum(x * x, axis=0))


@triton.jit
def sumsq_total(PARTIAL, OUT, P, BLOCK_P: tl.constexpr):
    """One program: `OUT[0] = sum PARTIAL` (f64, tiles of BLOCK_P partials in order), as f32."""
    acc = tl.zeros([BLOCK_P], dtype=tl.float64)
    for start in range(0, P, BLOCK_P):
        offs = start + tl.arange(0, BLOCK_P)
        acc += tl.load(PARTIAL + offs, mask=offs < P, other=0.0)
    tl.store(OUT, tl.sum(acc, axis=0).to(tl.float32))


# The fixed configuration compiled ahead of time; the Rust launch table is
# candle-fused/src/cuda_kernels/adamw.rs.
BLOCK = 1024
SUMSQ_BLOCK = 1024
TOTAL_BLOCK_P = 256

SCALARS = ["grad_scale", "beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "decay",
           "step_size", "inv_bc2", "eps"]
AOT = [
    dict(fn=adamw_update, num_warps=4, grid=f"(cdiv(E, {BLOCK}), 1, 1)",
         constexprs={"BLOCK": BLOCK},
         params=[("PARAM", "*fp32", "in/out [E] f32"), ("GRAD", "*{io}", "in [E]"),
                 ("EXP_AVG", "*fp32", "in/out [E] f32"), ("EXP_AVG_SQ", "*fp32", "in/out [E] f32"),
                 ("E", "i32", "elements")]
         + [(s, "fp32", "f32 constant (cuda_kernels::adamw::scalars)") for s in SCALARS]),
    dict(fn=sumsq_partial, num_warps=4, grid=f"(cdiv(E, {SUMSQ_BLOCK}), 1, 1)",
         constexprs={"BLOCK": SUMSQ_BLOCK},
         params=[("X", "*{io}", "in [E]"), ("PARTIAL", "*fp64", "out [P] f64"),
                 ("E", "i32", "elements")]),
    dict(fn=sumsq_total, num_warps=4, grid="(1, 1, 1)", dtypes=("f32",),
         constexprs={"BLOCK_P": TOTAL_BLOCK_P},
         params=[("PARTIAL", "*fp64", "in [P] f64"), ("OUT", "*fp32", "out [1] f32"),
                 ("P", "i32", "partials")]),
]

# Interpreter check. param, exp_avg, exp_avg_sq: bit-identical ("exact": no element differs)
# for every gradient dtype: the same f32 operations in the same order (IEEE add, multiply,
# correctly rounded sqrt and divide, no FMA contraction). sumsq: elementwise relative ("elem"):
# two f64 sums in different orders rounded to f32, equal unless the sum is within ~1e-16 of an
# f32 rounding boundary, then one f32 ulp apart: 2^-23 relative at most (expected 0).
ERROR = {"param": "exact", "exp_avg": "exact", "exp_avg_sq": "exact", "sumsq": "elem"}
TOL = {dt: {"param": 0, "exp_avg": 0, "exp_avg_sq": 0, "sumsq": 2.0**-23}
       for dt in ("f32", "bf16", "f16")}


def interpret(t, out_dtype):
    """The update on copies of the file's `param`, `exp_avg`, `exp_avg_sq` with its `grad` and
    `scalars` (the nine f32 constants), and the sum of squares of `grad`, under the
    interpreter. (`out_dtype` is unused: every output is f32.)"""
    import torch
    grad = t["grad"].reshape(-1)
    e = grad.numel()
    p, m, v = (t[k + "_in"].reshape(-1).clone() for k in ("param", "exp_avg", "exp_avg_sq"))
    scalars = [float(s) for s in t["scalars"]]
    adamw_update[(triton.cdiv(e, BLOCK),)](p, grad, m, v, e, *scalars, BLOCK=BLOCK)
    n_partial = triton.cdiv(e, SUMSQ_BLOCK)
    partial = torch.empty(n_partial, dtype=torch.float64)
    sumsq_partial[(n_partial,)](grad, partial, e, BLOCK=SUMSQ_BLOCK)
    out = torch.empty(1, dtype=torch.float32)
    sumsq_total[(1,)](partial, out, n_partial, BLOCK_P=TOTAL_BLOCK_P)
    shape = t["grad"].shape
    return {"param": p.reshape(shape), "exp_avg": m.reshape(shape),
            "exp_avg_sq": v.reshape(shape), "sumsq": out}
