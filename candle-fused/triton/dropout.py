"""Inverted dropout in Triton, the mask drawn inside the kernel from Philox4x32-10.

    y = x * m,   m = 0 if u < p else scale,   scale = 1 / (1 - p) rounded to x's dtype
    u = (word >> 8) * 2^-24,   word = lane (index % 4) of Philox4x32-10(counter, key)
    counter = [block lo, block hi, site lo, site hi],  block = index / 4,  key = [seed lo, seed hi]
    index = offset + i   (i: the element's flat index in the tensor)

The same counter layout, uniform and comparison as the CPU kernel (candle-fused/src/dropout.rs,
src/philox.rs), so the mask and the output are bit-identical: the words are integer
arithmetic, the uniform is exact in f32, `x * m` is one f32 multiply rounded once (the CPU's
`T::from_acc(x.acc() * m.acc())`). The op multiplies: a NaN or an infinity in a dropped position
stays NaN, a dropped negative gives -0. The backward is the same kernel on `dy` (the same key
gives the same mask): nothing is saved between forward and backward.

The Philox rounds are Triton's `tl.philox_impl`: the same constants and the same round as the
crate's `philox4x32_10` (`c0' = hi(M1 c2) ^ c1 ^ k0, c1' = lo(M1 c2), c2' = hi(M0 c0) ^ c3 ^ k1,
c3' = lo(M0 c0)`, the key bumped by the Weyl constants between rounds); `tl.randint4x` is not
used: it puts the offset in counter words 0-1 and zeros in 2-3, with a 64-bit seed as key, so it
cannot carry the site. The Rust vectors hold the raw words, so the check covers them directly.

Arguments: the 64-bit seed, site and offset travel as two i32 words each (low, high: the bits
of the u64, reinterpreted; `candle_fused::cuda_kernels::dropout::scalars` builds them), `p` and
`scale` as f32 (`scale` already rounded to the dtype, as the CPU rounds it).

Work split: program `pid` owns the elements `[pid BLOCK, (pid + 1) BLOCK)` as a `[BLOCK / 4, 4]`
tile. Row `r` starts at absolute index `a = offset + pid BLOCK + 4 r`; with `s = offset % 4` its
element `l` is lane `(s + l) % 4` of Philox block `a / 4` (when `s + l < 4`) or of the next one.
So a row needs one Philox call when `offset % 4 == 0` (the usual case) and two otherwise, not
four (one per element); the grid stays `cdiv(E, BLOCK)` and the loads stay aligned to the data.

Layout contract (`candle_fused::cuda_kernels::dropout`): x / dy and y / dx contiguous,
flattened to `[E]`; every pointer 16-byte aligned; `E` any value (< 2^31).
"""
import triton
import triton.language as tl

TWO_M24 = tl.constexpr(1.0 / 16777216.0)  # 2^-24


@triton.jit
def u32(word):
    """An i32 argument's bits as a u32."""
    return word.to(tl.uint32, bitcast=True)


@triton.jit
def u64(lo, hi):
    """The u64 whose low and high 32 bits are the i32 arguments `lo`, `hi`."""
    return (u32(hi).to(tl.uint64) << 32) | u32(lo).to(tl.uint64)


@triton.jit
def philox_block(block, seed_lo, seed_hi, site_lo, site_hi):
    """The 4 words of Philox4x32-10 for the u64 tensor `block` at `site` under `seed`: counter
    `[block lo, block hi, site lo, site hi]`, key `[seed lo, seed hi]`."""
    c0 = (block & 0xFFFFFFFF).to(tl.uint32)
    c1 = (block >> 32).to(tl.uint32)
    zero = c0 * 0
    return tl.philox_impl(c0, c1, zero + u32(site_lo), zero + u32(site_hi),
                          u32(seed_lo), u32(seed_hi), 10)


@triton.jit
def lane(w0, w1, w2, w3, k):
    """Word `k` (0..3) of each row `(w0, w1, w2, w3)`: `[R, 1]` words, `[R, 4]` lanes."""
    return tl.where(k == 0, w0, tl.where(k == 1, w1, tl.where(k == 2, w2, w3)))


@triton.jit
def draw(seed_lo, seed_hi, site_lo, site_hi, offset_lo, offset_hi, BLOCK: tl.constexpr):
    """This program's `[BLOCK / 4, 4]` tile: the elements' flat indices `i` (i64) and their
    Philox words (lane `(offset + i) % 4` of block `(offset + i) / 4`)."""
    ROWS: tl.constexpr = BLOCK // 4
    pid = tl.program_id(0)
    r = tl.arange(0, ROWS)[:, None]
    l = tl.arange(0, 4)[None, :]
    i = pid.to(tl.int64) * BLOCK + r * 4 + l
    start = u64(offset_lo, offset_hi) + pid.to(tl.uint64) * BLOCK  # BLOCK % 4 == 0
    s = (start & 3).to(tl.int32)
    block = (start >> 2) + r.to(tl.uint64)
    k = s + l  # element l of row r: lane k of `block`, or lane k - 4 of `block + 1`
    a0, a1, a2, a3 = philox_block(block, seed_lo, seed_hi, site_lo, site_hi)
    w = lane(a0, a1, a2, a3, k)
    if s != 0:
        b0, b1, b2, b3 = philox_block(block + 1, seed_lo, seed_hi, site_lo, site_hi)
        w = tl.where(k < 4, w, lane(b0, b1, b2, b3, k - 4))
    return i, w


@triton.jit
def dropout(X, Y, E, seed_lo, seed_hi, site_lo, site_hi, offset_lo, offset_hi, p, scale,
            BLOCK: tl.constexpr):
    """`Y = X * mask` for this program's elements (forward: x -> y; backward: dy -> dx)."""
    i, w = draw(seed_lo, seed_hi, site_lo, site_hi, offset_lo, offset_hi, BLOCK)
    mask = i < E
    u = (w >> 8).to(tl.float32) * TWO_M24  # 24 random bits, exact in f32
    m = tl.where(u >= p, scale, 0.0)
    x = tl.load(X + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + i, (x * m).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def dropout_bits(WORDS, KEEP, E, seed_lo, seed_hi, site_lo, site_hi, offset_lo, offset_hi, p,
                 BLOCK: tl.constexpr):
    """For the interpreter check only (not compiled): the words and the keep bits (u8) that
    `dropout` draws, from the same `draw`."""
    i, w = draw(seed_lo, seed_hi, site_lo, site_hi, offset_lo, offset_hi, BLOCK)
    mask = i < E
    u = (w >> 8).to(tl.float32) * TWO_M24
    tl.store(WORDS + i, w, mask=mask)
    tl.store(KEEP + i, (u >= p).to(tl.uint8), mask=mask)


# The fixed configuration compiled ahead of time; the Rust launch table is
# candle-fused/src/cuda_kernels/dropout.rs.
BLOCK = 1024
NUM_WARPS = 4

AOT = [
    dict(fn=dropout, num_warps=NUM_WARPS, grid=f"(cdiv(E, {BLOCK}), 1, 1)",
         constexprs={"BLOCK": BLOCK},
         params=[("X", "*{io}", "in [E] (x, or dy for the backward)"),
                 ("Y", "*{io}", "out [E] (y, or dx)"), ("E", "i32", "elements"),
                 ("seed_lo", "i32", "seed bits 0-31"), ("seed_hi", "i32", "seed bits 32-63"),
                 ("site_lo", "i32", "site bits 0-31"), ("site_hi", "i32", "site bits 32-63"),
                 ("offset_lo", "i32", "offset bits 0-31"),
                 ("offset_hi", "i32", "offset bits 32-63"),
                 ("p", "fp32", "drop probability"),
                 ("scale", "fp32", "1 / (1 - p) rounded to the dtype")]),
]

# Interpreter check: everything bit-identical ("exact": no element differs), every dtype:
# `words` (the Philox words of every element, u32), `mask` (u8 keep bits), `y`, and `dx` (the
# same kernel on dy). Integer arithmetic and one f32 multiply rounded once (the driver rounds
# the bf16 outputs the kernel stores in f32 to nearest even, as `cvt.rn.bf16.f32` does). The
# reference dx went through Candle's backprop, which adds it to a zero tensor (`0 + (-0) =
# +0`); `interpret` does the same to the kernel's dx (only the sign of a zero can change).
ERROR = {"words": "exact", "mask": "exact", "y": "exact", "dx": "exact"}
TOL = {dt: {"words": 0, "mask": 0, "y": 0, "dx": 0} for dt in ("f32", "bf16", "f16")}


def interpret(t, out_dtype):
    """The kernel on `x` (forward) and on `dy` (backward), and `dropout_bits`, under the
    interpreter, with the scalars of the file (`key`: the six i32 words, `p`, `scale`)."""
    import torch
    x, dy = t["x"].reshape(-1), t["dy"].reshape(-1)
    e = x.numel()
    key = [int(w) for w in t["key"]]
    p, scale = float(t["p"][0]), float(t["scale"][0])
    grid = (triton.cdiv(e, BLOCK),)
    y = torch.empty(e, dtype=out_dtype)
    dropout[grid](x, y, e, *key, p, scale, BLOCK=BLOCK)
    dx = torch.empty(e, dtype=out_dtype)
    dropout[grid](dy, dx, e, *key, p, scale, BLOCK=BLOCK)
    words = torch.empty(e, dtype=torch.uint32)
    keep = torch.empty(e, dtype=torch.uint8)
    dropout_bits[grid](words, keep, e, *key, p, BLOCK=BLOCK)
    shape = t["x"].shape
    return {"words": words.reshape(shape), "mask": keep.reshape(shape), "y": y.reshape(shape),
            "dx": (dx + 0.0).reshape(shape)}
