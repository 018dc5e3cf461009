//! The Triton kernels' committed artefacts stay consistent (pure Rust, no Python, no GPU):
//!
//! * `triton/interpret_record.json` (written by `scripts/python/triton_interpret_check.py`)
//!   lists the sha256 of every kernel source and every test vector file it checked: a source
//!   or vector that changed since, or a vector file not in the record, fails here, so a
//!   changed kernel has to be re-verified under the interpreter (and recompiled);
//! * every `kernels/<name>.<sm>.json` (written by `scripts/python/triton_compile.py`) agrees
//!   with the launcher's table `candle_fused::cuda_kernels::KERNELS`: entry, grid rule,
//!   warps, block, shared memory, parameters (and the two trailing scratch pointers), the
//!   alignment assumed, the source's and the cubin's sha256; and the table's kernels all have
//!   a cubin for every arch;
//! * `check_launch` accepts a valid launch and rejects misaligned, strided, oversized and
//!   wrongly typed arguments with a clear error.

use anyhow::{anyhow, ensure, Context, Result};
use candle_core::DType;
use candle_fused::cuda_kernels::{
    check_launch, dtype_suffix, find, Grid, Param, TensorArg, ARCHS, KERNELS, POINTER_ALIGNMENT,
    RMS_BWD_ROWS_PER_PROGRAM, SCRATCH_PARAMS,
};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Paths in the record and metadata are relative to the workspace root.
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
    .venv-triton/bin/python scripts/python/triton_interpret_check.py and \
    scripts/python/triton_compile.py (environment: scripts/python/triton_setup.sh)";

#[test]
fn sources_and_vectors_match_the_interpreter_record() -> Result<()> {
    let record = json(&crate_dir().join("triton/interpret_record.json"))?;
    let mut checked = 0;
    for key in ["kernel_sources", "vectors"] {
        let list = record[key]
            .as_array()
            .ok_or_else(|| anyhow!("record has no {key}"))?;
        ensure!(!list.is_empty(), "record lists no {key}");
        for item in list {
            let file = str_of(item, "file")?;
            let got = sha256(&from_root(file))?;
            ensure!(
                got == str_of(item, "sha256")?,
                "{file} changed since the interpreter check was recorded (sha256 {got}); {RERUN}"
            );
            checked += 1;
        }
    }
    // every vector file on disk was checked
    let recorded: Vec<&str> = record["vectors"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v["file"].as_str())
        .collect();
    for entry in std::fs::read_dir(crate_dir().join("triton/vectors"))? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        let rel = format!("candle-fused/triton/vectors/{name}");
        ensure!(
            recorded.contains(&rel.as_str()),
            "{rel} is not in the interpreter record; {RERUN}"
        );
    }
    // the interpreter ran the configuration the table (and the cubins) use
    let ce = &record["constexprs"];
    ensure!(u64_of(ce, "BWD_ROWS_PER_PROGRAM")? as usize == RMS_BWD_ROWS_PER_PROGRAM);
    for (key, entry) in [
        ("FWD_BLOCK_C", "rms_norm_fwd"),
        ("BWD_BLOCK_C", "rms_norm_bwd_dx"),
        ("DW_BLOCK_C", "rms_norm_bwd_dw"),
    ] {
        let spec = find(entry, DType::F32).expect("in the table");
        ensure!(
            u64_of(ce, key)? as usize == spec.block_c,
            "{key}: record and table differ"
        );
    }
    assert!(checked >= 2);
    Ok(())
}

#[test]
fn metadata_matches_the_launcher_table() -> Result<()> {
    let dir = crate_dir().join("kernels");
    for spec in &KERNELS {
        for arch in ARCHS {
            let stem = format!("{}.sm{arch}", spec.name());
            let meta = json(&dir.join(format!("{stem}.json")))?;
            let ctx =
                |what: &str| format!("{stem}.json: {what} differs from cuda_kernels::KERNELS");
            ensure!(str_of(&meta, "kernel")? == spec.name(), ctx("kernel"));
            ensure!(str_of(&meta, "entry")? == spec.entry, ctx("entry"));
            ensure!(
                str_of(&meta, "target")? == format!("sm_{arch}"),
                ctx("target")
            );
            ensure!(str_of(&meta, "grid")? == spec.grid.describe(), ctx("grid"));
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
                u64_of(&meta, "shared_bytes")? == spec.shared_bytes as u64,
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
            ensure!(
                u64_of(&meta["constexprs"], "BLOCK_C")? as usize == spec.block_c,
                ctx("BLOCK_C")
            );
            if let Grid::RowBlocks(r) = spec.grid {
                ensure!(
                    u64_of(&meta["constexprs"], "ROWS_PER_PROGRAM")? as usize == r,
                    ctx("ROWS_PER_PROGRAM")
                );
            }
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
                    Param::Int(..) => ".u32",
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
                "{stem}.cubin does not match its metadata; rerun scripts/python/triton_compile.py"
            );
        }
    }
    // no stray metadata without a table entry
    for entry in std::fs::read_dir(&dir)? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if let Some(stem) = name.strip_suffix(".json") {
            let kernel = stem.rsplit_once('.').map_or(stem, |(k, _)| k);
            ensure!(
                KERNELS.iter().any(|k| k.name() == kernel),
                "{name}: no entry in cuda_kernels::KERNELS"
            );
        }
    }
    Ok(())
}

fn t(dims: &[usize], dtype: DType) -> TensorArg {
    TensorArg::contiguous(dims, dtype, 0)
}

#[test]
fn check_launch_accepts_the_contract_and_rejects_the_rest() -> Result<()> {
    let (n, c) = (37usize, 129usize);
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let fwd = find("rms_norm_fwd", dt).unwrap();
        let l = check_launch(
            fwd,
            &[
                t(&[n, c], dt),
                t(&[c], dt),
                t(&[n, c], dt),
                t(&[n], DType::F32),
            ],
        )?;
        assert_eq!(l.grid, [37, 1, 1]);
        assert_eq!(l.block, [256, 1, 1]);
        assert_eq!(l.ints, [37, 129]);
        assert_eq!(l.shared_bytes, fwd.shared_bytes);

        let p = n.div_ceil(RMS_BWD_ROWS_PER_PROGRAM);
        let dx = find("rms_norm_bwd_dx", dt).unwrap();
        let args = [
            t(&[n, c], dt),
            t(&[c], dt),
            t(&[n, c], dt),
            t(&[n], DType::F32),
            t(&[n, c], dt),
            t(&[p, c], DType::F32),
        ];
        let l = check_launch(dx, &args)?;
        assert_eq!((l.grid, l.ints.clone()), ([2, 1, 1], vec![37, 129]));
        let mut wrong_p = args.clone();
        wrong_p[5] = t(&[p + 1, c], DType::F32);
        let e = check_launch(dx, &wrong_p).unwrap_err().to_string();
        assert!(e.contains("cdiv(N, 32)"), "{e}");

        let dw = find("rms_norm_bwd_dw", dt).unwrap();
        let l = check_launch(dw, &[t(&[p, c], DType::F32), t(&[c], dt)])?;
        assert_eq!(
            (l.grid, l.block, l.ints),
            ([1, 1, 1], [64, 1, 1], vec![2, 129])
        );
    }
    let dt = DType::BF16;
    let fwd = find("rms_norm_fwd", dt).unwrap();
    let ok = [
        t(&[n, c], dt),
        t(&[c], dt),
        t(&[n, c], dt),
        t(&[n], DType::F32),
    ];
    // misaligned: a view starting one row into a buffer (129 bf16 = 258 bytes)
    let mut a = ok.clone();
    a[0].offset_bytes = c * 2;
    let e = check_launch(fwd, &a).unwrap_err().to_string();
    assert!(
        e.contains("byte offset 258") && e.contains("16-byte aligned"),
        "{e}"
    );
    // an aligned offset is fine
    a[0].offset_bytes = 256;
    check_launch(fwd, &a)?;
    // strided rows
    let mut a = ok.clone();
    a[2].strides = vec![2 * c, 1];
    let e = check_launch(fwd, &a).unwrap_err().to_string();
    assert!(e.contains("Y must be contiguous"), "{e}");
    // wrong dtypes
    let mut a = ok.clone();
    a[3] = t(&[n], DType::BF16);
    let e = check_launch(fwd, &a).unwrap_err().to_string();
    assert!(e.contains("RSTD must be F32"), "{e}");
    // mismatched shapes
    let mut a = ok.clone();
    a[1] = t(&[c + 1], dt);
    let e = check_launch(fwd, &a).unwrap_err().to_string();
    assert!(e.contains("W has C = 130"), "{e}");
    // rows longer than one tile
    let big = 4097;
    let a = [
        t(&[2, big], dt),
        t(&[big], dt),
        t(&[2, big], dt),
        t(&[2], DType::F32),
    ];
    let e = check_launch(fwd, &a).unwrap_err().to_string();
    assert!(e.contains("exceeds BLOCK_C = 4096"), "{e}");
    // wrong number of arguments, empty grid
    assert!(check_launch(fwd, &ok[..3]).is_err());
    let a = [
        t(&[0, c], dt),
        t(&[c], dt),
        t(&[0, c], dt),
        t(&[0], DType::F32),
    ];
    assert!(check_launch(fwd, &a).is_err());
    // every table entry has a distinct name and a known dtype
    for k in &KERNELS {
        assert_ne!(dtype_suffix(k.dtype), "?");
        assert_eq!(KERNELS.iter().filter(|o| o.name() == k.name()).count(), 1);
    }
    Ok(())
}
