"""Flash attention in Triton: forward (saves the log-sum-exp) and the FlashAttention-2 backward.

    s_ij = scale * <q_i, k_j>  for the keys j that query i sees (else -inf)
    forward:  online softmax over key blocks: m_i (running max), l_i (running sum of every
              weight), acc_i += sum_j exp(s_ij - m_i) Z'_ij v_j;  o_i = acc_i * keep / l_i,
              L_i = m_i + ln l_i  (saved, f32)
    backward: D_i = <dO_i, O_i>;  P_ij = exp(s_ij - L_i);  Z_ij = 0 (dropped) or keep;
              dV_j += sum_i P_ij Z_ij dO_i;  dP_ij = Z_ij <dO_i, v_j>;
              dS_ij = P_ij (dP_ij - D_i) scale;  dQ_i += sum_j dS_ij k_j;  dK_j += sum_i dS_ij q_i

The formulas of the CPU kernel (candle-fused/src/attention/kernel.rs, kernel/backward.rs), the
reference. Which keys query i sees (T queries over the same T keys, self-attention): all, minus
those `causal` masks (j > i), those outside the sliding `window` (i - j >= window, 0 = no
window) and those of another document (DOC[b, i] != DOC[b, j]; the launcher passes zeros when
there are no document ids: every key is then in the query's document). Every query sees at
least itself, so no row is empty. The CPU op's additive `[Tq, Tk]` mask is not implemented here:
the trainer never sets one (trainer/src/model/kernels.rs builds causal / window / doc-id /
dropout configs only).

Dropout (probability p_drop > 0, `keep = 1 / (1 - p)` rounded to f32 as the CPU does): the
probability (b, h, i, j) is element `offset + ((b * H + h) * T + i) * T + j` of the CPU's
`[B, H, T, T]` mask (`RngKey::uniform`, src/philox.rs): Philox4x32-10 with counter
[block lo, block hi, site lo, site hi], key [seed lo, seed hi], block = index / 4, word
index % 4 of the four, uniform = (word >> 8) * 2^-24, dropped iff uniform < p. `_philox` below
writes the rounds out (the same as `tl.philox`'s with 32-bit counters: checked against the
rounds of src/philox.rs; the drop decisions are integer math, bit-identical to the CPU's).
As on the CPU, every weight counts in l_i; dropped ones leave the numerator.

Layout contract (checked on the Rust side by `candle_fused::cuda_kernels::check_launch`):
* Q, O, dO, dQ are contiguous [B, H, T, D]; K, V, dK, dV [B, KV, T, D] (grouped-query
  attention: query head h reads kv head h // (H // KV); K and V are never repeated);
  DOC [B, T] i32; LSE, DELTA [B, H, T] f32;
* D <= BLOCK_D (a head is one tile; 64, 80, 96 and 128 all fit the 128 tile; D < 128 costs
  the dots of 128 columns);
* every pointer is 16-byte aligned; the sizes are not specialised (odd T included).

Grids and determinism (no atomics anywhere):
* `attn_fwd`: (cdiv(T, BLOCK_M), B * H); a program owns BLOCK_M query rows of one head and
  loops over the key blocks its rows may see (causal: up to its last row; window: from its
  first row's first key), like the CPU's `block_keys`;
* `attn_bwd_delta`: (cdiv(T, BLOCK_M), B * H): D_i = <dO_i, O_i> in f32 (the stored O);
* `attn_bwd_dkdv`: (cdiv(T, BLOCK_N), B * KV); a program owns BLOCK_N keys of one kv head and
  loops over the query heads of its group in order, then over the query blocks that may see
  its keys: the sum over the group is in a fixed order inside one program (the CPU kernel's
  choice too), no per-query-head partials of size B x H x T x D;
* `attn_bwd_dq`: (cdiv(T, BLOCK_M), B * H); a program owns BLOCK_M query rows and loops over
  key blocks as the forward.

Precision: scores, softmax statistics and every accumulator are f32. Dots take their operands
in the io dtype: f32 dots use `input_precision="ieee"` (no TF32); bf16 / f16 dots run on tensor
cores with f32 accumulation, so P (forward) and dS (backward) are rounded to the io dtype
before their dots (the CPU keeps them in f32), to nearest even on both the GPU and the
interpreter (`_lowp`). That rounding, the summation orders and the final rounding of the
outputs are what separates these kernels from the CPU's (tolerances below).
"""
import contextlib

import triton
import triton.language as tl

# f32 dots as IEEE f32 products (TF32 would lose 13 mantissa bits against the CPU kernel).
DOT_PRECISION: tl.constexpr = tl.constexpr("ieee")


@triton.jit
def _lowp(x, dtype: tl.constexpr):
    """The f32 tile `x` as a dot operand of `dtype`, rounded to nearest even. bf16 is rounded
    with integer ops: Triton 3.9's interpreter truncates f32 -> bf16, the GPU rounds; rounding
    first makes the final conversion exact on both."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    elif dtype == tl.float32:
        return x
    else:
        return x.to(dtype)


@triton.jit
def _visible(rows, cols, doc_q, doc_k, T, causal, window):
    """[BLOCK_M, BLOCK_N]: query `rows[r]` sees key `cols[c]` (both in range, causal, window,
    same document)."""
    r = rows[:, None]
    c = cols[None, :]
    vis = (r < T) & (c < T) & (doc_q[:, None] == doc_k[None, :])
    vis = vis & ((causal == 0) | (c <= r))
    vis = vis & ((window == 0) | (r - c < window))
    return vis


@triton.jit
def _philox(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 (src/philox.rs `philox4x32_10`): the 4 words of counter (c0..c3) under
    key (k0, k1), all uint32."""
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, 0xD2511F53)
        lo0 = c0 * 0xD2511F53
        hi1 = tl.umulhi(c2, 0xCD9E8D57)
        lo1 = c2 * 0xCD9E8D57
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def _u32(x):
    """An i32 argument's bits as uint32 (64-bit seeds, sites, offsets come as lo / hi i32s)."""
    return x.to(tl.uint32, bitcast=True)


@triton.jit
def _keep_scale(bh, rows, cols, T, p_drop, keep, seed_lo, seed_hi, site_lo, site_hi,
                off_lo, off_hi):
    """[BLOCK_M, BLOCK_N] f32: 0 where probability (bh, rows[r], cols[c]) is dropped, `keep`
    where it is kept (the CPU's RngKey::uniform of element offset + (bh * T + i) * T + j)."""
    offset = (_u32(off_hi).to(tl.uint64) << 32) | _u32(off_lo).to(tl.uint64)
    flat = (bh.to(tl.int64) * T + rows[:, None]) * T + cols[None, :]
    idx = flat.to(tl.uint64) + offset
    block = idx >> 2
    lane = idx & 3
    c0 = (block & 0xFFFFFFFF).to(tl.uint32)
    c1 = (block >> 32).to(tl.uint32)
    c2 = tl.zeros_like(c0) + _u32(site_lo)
    c3 = tl.zeros_like(c0) + _u32(site_hi)
    w0, w1, w2, w3 = _philox(c0, c1, c2, c3, _u32(seed_lo), _u32(seed_hi))
    word = tl.where(lane == 0, w0, tl.where(lane == 1, w1, tl.where(lane == 2, w2, w3)))
    u = (word >> 8).to(tl.float32) * (1.0 / 16777216.0)
    return tl.where(u < p_drop, 0.0, keep)


@triton.jit
def attn_fwd(
    Q, K, V, DOC, O, LSE, H, KV, T, D, scale, causal, window, p_drop, keep,
    seed_lo, seed_hi, site_lo, site_hi, off_lo, off_hi,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (m, b * H + h): output rows m * BLOCK_M.. of head h and their log-sum-exp."""
    bh = tl.program_id(1)
    b = bh // H
    kvh = b * KV + (bh % H) // (H // KV)
    m0 = tl.program_id(0) * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    dcol = tl.arange(0, BLOCK_D)
    row_ok = rows < T
    d_ok = dcol < D
    q_at = bh.to(tl.int64) * T * D + rows[:, None] * D + dcol[None, :]
    q = tl.load(Q + q_at, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    doc_q = tl.load(DOC + b * T + rows, mask=row_ok, other=-1)
    kv_base = kvh.to(tl.int64) * T * D
    # The keys some row of the block sees: causal, up to the last row; window, from the first
    # row's first key (CPU: Geom::block_keys). Other keys are skipped, not masked.
    hi = T
    if causal != 0:
        hi = tl.minimum(T, m0 + BLOCK_M)
    lo = 0
    if window != 0:
        lo = tl.maximum(0, m0 + 1 - window)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < T
        kv_at = kv_base + cols[:, None] * D + dcol[None, :]
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(K + kv_at, mask=kv_mask, other=0.0)
        v = tl.load(V + kv_at, mask=kv_mask, other=0.0)
        doc_k = tl.load(DOC + b * T + cols, mask=col_ok, other=-2)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        s = tl.where(_visible(rows, cols, doc_q, doc_k, T, causal, window), s, float("-inf"))
        # Online softmax; while a row has seen only -inf, exponents are taken against 0.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if p_drop > 0.0:
            # Every weight counts in l_i; only kept ones reach the numerator (scaled at the end).
            z = _keep_scale(bh, rows, cols, T, p_drop, keep, seed_lo, seed_hi, site_lo,
                            site_hi, off_lo, off_hi)
            p = tl.where(z == 0.0, 0.0, p)
        acc = tl.dot(_lowp(p, V.dtype.element_ty), v, acc * alpha[:, None],
                     input_precision=DOT_PRECISION)
        m_i = m_new
    # Rows past T (never stored) have l_i = 0; keep them finite.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    inv = tl.div_rn(tl.zeros_like(l_safe) + keep, l_safe)
    o = acc * inv[:, None]
    tl.store(O + q_at, o.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + bh.to(tl.int64) * T + rows, m_i + tl.log(l_safe), mask=row_ok)


@triton.jit
def attn_bwd_delta(O, DO, DELTA, T, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (m, b * H + h): DELTA[b, h, i] = <dO_i, O_i> (f32) for its BLOCK_M rows."""
    bh = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dcol = tl.arange(0, BLOCK_D)
    row_ok = rows < T
    at = bh.to(tl.int64) * T * D + rows[:, None] * D + dcol[None, :]
    mask = row_ok[:, None] & (dcol < D)[None, :]
    o = tl.load(O + at, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + at, mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + bh.to(tl.int64) * T + rows, tl.sum(o * do, 1), mask=row_ok)


@triton.jit
def _bwd_tile(q, k, v, do, lse, delta, bh, rows, cols, doc_q, doc_k, T, scale, causal, window,
              p_drop, keep, seed_lo, seed_hi, site_lo, site_hi, off_lo, off_hi):
    """One (query block, key block) tile of the backward: (P∘Z, dS), f32 [BLOCK_M, BLOCK_N]
    (0 where the row does not see the key)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
    s = tl.where(_visible(rows, cols, doc_q, doc_k, T, causal, window), s, float("-inf"))
    p = tl.exp(s - lse[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    pz = p
    if p_drop > 0.0:
        z = _keep_scale(bh, rows, cols, T, p_drop, keep, seed_lo, seed_hi, site_lo, site_hi,
                        off_lo, off_hi)
        pz = p * z
        dp = dp * z
    ds = p * (dp - delta[:, None]) * scale
    return pz, ds


@triton.jit
def attn_bwd_dkdv(
    Q, K, V, DOC, DO, LSE, DELTA, DK, DV, H, KV, T, D, scale, causal, window, p_drop, keep,
    seed_lo, seed_hi, site_lo, site_hi, off_lo, off_hi,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (n, b * KV + c): dK, dV of keys n * BLOCK_N.. of kv head c, summed over the query
    heads c * G .. (c + 1) * G (G = H // KV) in order, then over query blocks in order."""
    bc = tl.program_id(1)
    b = bc // KV
    group = H // KV
    n0 = tl.program_id(0) * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    dcol = tl.arange(0, BLOCK_D)
    col_ok = cols < T
    d_ok = dcol < D
    kv_at = bc.to(tl.int64) * T * D + cols[:, None] * D + dcol[None, :]
    kv_mask = col_ok[:, None] & d_ok[None, :]
    k = tl.load(K + kv_at, mask=kv_mask, other=0.0)
    v = tl.load(V + kv_at, mask=kv_mask, other=0.0)
    doc_k = tl.load(DOC + b * T + cols, mask=col_ok, other=-2)
    # The query rows that may see these keys: causal, from the first key on; window, up to
    # the last key's last row.
    lo = 0
    if causal != 0:
        lo = n0
    hi = T
    if window != 0:
        hi = tl.minimum(T, n0 + BLOCK_N - 1 + window)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for g in range(0, group):
        bh = b * H + (bc % KV) * group + g
        for m0 in range(lo, hi, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            row_ok = rows < T
            q_at = bh.to(tl.int64) * T * D + rows[:, None] * D + dcol[None, :]
            q_mask = row_ok[:, None] & d_ok[None, :]
            q = tl.load(Q + q_at, mask=q_mask, other=0.0)
            do = tl.load(DO + q_at, mask=q_mask, other=0.0)
            lse = tl.load(LSE + bh.to(tl.int64) * T + rows, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + bh.to(tl.int64) * T + rows, mask=row_ok, other=0.0)
            doc_q = tl.load(DOC + b * T + rows, mask=row_ok, other=-1)
            pz, ds = _bwd_tile(q, k, v, do, lse, delta, bh, rows, cols, doc_q, doc_k, T, scale,
                               causal, window, p_drop, keep, seed_lo, seed_hi, site_lo,
                               site_hi, off_lo, off_hi)
            dv = tl.dot(tl.trans(_lowp(pz, DO.dtype.element_ty)), do, dv,
                        input_precision=DOT_PRECISION)
            dk = tl.dot(tl.trans(_lowp(ds, Q.dtype.element_ty)), q, dk,
                        input_precision=DOT_PRECISION)
    tl.store(DK + kv_at, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + kv_at, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def attn_bwd_dq(
    Q, K, V, DOC, DO, LSE, DELTA, DQ, H, KV, T, D, scale, causal, window, p_drop, keep,
    seed_lo, seed_hi, site_lo, site_hi, off_lo, off_hi,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (m, b * H + h): dQ of rows m * BLOCK_M.. of head h, over the key blocks the
    forward read, in order."""
    bh = tl.program_id(1)
    b = bh // H
    kvh = b * KV + (bh % H) // (H // KV)
    m0 = tl.program_id(0) * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    dcol = tl.arange(0, BLOCK_D)
    row_ok = rows < T
    d_ok = dcol < D
    q_at = bh.to(tl.int64) * T * D + rows[:, None] * D + dcol[None, :]
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + q_at, mask=q_mask, other=0.0)
    do = tl.load(DO + q_at, mask=q_mask, other=0.0)
    lse = tl.load(LSE + bh.to(tl.int64) * T + rows, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + bh.to(tl.int64) * T + rows, mask=row_ok, other=0.0)
    doc_q = tl.load(DOC + b * T + rows, mask=row_ok, other=-1)
    kv_base = kvh.to(tl.int64) * T * D
    hi = T
    if causal != 0:
        hi = tl.minimum(T, m0 + BLOCK_M)
    lo = 0
    if window != 0:
        lo = tl.maximum(0, m0 + 1 - window)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < T
        kv_at = kv_base + cols[:, None] * D + dcol[None, :]
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(K + kv_at, mask=kv_mask, other=0.0)
        v = tl.load(V + kv_at, mask=kv_mask, other=0.0)
        doc_k = tl.load(DOC + b * T + cols, mask=col_ok, other=-2)
        _, ds = _bwd_tile(q, k, v, do, lse, delta, bh, rows, cols, doc_q, doc_k, T, scale,
                          causal, window, p_drop, keep, seed_lo, seed_hi, site_lo, site_hi,
                          off_lo, off_hi)
        dq = tl.dot(_lowp(ds, K.dtype.element_ty), k, dq, input_precision=DOT_PRECISION)
    tl.store(DQ + q_at, dq.to(DQ.dtype.element_ty), mask=q_mask)


# The fixed configuration compiled ahead of time (scripts/python/triton_compile.py) and used
# by the interpreter check; the Rust launch table is candle-fused/src/cuda_kernels/attention.rs.
# bf16 / f16: 64 x 64 tiles, 2 pipeline stages (cp.async on sm_80, TMA-free software
# pipelining on sm_90; both compile, ~75-130 KB cubins, 41-83 KB shared). f32: 32 x 32 tiles,
# 1 stage: IEEE f32 dots are FMA loops (no tensor cores), 64 x 64 tiles gave 1.1-1.4 MB cubins
# and up to 161 KB of shared memory. BLOCK_D = 128 for all: D <= 128.
# Not tuned on a GPU (none here): pick the tiles / warps / stages on one and re-record.
BLOCK_D = 128
BLOCKS = {"f32": 32, "bf16": 64, "f16": 64}
STAGES = {"f32": 1, "bf16": 2, "f16": 2}
FWD_NUM_WARPS = 4
BWD_NUM_WARPS = 8
DELTA_BLOCK_M = 64
DELTA_NUM_WARPS = 4

_CFG = [("scale", "fp32", "score scale"), ("causal", "i32", "1: query i sees keys <= i"),
        ("window", "i32", "sliding window, 0 = none"),
        ("p_drop", "fp32", "dropout probability, 0 = none"),
        ("keep", "fp32", "1 / (1 - p_drop) rounded to f32"),
        ("seed_lo", "i32", "Philox seed bits 0..32"), ("seed_hi", "i32", "seed bits 32..64"),
        ("site_lo", "i32", "dropout site bits 0..32"), ("site_hi", "i32", "site bits 32..64"),
        ("off_lo", "i32", "mask element offset bits 0..32"),
        ("off_hi", "i32", "offset bits 32..64")]
_DIMS = [("H", "i32", "query heads"), ("KV", "i32", "kv heads (divides H)"),
         ("T", "i32", "sequence length"), ("D", "i32", "head dim (<= BLOCK_D)")]
_IN = [("Q", "*{io}", "in [B, H, T, D]"), ("K", "*{io}", "in [B, KV, T, D]"),
       ("V", "*{io}", "in [B, KV, T, D]"), ("DOC", "*i32", "in [B, T] doc ids")]
_BWD_IN = _IN + [("DO", "*{io}", "in [B, H, T, D]"), ("LSE", "*fp32", "in [B, H, T] f32"),
                 ("DELTA", "*fp32", "in [B, H, T] f32")]


def _blocks(dt):
    return {"BLOCK_M": BLOCKS[dt], "BLOCK_N": BLOCKS[dt], "BLOCK_D": BLOCK_D}


def _tiled(dt):
    """The three tiled kernels for dtype `dt` (their tiles and stages depend on it)."""
    n, common = BLOCKS[dt], dict(dtypes=(dt,), constexprs=_blocks(dt), num_stages=STAGES[dt],
                                 line_info=False)
    return [
        dict(fn=attn_fwd, num_warps=FWD_NUM_WARPS, grid=f"(cdiv(T, {n}), B*H, 1)",
             params=_IN + [("O", "*{io}", "out [B, H, T, D]"),
                           ("LSE", "*fp32", "out [B, H, T] f32")] + _DIMS + _CFG, **common),
        dict(fn=attn_bwd_dkdv, num_warps=BWD_NUM_WARPS, grid=f"(cdiv(T, {n}), B*KV, 1)",
             params=_BWD_IN + [("DK", "*{io}", "out [B, KV, T, D]"),
                               ("DV", "*{io}", "out [B, KV, T, D]")] + _DIMS + _CFG, **common),
        dict(fn=attn_bwd_dq, num_warps=BWD_NUM_WARPS, grid=f"(cdiv(T, {n}), B*H, 1)",
             params=_BWD_IN + [("DQ", "*{io}", "out [B, H, T, D]")] + _DIMS + _CFG, **common),
    ]


# What triton_compile.py compiles (`line_info=False`: no embedded PTX / line tables, which
# were 60-70 % of each cubin).
AOT = [
    dict(fn=attn_bwd_delta, num_warps=DELTA_NUM_WARPS, line_info=False,
         grid=f"(cdiv(T, {DELTA_BLOCK_M}), B*H, 1)",
         constexprs={"BLOCK_M": DELTA_BLOCK_M, "BLOCK_D": BLOCK_D},
         params=[("O", "*{io}", "in [B, H, T, D]"), ("DO", "*{io}", "in [B, H, T, D]"),
                 ("DELTA", "*fp32", "out [B, H, T] f32"), ("T", "i32", "sequence length"),
                 ("D", "i32", "head dim (<= BLOCK_D)")]),
] + _tiled("f32") + _tiled("bf16") + _tiled("f16")

# Interpreter check. Errors: o: max |triton - rust| / max |rust| of the row ("row");
# dq, dk, dv: of the tensor ("tensor": a key that few queries see has a tiny dK row); lse:
# absolute ("abs": it is a log, an absolute error is a relative error of l).
# Tolerances and why (measured maxima over the 4 cases in brackets):
# * f32 (o, dq, dk, dv [9e-7]; lse [5e-7]): both sides compute in f32 with IEEE products and
#   different summation orders (the CPU's 32 x 256 tiles and gemm micro-kernel vs 64 x 64 tiles,
#   numpy here, FMA chains on the GPU) and their own exp (the CPU's exp_f32, the GPU's
#   ex2.approx): a few ulp of 2^-24 times the lengths, plus the cancellation in dP - D.
#   1e-5 for all, 10x the measured.
# * bf16 / f16 (o [7.8e-3 / 9.7e-4], dq, dk, dv [6.8e-3 / 8.7e-4]): the outputs are rounded
#   to the dtype once on each side, one unit in the last place of the row's largest value
#   (2^-7 bf16, 2^-10 f16) when they straddle a rounding boundary; P (forward) and dS (backward)
#   are rounded to the dtype for the tensor-core dots here but stay f32 on the CPU, 2^-9 /
#   2^-12 relative per element, averaging over the keys. 2^-6 (bf16) and 2^-9 (f16): twice one
#   ulp. lse [5e-7]: f32 on both sides from the same (exactly widened) inputs: 1e-5 as f32.
ERROR = {"o": "row", "lse": "abs", "dq": "tensor", "dk": "tensor", "dv": "tensor"}
TOL = {
    "f32": {"o": 1e-5, "lse": 1e-5, "dq": 1e-5, "dk": 1e-5, "dv": 1e-5},
    "bf16": {"o": 2.0**-6, "lse": 1e-5, "dq": 2.0**-6, "dk": 2.0**-6, "dv": 2.0**-6},
    "f16": {"o": 2.0**-9, "lse": 1e-5, "dq": 2.0**-9, "dk": 2.0**-9, "dv": 2.0**-9},
}


def _i32(x):
    """A u32 as the i32 with the same bits (what the launcher passes)."""
    x = int(x)
    return x - (1 << 32) if x >= 1 << 31 else x


@contextlib.contextmanager
def _bf16_dot_fix():
    """Triton 3.9's interpreter stores bf16 as uint16 and its `create_dot` matmuls those bit
    patterns as integers (a bf16 `tl.dot` gives ~1e10). While active, bf16 dot operands are
    widened to f32 first (exact) and multiplied in f32: what the GPU's bf16 MMA computes,
    exact products with f32 accumulation. The kernel source is unchanged."""
    import numpy as np
    from triton.runtime import interpreter as interp

    cls = interp.InterpreterBuilder
    original = cls.create_dot

    def widened(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        f32 = (h.data.astype(np.uint32) << 16).view(np.float32)
        return interp.TensorHandle(f32, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    cls.create_dot = create_dot
    try:
        yield
    finally:
        cls.create_dot = original


def interpret(t, out_dtype):
    """The four kernels on the vectors `t` under the interpreter; io outputs in `out_dtype`."""
    with _bf16_dot_fix():
        return _interpret(t, out_dtype)


def _interpret(t, out_dtype):
    import torch
    q, k, v, do = t["q"], t["k"], t["v"], t["do"]
    b, h, n, d = q.shape
    kv = k.shape[1]
    assert d <= BLOCK_D and h % kv == 0
    doc = t["doc"].to(torch.int64).to(torch.int32)
    causal, window = (int(x) for x in t["flags"])
    rng = [_i32(x) for x in t["rng"].to(torch.int64)]
    cfg = (float(t["scale"][0]), causal, window, float(t["dropout"][0]), float(t["keep"][0]),
           *rng)
    dt = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}[q.dtype]
    blocks = _blocks(dt)
    o = torch.empty(q.shape, dtype=out_dtype)
    lse = torch.empty((b, h, n), dtype=torch.float32)
    grid_m = (triton.cdiv(n, blocks["BLOCK_M"]), b * h)
    attn_fwd[grid_m](q, k, v, doc, o, lse, h, kv, n, d, *cfg, **blocks)
    # The backward reads O as the forward stored it (the dtype; rounded to nearest even).
    o_io = o.to(q.dtype)
    delta = torch.empty((b, h, n), dtype=torch.float32)
    attn_bwd_delta[(triton.cdiv(n, DELTA_BLOCK_M), b * h)](o_io, do, delta, n, d,
                                                           BLOCK_M=DELTA_BLOCK_M,
                                                           BLOCK_D=BLOCK_D)
    dq = torch.empty(q.shape, dtype=out_dtype)
    dk = torch.empty(k.shape, dtype=out_dtype)
    dv = torch.empty(v.shape, dtype=out_dtype)
    grid_n = (triton.cdiv(n, blocks["BLOCK_N"]), b * kv)
    attn_bwd_dkdv[grid_n](q, k, v, doc, do, lse, delta, dk, dv, h, kv, n, d, *cfg, **blocks)
    attn_bwd_dq[grid_m](q, k, v, doc, do, lse, delta, dq, h, kv, n, d, *cfg, **blocks)
    return {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
