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
    // (constexpr, [(entry, the family's public constant)]), for every dtype of the entry
    let any_dtype: &[(&str, &[(&str, usize)])] = &[
        ("BLOCK_D", &[("attn_fwd", attention::BLOCK_D)]),
        ("BLOCK_M", &[("attn_bwd_delta", attention::DELTA_BLOCK_M)]),
        (
            "BLOCK_C",
            &[
                ("rms_norm_fwd", rms_norm::BLOCK_C),
                ("rms_norm_bwd_dw", rms_norm::DW_BLOCK_C),
                ("layer_norm_fwd", layer_norm::BLOCK_C),
                ("layer_norm_bwd_reduce", layer_norm::REDUCE_BLOCK_C),
                ("bias_gelu_fwd", gelu::BLOCK_C),
                ("bias_gelu_bwd_db", gelu::DB_BLOCK_C),
                ("embedding_bwd", embedding::BLOCK_C),
            ],
        ),
        (
            "ROWS_PER_PROGRAM",
            &[
                ("rms_norm_bwd_dx", rms_norm::ROWS_PER_PROGRAM),
                ("layer_norm_bwd_dx", layer_norm::ROWS_PER_PROGRAM),
                ("bias_gelu_bwd_dx", gelu::ROWS_PER_PROGRAM),
            ],
        ),
        ("BLOCK_V", &[("ce_fwd_bwd", cross_entropy::BLOCK_V)]),
        ("BLOCK_R", &[("bias_gelu_fwd", gelu::FWD_BLOCK_R)]),
        (
            "BLOCK",
            &[
                ("rope_fwd", rope::BLOCK),
                ("swiglu_fwd", swiglu::BLOCK),
                ("gelu_fwd", gelu::BLOCK),
                ("geglu_fwd", gelu::BLOCK),
                ("geglu_bwd", gelu::BLOCK),
                ("dropout", dropout::BLOCK),
                ("adamw_update", adamw::BLOCK),
                ("sumsq_partial", adamw::SUMSQ_BLOCK),
                ("adamw_update_multi", adamw::BLOCK),
                ("sumsq_partial_multi", adamw::SUMSQ_BLOCK),
                ("nf4_dequant", nf4::BLOCK),
                ("nf4_dequant_nested", nf4::BLOCK),
            ],
        ),
    ];
    // attention's row tile: one per dtype
    let per_dtype = [
        (DType::F32, "BLOCK_M", attention::BLOCK_F32),
        (DType::BF16, "BLOCK_M", attention::BLOCK_16),
        (DType::F16, "BLOCK_N", attention::BLOCK_16),
    ];
    let all = (any_dtype.iter())
        .flat_map(|&(key, rows)| rows.iter().map(move |&(entry, v)| (entry, None, key, v)))
        .chain(per_dtype.map(|(dt, key, v)| ("attn_fwd", Some(dt), key, v)));
    for (entry, dtype, key, value) in all {
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
