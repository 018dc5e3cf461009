"""LayerNorm over the last dimension in Triton, optional bias: forward (saves mean and rstd),
backward (dx, dw, db).

    y = xhat * w + b,   xhat = (x - mean) * rstd,   rstd = 1 / sqrt(var + eps)   (one row per program)
    mean = sum(x) * (1/C),   var = sum((x - mean)^2) * (1/C)            (biased, as PyTorch)
    dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),  g = dy * w
    dw = sum over rows of dy * xhat,   db = sum over rows of dy

The same formulas, in the same order, as the CPU kernel (candle-fused/src/norm.rs and
src/norm/kernel.rs): the row statistics are two sweeps in f32 (the mean, then the centred
second moment), means are sums times `1/C` (f32, correctly rounded), `y = ((x - mean) * rstd)
* w + b`, `dx = rstd * ((g - mean(g)) - xhat * mean(g xhat))`. x, w, b, dy are read in their
storage dtype (f32, bf16 or f16), widened to f32 for all arithmetic and rounded once on store
(to nearest even on the GPU; Triton 3.9's interpreter truncates f32 -> bf16 instead, see
triton_interpret_check.py); mean and rstd are saved in f32.

The bias is optional, as in `layer_norm(x, w, b: Option<&Tensor>, eps)`: each kernel that
touches it is compiled twice from one body with a `HAS_BIAS` constexpr, as two entries
(`layer_norm_fwd` / `layer_norm_fwd_no_bias`, `layer_norm_bwd_dx` / `layer_norm_bwd_dx_no_bias`)
whose parameter lists differ by `B` / `DB_PARTIAL`, so the Rust table states each exactly.

Layout contract (checked on the Rust side by `candle_fused::cuda_kernels::check_launch`):
* x, dy, y, dx are contiguous `[N, C]`, w, b, dw, db are `[C]`, mean and rstd are `[N]` f32;
* `C <= BLOCK_C` (a row is one tile, held in registers);
* every pointer is 16-byte aligned (the AOT specialisation `tt.divisibility = 16`);
  `N` and `C` are not specialised (any value, odd ones included).

The weight and bias gradients are deterministic, as rms_norm.py's: program `p` of the `dx`
kernel owns the fixed rows `[p * ROWS_PER_PROGRAM, (p + 1) * ROWS_PER_PROGRAM)`, adds `dy *
xhat` (and `dy`) over them in row order into f32 register tiles and stores them to row `p` of
`DW_PARTIAL` (and `DB_PARTIAL`), `[P, C]` f32, `P = cdiv(N, ROWS_PER_PROGRAM)`;
`layer_norm_bwd_reduce` then adds the `P` partial rows in order for each column (launched once
for dw, once more for db). No atomics: bit-identical from run to run and GPU to GPU. (The CPU
kernel's blocks of rows are a function of N, at least 16 rows: its dw, db are the same sums in
another order, equal up to f32 rounding.)
"""
import triton
import triton.language as tl


@triton.jit
def _fwd_row(X, W, B, Y, MEAN, RSTD, C, eps, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Program `row`: `Y[row] = (X[row] - mean) * rstd * W (+ B)`; saves mean and rstd (f32)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    # 1/C rounded once, as the CPU kernel's `inv_c` (then means are products, not quotients)
    inv_c = tl.div_rn(1.0, C.to(tl.float32))
    x = tl.load(X + row * C + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) * inv_c
    # the second sweep over the row (in registers) is centred: no cancellation for rows far
    # from zero; the padding lanes must not contribute (-mean)^2
    xc = tl.where(mask, x - mean, 0.0)
    var = tl.sum(xc * xc, axis=0) * inv_c
    # correctly rounded sqrt and division (the defaults are approximate on the GPU)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    y = xc * rstd * w
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * C + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@triton.jit
def layer_norm_fwd(X, W, B, Y, MEAN, RSTD, N, C, eps, BLOCK_C: tl.constexpr):
    """One program per row, with bias: `Y = (X - mean) * rstd * W + B`."""
    _fwd_row(X, W, B, Y, MEAN, RSTD, C, eps, BLOCK_C, True)


@triton.jit
def layer_norm_fwd_no_bias(X, W, Y, MEAN, RSTD, N, C, eps, BLOCK_C: tl.constexpr):
    """One program per row, no bias: `Y = (X - mean) * rstd * W`."""
    # W stands in for the bias pointer: HAS_BIAS=False compiles its load away
    _fwd_row(X, W, W, Y, MEAN, RSTD, C, eps, BLOCK_C, False)


@triton.jit
def _bwd_rows(X, W, DY, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL, N, C,
              BLOCK_C: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Program `p`: `dx` of its rows; their `sum dy * xhat` into `DW_PARTIAL[p]` and, with a
    bias, their `sum dy` into `DB_PARTIAL[p]` (f32)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    inv_c = tl.div_rn(1.0, C.to(tl.float32))
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    row_start = pid * ROWS_PER_PROGRAM
    row_end = tl.minimum(row_start + ROWS_PER_PROGRAM, N)
    for row in range(row_start, row_end):
        off = tl.cast(row, tl.int64) * C
        x = tl.load(X + off + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + off + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + row)
        rstd = tl.load(RSTD + row)
        # padding lanes: x = 0 would give xhat = -mean * rstd; keep them 0
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        g = dy * w
        mean_g = tl.sum(g, axis=0) * inv_c
        mean_gx = tl.sum(g * xhat, axis=0) * inv_c
        dx = rstd * (g - mean_g - xhat * mean_gx)
        tl.store(DX + off + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw_acc += dy * xhat
        if HAS_BIAS:
            db_acc += dy
    tl.store(DW_PARTIAL + pid.to(tl.int64) * C + cols, dw_acc, mask=mask)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + pid.to(tl.int64) * C + cols, db_acc, mask=mask)


@triton.jit
def layer_norm_bwd_dx(X, W, DY, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL, N, C,
                      BLOCK_C: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr):
    """With bias: `dx`, and the partial sums of dw and db over the program's rows."""
    _bwd_rows(X, W, DY, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL, N, C,
              BLOCK_C, ROWS_PER_PROGRAM, True)


@triton.jit
def layer_norm_bwd_dx_no_bias(X, W, DY, MEAN, RSTD, DX, DW_PARTIAL, N, C,
                              BLOCK_C: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr):
    """No bias: `dx`, and the partial sums of dw over the program's rows."""
    # DW_PARTIAL stands in for DB_PARTIAL: HAS_BIAS=False compiles its store away
    _bwd_rows(X, W, DY, MEAN, RSTD, DX, DW_PARTIAL, DW_PARTIAL, N, C,
              BLOCK_C, ROWS_PER_PROGRAM, False)


@triton.jit
def layer_norm_bwd_reduce(PARTIAL, OUT, P, C, BLOCK_C: tl.constexpr):
    """Program `q`: columns `[q * BLOCK_C, (q + 1) * BLOCK_C)` of `OUT = sum_p PARTIAL[p]`,
    added in the order p = 0, 1, .., P - 1 (dw from DW_PARTIAL, db from DB_PARTIAL)."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = cols < C
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for p in range(0, P):
        acc += tl.load(PARTIAL + tl.cast(p, tl.int64) * C + cols, mask=mask, other=0.0)
    tl.store(OUT + cols, acc.to(OUT.dtype.element_ty), mask=mask)


# The fixed configuration compiled ahead of time (scripts/python/triton_compile.py) and used
# by the interpreter check (scripts/python/triton_interpret_check.py); the Rust launch table
# is candle-fused/src/cuda_kernels/layer_norm.rs.
FWD_BLOCK_C = 4096
FWD_NUM_WARPS = 8
BWD_BLOCK_C = 4096
BWD_ROWS_PER_PROGRAM = 32
BWD_NUM_WARPS = 8
REDUCE_BLOCK_C = 256
REDUCE_NUM_WARPS = 2

_X = ("X", "*{io}", "in [N, C]")
_W = ("W", "*{io}", "in [C]")
_N = ("N", "i32", "rows")
_C = ("C", "i32", "columns")
_FWD_OUT = [("Y", "*{io}", "out [N, C]"), ("MEAN", "*fp32", "out [N] f32"),
            ("RSTD", "*fp32", "out [N] f32")]
_BWD_IN = [_X, _W, ("DY", "*{io}", "in [N, C]"), ("MEAN", "*fp32", "in [N] f32"),
           ("RSTD", "*fp32", "in [N] f32"), ("DX", "*{io}", "out [N, C]"),
           ("DW_PARTIAL", "*fp32", "out [P, C] f32")]
_BWD_GRID = f"(cdiv(N, {BWD_ROWS_PER_PROGRAM}), 1, 1)"
_BWD_CONST = {"BLOCK_C": BWD_BLOCK_C, "ROWS_PER_PROGRAM": BWD_ROWS_PER_PROGRAM}

# What triton_compile.py compiles, for each dtype: `{io}` in a type is the kernel's dtype.
AOT = [
    dict(fn=layer_norm_fwd, num_warps=FWD_NUM_WARPS, grid="(N, 1, 1)",
         constexprs={"BLOCK_C": FWD_BLOCK_C},
         params=[_X, _W, ("B", "*{io}", "in [C]")] + _FWD_OUT
         + [_N, _C, ("eps", "fp32", "epsilon")]),
    dict(fn=layer_norm_fwd_no_bias, num_warps=FWD_NUM_WARPS, grid="(N, 1, 1)",
         constexprs={"BLOCK_C": FWD_BLOCK_C},
         params=[_X, _W] + _FWD_OUT + [_N, _C, ("eps", "fp32", "epsilon")]),
    dict(fn=layer_norm_bwd_dx, num_warps=BWD_NUM_WARPS, grid=_BWD_GRID, constexprs=_BWD_CONST,
         params=_BWD_IN + [("DB_PARTIAL", "*fp32", "out [P, C] f32"), _N, _C]),
    dict(fn=layer_norm_bwd_dx_no_bias, num_warps=BWD_NUM_WARPS, grid=_BWD_GRID,
         constexprs=_BWD_CONST, params=_BWD_IN + [_N, _C]),
    dict(fn=layer_norm_bwd_reduce, num_warps=REDUCE_NUM_WARPS,
         grid=f"(cdiv(C, {REDUCE_BLOCK_C}), 1, 1)", constexprs={"BLOCK_C": REDUCE_BLOCK_C},
         params=[("PARTIAL", "*fp32", "in [P, C] f32"), ("OUT", "*{io}", "out [C]"),
                 ("P", "i32", "partial rows"), _C]),
]

# Interpreter check (triton_interpret_check.py). Errors: y, dx: max |triton - rust| / max |rust|
# of the row ("row": rows have magnitudes 1, 1e3, 1e-3 and an offset of 50 with spread 1; dx
# scales with rstd); dw, db: / max |rust| of the tensor ("tensor"); rstd: elementwise relative
# ("elem"); mean: / max |x| of its row ("row:x"; a mean near 0 has no relative precision of its
# own: its error is that of a sum of the row, relative to the row's values).
# Tolerances and why:
# * f32 outputs and the f32 statistics (every dtype): both sides compute in f32 with different
#   summation orders (the Rust kernel's 8-lane sums and row blocks of >= 16 rows vs the
#   interpreter's numpy reductions and blocks of 32 rows), a few ulp of 2^-24 times log(C);
#   rstd adds the centred second moment, dx the cancellation `g - mean(g) - xhat mean(g xhat)`.
#   mean, rstd: 4e-6; dx, dw, db: 2e-5. y: 2e-5, not 4e-6: in the row offset by 50 (|mean| /
#   std ~ 87) the few ulp of |mean| by which the two means differ are amplified by that ratio
#   in `x - mean` (measured 8.4e-6; the mean itself agrees to 1.5e-7 of |x|).
# * bf16 / f16 outputs: both sides round (nearly) the same f32 value once; when it straddles a
#   rounding boundary they differ by one unit in the last place, 2^-7 (bf16) / 2^-10 (f16)
#   relative to the value, so at most that relative to the row's (tensor's) largest value.
ERROR = {"y": "row", "dx": "row", "dw": "tensor", "db": "tensor", "mean": "row:x",
         "rstd": "elem"}
_STATS = {"mean": 4e-6, "rstd": 4e-6}
TOL = {
    "f32": {"y": 2e-5, "dx": 2e-5, "dw": 2e-5, "db": 2e-5, **_STATS},
    "bf16": {"y": 2.0**-7, "dx": 2.0**-7, "dw": 2.0**-7, "db": 2.0**-7, **_STATS},
    "f16": {"y": 2.0**-10, "dx": 2.0**-10, "dw": 2.0**-10, "db": 2.0**-10, **_STATS},
}


def interpret(t, out_dtype):
    """The kernels on the vectors `t` (a vector file's tensors; with a bias `b` the bias
    variants, else the `_no_bias` ones), under the interpreter; `y`, `dx`, `dw`, `db` are
    stored in `out_dtype` (the driver passes f32 for bf16 vectors and rounds them to nearest
    even itself: the interpreter truncates f32 -> bf16)."""
    import torch
    x, w, dy, b = t["x"], t["w"], t["dy"], t.get("b")
    eps = float(t["eps"][0])
    n, c = x.shape
    assert c <= FWD_BLOCK_C and c <= BWD_BLOCK_C
    y = torch.empty(x.shape, dtype=out_dtype)
    mean = torch.empty(n, dtype=torch.float32)
    rstd = torch.empty(n, dtype=torch.float32)
    if b is not None:
        layer_norm_fwd[(n,)](x, w, b, y, mean, rstd, n, c, eps, BLOCK_C=FWD_BLOCK_C)
    else:
        layer_norm_fwd_no_bias[(n,)](x, w, y, mean, rstd, n, c, eps, BLOCK_C=FWD_BLOCK_C)
    p = triton.cdiv(n, BWD_ROWS_PER_PROGRAM)
    dx = torch.empty(x.shape, dtype=out_dtype)
    dw_partial = torch.empty((p, c), dtype=torch.float32)
    db_partial = torch.empty((p, c), dtype=torch.float32)
    if b is not None:
        layer_norm_bwd_dx[(p,)](x, w, dy, mean, rstd, dx, dw_partial, db_partial, n, c,
                                BLOCK_C=BWD_BLOCK_C, ROWS_PER_PROGRAM=BWD_ROWS_PER_PROGRAM)
    else:
        layer_norm_bwd_dx_no_bias[(p,)](x, w, dy, mean, rstd, dx, dw_partial, n, c,
                                        BLOCK_C=BWD_BLOCK_C,
                                        ROWS_PER_PROGRAM=BWD_ROWS_PER_PROGRAM)
    out = {"y": y, "mean": mean, "rstd": rstd, "dx": dx}
    grid = (triton.cdiv(c, REDUCE_BLOCK_C),)
    for name, partial in [("dw", dw_partial)] + ([("db", db_partial)] if b is not None else []):
        out[name] = torch.empty(w.shape, dtype=out_dtype)
        layer_norm_bwd_reduce[grid](partial, out[name], p, c, BLOCK_C=REDUCE_BLOCK_C)
    return out
