//! The launch audit: the Triton kernels' committed artefacts agree with the launch tables
//! (pure Rust, no Python, no GPU; unit tests, since the tables are crate-private):
//!
//! * `triton/records/<family>.json` (written by `scripts/python/triton_interpret_check.py`)
//!   lists the sha256 of the family's kernel source and of every test vector file it checked: a
//!   source or vector that changed since, or a vector file not in its record, fails here, so a
//!   changed kernel has to be re-verified under the interpreter (and recompiled); every family
//!   of the launch tables has a record, and every record a family;
//! * every `kernels/<name>.<sm>.json` (written by `scripts/python/triton_compile.py`) agrees
//!   with the launch tables [`FAMILIES`]: family, entry, grid rule, warps, block, shared
//!   memory, parameters (and the two trailing scratch pointers), the alignment assumed, the
//!   source's and the cubin's sha256; and every table entry has a cubin for every arch;
//! * the cubins' ELF sections agree with their metadata and the launcher (`cubin_elf_tests.rs`):
//!   static shared memory (and the opt-in rule that counts it), and the pinned ptxas release
//!   that built them;
//! * every cubin's `.nv.info` (parameter layout, required block, registers, stack frame) agrees
//!   with the launch tables, and the SASS record `triton/records/sass.json` (spills, load
//!   widths) is the cubins' (`cubin_info_tests.rs`);
//! * `check_launch` accepts a valid launch and rejects misaligned, strided, oversized and
//!   wrongly typed arguments with a clear error (`launch_<family>_tests.rs`).
//!
//! The registry of the Triton tests (`tests/families`) is held to the records by
//! `tests/triton_record`.

use crate::cuda_kernels::{
    check_launch, cross_entropy, describe_grid, dtype_suffix, find, kernels, layer_norm, rms_norm,
    Arg, KernelSpec, Param, Rule, Scalar, TensorArg, ARCHS, FAMILIES, POINTER_ALIGNMENT,
    SCRATCH_PARAMS,
};
use anyhow::{anyhow, ensure, Context, Result};
use candle_core::DType;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Paths in the records and metadata are relative to the workspace root.
fn from_root(rel: &str) -> PathBuf {
    crate_dir().join("..").join(rel)
}

fn sha256(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

fn json(path: &Path) -> Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(serde_json::from_str(&text)?)
}

fn str_of<'a>(v: &'a Value, key: &str) -> Result<&'a str> {
    v[key]
        .as_str()
        .ok_or_else(|| anyhow!("missing string {key:?} in {v}"))
}

fn u64_of(v: &Value, key: &str) -> Result<u64> {
    v[key]
        .as_u64()
        .ok_or_else(|| anyhow!("missing integer {key:?}"))
}

const RERUN: &str = "re-verify: WRITE_TRITON_VECTORS=candle-fused/triton/vectors cargo test -p \
    candle-fused --release --test triton_vectors (if the CPU kernel changed), then \
    .venv-triton/bin/python scripts/python/triton_interpret_check.py <family> and \
    scripts/gpu/cubins.sh <family> (CUDA 13.0's ptxas; environment: scripts/python/triton_setup.sh)";

#[test]
fn sources_and_vectors_match_the_interpreter_records() -> Result<()> {
    let vector_files: Vec<String> = std::fs::read_dir(crate_dir().join("triton/vectors"))?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_>>()?;
    for (family, _) in FAMILIES {
        let path = crate_dir().join(format!("triton/records/{family}.json"));
        let record = json(&path).with_context(|| format!("family {family}: {RERUN}"))?;
        ensure!(
            str_of(&record, "family")? == *family,
            "{}: family",
            path.display()
        );
        for key in ["kernel_sources", "vectors"] {
            let list = record[key]
                .as_array()
                .ok_or_else(|| anyhow!("record {family} has no {key}"))?;
            ensure!(!list.is_empty(), "record {family} lists no {key}");
            for item in list {
                let file = str_of(item, "file")?;
                let got = sha256(&from_root(file))?;
                ensure!(
                    got == str_of(item, "sha256")?,
                    "{file} changed since the interpreter check was recorded (sha256 {got}); {RERUN}"
                );
            }
        }
        // every vector file of the family on disk was checked
        let recorded: Vec<&str> = record["vectors"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| v["file"].as_str())
            .collect();
        for name in vector_files
            .iter()
            .filter(|n| n.starts_with(&format!("{family}.")))
        {
            let rel = format!("candle-fused/triton/vectors/{name}");
            ensure!(
                recorded.contains(&rel.as_str()),
                "{rel} is not in the interpreter record of {family}; {RERUN}"
            );
        }
        // the interpreter ran the source the cubins were compiled from
        let src = format!("candle-fused/triton/{family}.py");
        ensure!(
            record["kernel_sources"][0]["file"].as_str() == Some(src.as_str()),
            "record {family}: source is not {src}"
        );
    }
    // every vector file belongs to a family
    for name in &vector_files {
        ensure!(
            FAMILIES
                .iter()
                .any(|(f, _)| name.starts_with(&format!("{f}."))),
            "{name}: no family of that name in cuda_kernels::FAMILIES"
        );
    }
    // every interpreter record is a family's (the registry test `tests/triton_record` lists
    // the families by their records)
    for entry in std::fs::read_dir(crate_dir().join("triton/records"))? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        let Some(family) = name.strip_suffix(".json").filter(|f| *f != "sass") else {
            continue;
        };
        ensure!(
            FAMILIES.iter().any(|(f, _)| *f == family),
            "triton/records/{name}: no family of that name in cuda_kernels::FAMILIES"
        );
    }
    Ok(())
}

#[test]
fn metadata_matches_the_launcher_table() -> Result<()> {
    let dir = crate_dir().join("kernels");
    for spec in kernels() {
        for arch in ARCHS {
            let stem = format!("{}.sm{arch}", spec.name());
            let meta = json(&dir.join(format!("{stem}.json")))?;
            let ctx =
                |what: &str| format!("{stem}.json: {what} differs from cuda_kernels::FAMILIES");
            ensure!(str_of(&meta, "kernel")? == spec.name(), ctx("kernel"));
            ensure!(str_of(&meta, "entry")? == spec.entry, ctx("entry"));
            ensure!(
                str_of(&meta, "target")? == format!("sm_{arch}"),
                ctx("target")
            );
            ensure!(str_of(&meta, "family")? == spec.family, ctx("family"));
            ensure!(
                str_of(&meta, "source")? == format!("candle-fused/triton/{}.py", spec.family),
                ctx("source")
            );
            ensure!(
                str_of(&meta, "grid")? == describe_grid(&spec.grid),
                ctx("grid")
            );
            ensure!(
                u64_of(&meta, "num_warps")? == spec.num_warps as u64,
                ctx("num_warps")
            );
            let block: Vec<u64> = meta["block"]
                .as_array()
                .ok_or_else(|| anyhow!("no block"))?
                .iter()
                .filter_map(Value::as_u64)
                .collect();
            ensure!(
                block == spec.block().map(u64::from),
                ctx("block (32 * num_warps)")
            );
            ensure!(
                Some(u64_of(&meta, "shared_bytes")? as u32) == spec.shared_bytes_for(arch),
                ctx("shared_bytes")
            );
            ensure!(
                u64_of(&meta, "global_scratch_size")? == 0
                    && u64_of(&meta, "profile_scratch_size")? == 0,
                "{stem}: the kernel needs scratch memory; the launcher passes null"
            );
            ensure!(
                u64_of(&meta, "pointer_alignment_bytes")? as usize == POINTER_ALIGNMENT,
                ctx("pointer_alignment_bytes")
            );
            tiles_tests::tile_rules_hold(spec).with_context(|| format!("{stem}.json"))?;
            // a size compiled as a multiple of 16 is one the table's rules hold to 16, and no
            // rule asks for a multiple the kernel was not compiled for
            let divisible: Vec<&str> = meta["divisible_by_16"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            let multiples: Vec<(&str, usize)> = spec
                .rules
                .iter()
                .filter_map(|r| match *r {
                    Rule::MultipleOf(d, f) => Some((d, f)),
                    _ => None,
                })
                .collect();
            let dim_of = |name: &str| {
                spec.params.iter().find_map(|p| match *p {
                    Param::Dim(n, d) if n == name => Some(d),
                    // a stride is bound under its parameter's name
                    Param::Stride(n, ..) if n == name => Some(n),
                    _ => None,
                })
            };
            for name in &divisible {
                let d = dim_of(name).ok_or_else(|| anyhow!("{stem}: {name} is not a dim"))?;
                ensure!(
                    multiples.contains(&(d, 16)),
                    "{stem}: compiled with {name} divisible by 16 but the table has no \
                     Rule::MultipleOf({d:?}, 16): a launch could break the assumption"
                );
            }
            ensure!(
                multiples.len() == divisible.len(),
                ctx("the MultipleOf rules (divisible_by_16)")
            );
            // parameters: the table's, in order, then the two scratch pointers
            let params = meta["params"]
                .as_array()
                .ok_or_else(|| anyhow!("no params"))?;
            ensure!(
                params.len() == spec.params.len() + SCRATCH_PARAMS,
                ctx("parameter count")
            );
            for (p, m) in spec.params.iter().zip(params) {
                ensure!(
                    str_of(m, "name")? == p.name()
                        && str_of(m, "type")? == p.triton_type(spec.dtype),
                    ctx(&format!("parameter {} ({m})", p.name()))
                );
            }
            for m in &params[spec.params.len()..] {
                ensure!(str_of(m, "type")? == "*i8", ctx("trailing scratch pointer"));
            }
            let ptx = meta["ptx_entry_params"]
                .as_array()
                .ok_or_else(|| anyhow!("no ptx_entry_params"))?;
            ensure!(
                ptx.len() == params.len(),
                ctx("the .entry's parameter count")
            );
            for (p, m) in spec.params.iter().zip(ptx) {
                let decl = m.as_str().unwrap_or("");
                let want = match p {
                    Param::Tensor(..) => ".u64 .ptr",
                    Param::Dim(..) | Param::Stride(..) | Param::Int(_) => ".u32",
                    Param::Float(_) => ".f32",
                };
                ensure!(decl.starts_with(want), ctx(&format!(".entry param {decl}")));
            }
            // the cubin is the one described, compiled from the current source
            let src = str_of(&meta, "source")?;
            ensure!(
                sha256(&from_root(src))? == str_of(&meta, "source_sha256")?,
                "{stem}: {src} changed since it was compiled; {RERUN}"
            );
            ensure!(
                sha256(&dir.join(format!("{stem}.cubin")))? == str_of(&meta, "cubin_sha256")?,
                "{stem}.cubin does not match its metadata; rerun scripts/gpu/cubins.sh"
            );
        }
    }
    // no stray metadata without a table entry
    for entry in std::fs::read_dir(&dir)? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if let Some(stem) = name.strip_suffix(".json") {
            let kernel = stem.rsplit_once('.').map_or(stem, |(k, _)| k);
            ensure!(
                kernels().any(|k| k.name() == kernel),
                "{name}: no entry in cuda_kernels::FAMILIES"
            );
        }
    }
    Ok(())
}

/// A contiguous tensor argument at offset 0.
pub(crate) fn t(dims: &[usize], dtype: DType) -> TensorArg {
    TensorArg::contiguous(dims, dtype, 0)
}

pub(crate) const EPS: &[Scalar] = &[Scalar::F32(1e-5)];

/// The `.entry` arguments of a launch: tensors `0..tensors` in order, then `rest`, then the
/// two scratch pointers.
pub(crate) fn args_of(tensors: usize, rest: &[Arg]) -> Vec<Arg> {
    (0..tensors)
        .map(Arg::Tensor)
        .chain(rest.iter().copied())
        .chain([Arg::Null, Arg::Null])
        .collect()
}

/// Asserts that `check_launch` refuses the launch with an error that says `what`.
pub(crate) fn refuses(spec: &KernelSpec, tensors: &[TensorArg], scalars: &[Scalar], what: &str) {
    match check_launch(spec, tensors, scalars) {
        Ok(l) => panic!(
            "{}: accepted a launch to refuse ({what}): {:?}",
            spec.name(),
            l.args
        ),
        Err(e) => assert!(e.to_string().contains(what), "{}: {e}", spec.name()),
    }
}

mod cubin_elf_tests;
mod cubin_info_tests;
mod examples_tests;
mod launch_attention_tests;
mod launch_cross_entropy_tests;
mod launch_elementwise_tests;
mod launch_embedding_tests;
mod launch_layer_norm_tests;
mod launch_nf4_tests;
mod launch_rms_norm_tests;
mod launch_rope_tests;
mod tiles_tests;
