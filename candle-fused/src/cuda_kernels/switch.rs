//! The opt-in switch for the Triton kernels on CUDA, and the two checks every op makes before
//! taking them (compiled with or without the `cuda` feature, so callers need no `cfg`).
//!
//! Until the GPU test (`tests/cuda_triton/`) has passed on a GPU, the CUDA default stays
//! the composite fallback (each op's composite Candle expression inside the op); the Triton
//! kernels run only when switched on, for the whole process:
//!
//! * [`set_triton`]`(true)` (e.g. from a trainer flag), or
//! * the environment variable [`TRITON_ENV`] (`CANDLE_FUSED_TRITON=1`), read once, at the first
//!   op, when [`set_triton`] has not been called.
//!
//! Ops on other devices, or with a dtype or shape the compiled kernels do not cover, take
//! their usual path whatever the switch says; [`crate::with_composite_fallback`] also turns the
//! Triton kernels off on its thread.

use candle_core::{DType, Device, Result, Tensor};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

/// The environment variable that switches the Triton kernels on (`1`, `true`, `on`, `yes`) or
/// off (anything else) when [`set_triton`] was not called first.
pub const TRITON_ENV: &str = "CANDLE_FUSED_TRITON";

const UNSET: u8 = 0;
const OFF: u8 = 1;
const ON: u8 = 2;

static TRITON: AtomicU8 = AtomicU8::new(UNSET);
static LAUNCHES: AtomicU64 = AtomicU64::new(0);

/// Switches the Triton kernels on or off for every op of this crate, on every thread, from
/// the next op on (an op already in a graph keeps the path its forward took, for its
/// backward too). Overrides [`TRITON_ENV`].
///
/// ```
/// use candle_fused::cuda_kernels::{set_triton, triton_enabled};
/// set_triton(true);
/// assert!(triton_enabled());
/// set_triton(false);
/// assert!(!triton_enabled());
/// ```
pub fn set_triton(on: bool) {
    TRITON.store(if on { ON } else { OFF }, Ordering::Relaxed);
}

/// Whether the Triton kernels are switched on ([`set_triton`], else [`TRITON_ENV`]; off by
/// default).
pub fn triton_enabled() -> bool {
    let state = match TRITON.load(Ordering::Relaxed) {
        UNSET => {
            let from_env = if env_says_on() { ON } else { OFF };
            // a concurrent `set_triton` wins over the environment
            match TRITON.compare_exchange(UNSET, from_env, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => from_env,
                Err(now) => now,
            }
        }
        s => s,
    };
    state == ON
}

fn env_says_on() -> bool {
    std::env::var(TRITON_ENV).is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "on" | "yes"
        )
    })
}

/// How many Triton kernels this process has launched (0 without the `cuda` feature): a test
/// or a profile can tell that an op took the kernels and not the fallback.
pub fn launch_count() -> u64 {
    LAUNCHES.load(Ordering::Relaxed)
}

#[cfg(feature = "cuda")]
pub(crate) fn count_launch() {
    LAUNCHES.fetch_add(1, Ordering::Relaxed);
}

/// Whether an op whose main input is `t` takes the Triton kernels: switched on, not forced to
/// the fallback on this thread, `t` on a CUDA device the cubins run on (compute capability
/// 8.x or 9.0), f32 / bf16 / f16 (the compiled variants), not empty (an empty grid is not
/// launched). The op adds its own shape limits (e.g. RMSNorm's `C <= BLOCK_C`; the flat
/// elementwise kernels take their element count as an i32: [`triton_flat`]).
pub(crate) fn triton_for(t: &Tensor) -> bool {
    t.elem_count() > 0 && triton_on(t.device(), t.dtype())
}

/// [`triton_for`] for the flat elementwise kernels (dropout, SwiGLU, GELU, AdamW), whose
/// element count `n` is an i32 argument: at most `i32::MAX` elements (more take the composite).
pub(crate) fn triton_flat(dev: &Device, dtype: DType, n: usize) -> bool {
    n > 0 && i32::try_from(n).is_ok() && triton_on(dev, dtype)
}

/// The device and dtype part of [`triton_for`].
fn triton_on(dev: &Device, dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
        && !crate::cpu::fallback_forced()
        && triton_enabled()
        && has_cubins(dev)
}

#[cfg(feature = "cuda")]
fn has_cubins(dev: &Device) -> bool {
    match dev {
        Device::Cuda(d) => super::launch::has_cubins(d),
        _ => false,
    }
}

#[cfg(not(feature = "cuda"))]
fn has_cubins(_: &Device) -> bool {
    false
}

/// `t` as a kernel argument: contiguous and starting on a 16-byte boundary (the compiled
/// kernels assume both: `check_launch`); a copy only when it is not already so.
pub(crate) fn triton_input(t: &Tensor) -> Result<Tensor> {
    let offset_bytes = t.layout().start_offset() * t.dtype().size_in_bytes();
    if t.is_contiguous() && offset_bytes.is_multiple_of(super::POINTER_ALIGNMENT) {
        Ok(t.clone())
    } else {
        t.force_contiguous()
    }
}
