//! The switch for the Triton kernels on CUDA, and the two checks every op makes before
//! taking them (compiled with or without the `cuda` feature, so callers need no `cfg`).
//!
//! Three states, the first that says something wins, for the whole process:
//!
//! 1. a program's choice: [`set_triton`]`(on)` or [`choose_triton`]`(Some(on))` (the trainer's
//!    `--triton-kernels true|false`); [`choose_triton`]`(None)` takes the choice back;
//! 2. the environment variable [`TRITON_ENV`] (`CANDLE_FUSED_TRITON=1` or `=0`), read at the
//!    first op after the program's choice was taken back (or never made): [`triton_from_env`];
//! 3. [`TRITON_DEFAULT`]: on, since the GPU check (`tests/cuda_triton/`, `scripts/gpu/run.sh`)
//!    passed on an H200 (2026-11-28); the two states above keep the way back to the
//!    composite path.
//!
//! Ops on other devices, or with a dtype or shape the compiled kernels do not cover, take
//! their usual path whatever the switch says; so do GPUs without a compiled cubin (anything but
//! compute capability 8.x and 9.0), with one log line per device saying so; and
//! [`crate::with_composite_fallback`] turns the Triton kernels off on its thread.

use candle_core::{DType, Device, Result, Tensor};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

/// The environment variable that switches the Triton kernels on (`1`, `true`, `on`, `yes`) or
/// off (`0`, `false`, `off`, `no`) when no program chose ([`set_triton`], [`choose_triton`]);
/// unset, empty or anything else: [`TRITON_DEFAULT`] (anything else is also logged).
pub const TRITON_ENV: &str = "CANDLE_FUSED_TRITON";

/// Whether the Triton kernels run when neither a program nor [`TRITON_ENV`] chose: on, since
/// every CUDA test passed with them on an H200 (sm_90, driver 580, 2026-11-28) and a run
/// trained as on the CPU. GPUs without a cubin (anything but 8.x and 9.0) take the composite
/// path whatever this says.
pub const TRITON_DEFAULT: bool = true;

const UNSET: u8 = 0;
const OFF: u8 = 1;
const ON: u8 = 2;

static TRITON: AtomicU8 = AtomicU8::new(UNSET);
static LAUNCHES: AtomicU64 = AtomicU64::new(0);

/// Switches the Triton kernels on or off for every op of this crate, on every thread, from
/// the next op on (an op already in a graph keeps the path its forward took, for its
/// backward too). Overrides [`TRITON_ENV`] and [`TRITON_DEFAULT`].
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

/// A program's three-state choice (e.g. a flag that may be absent): `Some(on)` is
/// [`set_triton`]`(on)`; `None` takes any earlier choice back, so that [`TRITON_ENV`], else
/// [`TRITON_DEFAULT`], decides again at the next op.
///
/// ```
/// use candle_fused::cuda_kernels::{choose_triton, triton_enabled, triton_from_env, TRITON_DEFAULT};
/// choose_triton(Some(true));
/// assert!(triton_enabled());
/// choose_triton(None);
/// assert_eq!(triton_enabled(), triton_from_env().unwrap_or(TRITON_DEFAULT));
/// ```
pub fn choose_triton(choice: Option<bool>) {
    match choice {
        Some(on) => set_triton(on),
        None => TRITON.store(UNSET, Ordering::Relaxed),
    }
}

/// Whether the Triton kernels are switched on: the program's choice, else [`TRITON_ENV`], else
/// [`TRITON_DEFAULT`].
pub fn triton_enabled() -> bool {
    let state = match TRITON.load(Ordering::Relaxed) {
        UNSET => {
            let on = triton_from_env().unwrap_or(TRITON_DEFAULT);
            let from_env = if on { ON } else { OFF };
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

/// What [`TRITON_ENV`] says: `Some(true)` / `Some(false)` for an on / off word, `None` when
/// unset or empty, and `None` with a warning logged for anything else (a typo must not pass
/// for a choice).
pub fn triton_from_env() -> Option<bool> {
    let value = std::env::var(TRITON_ENV).ok()?;
    let word = parse_switch(&value);
    if word.is_none() && !value.trim().is_empty() {
        tracing::warn!(
            "{TRITON_ENV}={value:?} is neither on (1, true, on, yes) nor off (0, false, off, no): \
             ignored, the default ({}) holds",
            if TRITON_DEFAULT { "on" } else { "off" }
        );
    }
    word
}

/// An on / off word of [`TRITON_ENV`] (case and surrounding blanks ignored).
fn parse_switch(value: &str) -> Option<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Some(true),
        "0" | "false" | "off" | "no" => Some(false),
        _ => None,
    }
}

/// The log line for a device whose compute capability `major.minor` has no compiled cubin
/// (`None` when it has one): said once per device, when the Triton kernels are asked for.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // read by `cuda_has_cubins`
pub(crate) fn no_cubin_notice(ordinal: usize, major: i32, minor: i32) -> Option<String> {
    (cubin_arch(major, minor).is_none()).then(|| {
        format!(
            "candle-fused: the Triton kernels are switched on, but CUDA device {ordinal} \
             (compute capability {major}.{minor}) has no compiled cubin (sm_80 runs on 8.x, \
             sm_90a on 9.0 only): its ops use the composite path"
        )
    })
}

/// The cubin architecture (80, 90) that runs on compute capability `major.minor`: a cubin
/// runs on its major version at an equal or higher minor, and Triton's sm_90 cubins are
/// sm_90a (architecture-specific), which runs on 9.0 only.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn cubin_arch(major: i32, minor: i32) -> Option<u32> {
    match (major, minor) {
        (8, _) => Some(80),
        (9, 0) => Some(90),
        _ => None,
    }
}

/// The environment variable that lets the kernels in [`UNPROVEN`] run (`1`, `true`, `on`,
/// `yes`); unset or anything else: they do not, and their ops take the proven kernels (or the
/// composite path) instead. `scripts/gpu/run.sh` sets it for its checks on a GPU.
pub const UNPROVEN_ENV: &str = "CANDLE_FUSED_TRITON_UNPROVEN";

/// Kernels compiled, audited and checked in Triton's interpreter, but never launched on a
/// GPU: they stay off unless [`UNPROVEN_ENV`] allows them, so that a default run on a GPU
/// takes only kernels a GPU run has checked (the H200 run of 2026-11-28 checked every other
/// entry). A GPU run that passes `tests/cuda_triton` with them on is what moves an entry out.
pub const UNPROVEN: &[&str] = &[
    // multi-tensor AdamW (one launch per gradient dtype group)
    "adamw_update_multi",
    "sumsq_partial_multi",
    "sumsq_total_multi",
    // the token embedding's backward
    "embedding_bwd",
    // GeGLU (Gemma's MLP activation)
    "geglu_fwd",
    "geglu_bwd",
    // QLoRA's NF4 dequantization
    "nf4_dequant",
    "nf4_dequant_nested",
    // attention: every build reads its tensors through strides since q/k/v are read in place
    // (the generic builds were checked on the H200 before that)
    "attn_fwd",
    "attn_bwd_delta",
    "attn_bwd_dkdv",
    "attn_bwd_dq",
    "attn_bwd_delta_d64",
    "attn_bwd_delta_d128",
    "attn_fwd_d64",
    "attn_bwd_dkdv_d64",
    "attn_bwd_dq_d64",
    "attn_fwd_d64_nodrop",
    "attn_bwd_dkdv_d64_nodrop",
    "attn_bwd_dq_d64_nodrop",
    "attn_fwd_d128",
    "attn_bwd_dkdv_d128",
    "attn_bwd_dq_d128",
    "attn_fwd_d128_nodrop",
    "attn_bwd_dkdv_d128_nodrop",
    "attn_bwd_dq_d128_nodrop",
];

/// Whether the kernel `entry` may be launched: it is not in [`UNPROVEN`], or [`UNPROVEN_ENV`]
/// allows those (read once per process).
pub fn may_launch(entry: &str) -> bool {
    static ALLOWED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let allowed = *ALLOWED
        .get_or_init(|| std::env::var(UNPROVEN_ENV).is_ok_and(|v| parse_switch(&v) == Some(true)));
    launchable(entry, allowed)
}

/// [`may_launch`] with the environment's answer given.
fn launchable(entry: &str, unproven_allowed: bool) -> bool {
    unproven_allowed || !UNPROVEN.contains(&entry)
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
        Device::Cuda(d) => cuda_has_cubins(d),
        _ => false,
    }
}

/// Whether the embedded cubins run on `dev` (compute capability 8.x or 9.0; cached per CUDA
/// context): on other GPUs the ops take their composite path, switch or no switch, and the
/// first time (only called with the kernels switched on) one log line says so.
#[cfg(feature = "cuda")]
fn cuda_has_cubins(dev: &candle_core::CudaDevice) -> bool {
    use candle_core::backend::BackendDevice;
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static CACHE: OnceLock<Mutex<HashMap<usize, bool>>> = OnceLock::new();
    let ctx = dev.cuda_stream().context().clone();
    let key = ctx.cu_ctx() as usize;
    let Ok(mut cache) = CACHE.get_or_init(Default::default).lock() else {
        return false;
    };
    *cache.entry(key).or_insert_with(|| {
        let Ok((major, minor)) = ctx.compute_capability() else {
            return false;
        };
        let ordinal = match dev.location() {
            candle_core::DeviceLocation::Cuda { gpu_id } => gpu_id,
            _ => 0,
        };
        if let Some(line) = no_cubin_notice(ordinal, major, minor) {
            tracing::warn!("{line}");
        }
        cubin_arch(major, minor).is_some()
    })
}

#[cfg(not(feature = "cuda"))]
fn has_cubins(_: &Device) -> bool {
    false
}

/// `t` as a kernel argument: contiguous and starting on a 16-byte boundary (the compiled
/// kernels assume both: `check_launch`); a copy only when it is not already so.
pub(crate) fn triton_input(t: &Tensor) -> Result<Tensor> {
    let offset_bytes = t.layout().start_offset() * t.dtype().size_in_bytes();
    if t.is_contiguous() && offset_bytes.is_multiple_of(super::table::POINTER_ALIGNMENT) {
        Ok(t.clone())
    } else {
        t.force_contiguous()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn environment_words() {
        for on in ["1", "true", "ON", " yes "] {
            assert_eq!(parse_switch(on), Some(true), "{on}");
        }
        for off in ["0", "false", "Off", "no"] {
            assert_eq!(parse_switch(off), Some(false), "{off}");
        }
        for neither in ["", "2", "maybe", "enable"] {
            assert_eq!(parse_switch(neither), None, "{neither}");
        }
    }

    /// The program's choice over the environment over the default, and `None` giving the
    /// decision back (one test: the switch is process-wide).
    #[test]
    fn three_states() {
        let env = triton_from_env().unwrap_or(TRITON_DEFAULT);
        choose_triton(Some(!env));
        assert_eq!(triton_enabled(), !env);
        choose_triton(Some(env));
        assert_eq!(triton_enabled(), env);
        set_triton(!env);
        choose_triton(None);
        assert_eq!(triton_enabled(), env);
    }

    #[test]
    fn unproven_kernels_wait_for_their_switch() {
        assert!(!launchable("attn_fwd_d64", false) && launchable("attn_fwd_d64", true));
        assert!(!launchable("attn_fwd", false) && launchable("adamw_update", false));
        assert!(!launchable("adamw_update_multi", false));
        // every name is a compiled kernel (the list cannot rot)
        for entry in UNPROVEN {
            assert!(
                crate::cuda_kernels::kernels().any(|k| k.entry == *entry),
                "{entry} is not in the launch tables"
            );
        }
    }

    #[test]
    fn gpus_without_cubins_are_named_once_per_device() {
        assert_eq!(cubin_arch(8, 0), Some(80));
        assert_eq!(cubin_arch(8, 9), Some(80));
        assert_eq!(cubin_arch(9, 0), Some(90));
        for (major, minor) in [(7, 5), (10, 0), (12, 0)] {
            assert_eq!(cubin_arch(major, minor), None);
            let line = no_cubin_notice(1, major, minor).expect("a notice");
            assert!(line.contains(&format!("{major}.{minor}")) && line.contains("composite"));
        }
        assert_eq!(no_cubin_notice(0, 9, 0), None);
    }
}
