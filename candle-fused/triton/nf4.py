"""NF4 dequantization in Triton (QLoRA's frozen 4-bit base), as bitsandbytes computes it.

Values `[START, START + E)` of a weight (flat, row-major) quantized to NF4 in blocks of `BS`
values: value `i` is `NF4[code_i] * absmax_{i // BS}` in f32, rounded once on store, where
`code_i` is the high nibble of byte `i // 2` for even `i`, the low nibble for odd `i`. The
absmax of a block is an f32 (`nf4_dequant`) or double-quantized (`nf4_dequant_nested`):
`NMAP[CODES[b]] * NABSMAX[b // NBS] + OFFSET` in f32 (a product, then a sum: two roundings, as
the CPU's `Nf4Weight::absmax_f32` and bitsandbytes' `dequantize_blockwise` compute it).

The same operations as the CPU dequantization (candle-fused/src/nf4.rs,
`Nf4Weight::dequantize_range`): a table lookup, one f32 product (and for the nested absmax one
product and one sum; the AOT compile turns FMA contraction off), so the outputs are the CPU's
bits: the check is exact. The 16 NF4 values are the f32 of `nf4::NF4_VALUES`, written here as
the exact decimal of each f32 (no rounding on the way in), selected by the code's four bits.

Layout contract (`candle_fused::cuda_kernels::nf4`): PACKED the whole weight's bytes (u8,
`ceil(n / 2)`), ABSMAX / CODES one per block, NABSMAX one per nested block, NMAP the 256-entry
dynamic map, OUT the `E` values asked for, contiguous; every pointer 16-byte aligned (whole
buffers: the range starts at `START`, not at an offset pointer); `START + E <= n` and
`n + BLOCK <= i32::MAX` (the caller checks both).
"""
import triton
import triton.language as tl

# nf4::NF4_VALUES, each the exact decimal of its f32
V0 = tl.constexpr(-1.0)
V1 = tl.constexpr(-0.6961928009986877)
V2 = tl.constexpr(-0.5250730514526367)
V3 = tl.constexpr(-0.39491748809814453)
V4 = tl.constexpr(-0.28444138169288635)
V5 = tl.constexpr(-0.18477343022823334)
V6 = tl.constexpr(-0.09105003625154495)
V7 = tl.constexpr(0.0)
V8 = tl.constexpr(0.07958029955625534)
V9 = tl.constexpr(0.16093020141124725)
V10 = tl.constexpr(0.24611230194568634)
V11 = tl.constexpr(0.33791524171829224)
V12 = tl.constexpr(0.44070982933044434)
V13 = tl.constexpr(0.5626170039176941)
V14 = tl.constexpr(0.7229568362236023)
V15 = tl.constexpr(1.0)


@triton.jit
def nf4_value(c):
    """`NF4_VALUES[c]` for 4-bit codes `c` (i32): a tree of selects on the code's bits."""
    b0 = (c & 1) != 0
    b1 = (c & 2) != 0
    b2 = (c & 4) != 0
    lo = tl.where(b2, tl.where(b1, tl.where(b0, V7, V6), tl.where(b0, V5, V4)),
                  tl.where(b1, tl.where(b0, V3, V2), tl.where(b0, V1, V0)))
    hi = tl.where(b2, tl.where(b1, tl.where(b0, V15, V14), tl.where(b0, V13, V12)),
                  tl.where(b1, tl.where(b0, V11, V10), tl.where(b0, V9, V8)))
    return tl.where((c & 8) != 0, hi, lo)


@triton.jit
def _dequant(PACKED, ABSMAX, CODES, NABSMAX, NMAP, OUT, OFFSET, START, E, BS, NBS,
             BLOCK: tl.constexpr, NESTED: tl.constexpr):
    """Program `p`: values `START + [p * BLOCK, (p + 1) * BLOCK)`, written to `OUT[p * BLOCK..]`.
    Indices in i32 (the caller keeps `n + BLOCK <= i32::MAX`): 64-bit divisions by `BS` cost
    a stack frame on sm_80."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < E
    i = offs + START
    byte = tl.load(PACKED + (i >> 1), mask=mask, other=0).to(tl.int32)
    code = tl.where((i & 1) == 0, byte >> 4, byte & 15)
    blk = i // BS
    if NESTED:
        q = tl.load(CODES + blk, mask=mask, other=0).to(tl.int32)
        m = tl.load(NMAP + q, mask=mask, other=0.0)
        nested = tl.load(NABSMAX + blk // NBS, mask=mask, other=0.0)
        absmax = m * nested + OFFSET
    else:
        absmax = tl.load(ABSMAX + blk, mask=mask, other=0.0)
    v = nf4_value(code) * absmax
    tl.store(OUT + offs, v.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def nf4_dequant(PACKED, ABSMAX, OUT, START, E, BS, BLOCK: tl.constexpr):
    """Plain f32 absmaxes."""
    # ABSMAX stands in for the nested pointers: NESTED=False compiles their loads away
    _dequant(PACKED, ABSMAX, ABSMAX, ABSMAX, ABSMAX, OUT, 0.0, START, E, BS, 1,
             BLOCK=BLOCK, NESTED=False)


@triton.jit
def nf4_dequant_nested(PACKED, CODES, NABSMAX, NMAP, OUT, OFFSET, START, E, BS, NBS,
                       BLOCK: tl.constexpr):
    """Double-quantized absmaxes."""
    # NABSMAX stands in for the plain absmax pointer: NESTED=True compiles its load away
    _dequant(PACKED, NABSMAX, CODES, NABSMAX, NMAP, OUT, OFFSET, START, E, BS, NBS,
             BLOCK=BLOCK, NESTED=True)


# The fixed configuration compiled ahead of time; the Rust launch table is
# candle-fused/src/cuda_kernels/nf4.rs.
BLOCK = 1024
NUM_WARPS = 4


def _aot(fn, params):
    """An entry compiled with the fixed configuration: one program per `BLOCK` values."""
    return dict(fn=fn, num_warps=NUM_WARPS, grid=f"(cdiv(E, {BLOCK}), 1, 1)",
                constexprs={"BLOCK": BLOCK}, params=params)


# (name, type, role): the roles' `[dims]` name the tensors' sizes
_RANGE = [("START", "i32", "first value"), ("E", "i32", "values"), ("BS", "i32", "block size")]
AOT = [
    _aot(nf4_dequant, [("PACKED", "*u8", "in [B]"), ("ABSMAX", "*fp32", "in [A] f32"),
                       ("OUT", "*{io}", "out [E]"), *_RANGE]),
    _aot(nf4_dequant_nested, [("PACKED", "*u8", "in [B]"), ("CODES", "*u8", "in [A]"),
                              ("NABSMAX", "*fp32", "in [C] f32"), ("NMAP", "*fp32", "in [M] f32"),
                              ("OUT", "*{io}", "out [E]"), ("OFFSET", "fp32", "nested offset"),
                              *_RANGE, ("NBS", "i32", "nested block size")]),
]

# Interpreter check: the dequantized values bit-identical to the CPU's ("exact": no element
# differs), every dtype: the same f32 table value times the same f32 absmax (nested: the same
# product and sum), rounded once to nearest even (the driver rounds the bf16 outputs the
# kernel stores in f32, as `cvt.rn.bf16.f32` does).
ERROR = {"out": "exact"}
TOL = {dt: {"out": 0} for dt in ("f32", "bf16", "f16")}


def interpret(t, out_dtype):
    """The vector file's range of its weight, dequantized by the kernel of its absmax form."""
    import torch
    start, end, _ = (int(v) for v in t["range"])
    bs = int(t["blocksize"][0])
    e = end - start
    out = torch.empty(e, dtype=out_dtype)
    grid = (triton.cdiv(e, BLOCK),)
    if "codes" in t:
        nbs = int(t["blocksize"][1])
        offset = float(t["offset"][0])
        nf4_dequant_nested[grid](t["packed"], t["codes"], t["nested_absmax"], t["nested_map"],
                                 out, offset, start, e, bs, nbs, BLOCK=BLOCK)
    else:
        nf4_dequant[grid](t["packed"], t["absmax"], out, start, e, bs, BLOCK=BLOCK)
    return {"out": out}
