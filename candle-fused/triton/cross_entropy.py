"""Softmax cross-entropy over a row of logits in Triton: the kernel half of the fused linear
cross-entropy (the GEMMs are cuBLAS; the host loop is in src/cuda_kernels/cross_entropy.rs).

For row i of `LOGITS [R, V]` (the vocabulary `V` is many blocks: looped over, never one tile)
with target t_i, weight w_i and upstream scale s:

    lse_i = log sum_j exp l_ij                       (online max / sum over the blocks)
    nll_i = lse_i - l_i,t_i
    dl_ij = s w_i (exp(l_ij - lse_i) - [j == t_i])   (softmax - onehot, scaled)

Kernels, one program per row:
* `ce_fwd`: `NLL`, `LSE` (evaluation, and the forward of `cross_entropy`);
* `ce_bwd`: `DLOGITS` from a saved `LSE` (the backward of `cross_entropy`);
* `ce_fwd_bwd`: both in one launch (`linear_cross_entropy`'s chunks, whose scale `1 / count`
  is known up front); `DLOGITS` may be `LOGITS` itself (in place: each element is read before
  the same thread overwrites it, and the target logit is read before the gradient pass).

The formulas of the CPU kernels (candle-fused/src/cross_entropy.rs `fwd_kernel` /
`bwd_kernel`, src/linear_cross_entropy/kernel.rs): logits are read in their storage dtype and
widened to f32; the max, the sum of exponentials, lse, nll and the gradient are f32; the
gradient is rounded once to the storage dtype on store (to nearest even on the GPU). The
target's entry is `s w (exp(l_t - lse) - 1)`, the others `s w exp(l - lse)`, with `s w`
computed as one f32 product (the CPU's `coef`). Differences from the CPU, all at rounding
level: the CPU takes the max first and then sums `exp(l - max)` (8 lanes); here each block
updates a running max and rescales the running sum by `exp(m_old - m_new)` (one pass instead
of two over the row); on the GPU `tl.exp` compiles to `ex2.approx.f32` of `x * log2(e)`
(relative error about 2^-22 plus the rounding of the product: about 3e-7 where
`exp(l - lse) > 1e-4`, the CPU's `exp_f32` is within an ulp or two), `tl.log` (once per row)
to libdevice's `logf`; the interpreter uses numpy's. The loads are coalesced but not
vectorised: `V` is not specialised, so a row's start has no known alignment.

Skipped rows: a row whose target is `ignore_index` (compared as 32-bit patterns: the u32
target against the i32 argument, so HF's -100 is the u32 4294967196) or whose weight is 0 is
never read: `NLL = LSE = 0` and its gradient row is exactly 0, even if its logits are not
finite (as the CPU kernels skip it). `NLL` is unweighted: the host forms the loss
`sum_i w_i nll_i / max(sum_{i counted} w_i, 1)`.

Layout contract (checked on the Rust side by `candle_fused::cuda_kernels::check_launch`):
* LOGITS, DLOGITS are contiguous `[R, V]` in the io dtype; TARGETS `[R]` u32; WEIGHT `[R]`
  f32 (the mask in f32, or ones); NLL, LSE `[R]` f32;
* targets of counted rows are `< V` (the host checks them, as the CPU op does; a target out of
  range reads no memory: its logit is taken as 0 and no entry gets the `- 1`);
* every pointer 16-byte aligned; `R`, `V` unspecialised (any value); offsets are 64-bit
  (`R * V` may exceed 2^31).
"""
import triton
import triton.language as tl


@triton.jit
def _row_lse(LOGITS, off, V, BLOCK_V: tl.constexpr):
    """`log sum_j exp l_j` of the row at `LOGITS + off`, in f32, block by block: the running
    max `m` and the running `d = sum exp(l - m)`, rescaled when the max grows."""
    cols = tl.arange(0, BLOCK_V)
    m = float("-inf")
    d = 0.0
    for v0 in range(0, V, BLOCK_V):
        x = tl.load(LOGITS + off + v0 + cols, mask=v0 + cols < V,
                    other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    return m + tl.log(d)


@triton.jit
def _row_grad(LOGITS, DLOGITS, off, V, t, lse, coef, BLOCK_V: tl.constexpr):
    """`DLOGITS[row] = coef (exp(l - lse) - onehot(t))`, rounded to DLOGITS' dtype."""
    cols = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols
        x = tl.load(LOGITS + off + c, mask=c < V, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        g = tl.where(c == t, coef * (p - 1.0), coef * p)
        tl.store(DLOGITS + off + c, g.to(DLOGITS.dtype.element_ty), mask=c < V)


@triton.jit
def _row_zero(DLOGITS, off, V, BLOCK_V: tl.constexpr):
    """A skipped row's gradient: exactly 0."""
    cols = tl.arange(0, BLOCK_V)
    zero = tl.zeros([BLOCK_V], dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols
        tl.store(DLOGITS + off + c, zero.to(DLOGITS.dtype.element_ty), mask=c < V)


@triton.jit
def _row_target(TARGETS, WEIGHT, row, ignore_index):
    """`(t, w, counted)` of a row: the target as i32 (the u32's bits), its weight, and whether
    it counts (target not `ignore_index`, weight not 0; a NaN weight counts, as on the CPU)."""
    t = tl.load(TARGETS + row).to(tl.int32, bitcast=True)
    w = tl.load(WEIGHT + row)
    return t, w, (t != ignore_index) & (w != 0.0)


@triton.jit
def _target_logit(LOGITS, off, V, t):
    """`l_t` in f32; 0 (no read) for a target outside [0, V)."""
    ok = (t >= 0) & (t < V)
    return tl.load(LOGITS + off + tl.where(ok, t, 0), mask=ok, other=0.0).to(tl.float32)


@triton.jit
def ce_fwd(LOGITS, TARGETS, WEIGHT, NLL, LSE, R, V, ignore_index, BLOCK_V: tl.constexpr):
    """One program per row: `NLL[row] = lse - l_t`, `LSE[row] = lse` (0, 0 for a skipped row)."""
    row = tl.program_id(0).to(tl.int64)
    off = row * V
    t, w, counted = _row_target(TARGETS, WEIGHT, row, ignore_index)
    lse = 0.0
    nll = 0.0
    if counted:
        lse = _row_lse(LOGITS, off, V, BLOCK_V)
        nll = lse - _target_logit(LOGITS, off, V, t)
    tl.store(NLL + row, nll)
    tl.store(LSE + row, lse)


@triton.jit
def ce_bwd(LOGITS, TARGETS, WEIGHT, LSE, DLOGITS, R, V, ignore_index, scale,
           BLOCK_V: tl.constexpr):
    """One program per row: `DLOGITS[row] = scale w (exp(l - LSE[row]) - onehot(t))`, 0 for a
    skipped row."""
    row = tl.program_id(0).to(tl.int64)
    off = row * V
    t, w, counted = _row_target(TARGETS, WEIGHT, row, ignore_index)
    if counted:
        _row_grad(LOGITS, DLOGITS, off, V, t, tl.load(LSE + row), scale * w, BLOCK_V)
    else:
        _row_zero(DLOGITS, off, V, BLOCK_V)


@triton.jit
def ce_fwd_bwd(LOGITS, TARGETS, WEIGHT, NLL, LSE, DLOGITS, R, V, ignore_index, scale,
               BLOCK_V: tl.constexpr):
    """`ce_fwd` then `ce_bwd` on the row in one program (two passes over it); `DLOGITS` may
    alias `LOGITS`."""
    row = tl.program_id(0).to(tl.int64)
    off = row * V
    t, w, counted = _row_target(TARGETS, WEIGHT, row, ignore_index)
    if counted:
        lse = _row_lse(LOGITS, off, V, BLOCK_V)
        # read before the gradient pass overwrites it (in place)
        nll = lse - _target_logit(LOGITS, off, V, t)
        tl.store(NLL + row, nll)
        tl.store(LSE + row, lse)
        _row_grad(LOGITS, DLOGITS, off, V, t, lse, scale * w, BLOCK_V)
    else:
        tl.store(NLL + row, 0.0)
        tl.store(LSE + row, 0.0)
        _row_zero(DLOGITS, off, V, BLOCK_V)


# The fixed configuration compiled ahead of time (scripts/python/triton_compile.py) and used
# by the interpreter check; the Rust launch table is candle-fused/src/cuda_kernels/
# cross_entropy.rs. A block of 4096 classes over 8 warps is 16 f32 per thread: a vocabulary of
# 50257 is 13 blocks (12 full, one of 1105), each with one max and one sum across the program.
BLOCK_V = 4096
NUM_WARPS = 8

_COMMON = [("LOGITS", "*{io}", "in [R, V]"), ("TARGETS", "*u32", "in [R] u32"),
           ("WEIGHT", "*fp32", "in [R] f32 (mask or ones)")]
_DIMS = [("R", "i32", "rows"), ("V", "i32", "classes"),
         ("ignore_index", "i32", "bits of the u32 ignore index (-1: none)")]
AOT = [
    dict(fn=ce_fwd, num_warps=NUM_WARPS, grid="(R, 1, 1)", constexprs={"BLOCK_V": BLOCK_V},
         params=_COMMON + [("NLL", "*fp32", "out [R] f32"), ("LSE", "*fp32", "out [R] f32")]
         + _DIMS),
    dict(fn=ce_bwd, num_warps=NUM_WARPS, grid="(R, 1, 1)", constexprs={"BLOCK_V": BLOCK_V},
         params=_COMMON + [("LSE", "*fp32", "in [R] f32"),
                           ("DLOGITS", "*{io}", "out [R, V] (may be LOGITS)")]
         + _DIMS + [("scale", "fp32", "upstream gradient / count")]),
    dict(fn=ce_fwd_bwd, num_warps=NUM_WARPS, grid="(R, 1, 1)", constexprs={"BLOCK_V": BLOCK_V},
         params=_COMMON + [("NLL", "*fp32", "out [R] f32"), ("LSE", "*fp32", "out [R] f32"),
                           ("DLOGITS", "*{io}", "out [R, V] (may be LOGITS)")]
         + _DIMS + [("scale", "fp32", "upstream gradient / count")]),
]

# Interpreter check (triton_interpret_check.py) on each vector file, which holds one case of
# `linear_cross_entropy` written by the Rust CPU ops (tests/triton_vectors/cross_entropy.rs):
# * kernel level, on `logits = x Wᵀ` of all N rows (ignored and zero-weight rows included):
#   ce_fwd -> nll, lse; ce_bwd (from that lse) -> dlogits; ce_fwd_bwd must give the same bits
#   (in place for f32 / f16); `loss` = sum w nll / max(sum w, 1) on the host, against the CPU
#   `cross_entropy(logits, targets, mask, ignore_index)` and its backward for an upstream
#   gradient g (`scale` = g / count);
# * the host loop of src/cuda_kernels/cross_entropy.rs, torch's matmul standing in for cuBLAS
#   (f32 products and sums, rounded once to the dtype): counted rows gathered, `chunk` at a
#   time, their logits, ce_fwd_bwd in place with weight 1 and scale 1 / count, dx = G W, dW +=
#   Gᵀ xc in f32 -> lce_loss, dx, dw against the CPU `linear_cross_entropy_chunked`.
#
# Errors: nll "abs"; lse, dlogits, dx, dw "tensor" (/ max |rust| of the tensor); the losses
# "elem". Why "tensor" for the gradients: every entry of a row of dlogits is bounded by its
# coefficient s w_i (|p - onehot| <= 1), and a row whose target takes nearly all the
# probability has entries of only coef (1 - p_t) ~ coef e^-nll, the target's computed as
# coef (p_t - 1) with p_t within an f32 ulp of 1 on both sides: an absolute error of coef
# 2^-24 that is inherent, not the kernel's; the rows' coefficients differ by at most 3x
# (weights 0.5 .. 1.5). dx and dW inherit it (and dx_i0 = sum_j dl_ij is 0 up to rounding:
# column 0 of W is all ones).
# Tolerances and why:
# * lse, nll, loss (f32 for every dtype): the same f32 inputs, different summation orders
#   (the online per-block rescaling here, the CPU's max-then-sum over 8 lanes; the reference
#   lse / nll are f64 of the same logits, rounded to f32, already half an ulp). lse reaches
#   112 in these vectors (the rows shifted by 100), where an f32 ulp is 2^-17 = 7.6e-6:
#   nll = lse - l_t within about 2.5 ulp of lse, 2e-5 absolute; lse 4e-7 of the largest
#   (about 3 ulp); the losses 2e-6.
# * dlogits, f32: exp(l - lse) with lse a few ulp apart, 1e-6 of the largest (on the GPU,
#   ex2.approx adds about 3e-7 relative for the entries that matter, p > 1e-4); 16-bit: the
#   same f32 value rounded once on both sides, one unit in the last place when it straddles a
#   boundary: at most 2^-8 of the entry, 2^-7 / 2^-10 of the largest.
# * lce_loss, dx, dw: the losses as above; dx = dl W sums V terms, dW = dlᵀ x sums the chunk's
#   rows, in another order than the CPU's GEMMs (whose logits of 16-bit input may also round
#   to the other neighbour), with cancellation: sum_j |dl_ij| <= 2 coef. f32: the order alone
#   moves dx by up to 1.5e-5 of the largest here (V = 8311, torch's f32 GEMM), 5e-5; 16-bit:
#   one rounding of the result (2^-8 of the entry) plus rounded gradients that may differ by a
#   unit, 2^-6 (bf16) and 2^-9 (f16) of the largest.
ERROR = {"nll": "abs", "lse": "tensor", "loss": "elem", "dlogits": "tensor",
         "lce_loss": "elem", "dx": "tensor", "dw": "tensor"}
_F32_STATS = {"nll": 2e-5, "lse": 4e-7, "loss": 2e-6, "lce_loss": 2e-6}
TOL = {
    "f32": {**_F32_STATS, "dlogits": 1e-6, "dx": 5e-5, "dw": 5e-5},
    "bf16": {**_F32_STATS, "dlogits": 2.0**-7, "dx": 2.0**-6, "dw": 2.0**-6},
    "f16": {**_F32_STATS, "dlogits": 2.0**-10, "dx": 2.0**-9, "dw": 2.0**-9},
}


def _i32_bits(u):
    """The i32 with the bits of the u32 `u` (the kernels' `ignore_index` argument)."""
    return u - (1 << 32) if u >= 1 << 31 else u


def interpret(t, out_dtype):
    """The kernels on a vector file's tensors `t` under the interpreter, then the host loop of
    linear_cross_entropy (see above); io outputs are stored in `out_dtype` (f32 for bf16
    vectors: the interpreter truncates f32 -> bf16, the driver rounds to nearest even) and the
    chunk loop rounds them to the io dtype itself before its GEMMs, as the GPU's store would."""
    import torch
    logits, targets, weight = t["logits"], t["targets"], t["weight"]
    x, w = t["x"], t["w"]
    io = logits.dtype
    ignore = int(t["ignore_index"][0])
    ig = _i32_bits(ignore)
    scale = float(t["scale"][0])
    n, v = logits.shape
    grid = (n,)

    nll = torch.empty(n, dtype=torch.float32)
    lse = torch.empty(n, dtype=torch.float32)
    ce_fwd[grid](logits, targets, weight, nll, lse, n, v, ig, BLOCK_V=BLOCK_V)
    dlogits = torch.empty((n, v), dtype=out_dtype)
    ce_bwd[grid](logits, targets, weight, lse, dlogits, n, v, ig, scale, BLOCK_V=BLOCK_V)
    # the fused kernel: the same bits, in place where the stored dtype is the io dtype
    nll2 = torch.empty(n, dtype=torch.float32)
    lse2 = torch.empty(n, dtype=torch.float32)
    buf = logits.clone() if out_dtype == io else torch.empty((n, v), dtype=out_dtype)
    src = buf if out_dtype == io else logits
    ce_fwd_bwd[grid](src, targets, weight, nll2, lse2, buf, n, v, ig, scale, BLOCK_V=BLOCK_V)
    for name, a, b in [("nll", nll, nll2), ("lse", lse, lse2), ("dlogits", dlogits, buf)]:
        if not torch.equal(a, b):
            raise AssertionError(f"ce_fwd_bwd's {name} differs from ce_fwd / ce_bwd's")

    counted = (targets.long() != ignore) & (weight != 0)
    wc = torch.where(counted, weight.double(), 0.0)
    loss = (wc * nll.double()).sum() / max(float(wc.sum()), 1.0)

    # linear_cross_entropy's host loop (src/cuda_kernels/cross_entropy.rs), torch for cuBLAS
    chunk = int(t["chunk"][0])
    rows = [i for i in range(n) if int(targets[i]) != ignore]
    count = max(len(rows), 1)
    s = float(torch.tensor(1.0 / count, dtype=torch.float32))
    if s != float(t["lce_scale"][0]):
        raise AssertionError(f"1 / count = {s}, the vector's lce_scale {t['lce_scale']}")
    dx = torch.zeros(x.shape, dtype=io)
    dw32 = torch.zeros(w.shape, dtype=torch.float32)
    nll_sum = 0.0
    for c0 in range(0, len(rows), chunk):
        idx = torch.tensor(rows[c0:c0 + chunk])
        r = len(idx)
        xc = x[idx]
        # the chunk's logits as cuBLAS gives them: the rows of `logits` (x Wᵀ, f32 sums)
        lc = logits[idx].contiguous()
        g = lc if out_dtype == io else torch.empty((r, v), dtype=out_dtype)
        tc = targets[idx].contiguous()
        ones = torch.ones(r, dtype=torch.float32)
        nll_c = torch.empty(r, dtype=torch.float32)
        lse_c = torch.empty(r, dtype=torch.float32)
        ce_fwd_bwd[(r,)](lc, tc, ones, nll_c, lse_c, g, r, v, -1, s, BLOCK_V=BLOCK_V)
        g = g.to(io)
        nll_sum += float(nll_c.double().sum())
        dx[idx] = (g.float() @ w.float()).to(io)
        dw32 += g.float().t() @ xc.float()
    return {"nll": nll, "lse": lse, "dlogits": dlogits, "loss": loss.float(),
            "lce_loss": torch.tensor(nll_sum / count, dtype=torch.float32),
            "dx": dx, "dw": dw32.to(io)}
