//! The Triton kernels' committed artefacts stay consistent (pure Rust, no Python, no GPU):
//!
//! * `triton/records/<family>.json` (written by `scripts/python/triton_interpret_check.py`)
//!   lists the sha256 of the family's kernel source and of every test vector file it checked: a
//!   source or vector that changed since, or a vector file not in its record, fails here, so a
//!   changed kernel has to be re-verified under the interpreter (and recompiled); every family
//!   of the launch tables has a record;
//! * every `kernels/<name>.<sm>.json` (written by `scripts/python/triton_compile.py`) agrees
//!   with the launch tables `candle_fused::cuda_kernels::FAMILIES`: family, entry, grid rule,
//!   warps, block, shared memory, parameters (and the two trailing scratch pointers), the
//!   alignment assumed, the source's and the cubin's sha256; and every table entry has a cubin
//!   for every arch;
//! * `check_launch` accepts a valid launch and rejects misaligned, strided, oversized and
//!   wrongly typed arguments with a clear error (RMSNorm here; the elementwise families in
//!   `triton_record/elementwise.rs`).

use anyhow::{anyhow, ensure, Context, Result};
use candle_core::DType;
use candle_fused::cuda_kernels::{
    check_launch, describe_grid, dtype_suffix, find, kernels, rms_norm, Arg, Param, Rule, Scalar,
    TensorArg, ARCHS, FAMILIES, POINTER_ALIGNMENT, SCRATCH_PARAMS,
};
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
    scripts/python/triton_compile.py <family> (environment: scripts/python/triton_setup.sh)";

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
            // a tile limit of the table is the compiled constexpr of that name
            for rule in spec.rules {
                if let Rule::AtMost(d, max) = rule {
                    let key = format!("BLOCK_{d}");
                    if let Some(v) = meta["constexprs"][&key].as_u64() {
                        ensure!(v as usize == *max, ctx(&key));
                    }
                }
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
                    Param::Dim(..) | Param::Int(_) => ".u32",
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
                kernels().any(|k| k.name() == kernel),
                "{name}: no entry in cuda_kernels::FAMILIES"
            );
        }
    }
    Ok(())
}

#[path = "triton_record/elementwise.rs"]
mod elementwise;

fn t(dims: &[usize], dtype: DType) -> TensorArg {
    TensorArg::contiguous(dims, dtype, 0)
}

const EPS: &[Scalar] = &[Scalar::F32(1e-5)];

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
            EPS,
        )?;
        assert_eq!(l.grid, [37, 1, 1]);
        assert_eq!(l.block, [256, 1, 1]);
        use Arg::{Null, Tensor as T, F32, I32};
        assert_eq!(
            l.args,
            [
                T(0),
                T(1),
                T(2),
                T(3),
                I32(37),
                I32(129),
                F32(1e-5),
                Null,
                Null
            ]
        );
        assert_eq!(
            (l.dim("N"), l.dim("C"), l.dim("P")),
            (Some(37), Some(129), None)
        );
        assert_eq!(l.shared_bytes, fwd.shared_bytes);

        let p = n.div_ceil(rms_norm::ROWS_PER_PROGRAM);
        let dx = find("rms_norm_bwd_dx", dt).unwrap();
        let args = [
            t(&[n, c], dt),
            t(&[c], dt),
            t(&[n, c], dt),
            t(&[n], DType::F32),
            t(&[n, c], dt),
            t(&[p, c], DType::F32),
        ];
        let l = check_launch(dx, &args, &[])?;
        assert_eq!(l.grid, [2, 1, 1]);
        assert_eq!(
            l.args,
            [
                T(0),
                T(1),
                T(2),
                T(3),
                T(4),
                T(5),
                I32(37),
                I32(129),
                Null,
                Null
            ]
        );
        let mut wrong_p = args.clone();
        wrong_p[5] = t(&[p + 1, c], DType::F32);
        let e = check_launch(dx, &wrong_p, &[]).unwrap_err().to_string();
        assert!(e.contains("cdiv(N, 32)"), "{e}");

        let dw = find("rms_norm_bwd_dw", dt).unwrap();
        let l = check_launch(dw, &[t(&[p, c], DType::F32), t(&[c], dt)], &[])?;
        assert_eq!((l.grid, l.block), ([1, 1, 1], [64, 1, 1]));
        assert_eq!(l.args, [T(0), T(1), I32(2), I32(129), Null, Null]);
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
    let e = check_launch(fwd, &a, EPS).unwrap_err().to_string();
    assert!(
        e.contains("byte offset 258") && e.contains("16-byte aligned"),
        "{e}"
    );
    // an aligned offset is fine
    a[0].offset_bytes = 256;
    check_launch(fwd, &a, EPS)?;
    // strided rows
    let mut a = ok.clone();
    a[2].strides = vec![2 * c, 1];
    let e = check_launch(fwd, &a, EPS).unwrap_err().to_string();
    assert!(e.contains("Y must be contiguous"), "{e}");
    // wrong dtypes
    let mut a = ok.clone();
    a[3] = t(&[n], DType::BF16);
    let e = check_launch(fwd, &a, EPS).unwrap_err().to_string();
    assert!(e.contains("RSTD must be F32"), "{e}");
    // mismatched shapes
    let mut a = ok.clone();
    a[1] = t(&[c + 1], dt);
    let e = check_launch(fwd, &a, EPS).unwrap_err().to_string();
    assert!(e.contains("W has C = 130"), "{e}");
    // rows longer than one tile
    let big = 4097;
    let a = [
        t(&[2, big], dt),
        t(&[big], dt),
        t(&[2, big], dt),
        t(&[2], DType::F32),
    ];
    let e = check_launch(fwd, &a, EPS).unwrap_err().to_string();
    assert!(e.contains("C = 4097 exceeds 4096"), "{e}");
    // scalars: missing, of the wrong kind, or too many
    let e = check_launch(fwd, &ok, &[]).unwrap_err().to_string();
    assert!(e.contains("eps needs a Scalar::F32"), "{e}");
    let e = check_launch(fwd, &ok, &[Scalar::I32(1)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("eps needs a Scalar::F32"), "{e}");
    let e = check_launch(fwd, &ok, &[EPS[0], EPS[0]])
        .unwrap_err()
        .to_string();
    assert!(e.contains("left over"), "{e}");
    // wrong number of arguments, empty grid
    assert!(check_launch(fwd, &ok[..3], EPS).is_err());
    let a = [
        t(&[0, c], dt),
        t(&[c], dt),
        t(&[0, c], dt),
        t(&[0], DType::F32),
    ];
    assert!(check_launch(fwd, &a, EPS).is_err());
    // every table entry has a distinct name and a known dtype
    for k in kernels() {
        assert_ne!(dtype_suffix(k.dtype), "?");
        assert_eq!(kernels().filter(|o| o.name() == k.name()).count(), 1);
    }
    Ok(())
}
