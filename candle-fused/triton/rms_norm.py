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
# by the interpreter check (scripts/python/triton_interpret_check.py).
FWD_BLOCK_C = 4096
FWD_NUM_WARPS = 8
BWD_BLOCK_C = 4096
BWD_ROWS_PER_PROGRAM = 32
BWD_NUM_WARPS = 8
DW_BLOCK_C = 256
DW_NUM_WARPS = 2
