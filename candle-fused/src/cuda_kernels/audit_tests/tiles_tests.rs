//! The hand-written halves of the launch tables against the compiled constexprs (the rest of
//! each table is generated from the metadata by `build.rs`):
//!
//! * a tile limit `Rule::AtMost(d, n)` is what the kernel was compiled for: its constexpr
//!   `BLOCK_<d>` is `n`. This is how a variant states the tile it expects: an attention kernel
//!   for head size 64 declares `AtMost("D", 64)` and must be compiled with `BLOCK_D = 64` (a
//!   128-wide tile where 64 is asked fails here), while the one compiled today declares itself
//!   the fallback for every head size up to 128 (`AtMost("D", 128)`, `BLOCK_D = 128`);
//! * the families' public block sizes, which the launchers use to size partial buffers, are
//!   the constexprs of the kernels they describe.

use crate::cuda_kernels::{
    adamw, attention, cross_entropy, dropout, embedding, find, gelu, kernels, layer_norm, nf4,
    rms_norm, rope, swiglu, KernelSpec, Rule,
};
use anyhow::{anyhow, ensure, Result};
use candle_core::DType;

/// Every `AtMost(d, n)` rule of `spec` is its compiled tile: the constexpr `BLOCK_<d>` is `n`.
pub(crate) fn tile_rules_hold(spec: &KernelSpec) -> Result<()> {
    for rule in spec.rules {
        if let Rule::AtMost(d, max) = *rule {
            let key = format!("BLOCK_{d}");
            let compiled = spec.constexpr(&key).ok_or_else(|| {
                anyhow!(
                    "{}: the table limits {d} to {max} (one tile) but the kernel has no \
                     constexpr {key}",
                    spec.name()
                )
            })?;
            ensure!(
                compiled as usize == max,
                "{}: compiled with {key} = {compiled} where the table asks for {d} <= {max}: \
                 compile the variant with {key} = {max} (its AOT entry) or declare the limit it \
                 was built for",
                spec.name()
            );
        }
    }
    Ok(())
}

#[test]
fn a_wider_tile_than_the_variant_asks_for_fails() {
    // today's attention: the <= 128 fallback, compiled with BLOCK_D 128
    let fallback = *find("attn_fwd", DType::BF16).expect("attn_fwd.bf16");
    assert_eq!(fallback.constexpr("BLOCK_D"), Some(128));
    tile_rules_hold(&fallback).unwrap();
    // a head-size-64 variant built from the same cubin (BLOCK_D 128) is refused
    let d64 = KernelSpec {
        rules: &[Rule::AtMost("D", 64), Rule::Divides("KV", "H")],
        ..fallback
    };
    let err = tile_rules_hold(&d64).unwrap_err().to_string();
    assert!(
        err.contains("BLOCK_D = 128") && err.contains("D <= 64"),
        "{err}"
    );
    // ... and so is a limit without a compiled tile
    let untiled = KernelSpec {
        constexprs: &[("BLOCK_M", 64)],
        ..fallback
    };
    assert!(tile_rules_hold(&untiled).is_err());
}

#[test]
fn every_tile_rule_is_its_compiled_tile() -> Result<()> {
    for spec in kernels() {
        tile_rules_hold(spec)?;
    }
    Ok(())
}

#[test]
fn public_block_sizes_are_the_compiled_constexprs() -> Result<()> {
    // (entry, only this dtype, constexpr, the family's public constant): one row a line
    #[rustfmt::skip]
    let all: &[(&str, Option<DType>, &str, usize)] = &[
        ("attn_fwd", None, "BLOCK_D", attention::BLOCK_D),
        ("attn_fwd", Some(DType::F32), "BLOCK_M", attention::BLOCK_F32),
        ("attn_fwd", Some(DType::BF16), "BLOCK_M", attention::BLOCK_16),
        ("attn_fwd", Some(DType::F16), "BLOCK_N", attention::BLOCK_16),
        ("attn_bwd_delta", None, "BLOCK_M", attention::DELTA_BLOCK_M),
        ("rms_norm_fwd", None, "BLOCK_C", rms_norm::BLOCK_C),
        ("rms_norm_bwd_dx", None, "ROWS_PER_PROGRAM", rms_norm::ROWS_PER_PROGRAM),
        ("rms_norm_bwd_dw", None, "BLOCK_C", rms_norm::DW_BLOCK_C),
        ("layer_norm_fwd", None, "BLOCK_C", layer_norm::BLOCK_C),
        ("layer_norm_bwd_dx", None, "ROWS_PER_PROGRAM", layer_norm::ROWS_PER_PROGRAM),
        ("layer_norm_bwd_reduce", None, "BLOCK_C", layer_norm::REDUCE_BLOCK_C),
        ("rope_fwd", None, "BLOCK", rope::BLOCK),
        ("ce_fwd_bwd", None, "BLOCK_V", cross_entropy::BLOCK_V),
        ("swiglu_fwd", None, "BLOCK", swiglu::BLOCK),
        ("gelu_fwd", None, "BLOCK", gelu::BLOCK),
        ("geglu_fwd", None, "BLOCK", gelu::BLOCK),
        ("geglu_bwd", None, "BLOCK", gelu::BLOCK),
        ("bias_gelu_fwd", None, "BLOCK_R", gelu::FWD_BLOCK_R),
        ("bias_gelu_fwd", None, "BLOCK_C", gelu::BLOCK_C),
        ("bias_gelu_bwd_dx", None, "ROWS_PER_PROGRAM", gelu::ROWS_PER_PROGRAM),
        ("bias_gelu_bwd_db", None, "BLOCK_C", gelu::DB_BLOCK_C),
        ("dropout", None, "BLOCK", dropout::BLOCK),
        ("adamw_update", None, "BLOCK", adamw::BLOCK),
        ("sumsq_partial", None, "BLOCK", adamw::SUMSQ_BLOCK),
        ("adamw_update_multi", None, "BLOCK", adamw::BLOCK),
        ("sumsq_partial_multi", None, "BLOCK", adamw::SUMSQ_BLOCK),
        ("embedding_bwd", None, "BLOCK_C", embedding::BLOCK_C),
        ("nf4_dequant", None, "BLOCK", nf4::BLOCK),
        ("nf4_dequant_nested", None, "BLOCK", nf4::BLOCK),
    ];
    for &(entry, dtype, key, value) in all {
        let specs: Vec<_> = kernels()
            .filter(|k| k.entry == entry && dtype.is_none_or(|d| d == k.dtype))
            .collect();
        ensure!(!specs.is_empty(), "no kernel {entry}");
        for spec in specs {
            ensure!(
                spec.constexpr(key) == Some(value as u32),
                "{}: compiled with {key} = {:?}, the family's public constant says {value}",
                spec.name(),
                spec.constexpr(key)
            );
        }
    }
    Ok(())
}
