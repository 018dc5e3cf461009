"""RMSNorm over the last dimension in Triton: forward (saves rstd) and backward (dx, dw).

    y = x * rstd * w,   rstd = 1 / sqrt(mean(x^2) + eps)            (one row per program)
    dx = rstd * (g - xhat * mean(g * xhat)),  g = dy * w, xhat = x * rstd
    dw = sum over rows of dy * xhat

The same formulas as the CPU kernel (candle-fused/src/norm.rs): x, w, dy are read in their
storage dtype (f32, bf16 or f16), widened to f32 for all arithmetic (statistics in f32) and
rounded once on store (to nearest even on the GPU: `cvt.rn.bf16.f32` / `cvt.rn.f16.f32`;
Triton 3.9's interpreter truncates f32 -> bf16 instead, see triton_interpret_check.py);
rstd is saved in f32.

Layout contract (checked on the Rust side by `candle_fused::cuda_kernels::check_launch`):
* x, dy, y, dx are contiguous `[N, C]`, w and dw are `[C]`, rstd is `[N]` f32;
* `C <= BLOCK_C` (a row is one tile, held in registers);
* every pointer is 16-byte aligned (the AOT specialisation `tt.divisibility = 16`);
  `N` and `C` are not specialised (any value, odd ones included).

The weight gradient is deterministic: program `p` of `rms_norm_bwd_dx` owns the fixed rows
`[p * ROWS_PER_PROGRAM, (p + 1) * ROWS_PER_PROGRAM)`, adds `dy * xhat` over them in row order
into an f32 register tile and stores it to row `p` of `DW_PARTIAL` (`[P, C]` f32,
`P = cdiv(N, ROWS_PER_PROGRAM)`); `rms_norm_bwd_dw` then adds the `P` partial rows in order
for each column. No atomics, so the result is bit-identical from run to run and GPU to GPU.
"""
import triton
import triton.language as tl


@triton.jit
def rms_norm_fwd(X, W, Y, RSTD, N, C, eps, BLOCK_C: tl.constexpr):
    """One program per row: `Y[row] = X[row] * rstd * W`, `RSTD[row] = rstd` (f32)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    x = tl.load(X + row * C + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / C
    # correctly rounded sqrt and division (the defaults are approximate on the GPU)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(mean_sq + eps))
    y = x * rstd * w
    tl.store(Y + row * C + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def rms_norm_bwd_dx(
    X, W, DY, RSTD, DX, DW_PARTIAL, N, C,
    BLOCK_C: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr,
):
    """Program `p`: `dx` of its rows, and their `sum dy * xhat` into `DW_PARTIAL[p]` (f32)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    row_start = pid * ROWS_PER_PROGRAM
    row_end = tl.minimum(row_start + ROWS_PER_PROGRAM, N)
    for row in range(row_start, row_end):
        off = tl.cast(row, tl.int64) * C
        x = tl.load(X + off + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + off + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        xhat = x * rstd
        g = dy * w
        mean_gx = tl.sum(g * xhat, axis=0) / C
        dx = rstd * (g - xhat * mean_gx)
        tl.store(DX + off + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw_acc += dy * xhat
    tl.store(DW_PARTIAL + pid.to(tl.int64) * C + cols, dw_acc, mask=mask)


@triton.jit
def rms_norm_bwd_dw(DW_PARTIAL, DW, P, C, BLOCK_C: tl.constexpr):
    """Program `q`: columns `[q * BLOCK_C, (q + 1) * BLOCK_C)` of `DW = sum_p DW_PARTIAL[p]`,
    added in the order p = 0, 1, .., P - 1."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = cols < C
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for p in range(0, P):
        acc += tl.load(DW_PARTIAL + tl.cast(p, tl.int64) * C + cols, mask=mask, other=0.0)
    tl.store(DW + cols, acc.to(DW.dtype.element_ty), mask=mask)


# The fixed configuration compiled ahead of time (scripts/python/triton_compile.py) and used
# by the interpreter check (scripts/python/triton_interpret_check.py); the Rust launch table
# is candle-fused/src/cuda_kernels/rms_norm.rs.
FWD_BLOCK_C = 4096
FWD_NUM_WARPS = 8
BWD_BLOCK_C = 4096
BWD_ROWS_PER_PROGRAM = 32
BWD_NUM_WARPS = 8
DW_BLOCK_C = 256
DW_NUM_WARPS = 2

# What triton_compile.py compiles, for each dtype: `{io}` in a type is the kernel's dtype.
AOT = [
    dict(fn=rms_norm_fwd, num_warps=FWD_NUM_WARPS, grid="(N, 1, 1)",
         constexprs={"BLOCK_C": FWD_BLOCK_C},
         params=[("X", "*{io}", "in [N, C]"), ("W", "*{io}", "in [C]"),
                 ("Y", "*{io}", "out [N, C]"), ("RSTD", "*fp32", "out [N] f32"),
                 ("N", "i32", "rows"), ("C", "i32", "columns"), ("eps", "fp32", "epsilon")]),
    dict(fn=rms_norm_bwd_dx, num_warps=BWD_NUM_WARPS,
         grid=f"(cdiv(N, {BWD_ROWS_PER_PROGRAM}), 1, 1)",
         constexprs={"BLOCK_C": BWD_BLOCK_C, "ROWS_PER_PROGRAM": BWD_ROWS_PER_PROGRAM},
         params=[("X", "*{io}", "in [N, C]"), ("W", "*{io}", "in [C]"),
                 ("DY", "*{io}", "in [N, C]"), ("RSTD", "*fp32", "in [N] f32"),
                 ("DX", "*{io}", "out [N, C]"), ("DW_PARTIAL", "*fp32", "out [P, C] f32"),
                 ("N", "i32", "rows"), ("C", "i32", "columns")]),
    dict(fn=rms_norm_bwd_dw, num_warps=DW_NUM_WARPS, grid=f"(cdiv(C, {DW_BLOCK_C}), 1, 1)",
         constexprs={"BLOCK_C": DW_BLOCK_C},
         params=[("DW_PARTIAL", "*fp32", "in [P, C] f32"), ("DW", "*{io}", "out [C]"),
                 ("P", "i32", "partial rows"), ("C", "i32", "columns")]),
]

# Interpreter check (triton_interpret_check.py). Errors: y, dx: max |triton - rust| / max |rust|
# of the row ("row": rows have magnitudes 1, 1e3 and 1e-3, and dx scales with 1/magnitude);
# dw: / max |rust| of the tensor ("tensor"); rstd: elementwise relative ("elem").
# Tolerances and why:
# * f32 outputs, rstd (f32 for every dtype): both sides compute in f32 with different summation
#   orders (the Rust kernel's 8-lane sums vs the interpreter's numpy reduction), a few ulp of
#   2^-24 times log(C); dx adds the cancellation `g - xhat * mean(g xhat)`. y, rstd: 4e-6;
#   dx, dw: 2e-5.
# * bf16 / f16 outputs: both sides round (nearly) the same f32 value once; when it straddles a
#   rounding boundary they differ by one unit in the last place, 2^-7 (bf16) / 2^-10 (f16)
#   relative to the value, so at most that relative to the row's largest value.
ERROR = {"y": "row", "dx": "row", "dw": "tensor", "rstd": "elem"}
TOL = {
    "f32": {"y": 4e-6, "rstd": 4e-6, "dx": 2e-5, "dw": 2e-5},
    "bf16": {"y": 2.0**-7, "rstd": 4e-6, "dx": 2.0**-7, "dw": 2.0**-7},
    "f16": {"y": 2.0**-10, "rstd": 4e-6, "dx": 2.0**-10, "dw": 2.0**-10},
}


def interpret(t, out_dtype):
    """The three kernels on the vectors `t` (a vector file's tensors), under the interpreter;
    `y`, `dx`, `dw` are stored in `out_dtype` (the driver passes f32 for bf16 vectors and
    rounds them to nearest even itself: the interpreter truncates f32 -> bf16)."""
    import torch
    x, w, dy = t["x"], t["w"], t["dy"]
    eps = float(t["eps"][0])
    n, c = x.shape
    assert c <= FWD_BLOCK_C and c <= BWD_BLOCK_C
    y = torch.empty(x.shape, dtype=out_dtype)
    rstd = torch.empty(n, dtype=torch.float32)
    rms_norm_fwd[(n,)](x, w, y, rstd, n, c, eps, BLOCK_C=FWD_BLOCK_C)
    p = triton.cdiv(n, BWD_ROWS_PER_PROGRAM)
    dx = torch.empty(x.shape, dtype=out_dtype)
    dw_partial = torch.empty((p, c), dtype=torch.float32)
    rms_norm_bwd_dx[(p,)](x, w, dy, rstd, dx, dw_partial, n, c,
                          BLOCK_C=BWD_BLOCK_C, ROWS_PER_PROGRAM=BWD_ROWS_PER_PROGRAM)
    dw = torch.empty(w.shape, dtype=out_dtype)
    rms_norm_bwd_dw[(triton.cdiv(c, DW_BLOCK_C),)](dw_partial, dw, p, c, BLOCK_C=DW_BLOCK_C)
    return {"y": y, "rstd": rstd, "dx": dx, "dw": dw}
