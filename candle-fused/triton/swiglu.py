"""SwiGLU in Triton: `y = silu(gate) * up`, forward and backward, elementwise.

With `s = sigmoid(g) = 1 / (1 + e^-g)`:

    y      = g s u                        (silu(g) = g s)
    d_gate = dy u (s + g s (1 - s))       (silu'(g) = s (1 + g (1 - s)))
    d_up   = dy g s

The same formulas, in the same operation order, as the CPU kernel (candle-fused/src/swiglu.rs):
inputs widened to f32, `e^-g` from the crate's branch-free `exp_f32` (src/gelu.rs), reproduced
here operation for operation (below), the division correctly rounded (`div_rn`; Triton's
default f32 division is approximate on the GPU), each output rounded once on store. Every
operation is an IEEE f32 add, multiply, divide or an integer bit operation, and the AOT compile
turns FMA contraction off, so the Triton kernels give the CPU kernel's bits: the check is exact.

Layout contract (`candle_fused::cuda_kernels::swiglu`): gate, up, dy, y, d_gate, d_up are
contiguous and flattened to `[E]` (a packed `[.., 2I]` projection's halves are copied first);
every pointer 16-byte aligned; `E` any value.
"""
import triton
import triton.language as tl

# `exp_f32` of candle-fused/src/gelu.rs: Cody-Waite reduction `x = n ln2 + r`, Cephes' degree-7
# polynomial for e^r, `2^n` built from exponent bits in two factors. The decimal constants are
# the Rust source's f32 literals; each rounds to the same f32 through f64 (checked).
LOG2E = tl.constexpr(1.44269504088896340735992468100189214)
LN2_HI = tl.constexpr(0.6933594)
LN2_LO = tl.constexpr(-2.1219444e-4)
MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: adding it rounds to an integer
P0 = tl.constexpr(1.9875691e-4)
P1 = tl.constexpr(1.3981999e-3)
P2 = tl.constexpr(8.333452e-3)
P3 = tl.constexpr(4.1665796e-2)
P4 = tl.constexpr(1.6666665e-1)


@triton.jit
def exp_f32(x):
    """`e^x` in f32, bit for bit the crate's `gelu::exp_f32` (a copy of gelu.py's: each family
    file is the whole source its interpreter record and cubins hash)."""
    # Rust's clamp(-104, 89), which keeps a NaN
    x = tl.where(x < -104.0, -104.0, tl.where(x > 89.0, 89.0, x))
    t = x * LOG2E + MAGIC
    n = t - MAGIC
    r = (x - n * LN2_HI) - n * LN2_LO
    r2 = r * r
    p = (((((P0 * r + P1) * r + P2) * r + P3) * r + P4) * r + 0.5) * r2 + r + 1.0
    ni = t.to(tl.int32, bitcast=True) - 0x4B400000
    h = ni >> 1
    s1 = ((h + 127) << 23).to(tl.float32, bitcast=True)
    s2 = ((ni - h + 127) << 23).to(tl.float32, bitcast=True)
    return p * s1 * s2


@triton.jit
def sigmoid(g):
    """`1 / (1 + e^-g)`, the division correctly rounded as on the CPU."""
    return tl.div_rn(1.0, 1.0 + exp_f32(-g))


@triton.jit
def swiglu_fwd(GATE, UP, Y, E, BLOCK: tl.constexpr):
    """Program `p`: elements `[p * BLOCK, (p + 1) * BLOCK)` of `Y = silu(GATE) * UP`."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < E
    g = tl.load(GATE + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + offs, mask=mask, other=0.0).to(tl.float32)
    y = g * sigmoid(g) * u
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_bwd(GATE, UP, DY, DGATE, DUP, E, BLOCK: tl.constexpr):
    """Program `p`: elements `[p * BLOCK, (p + 1) * BLOCK)` of both gradients; `s` is
    recomputed from `GATE` (the forward saves nothing)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < E
    g = tl.load(GATE + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + offs, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    s = sigmoid(g)
    gs = g * s
    dg = d * u * (s + gs * (1.0 - s))
    du = d * gs
    tl.store(DGATE + offs, dg.to(DGATE.dtype.element_ty), mask=mask)
    tl.store(DUP + offs, du.to(DUP.dtype.element_ty), mask=mask)


# The fixed configuration compiled ahead of time; the Rust launch table is
# candle-fused/src/cuda_kernels/swiglu.rs.
BLOCK = 1024
NUM_WARPS = 4

AOT = [
    dict(fn=swiglu_fwd, num_warps=NUM_WARPS, grid=f"(cdiv(E, {BLOCK}), 1, 1)",
         constexprs={"BLOCK": BLOCK},
         params=[("GATE", "*{io}", "in [E]"), ("UP", "*{io}", "in [E]"),
                 ("Y", "*{io}", "out [E]"), ("E", "i32", "elements")]),
    dict(fn=swiglu_bwd, num_warps=NUM_WARPS, grid=f"(cdiv(E, {BLOCK}), 1, 1)",
         constexprs={"BLOCK": BLOCK},
         params=[("GATE", "*{io}", "in [E]"), ("UP", "*{io}", "in [E]"),
                 ("DY", "*{io}", "in [E]"), ("DGATE", "*{io}", "out [E]"),
                 ("DUP", "*{io}", "out [E]"), ("E", "i32", "elements")]),
]

# Interpreter check: every output bit-identical to the CPU kernel's ("exact", tolerance 0 =
# no element differs), for every dtype: the same f32 operations in the same order (IEEE
# add/mul/div, integer bit operations; no FMA contraction), rounded once to nearest even (the
# driver rounds the bf16 outputs the kernel stores in f32, as `cvt.rn.bf16.f32` does).
# The reference gradients went through Candle's backprop, which adds each op's gradient to a
# zero tensor (`0 + (-0) = +0`), so `interpret` adds 0 to the kernel's gradients too: that
# changes nothing but the sign of a zero (here where the sigmoid underflows, g <= -88).
ERROR = {"y": "exact", "d_gate": "exact", "d_up": "exact"}
TOL = {dt: {"y": 0, "d_gate": 0, "d_up": 0} for dt in ("f32", "bf16", "f16")}


def interpret(t, out_dtype):
    """Both kernels on the vectors `t`, flattened, under the interpreter."""
    import numpy
    import torch
    gate, up, dy = (t[k].reshape(-1) for k in ("gate", "up", "dy"))
    e = gate.numel()
    grid = (triton.cdiv(e, BLOCK),)
    y = torch.empty(e, dtype=out_dtype)
    dg = torch.empty(e, dtype=out_dtype)
    du = torch.empty(e, dtype=out_dtype)
    # e^-g overflows to inf for g < -88.7 (s = 0), as on the CPU: not worth a numpy warning
    with numpy.errstate(over="ignore"):
        swiglu_fwd[grid](gate, up, y, e, BLOCK=BLOCK)
        swiglu_bwd[grid](gate, up, dy, dg, du, e, BLOCK=BLOCK)
    shape = t["gate"].shape
    # as Candle's backprop accumulates them: 0 + g (only -0 changes, to +0)
    return {"y": y.reshape(shape), "d_gate": (dg + 0.0).reshape(shape),
            "d_up": (du + 0.0).reshape(shape)}
