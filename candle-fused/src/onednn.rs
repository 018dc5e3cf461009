//! oneDNN's GEMMs (`dnnl_sgemm`, `dnnl_gemm_bf16bf16f32`) for the products of
//! [`linear`](crate::linear) (and of the LoRA ops built on it), behind the `onednn` cargo
//! feature (off by default; links the system `libdnnl`, e.g. Debian's `libdnnl-dev`).
//!
//! oneDNN picks its own kernels by CPUID: AMX tiles where the CPU has them (as PyTorch's bf16
//! GEMMs do), AVX512-BF16 or AVX-512 ones elsewhere. With the feature on, this crate sends its
//! **bf16** GEMMs there on every CPU with bf16 dot products (AVX512-BF16, which every AMX CPU
//! has), so one binary serves every x86-64: measured on an AVX512-BF16 CPU without AMX, oneDNN's
//! bf16 GEMM was 1.02-1.20x as fast as the native kernel on a step's projections and 2.8-3.5x on
//! its rank-16 LoRA products, and AMX only widens the gap. **f32** GEMMs stay on the native
//! kernels (oneDNN's f32 GEMM, which uses no tiles, was 0.7-1.16x their speed there).
//! `CANDLE_FUSED_ONEDNN=1` sends f32 GEMMs too (to test and measure them),
//! `CANDLE_FUSED_ONEDNN=0` none; the choice is made once per process.
//!
//! Same bits on any thread count: each oneDNN call runs on one thread (its OpenMP team size set
//! to 1 on the calling thread for the call), and the output is cut into bands of fixed width
//! along its longer side (never along `k`) whatever the thread count; the threads of Candle's
//! pool only decide which thread computes which band.
//!
//! ```
//! use candle_core::DType;
//! use candle_fused::onednn::active;
//! // bf16: with the `onednn` feature on a CPU with AVX512-BF16 (or CANDLE_FUSED_ONEDNN=1)
//! let bf16 = active(DType::BF16);
//! assert!(!bf16 || cfg!(feature = "onednn"));
//! // f32 only when forced, which sends bf16 too; never another dtype
//! assert!(!active(DType::F32) || bf16);
//! assert!(!active(DType::F64));
//! ```

#[cfg(feature = "onednn")]
mod ffi;

use std::sync::OnceLock;

use candle_core::DType;

/// Whether [`linear`](crate::linear)'s GEMMs of `dtype` run on oneDNN in this process: the
/// `onednn` feature is on, and `CANDLE_FUSED_ONEDNN=1`, or (the variable unset) `dtype` is bf16
/// and the CPU has bf16 dot products (AVX512-BF16). Never for dtypes other than f32 and bf16.
pub fn active(dtype: DType) -> bool {
    static CHOICE: OnceLock<Choice> = OnceLock::new();
    let choice = || *CHOICE.get_or_init(choose);
    cfg!(feature = "onednn")
        && match dtype {
            DType::F32 => choice() == Choice::All,
            DType::BF16 => choice() != Choice::Native,
            _ => false,
        }
}

/// Which GEMMs go to oneDNN.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Choice {
    Native,
    Bf16,
    All,
}

/// The choice of [`active`]: the environment variable, else CPUID.
fn choose() -> Choice {
    let by_cpu = || {
        let bf16 = crate::gemm_bf16::available();
        tracing::debug!(
            "candle-fused onednn: bf16 GEMMs on oneDNN: {bf16} (AMX-BF16: {})",
            amx_bf16()
        );
        if bf16 {
            Choice::Bf16
        } else {
            Choice::Native
        }
    };
    match std::env::var("CANDLE_FUSED_ONEDNN").as_deref() {
        Ok("1") => Choice::All,
        Ok("0") => Choice::Native,
        Err(std::env::VarError::NotPresent) => by_cpu(),
        Ok(v) => {
            tracing::warn!("CANDLE_FUSED_ONEDNN={v:?} is neither 0 nor 1: choosing by CPUID");
            by_cpu()
        }
        Err(e) => {
            tracing::warn!("CANDLE_FUSED_ONEDNN: {e}: choosing by CPUID");
            by_cpu()
        }
    }
}

/// AMX-BF16 (CPUID leaf 7, EDX bit 22) with the tile state enabled by the OS (XCR0 bits 17 and
/// 18): whether oneDNN can use tiles (it requests Linux's `ARCH_REQ_XCOMP_PERM` itself).
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
#[cfg_attr(not(feature = "onednn"), allow(dead_code))]
pub(crate) enum Data<'a, A> {
    Bf16(&'a [half::bf16]),
    Acc(&'a [A]),
}

/// A 2-D operand: element `(r, c)` at `r * rs + c * cs` of `data`.
#[cfg_attr(not(feature = "onednn"), allow(dead_code))]
pub(crate) struct Mat<'a, A> {
    pub(crate) data: Data<'a, A>,
    pub(crate) rs: usize,
    pub(crate) cs: usize,
}

/// `dst [m x n] (row-major) = acc * dst + lhs [m x k] · rhs [k x n]` on oneDNN when both
/// operands are bf16 or f32 (`A` f32), [`active`] for that dtype, and each operand row-major or
/// transposed (a unit stride on one side); `None` (nothing written) otherwise.
///
/// # Safety
/// As `linear::gemm::gemm_raw`: `dst` is valid for writes of `m * n` elements, initialised
/// when `acc`, and nothing else accesses them during the call.
#[cfg_attr(not(feature = "onednn"), allow(unused_variables))]
pub(crate) unsafe fn gemm<A: 'static>(
    mnk: (usize, usize, usize),
    dst: *mut A,
    acc: bool,
    lhs: Mat<'_, A>,
    rhs: Mat<'_, A>,
    threads: usize,
) -> Option<()> {
    #[cfg(feature = "onednn")]
    {
        let job = run::Job::new(mnk, &lhs, &rhs)?;
        if !active(job.dtype()) {
            return None;
        }
        // SAFETY: `A` is f32 (`Job::new` checked); `dst` per this function's contract.
        unsafe { job.run(dst.cast::<f32>(), acc, threads) };
        Some(())
    }
    #[cfg(not(feature = "onednn"))]
    None
}

#[cfg(feature = "onednn")]
mod run;
