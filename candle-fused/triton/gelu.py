"""Bias add + tanh GELU (GPT-2's) in Triton: forward and backward, with and without a bias,
and GeGLU, the gated form `gelu(gate) * up` (Gemma's MLP).

    gelu(z)  = 0.5 z (1 + tanh(u)),   u = K0 (z + K1 z^3),   K0 = sqrt(2/pi), K1 = 0.044715
    gelu'(z) = 0.5 (1 + t) + 0.5 z (1 - t^2) K0 (1 + 3 K1 z^2),   t = tanh(u)
    z = x + b (b broadcast over rows) or z = x;   dx = dy gelu'(z);   db = sum over rows of dx
    GeGLU:   y = gelu(g) u;   d_gate = dy u gelu'(g);   d_up = dy gelu(g)

The same formulas, in the same operation order, as the CPU kernels (candle-fused/src/gelu.rs,
and src/gated.rs for GeGLU).
The CPU's f32 kernel does not call libm: its `tanh_f32` is a branch-free approximation (Cephes'
odd polynomial for |x| < 0.625, else `1 - 2 / (e^{2|x|} + 1)` with the crate's `exp_f32`, a
Cody-Waite reduction and a degree-7 polynomial; <= 1.32 ulp from the true tanh). Matching it
to "a few ulp" would leave the outputs a rounding apart; instead the Triton kernels reproduce
`exp_f32` and `tanh_f32` operation for operation (IEEE f32 add, multiply, correctly rounded
divide `div_rn`, integer bit operations, no FMA contraction in the AOT compile), so they give
the CPU kernel's bits: y and dx are checked exactly, for every dtype.

`db` is deterministic: program `(p, q)` of `bias_gelu_bwd_dx` owns the fixed rows
`[16 p, 16 p + 16)` and columns `[BLOCK_C q, ..)`, adds the unrounded f32 `dx` over its rows in
row order into `DB_PARTIAL[p]` (`[P, C]` f32, `P = cdiv(N, 16)`), and `bias_gelu_bwd_db` adds
the `P` partial rows in order, then rounds once. The CPU kernel does the same with blocks of
`max(16, cdiv(N, 256))` rows, so for `N <= 4096` rows the groupings, and the bits, are the same;
beyond, the f32 sums are grouped differently (see TOL).

Layout contract (`candle_fused::cuda_kernels::gelu`): x, dy, y, dx contiguous, `[N, C]` with a
bias `[C]`, flattened to `[E]` without; GeGLU's gate, up, dy, y, d_gate, d_up contiguous and
flattened to `[E]` (a packed `[.., 2I]` projection's halves are copied first); every pointer
16-byte aligned; sizes any value.
"""
import triton
import triton.language as tl

# The constants of candle-fused/src/gelu.rs. The f32 literals of `exp_f32` / `tanh_f32` round to
# the same f32 through f64 (checked); K0, K1 and 3 K1 are f64 there too, rounded to f32 on use.
K0 = tl.constexpr(0.7978845608028654)
K1 = tl.constexpr(0.044715)
K1X3 = tl.constexpr(3.0 * 0.044715)
LOG2E = tl.constexpr(1.44269504088896340735992468100189214)
LN2_HI = tl.constexpr(0.6933594)
LN2_LO = tl.constexpr(-2.1219444e-4)
MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: adding it rounds to an integer
E0 = tl.constexpr(1.9875691e-4)
E1 = tl.constexpr(1.3981999e-3)
E2 = tl.constexpr(8.333452e-3)
E3 = tl.constexpr(4.1665796e-2)
E4 = tl.constexpr(1.6666665e-1)
T0 = tl.constexpr(5.7049887e-3)
T1 = tl.constexpr(2.063909e-2)
T2 = tl.constexpr(5.3739716e-2)
T3 = tl.constexpr(1.3331442e-1)
T4 = tl.constexpr(3.333328e-1)
SIGN = tl.constexpr(-0x80000000)  # the f32 sign bit, as an i32


@triton.jit
def exp_f32(x):
    """`e^x` in f32, bit for bit the crate's `gelu::exp_f32`."""
    # Rust's clamp(-104, 89), which keeps a NaN
    x = tl.where(x < -104.0, -104.0, tl.where(x > 89.0, 89.0, x))
    t = x * LOG2E + MAGIC
    n = t - MAGIC
    r = (x - n * LN2_HI) - n * LN2_LO
    r2 = r * r
    p = (((((E0 * r + E1) * r + E2) * r + E3) * r + E4) * r + 0.5) * r2 + r + 1.0
    # 2^n as two factors built from exponent bits (subnormal results, the top of the range)
    ni = t.to(tl.int32, bitcast=True) - 0x4B400000
    h = ni >> 1
    s1 = ((h + 127) << 23).to(tl.float32, bitcast=True)
    s2 = ((ni - h + 127) << 23).to(tl.float32, bitcast=True)
    return p * s1 * s2


@triton.jit
def tanh_f32(x):
    """`tanh x` in f32, bit for bit the crate's `gelu::tanh_f32`."""
    a = tl.abs(x)
    z = a * a
    small = ((((-T0 * z + T1) * z - T2) * z + T3) * z - T4) * z * a + a
    large = 1.0 - tl.div_rn(2.0, exp_f32(a + a) + 1.0)
    r = tl.where(a < 0.625, small, large)
    # r.copysign(x)
    bits = (r.to(tl.int32, bitcast=True) & ~SIGN) | (x.to(tl.int32, bitcast=True) & SIGN)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def gelu_val(z):
    u = K0 * (z + K1 * z * z * z)
    return 0.5 * z * (1.0 + tanh_f32(u))


@triton.jit
def gelu_grad(z):
    z2 = z * z
    # (a variable, not the expression as the argument: Triton 3.9's interpreter would pass
    # `K0 * (..)` as a constexpr wrapping a tensor)
    u = K0 * (z + K1 * z2 * z)
    t = tanh_f32(u)
    return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * K0 * (1.0 + K1X3 * z2)


@triton.jit
def gelu_fwd(X, Y, E, BLOCK: tl.constexpr):
    """Without a bias: program `p`, elements `[p * BLOCK, (p + 1) * BLOCK)` of `gelu(X)`."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < E
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, gelu_val(x).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def gelu_bwd(X, DY, DX, E, BLOCK: tl.constexpr):
    """Without a bias: program `p`, elements `[p * BLOCK, (p + 1) * BLOCK)` of
    `DX = DY gelu'(X)`."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < E
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(DX + offs, (dy * gelu_grad(x)).to(DX.dtype.element_ty), mask=mask)


@triton.jit
def bias_gelu_fwd(X, B, Y, N, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program `(p, q)`: the tile of rows `[p BLOCK_R, ..)`, columns `[q BLOCK_C, ..)` of
    `gelu(X + B)`."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    mask = (rows < N)[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
    tl.store(Y + offs, gelu_val(x + b[None, :]).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def bias_gelu_bwd_dx(
    X, B, DY, DX, DB_PARTIAL, N, C,
    BLOCK_C: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr,
):
    """Program `(p, q)`: `dx` of rows `[p R, (p + 1) R)` (`R = ROWS_PER_PROGRAM`), columns
    `[q BLOCK_C, ..)`, and their sum over those rows, in row order, into `DB_PARTIAL[p]`."""
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
    db_acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    row_start = pid * ROWS_PER_PROGRAM
    row_end = tl.minimum(row_start + ROWS_PER_PROGRAM, N)
    for row in range(row_start, row_end):
        off = tl.cast(row, tl.int64) * C
        x = tl.load(X + off + cols, mask=cmask, other=0.0).to(tl.float32)
        dy = tl.load(DY + off + cols, mask=cmask, other=0.0).to(tl.float32)
        g = dy * gelu_grad(x + b)
        tl.store(DX + off + cols, g.to(DX.dtype.element_ty), mask=cmask)
        db_acc += g
    tl.store(DB_PARTIAL + pid.to(tl.int64) * C + cols, db_acc, mask=cmask)


@triton.jit
def bias_gelu_bwd_db(DB_PARTIAL, DB, P, C, BLOCK_C: tl.constexpr):
    """Program `q`: columns `[q BLOCK_C, ..)` of `DB = sum_p DB_PARTIAL[p]`, added in the order
    p = 0, 1, .., P - 1, rounded once."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = cols < C
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for p in range(0, P):
        acc += tl.load(DB_PARTIAL + tl.cast(p, tl.int64) * C + cols, mask=mask, other=0.0)
    tl.store(DB + cols, acc.to(DB.dtype.element_ty), mask=mask)


@triton.jit
def geglu_fwd(GATE, UP, Y, E, BLOCK: tl.constexpr):
    """Program `p`: elements `[p * BLOCK, (p + 1) * BLOCK)` of `Y = gelu(GATE) * UP`."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < E
    y = gelu_val(tl.load(GATE + offs, mask=mask, other=0.0).to(tl.float32))
    y *= tl.load(UP + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def geglu_bwd(GATE, UP, DY, DGATE, DUP, E, BLOCK: tl.constexpr):
    """Program `p`: elements `[p * BLOCK, (p + 1) * BLOCK)` of `DGATE = DY UP gelu'(GATE)` and
    `DUP = DY gelu(GATE)`, both recomputed from `GATE` (the forward saves nothing)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < E
    g = tl.load(GATE + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + offs, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(DGATE + offs, (d * u * gelu_grad(g)).to(DGATE.dtype.element_ty), mask=mask)
    tl.store(DUP + offs, (d * gelu_val(g)).to(DUP.dtype.element_ty), mask=mask)


# The fixed configuration compiled ahead of time; the Rust launch table is
# candle-fused/src/cuda_kernels/gelu.rs.
BLOCK = 1024
FWD_BLOCK_R = 8
BLOCK_C = 256
ROWS_PER_PROGRAM = 16  # the CPU kernel's row block for N <= 4096 (cpu::row_block)
DB_BLOCK_C = 256

AOT = [
    dict(fn=gelu_fwd, num_warps=4, grid=f"(cdiv(E, {BLOCK}), 1, 1)",
         constexprs={"BLOCK": BLOCK},
         params=[("X", "*{io}", "in [E]"), ("Y", "*{io}", "out [E]"), ("E", "i32", "elements")]),
    dict(fn=gelu_bwd, num_warps=4, grid=f"(cdiv(E, {BLOCK}), 1, 1)",
         constexprs={"BLOCK": BLOCK},
         params=[("X", "*{io}", "in [E]"), ("DY", "*{io}", "in [E]"),
                 ("DX", "*{io}", "out [E]"), ("E", "i32", "elements")]),
    dict(fn=bias_gelu_fwd, num_warps=4,
         grid=f"(cdiv(N, {FWD_BLOCK_R}), cdiv(C, {BLOCK_C}), 1)",
         constexprs={"BLOCK_R": FWD_BLOCK_R, "BLOCK_C": BLOCK_C},
         params=[("X", "*{io}", "in [N, C]"), ("B", "*{io}", "in [C]"),
                 ("Y", "*{io}", "out [N, C]"), ("N", "i32", "rows"), ("C", "i32", "columns")]),
    dict(fn=bias_gelu_bwd_dx, num_warps=2,
         grid=f"(cdiv(N, {ROWS_PER_PROGRAM}), cdiv(C, {BLOCK_C}), 1)",
         constexprs={"BLOCK_C": BLOCK_C, "ROWS_PER_PROGRAM": ROWS_PER_PROGRAM},
         params=[("X", "*{io}", "in [N, C]"), ("B", "*{io}", "in [C]"),
                 ("DY", "*{io}", "in [N, C]"), ("DX", "*{io}", "out [N, C]"),
                 ("DB_PARTIAL", "*fp32", "out [P, C] f32"),
                 ("N", "i32", "rows"), ("C", "i32", "columns")]),
    dict(fn=bias_gelu_bwd_db, num_warps=2, grid=f"(cdiv(C, {DB_BLOCK_C}), 1, 1)",
         constexprs={"BLOCK_C": DB_BLOCK_C},
         params=[("DB_PARTIAL", "*fp32", "in [P, C] f32"), ("DB", "*{io}", "out [C]"),
                 ("P", "i32", "partial rows"), ("C", "i32", "columns")]),
    dict(fn=geglu_fwd, num_warps=4, grid=f"(cdiv(E, {BLOCK}), 1, 1)",
         constexprs={"BLOCK": BLOCK},
         params=[("GATE", "*{io}", "in [E]"), ("UP", "*{io}", "in [E]"),
                 ("Y", "*{io}", "out [E]"), ("E", "i32", "elements")]),
    dict(fn=geglu_bwd, num_warps=4, grid=f"(cdiv(E, {BLOCK}), 1, 1)",
         constexprs={"BLOCK": BLOCK},
         params=[("GATE", "*{io}", "in [E]"), ("UP", "*{io}", "in [E]"),
                 ("DY", "*{io}", "in [E]"), ("DGATE", "*{io}", "out [E]"),
                 ("DUP", "*{io}", "out [E]"), ("E", "i32", "elements")]),
]

# Interpreter check. y, dx (with a bias), y_nobias, dx_nobias (the same x without one) and
# GeGLU's geglu_y, geglu_d_gate, geglu_d_up (x as the gate, with its own `up`):
# bit-identical ("exact": no element differs), every dtype, for the reason above (the driver
# rounds the bf16 outputs the kernels store in f32 to nearest even, as `cvt.rn.bf16.f32` does).
# db: max |triton - rust| / max |rust| ("tensor"). For N <= 4096 rows both sides add the same
# f32 values in the same groups (exact); beyond, the CPU's blocks are larger than 16 rows and
# the two sums of N f32 terms round differently: a few ulp of 2^-24 times the growth of the
# partial sums over max |db|, ~1e-6 here (the 4097-row f32 vectors: 7.9e-7), held to 1e-5. For
# bf16 / f16 (N <= 4096 here) one rounding of equal f32 values; the bound stated is that of one
# rounding of values a few f32 ulp apart: 2^-7 / 2^-10.
# The reference gradients went through Candle's backprop, which adds each op's gradient to a
# zero tensor (`0 + (-0) = +0`); `interpret` does the same to the kernels' gradients (only the
# sign of a zero can change).
EXACT = ("y", "dx", "y_nobias", "dx_nobias", "geglu_y", "geglu_d_gate", "geglu_d_up")
ERROR = {**{k: "exact" for k in EXACT}, "db": "tensor"}
TOL = {dt: {**{k: 0 for k in EXACT}, "db": db}
       for dt, db in (("f32", 1e-5), ("bf16", 2.0**-7), ("f16", 2.0**-10))}


def interpret(t, out_dtype):
    """The seven kernels on the vectors `t` under the interpreter: with the bias `b` on `x`
    `[N, C]`, without it on `x` flattened, and GeGLU with `x` as the gate and `up`."""
    import numpy
    import torch
    x, b, dy = t["x"], t["b"], t["dy"]
    n, c = x.shape
    e = n * c
    y = torch.empty(x.shape, dtype=out_dtype)
    dx = torch.empty(x.shape, dtype=out_dtype)
    p = triton.cdiv(n, ROWS_PER_PROGRAM)
    db_partial = torch.empty((p, c), dtype=torch.float32)
    db = torch.empty(c, dtype=out_dtype)
    y_nb = torch.empty(e, dtype=out_dtype)
    dx_nb = torch.empty(e, dtype=out_dtype)
    # e^{2|u|} overflows to inf for |u| > 44.4 (tanh = 1), as on the CPU: no numpy warning
    with numpy.errstate(over="ignore"):
        bias_gelu_fwd[(triton.cdiv(n, FWD_BLOCK_R), triton.cdiv(c, BLOCK_C))](
            x, b, y, n, c, BLOCK_R=FWD_BLOCK_R, BLOCK_C=BLOCK_C)
        bias_gelu_bwd_dx[(p, triton.cdiv(c, BLOCK_C))](
            x, b, dy, dx, db_partial, n, c, BLOCK_C=BLOCK_C, ROWS_PER_PROGRAM=ROWS_PER_PROGRAM)
        bias_gelu_bwd_db[(triton.cdiv(c, DB_BLOCK_C),)](db_partial, db, p, c, BLOCK_C=DB_BLOCK_C)
        gelu_fwd[(triton.cdiv(e, BLOCK),)](x.reshape(-1), y_nb, e, BLOCK=BLOCK)
        gelu_bwd[(triton.cdiv(e, BLOCK),)](x.reshape(-1), dy.reshape(-1), dx_nb, e, BLOCK=BLOCK)
        geglu = run_geglu(x, t["up"], dy, out_dtype)
    # the gradients as Candle's backprop accumulates them: 0 + g (only -0 changes, to +0)
    return {"y": y, "dx": dx + 0.0, "db": db + 0.0,
            "y_nobias": y_nb.reshape(x.shape), "dx_nobias": (dx_nb + 0.0).reshape(x.shape),
            **geglu}


def run_geglu(gate, up, dy, out_dtype):
    """GeGLU's kernels on the flattened tensors: `geglu_y`, `geglu_d_gate`, `geglu_d_up`."""
    import torch
    e = gate.numel()
    y, dg, du = (torch.empty(e, dtype=out_dtype) for _ in range(3))
    grid = (triton.cdiv(e, BLOCK),)
    g, u, d = (v.reshape(-1) for v in (gate, up, dy))
    geglu_fwd[grid](g, u, y, e, BLOCK=BLOCK)
    geglu_bwd[grid](g, u, d, dg, du, e, BLOCK=BLOCK)
    # the gradients as Candle's backprop accumulates them: 0 + g (only -0 changes, to +0)
    return {"geglu_y": y.reshape(gate.shape), "geglu_d_gate": (dg + 0.0).reshape(gate.shape),
            "geglu_d_up": (du + 0.0).reshape(gate.shape)}
