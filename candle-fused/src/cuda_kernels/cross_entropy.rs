//! Softmax cross-entropy over a row of logits (`triton/cross_entropy.py`): `ce_fwd` (per-row
//! `nll` and `lse`), `ce_bwd` (the logits' gradient from a saved `lse`) and `ce_fwd_bwd`
//! (both in one launch, the gradient possibly in place over the logits): the kernel half of
//! the fused linear cross-entropy, whose GEMMs are cuBLAS. One program per row, the
//! vocabulary looped over in blocks of [`BLOCK_V`] classes (any `V`); no atomics, so every
//! output is the same bits from run to run.
//!
//! Per row `i` with target `t_i` (u32), weight `w_i` (f32) and `scale` `s`, in f32 from the
//! logits in their storage dtype, as the CPU kernels of [`crate::cross_entropy`] and
//! [`crate::linear_cross_entropy`]:
//!
//! ```text
//! lse_i = log Σ_j exp l_ij     nll_i = lse_i - l_i,t_i     (NLL, LSE: [R] f32)
//! dl_ij = s w_i (exp(l_ij - lse_i) - [j == t_i])            (DLOGITS: the io dtype, rounded once)
//! ```
//!
//! A row whose target equals `ignore_index` (the u32's bits as an i32; -1 when there is none)
//! or whose weight is 0 is not read: `nll = lse = 0` and a zero gradient row. `NLL` is not
//! weighted: the host forms `loss = Σ_i w_i nll_i / max(Σ_{i counted} w_i, 1)`. Targets of
//! counted rows must be `< V` (checked on the host, as the CPU ops do). The loads are
//! coalesced but not vectorised (`V` is not specialised, so a row's start has no known
//! alignment).
//!
//! # The CUDA path of `linear_cross_entropy` (the host loop, `linear_cross_entropy/cuda.rs`)
//!
//! What [`crate::linear_cross_entropy`]'s CPU kernel does (its module docs), with the GEMMs
//! on cuBLAS and one kernel per chunk; `io` is f32, bf16 or f16 (f64 keeps the plain-op chunk
//! loop of `linear_cross_entropy/fallback.rs`). Given `x2 = x [N, C]` (contiguous), `w [V, C]`
//! (made contiguous once, as the fallback does), the host targets (`run` already copies them to
//! the host and checks them), `need = [dx, dW]` and `chunk` rows per chunk:
//!
//! ```text
//! once:  rows   = counted row indices (target != ignore_index), M = rows.len()
//!        count  = max(M, 1);  s = (1.0 / count) as f32        (the CPU pass's scale)
//!        rows_d = rows as u32 [M] on the device                (index_select / index_add)
//!        tgt_d  = targets of rows, u32 [K, chunk4]: chunk k in row k, chunk4 = chunk rounded
//!                 up to 4, so every chunk's slice starts 16-byte aligned
//!        ones   = 1.0f32 [min(chunk, M)]                       (WEIGHT: no mask here)
//!        dW32   = f32 [V, C] (if need dW), dxs = [], parts = []
//! chunk k (R rows: rows[k*chunk ..][..R]):
//!   1. xc = x2.index_select(rows_d.narrow(0, k*chunk, R), 0)   [R, C] io
//!          (x2.narrow(0, k*chunk, R) when M == N: no row ignored)
//!   2. GEMM 1: L = xc.matmul(&w.t())                            [R, V] io, a fresh buffer
//!          (cuBLAS, CUBLAS_COMPUTE_32F: f32 sums rounded once to io, the CPU's logits;
//!          leave candle's gemm_reduced_precision_{f32,f16,bf16} off, their default)
//!   3. kernel: ce_fwd_bwd(LOGITS = L, TARGETS = tgt_d[k][..R], WEIGHT = ones[..R],
//!          NLL = f32 [R] new, LSE = f32 [R] new, DLOGITS = L (in place),
//!          ignore_index = -1, scale = s), grid (R, 1, 1), block 256, shared 32 bytes
//!          (check_launch gives them). L now holds G = s (softmax - onehot), rounded to io.
//!          Forward only (neither x nor w tracks a gradient): ce_fwd, and skip 4-5.
//!      parts.push(NLL.to_dtype(F64).sum_all())                 (the CPU adds nll in f64)
//!   4. GEMM 2 (need dx): dxs.push(G.matmul(&w))                [R, C] io, f32 sums, rounded
//!          once (the CPU rounds each dx row once)
//!   5. GEMM 3 (need dW): dW32 (+)= Gᵀ xc in f32, chunks added in order, as the CPU does,
//!          with Candle ops (as fallback.rs): dW32 = dW32 + G.to_dtype(F32).t()
//!          .matmul(&xc.to_dtype(F32)): an f32 GEMM and an f32 copy of G per chunk (exact
//!          for 16-bit G and xc even under TF32, whose inputs hold their 11-bit significands).
//!          (Not wired: cublasGemmEx through CudaDevice::cublas_handle(), column-major
//!          m = C, n = V, k = R, A = xc (op N, lda = C), B = G (op T, ldb = V),
//!          C = dW32 (CUDA_R_32F, ldc = C), A/B of io's type, CUBLAS_COMPUTE_32F,
//!          alpha = 1, beta = 0 for the first chunk and 1 after, would save both copies and
//!          run the 16-bit tensor-core rate.)
//! end:   loss = (Σ parts) / count, as f32 (f64 sums for an f64 loss are not on this path)
//!        dx   = zeros io [N, C].index_add(rows_d, cat(dxs), 0)  (cat(dxs) when M == N)
//!        dW   = dW32.to_dtype(io)                               (rounded once)
//! ```
//!
//! No counted row (M = 0): no launch (an empty grid is an error of [`super::check_launch`]);
//! the loss is 0 and both gradients zero. The backward is unchanged (`LceOp::bwd` scales the
//! gradients by the upstream `g`). Memory: one chunk's logits (its gradient in place), `xc`,
//! `dW32` and `dx`; nothing of size `N x V`. `triton/cross_entropy.py`'s `interpret` runs
//! this loop with torch's matmul for cuBLAS against the CPU op's `loss`, `dx`, `dW`.
//!
//! `cross_entropy` on CUDA (`cross_entropy/cuda.rs`): `ce_fwd` over the whole `[N, V]` logits
//! (WEIGHT = the mask in f32, or ones), `loss = Σ w nll / max(Σ_{counted} w, 1)` on the device,
//! `lse` saved; the backward `ce_bwd` into a fresh `[N, V]` with `scale = 1` and WEIGHT =
//! `w (g / count)` formed on the device (f32; 0 where `w` is 0): the CPU's coefficient
//! `f32(g / count) w` without reading `g` or the count back to the host.

use super::KernelSpec;

/// Classes per block of the loop over a row (`BLOCK_V`).
pub const BLOCK_V: usize = 4096;

/// The [`Rule`](super::Rule)s of each entry; the rest of its launch table is generated from its
/// metadata (`kernels/*.json`) by `build.rs`.
pub(crate) const RULES: &[(&str, &[super::Rule])] =
    &[("ce_fwd", &[]), ("ce_bwd", &[]), ("ce_fwd_bwd", &[])];

/// `ce_fwd`, `ce_bwd` and `ce_fwd_bwd` for f32, bf16 and f16.
pub(crate) const KERNELS: &[KernelSpec] = super::compiled::CROSS_ENTROPY;
