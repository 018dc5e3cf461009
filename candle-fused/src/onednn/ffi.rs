//! The oneDNN and OpenMP entry points [`super`] calls: the system `libdnnl` (Debian's
//! `libdnnl-dev`, 2.6 or later) and the OpenMP runtime it is built on (`libgomp`).
//!
//! `dnnl_sgemm` is declared in `oneapi/dnnl/dnnl.h`; `dnnl_gemm_bf16bf16f32` is exported by the
//! same library (`extern "C" DNNL_API` in `src/common/gemm.cpp`) but declared only in oneDNN's
//! own tests, so its signature is written here from that source. Both are row-major:
//! `C = alpha * op(A) · op(B) + beta * C`, `op(X)` being `X` for `'N'` and `Xᵀ` for `'T'`,
//! `op(A)` `m x k`, `op(B)` `k x n`, `C` `m x n`, each with its leading dimension (the distance
//! between rows as stored).

use std::os::raw::{c_char, c_int};

/// `dnnl_status_t`: `dnnl_success` is 0.
pub(super) type Status = c_int;

/// The signature the GEMMs share, `T` the operands' element type:
/// `(transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)`.
pub(super) type Gemm<T> = unsafe extern "C" fn(
    c_char,
    c_char,
    i64,
    i64,
    i64,
    f32,
    *const T,
    i64,
    *const T,
    i64,
    f32,
    *mut f32,
    i64,
) -> Status;

/// Declares oneDNN GEMMs of the [`Gemm`] signature, by name and operand type.
macro_rules! gemms {
    ($($(#[$doc:meta])* fn $name:ident($t:ty);)*) => {
        #[link(name = "dnnl")]
        extern "C" {
            $($(#[$doc])*
            pub(super) fn $name(transa: c_char, transb: c_char, m: i64, n: i64, k: i64, alpha: f32, a: *const $t, lda: i64, b: *const $t, ldb: i64, beta: f32, c: *mut f32, ldc: i64) -> Status;)*
        }
    };
}

gemms! {
    /// f32 GEMM. Reads `op(A)` / `op(B)` through `lda` / `ldb`, writes `C` through `ldc`; with
    /// `beta == 0` `C` is only written.
    fn dnnl_sgemm(f32);
    /// bf16 x bf16 GEMM accumulated and written in f32; otherwise as [`dnnl_sgemm`] (a bf16 is
    /// passed as its 16 bits: `half::bf16` is a transparent `u16`).
    fn dnnl_gemm_bf16bf16f32(half::bf16);
}

#[link(name = "gomp")]
extern "C" {
    /// The calling thread's OpenMP team size for its next parallel region (oneDNN's thread
    /// count for a call made from this thread).
    pub(super) fn omp_get_max_threads() -> c_int;
    /// Sets [`omp_get_max_threads`] for the calling thread only.
    pub(super) fn omp_set_num_threads(n: c_int);
}
