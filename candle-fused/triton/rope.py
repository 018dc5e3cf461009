"""Rotary position embeddings (transformers' split halves) in Triton, fused with the
`[B, T, H, D] -> [B, H, T, D]` transpose: forward and backward.

With `d = D / 2` and the f32 tables `cos`, `sin` of each row's positions:

    forward:   y[i]     = x[i] cos[i] - x[i + d] sin[i]       x [B, T, H, D] -> y [B, H, T, D]
               y[i + d] = x[i + d] cos[i] + x[i] sin[i]
    backward:  dx[i]     = dy[i] cos[i] + dy[i + d] sin[i]     dy [B, H, T, D] -> dx [B, T, H, D]
               dx[i + d] = dy[i + d] cos[i] - dy[i] sin[i]

(the backward is the rotation by -angle, a rotation's transpose, with the inverse transpose:
it needs neither x nor y). The same formulas as the CPU kernel (candle-fused/src/rope.rs and
src/rope/kernel.rs): x / dy read in their storage dtype (f32, bf16, f16) and widened to f32,
one product per term and one add or subtract in f32 (no FMA: the AOT compile disables
contraction, as the CPU kernel's separate multiply and add), rounded once on store. So the
results are the CPU kernel's bit for bit (the interpreter check is exact).

Layout contract (checked on the Rust side by `candle_fused::cuda_kernels::check_launch`):
* x and dx are contiguous `[B, T, H, D]`, y and dy contiguous `[B, H, T, D]` (the CPU op also
  reads a strided x, e.g. a view of a packed qkv projection; the launcher makes such an x
  contiguous first);
* cos and sin are contiguous `[TB, T, D/2]` f32 with `TB = B` (each batch row's own
  positions, the CPU op's `[B, T, D/2]`) or `TB = 1` (shared by the batch: the CPU op's
  `[T, D/2]` / `[1, T, D/2]`, passed as `[1, T, D/2]`); batch row `b` reads table `b % TB`;
* `D = 2 * HALF` (any even D: D need not be a power of two, there is no tile over D);
* every pointer is 16-byte aligned (`tt.divisibility = 16`); B, T, H, D are not specialised.

One program per `(b, t)`, grid `(B*T, 1, 1)`: it rotates the `H * HALF` pairs of that
position, flattened (pair `j` is head `j // HALF`, index `i = j % HALF`), in blocks of
`BLOCK` pairs with a mask on the last, so H and D are unconstrained and no lane is idle for a
small D; the program's table row (`HALF` values of cos and sin) is gathered by each pair,
all heads hitting the same few cache lines. Every output element is written by exactly one program: no reduction, no atomics.
"""
import triton
import triton.language as tl


@triton.jit
def rope_fwd(X, COS, SIN, Y, T, H, HALF, TB, BLOCK: tl.constexpr):
    """Program `b * T + t`: `Y[b, h, t] = rotate(X[b, t, h], angle(b, t))` for every head."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid - b * T
    D = 2 * HALF
    x_row = pid * H * D  # X[b, t, 0, 0]
    tab_row = ((b % TB) * T + t) * HALF
    pairs = H * HALF
    for start in range(0, pairs, BLOCK):
        j = start + tl.arange(0, BLOCK)
        mask = j < pairs
        h = j // HALF
        i = j - h * HALF
        c = tl.load(COS + tab_row + i, mask=mask, other=0.0)
        s = tl.load(SIN + tab_row + i, mask=mask, other=0.0)
        xo = x_row + h * D + i
        u = tl.load(X + xo, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(X + xo + HALF, mask=mask, other=0.0).to(tl.float32)
        yo = ((b * H + h) * T + t) * D + i  # Y[b, h, t, i]
        tl.store(Y + yo, (u * c - v * s).to(Y.dtype.element_ty), mask=mask)
        tl.store(Y + yo + HALF, (v * c + u * s).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def rope_bwd(DY, COS, SIN, DX, T, H, HALF, TB, BLOCK: tl.constexpr):
    """Program `b * T + t`: `DX[b, t, h] = rotate(DY[b, h, t], -angle(b, t))` for every head."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid - b * T
    D = 2 * HALF
    dx_row = pid * H * D  # DX[b, t, 0, 0]
    tab_row = ((b % TB) * T + t) * HALF
    pairs = H * HALF
    for start in range(0, pairs, BLOCK):
        j = start + tl.arange(0, BLOCK)
        mask = j < pairs
        h = j // HALF
        i = j - h * HALF
        c = tl.load(COS + tab_row + i, mask=mask, other=0.0)
        s = tl.load(SIN + tab_row + i, mask=mask, other=0.0)
        go = ((b * H + h) * T + t) * D + i  # DY[b, h, t, i]
        u = tl.load(DY + go, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(DY + go + HALF, mask=mask, other=0.0).to(tl.float32)
        xo = dx_row + h * D + i
        tl.store(DX + xo, (u * c + v * s).to(DX.dtype.element_ty), mask=mask)
        tl.store(DX + xo + HALF, (v * c - u * s).to(DX.dtype.element_ty), mask=mask)


# The fixed configuration compiled ahead of time (scripts/python/triton_compile.py) and used
# by the interpreter check (scripts/python/triton_interpret_check.py); the Rust launch table
# is candle-fused/src/cuda_kernels/rope.rs.
BLOCK = 512
NUM_WARPS = 4

_TABLES = [("COS", "*fp32", "in [TB, T, HALF] f32"), ("SIN", "*fp32", "in [TB, T, HALF] f32")]
_DIMS = [("T", "i32", "positions"), ("H", "i32", "heads"), ("HALF", "i32", "D / 2"),
         ("TB", "i32", "table batch: B or 1")]

# What triton_compile.py compiles, for each dtype: `{io}` in a type is the kernel's dtype.
AOT = [
    dict(fn=rope_fwd, num_warps=NUM_WARPS, grid="(B*T, 1, 1)", constexprs={"BLOCK": BLOCK},
         params=[("X", "*{io}", "in [B, T, H, D]")] + _TABLES
         + [("Y", "*{io}", "out [B, H, T, D]")] + _DIMS),
    dict(fn=rope_bwd, num_warps=NUM_WARPS, grid="(B*T, 1, 1)", constexprs={"BLOCK": BLOCK},
         params=[("DY", "*{io}", "in [B, H, T, D]")] + _TABLES
         + [("DX", "*{io}", "out [B, T, H, D]")] + _DIMS),
]

# Interpreter check (triton_interpret_check.py): "exact", the number of elements whose bits
# differ from the CPU kernel's, tolerance 0 for every dtype. Why exact: each output is one
# rounding of `a * c -/+ b * s` computed in f32 from the same inputs with the same operation
# order on both sides (two IEEE f32 products, one add or subtract, no FMA; numpy's f32 in the
# interpreter, Rust's f32 on the CPU), then one rounding to nearest even to the dtype (the
# CPU's `half` conversions; numpy for f16; the driver's torch rounding for bf16).
ERROR = {"y": "exact", "dx": "exact"}
TOL = {dt: {"y": 0, "dx": 0} for dt in ("f32", "bf16", "f16")}


def interpret(t, out_dtype):
    """Both kernels on the vectors `t` under the interpreter: `y` from `x`, `dx` from `dy`
    (stored in `out_dtype`: the driver passes f32 for bf16 vectors and rounds them to nearest
    even itself). Tables `[T, D/2]` (shared by the batch) are passed as `[1, T, D/2]`."""
    import torch
    x, dy, cos, sin = t["x"], t["dy"], t["cos"], t["sin"]
    b, tt, h, d = x.shape
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    tb, half = cos.shape[0], d // 2
    assert cos.shape == (tb, tt, half) and tb in (1, b) and dy.shape == (b, h, tt, d)
    y = torch.empty((b, h, tt, d), dtype=out_dtype)
    rope_fwd[(b * tt,)](x, cos.contiguous(), sin.contiguous(), y, tt, h, half, tb, BLOCK=BLOCK)
    dx = torch.empty(x.shape, dtype=out_dtype)
    rope_bwd[(b * tt,)](dy, cos.contiguous(), sin.contiguous(), dx, tt, h, half, tb,
                        BLOCK=BLOCK)
    return {"y": y, "dx": dx}
