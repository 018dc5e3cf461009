//! The compiled kernels (`candle-fused/kernels/<entry>.<dtype>.sm<NN>.cubin`) embedded in the
//! library (`cuda` feature only), so a `cuda` build needs neither Python nor the kernel files
//! at run time. A family adds one `cubins!` line per `.entry` to [`CUBINS`]; a unit test checks
//! that every kernel of the launch tables has its cubins here.

use candle_core::DType;

/// One kernel variant's cubins.
pub(crate) struct Cubin {
    /// The `.entry` name.
    pub(crate) entry: &'static str,
    /// The variant's dtype.
    pub(crate) dtype: DType,
    /// For compute capability 8.x (`sm_80`: runs on 8.0, 8.6, 8.7, 8.9).
    pub(crate) sm80: &'static [u8],
    /// For compute capability 9.0 (Triton compiles `sm_90a`, which runs on 9.0 only).
    pub(crate) sm90: &'static [u8],
}

/// The cubins of `entry` for f32, bf16 and f16 (`cubins!("entry")`), or for the dtypes named
/// (`cubins!("entry", ["f32"])`, for a family compiled for fewer dtypes).
macro_rules! cubins {
    ($entry:literal) => {
        cubins!($entry, ["f32", "bf16", "f16"])
    };
    ($entry:literal, [$($dt:literal),+]) => {
        &[$(Cubin {
            entry: $entry,
            dtype: dtype_of($dt),
            sm80: include_bytes!(concat!(
                env!("CARGO_MANIFEST_DIR"), "/kernels/", $entry, ".", $dt, ".sm80.cubin"
            )),
            sm90: include_bytes!(concat!(
                env!("CARGO_MANIFEST_DIR"), "/kernels/", $entry, ".", $dt, ".sm90.cubin"
            )),
        }),+]
    };
}

const fn dtype_of(suffix: &str) -> DType {
    match suffix.as_bytes() {
        b"f32" => DType::F32,
        b"bf16" => DType::BF16,
        b"f16" => DType::F16,
        _ => panic!("cubins!: dtype must be f32, bf16 or f16"),
    }
}

/// Every embedded kernel, one slice per `.entry`.
pub(crate) static CUBINS: &[&[Cubin]] = &[
    // rms_norm (triton/rms_norm.py)
    cubins!("rms_norm_fwd"),
    cubins!("rms_norm_bwd_dx"),
    cubins!("rms_norm_bwd_dw"),
    // layer_norm (triton/layer_norm.py)
    cubins!("layer_norm_fwd"),
    cubins!("layer_norm_fwd_no_bias"),
    cubins!("layer_norm_bwd_dx"),
    cubins!("layer_norm_bwd_dx_no_bias"),
    cubins!("layer_norm_bwd_reduce"),
    // rope (triton/rope.py)
    cubins!("rope_fwd"),
    cubins!("rope_bwd"),
    // cross_entropy (triton/cross_entropy.py)
    cubins!("ce_fwd"),
    cubins!("ce_bwd"),
    cubins!("ce_fwd_bwd"),
    // attention (triton/attention.py)
    cubins!("attn_fwd"),
    cubins!("attn_bwd_delta"),
    cubins!("attn_bwd_dkdv"),
    cubins!("attn_bwd_dq"),
    // attention head-size builds (bf16, f16; `attention::builds`)
    cubins!("attn_bwd_delta_d64", ["bf16", "f16"]),
    cubins!("attn_fwd_d64", ["bf16", "f16"]),
    cubins!("attn_bwd_dkdv_d64", ["bf16", "f16"]),
    cubins!("attn_bwd_dq_d64", ["bf16", "f16"]),
    cubins!("attn_fwd_d64_nodrop", ["bf16", "f16"]),
    cubins!("attn_bwd_dkdv_d64_nodrop", ["bf16", "f16"]),
    cubins!("attn_bwd_dq_d64_nodrop", ["bf16", "f16"]),
    cubins!("attn_bwd_delta_d128", ["bf16", "f16"]),
    cubins!("attn_fwd_d128", ["bf16", "f16"]),
    cubins!("attn_bwd_dkdv_d128", ["bf16", "f16"]),
    cubins!("attn_bwd_dq_d128", ["bf16", "f16"]),
    cubins!("attn_fwd_d128_nodrop", ["bf16", "f16"]),
    cubins!("attn_bwd_dkdv_d128_nodrop", ["bf16", "f16"]),
    cubins!("attn_bwd_dq_d128_nodrop", ["bf16", "f16"]),
    // swiglu (triton/swiglu.py)
    cubins!("swiglu_fwd"),
    cubins!("swiglu_bwd"),
    // gelu (triton/gelu.py)
    cubins!("gelu_fwd"),
    cubins!("gelu_bwd"),
    cubins!("bias_gelu_fwd"),
    cubins!("bias_gelu_bwd_dx"),
    cubins!("bias_gelu_bwd_db"),
    // dropout (triton/dropout.py)
    cubins!("dropout"),
    // adamw (triton/adamw.py)
    cubins!("adamw_update"),
    cubins!("sumsq_partial"),
    cubins!("sumsq_total", ["f32"]),
    cubins!("adamw_update_multi"),
    cubins!("sumsq_partial_multi"),
    cubins!("sumsq_total_multi", ["f32"]),
    // embedding (triton/embedding.py)
    cubins!("embedding_bwd"),
];

/// The cubins of `entry` for `dtype`.
pub(crate) fn find(entry: &str, dtype: DType) -> Option<&'static Cubin> {
    CUBINS
        .iter()
        .flat_map(|c| c.iter())
        .find(|c| c.entry == entry && c.dtype == dtype)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_of_the_launch_tables_is_embedded() {
        for spec in crate::cuda_kernels::kernels() {
            let c = find(spec.entry, spec.dtype).unwrap_or_else(|| {
                panic!("{}: add cubins!({:?}) to CUBINS", spec.name(), spec.entry)
            });
            for bytes in [c.sm80, c.sm90] {
                assert_eq!(&bytes[..4], b"\x7fELF", "{}: not a cubin", spec.name());
            }
        }
    }
}
