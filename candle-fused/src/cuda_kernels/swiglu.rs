//! SwiGLU (`triton/swiglu.py`): `y = silu(gate) * up` and its two gradients, elementwise over
//! the flattened tensors (`[E]`; a packed `[.., 2I]` projection's halves are copied to
//! contiguous tensors first). Bit-identical to the CPU kernel (`crate::swiglu`).

use super::KernelSpec;

/// Elements per program (`BLOCK`).
pub const BLOCK: usize = 1024;

/// The [`Rule`](super::Rule)s of each entry; the rest of its launch table is generated from its
/// metadata (`kernels/*.json`) by `build.rs`.
pub(crate) const RULES: &[(&str, &[super::Rule])] = &[("swiglu_fwd", &[]), ("swiglu_bwd", &[])];

/// SwiGLU forward and backward (`d_gate`, `d_up` in one pass), for f32, bf16 and f16.
pub(crate) const KERNELS: &[KernelSpec] = super::compiled::SWIGLU;
