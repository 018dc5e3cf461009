//! oneDNN's GEMMs (`dnnl_sgemm`, `dnnl_gemm_bf16bf16f32`) for the products of
//! [`linear`](crate::linear), behind the `onednn` cargo feature (off by default; links the system
//! `libdnnl`, e.g. Debian's `libdnnl-dev`).
//!
//! oneDNN picks its own kernels by CPUID: AMX tiles where the CPU has them (as PyTorch's bf16
//! GEMMs do), AVX512-BF16 or AVX-512 ones elsewhere. This crate routes its f32 and bf16 GEMMs
//! there when the feature is on **and** the CPU reports `amx_bf16`, so one binary serves every
//! x86-64; elsewhere the native kernels stay (they are as fast or faster without AMX: see the
//! crate's README). `CANDLE_FUSED_ONEDNN=1` forces oneDNN (to test and measure it on any CPU),
//! `CANDLE_FUSED_ONEDNN=0` keeps the native kernels; the choice is made once per process.
//!
//! Same bits on any thread count: each oneDNN call runs on one thread (its OpenMP team size set
//! to 1 on the calling thread for the call), and the output is cut into bands of fixed width
//! along its longer side (never along `k`) whatever the thread count; the threads of Candle's
//! pool only decide which thread computes which band.
//!
//! ```
//! // true only with the `onednn` feature on an AMX CPU (or with CANDLE_FUSED_ONEDNN=1)
//! let on = candle_fused::onednn::active();
//! assert!(!on || cfg!(feature = "onednn"));
//! ```

#[cfg(feature = "onednn")]
mod ffi;

use std::sync::OnceLock;

/// Whether [`linear`](crate::linear)'s f32 and bf16 GEMMs run on oneDNN in this process: the
/// `onednn` feature is on and either `CANDLE_FUSED_ONEDNN=1` or (the variable unset) the CPU
/// reports AMX-BF16 with the OS's permission to use its tiles.
pub fn active() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    cfg!(feature = "onednn") && *ON.get_or_init(choose)
}

/// The choice of [`active`]: the environment variable, else CPUID.
fn choose() -> bool {
    match std::env::var("CANDLE_FUSED_ONEDNN").as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        Err(std::env::VarError::NotPresent) => amx_bf16(),
        Ok(v) => {
            tracing::warn!("CANDLE_FUSED_ONEDNN={v:?} is neither 0 nor 1: choosing by CPUID");
            amx_bf16()
        }
        Err(e) => {
            tracing::warn!("CANDLE_FUSED_ONEDNN: {e}: choosing by CPUID");
            amx_bf16()
        }
    }
}

/// AMX-BF16 (CPUID leaf 7, EDX bit 22) with the tile state enabled by the OS (XCR0 bits 17 and
/// 18). oneDNN requests the Linux permission (`ARCH_REQ_XCOMP_PERM`) itself.
#[cfg(target_arch = "x86_64")]
fn amx_bf16() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    // SAFETY: CPUID exists on every x86-64 (the intrinsics are safe to call from Rust 1.87 on;
    // `unsafe` for the crate's older minimum).
    #[allow(unused_unsafe)]
    let (max, leaf7) = unsafe { (__cpuid(0).eax, __cpuid_count(7, 0)) };
    max >= 7 && leaf7.edx & (1 << 22) != 0 && is_x86_feature_detected!("xsave") && {
        // SAFETY: XSAVE (hence XGETBV) is supported, checked above.
        let xcr0 = unsafe { xgetbv0() };
        xcr0 & (0b11 << 17) == 0b11 << 17
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn amx_bf16() -> bool {
    false
}

/// XCR0, the state components the OS enables.
///
/// # Safety
/// The CPU supports XSAVE.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "xsave")]
unsafe fn xgetbv0() -> u64 {
    std::arch::x86_64::_xgetbv(0)
}

/// A GEMM operand's data: bf16 as stored, or the accumulation type (oneDNN takes f32 only).
pub(crate) enum Data<'a, A> {
    Bf16(&'a [half::bf16]),
    Acc(&'a [A]),
}

/// A 2-D operand: element `(r, c)` at `r * rs + c * cs` of `data`.
pub(crate) struct Mat<'a, A> {
    pub(crate) data: Data<'a, A>,
    pub(crate) rs: usize,
    pub(crate) cs: usize,
}

/// `dst [m x n] (row-major) = acc * dst + lhs [m x k] · rhs [k x n]` on oneDNN when
/// [`active`], both operands are bf16 or f32 (`A` f32) and each is row-major or transposed
/// (a unit stride on one side); `None` (nothing written) otherwise.
///
/// # Safety
/// As `linear::gemm::gemm_raw`: `dst` is valid for writes of `m * n` elements, initialised
/// when `acc`, and nothing else accesses them during the call.
#[cfg_attr(not(feature = "onednn"), allow(unused_variables))]
pub(crate) unsafe fn gemm<A: 'static>(
    (m, n, k): (usize, usize, usize),
    dst: *mut A,
    acc: bool,
    lhs: Mat<'_, A>,
    rhs: Mat<'_, A>,
    threads: usize,
) -> Option<()> {
    if !active() {
        return None;
    }
    #[cfg(feature = "onednn")]
    {
        // SAFETY: per this function's contract.
        unsafe { run::gemm((m, n, k), dst, acc, lhs, rhs, threads) }
    }
    #[cfg(not(feature = "onednn"))]
    None
}

#[cfg(feature = "onednn")]
mod run;
