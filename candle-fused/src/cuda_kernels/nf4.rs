//! NF4 dequantization (`triton/nf4.py`): values `[START, START + E)` of a 4-bit weight (whole
//! packed buffer `[B]` u8, absmaxes `[A]` f32, or double-quantized: codes `[A]` u8, nested
//! absmaxes `[C]` f32 and the 256-entry map `[M]`) into `[E]` of the variant's dtype.
//! Bit-identical to the CPU dequantization (`crate::nf4::Nf4Weight::dequantize_range`).

use super::{KernelSpec, Rule};

/// Values per program (`BLOCK`).
pub const BLOCK: usize = 1024;

/// The [`Rule`]s of each entry; the rest of its launch table is generated from its
/// metadata (`kernels/*.json`) by `build.rs`.
pub(crate) const RULES: &[(&str, &[Rule])] = &[
    ("nf4_dequant", &[]),
    // the dynamic map has 256 entries: every u8 code indexes it
    ("nf4_dequant_nested", &[Rule::Product("M", &[], 256)]),
];

/// The plain and the double-quantized dequantization, to f32, bf16 and f16.
pub(crate) const KERNELS: &[KernelSpec] = super::compiled::NF4;
