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
//!   wrongly typed arguments with a clear error.

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

#[test]
fn swiglu_launches() -> Result<()> {
    use Arg::{Null, Tensor as T, I32};
    let e = 37 * 129;
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let fwd = find("swiglu_fwd", dt).unwrap();
        let l = check_launch(fwd, &[t(&[e], dt), t(&[e], dt), t(&[e], dt)], &[])?;
        assert_eq!((l.grid, l.block), ([5, 1, 1], [128, 1, 1]));
        assert_eq!(l.args, [T(0), T(1), T(2), I32(e as i32), Null, Null]);
        let bwd = find("swiglu_bwd", dt).unwrap();
        let l = check_launch(
            bwd,
            &[
                t(&[e], dt),
                t(&[e], dt),
                t(&[e], dt),
                t(&[e], dt),
                t(&[e], dt),
            ],
            &[],
        )?;
        assert_eq!(l.grid, [5, 1, 1]);
        assert_eq!(
            l.args,
            [T(0), T(1), T(2), T(3), T(4), I32(e as i32), Null, Null]
        );
    }
    let fwd = find("swiglu_fwd", DType::BF16).unwrap();
    // gate and up of different lengths
    let err = check_launch(
        fwd,
        &[
            t(&[e], DType::BF16),
            t(&[e + 1], DType::BF16),
            t(&[e], DType::BF16),
        ],
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("UP has E = 4774"), "{err}");
    // the packed [gate | up] halves are not contiguous: copy them first
    let mut half = t(&[37, 129], DType::BF16);
    half.strides = vec![258, 1];
    let fwd2 = [half.clone(), half, t(&[37, 129], DType::BF16)];
    assert!(check_launch(fwd, &fwd2, &[]).is_err());
    // the second half of a packed buffer of odd width is misaligned (129 bf16 = 258 bytes)
    let mut up = t(&[e], DType::BF16);
    up.offset_bytes = 258;
    let err = check_launch(fwd, &[t(&[e], DType::BF16), up, t(&[e], DType::BF16)], &[])
        .unwrap_err()
        .to_string();
    assert!(err.contains("16-byte aligned"), "{err}");
    // an empty tensor: skip the launch
    let z = t(&[0], DType::BF16);
    assert!(check_launch(fwd, &[z.clone(), z.clone(), z], &[]).is_err());
    Ok(())
}

#[test]
fn gelu_launches() -> Result<()> {
    use candle_fused::cuda_kernels::gelu::ROWS_PER_PROGRAM;
    use Arg::{Null, Tensor as T, I32};
    let (n, c) = (37usize, 300usize);
    let e = n * c;
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let l = check_launch(
            find("gelu_fwd", dt).unwrap(),
            &[t(&[e], dt), t(&[e], dt)],
            &[],
        )?;
        assert_eq!((l.grid, l.block), ([11, 1, 1], [128, 1, 1]));
        assert_eq!(l.args, [T(0), T(1), I32(e as i32), Null, Null]);
        let l = check_launch(
            find("gelu_bwd", dt).unwrap(),
            &[t(&[e], dt), t(&[e], dt), t(&[e], dt)],
            &[],
        )?;
        assert_eq!(l.args, [T(0), T(1), T(2), I32(e as i32), Null, Null]);

        let fwd = find("bias_gelu_fwd", dt).unwrap();
        let l = check_launch(fwd, &[t(&[n, c], dt), t(&[c], dt), t(&[n, c], dt)], &[])?;
        assert_eq!((l.grid, l.block), ([5, 2, 1], [128, 1, 1]));
        assert_eq!(l.args, [T(0), T(1), T(2), I32(37), I32(300), Null, Null]);

        let p = n.div_ceil(ROWS_PER_PROGRAM);
        let dx = find("bias_gelu_bwd_dx", dt).unwrap();
        let args = [
            t(&[n, c], dt),
            t(&[c], dt),
            t(&[n, c], dt),
            t(&[n, c], dt),
            t(&[p, c], DType::F32),
        ];
        let l = check_launch(dx, &args, &[])?;
        assert_eq!((l.grid, l.block), ([3, 2, 1], [64, 1, 1]));
        assert_eq!(
            l.args,
            [T(0), T(1), T(2), T(3), T(4), I32(37), I32(300), Null, Null]
        );
        let mut wrong = args.clone();
        wrong[4] = t(&[p, c], dt);
        if dt != DType::F32 {
            let err = check_launch(dx, &wrong, &[]).unwrap_err().to_string();
            assert!(err.contains("DB_PARTIAL must be F32"), "{err}");
        }
        wrong[4] = t(&[p + 1, c], DType::F32);
        let err = check_launch(dx, &wrong, &[]).unwrap_err().to_string();
        assert!(err.contains("cdiv(N, 16)"), "{err}");

        let db = find("bias_gelu_bwd_db", dt).unwrap();
        let l = check_launch(db, &[t(&[p, c], DType::F32), t(&[c], dt)], &[])?;
        assert_eq!((l.grid, l.block), ([2, 1, 1], [64, 1, 1]));
        assert_eq!(l.args, [T(0), T(1), I32(3), I32(300), Null, Null]);
    }
    // a bias of another length than the rows
    let dt = DType::BF16;
    let fwd = find("bias_gelu_fwd", dt).unwrap();
    let err = check_launch(fwd, &[t(&[n, c], dt), t(&[c + 1], dt), t(&[n, c], dt)], &[])
        .unwrap_err()
        .to_string();
    assert!(err.contains("B has C = 301"), "{err}");
    // no scalars are taken
    let err = check_launch(
        fwd,
        &[t(&[n, c], dt), t(&[c], dt), t(&[n, c], dt)],
        &[Scalar::F32(1.0)],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("left over"), "{err}");
    Ok(())
}

#[test]
fn dropout_launches() -> Result<()> {
    use candle_fused::cuda_kernels::dropout::{scalars, words};
    use candle_fused::RngKey;
    use Arg::{Null, Tensor as T, F32, I32};
    let e = 4773;
    let key = RngKey::new(0xDEAD_BEEF_1234_5678, 0x1_0000_0003).with_offset((5 << 32) + 7);
    assert_eq!(
        words(0xDEAD_BEEF_1234_5678),
        [0x1234_5678, 0xDEAD_BEEFu32 as i32]
    );
    for (dt, scale) in [
        (DType::F32, 1.0 / 0.7f32),
        (DType::BF16, 1.4296875),
        (DType::F16, 1.4287109),
    ] {
        let s = scalars(0.3, key, dt)?;
        assert_eq!(s[7], Scalar::F32(scale), "{dt:?}");
        let spec = find("dropout", dt).unwrap();
        let l = check_launch(spec, &[t(&[e], dt), t(&[e], dt)], &s)?;
        assert_eq!((l.grid, l.block), ([5, 1, 1], [128, 1, 1]));
        assert_eq!(
            l.args,
            [
                T(0),
                T(1),
                I32(e as i32),
                I32(0x1234_5678),
                I32(0xDEAD_BEEFu32 as i32),
                I32(3),
                I32(1),
                I32(7),
                I32(5),
                F32(0.3),
                F32(scale),
                Null,
                Null
            ]
        );
    }
    // p outside [0, 1), a dtype without a variant
    assert!(scalars(1.0, key, DType::F32).is_err());
    assert!(scalars(-0.1, key, DType::F32).is_err());
    assert!(scalars(0.1, key, DType::F64).is_err());
    // the scalars in the wrong order (p first)
    let spec = find("dropout", DType::F32).unwrap();
    let mut s = scalars(0.3, key, DType::F32)?.to_vec();
    s.rotate_right(2);
    let err = check_launch(spec, &[t(&[e], DType::F32), t(&[e], DType::F32)], &s)
        .unwrap_err()
        .to_string();
    assert!(err.contains("seed_lo needs a Scalar::I32"), "{err}");
    // x and y of different lengths
    let err = check_launch(
        spec,
        &[t(&[e], DType::F32), t(&[e - 1], DType::F32)],
        &scalars(0.3, key, DType::F32)?,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("Y has E = 4772"), "{err}");
    Ok(())
}

#[test]
fn adamw_launches() -> Result<()> {
    use candle_fused::adamw::AdamWStep;
    use candle_fused::cuda_kernels::adamw::{scalars, SUMSQ_BLOCK};
    use Arg::{Null, Tensor as T, F32, I32};
    let e = 3001usize;
    let step = AdamWStep {
        step: 7,
        grad_scale: 0.5,
        ..Default::default()
    };
    let s = scalars(&step)?;
    let f = DType::F32;
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let up = find("adamw_update", dt).unwrap();
        let args = [t(&[e], f), t(&[e], dt), t(&[e], f), t(&[e], f)];
        let l = check_launch(up, &args, &s)?;
        assert_eq!((l.grid, l.block), ([3, 1, 1], [128, 1, 1]));
        assert_eq!(l.args[..5], [T(0), T(1), T(2), T(3), I32(3001)]);
        assert_eq!(l.args[5], F32(0.5));
        assert_eq!(
            l.args[6..14],
            s.map(|v| match v {
                Scalar::F32(x) => F32(x),
                Scalar::I32(x) => I32(x),
            })[1..]
        );
        assert_eq!(l.args[14..], [Null, Null]);
        // the moments and the parameter are f32 whatever the gradient's dtype
        if dt != f {
            let mut wrong = args.clone();
            wrong[2] = t(&[e], dt);
            let err = check_launch(up, &wrong, &s).unwrap_err().to_string();
            assert!(err.contains("EXP_AVG must be F32"), "{err}");
        }
        // eight scalars instead of nine
        let err = check_launch(up, &args, &s[..8]).unwrap_err().to_string();
        assert!(err.contains("eps needs a Scalar::F32"), "{err}");

        let p = e.div_ceil(SUMSQ_BLOCK);
        let part = find("sumsq_partial", dt).unwrap();
        let l = check_launch(part, &[t(&[e], dt), t(&[p], DType::F64)], &[])?;
        assert_eq!(l.grid, [3, 1, 1]);
        assert_eq!(l.args, [T(0), T(1), I32(3001), Null, Null]);
        let err = check_launch(part, &[t(&[e], dt), t(&[p], f)], &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("PARTIAL must be F64"), "{err}");
        let err = check_launch(part, &[t(&[e], dt), t(&[p + 1], DType::F64)], &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("cdiv(E, 1024)"), "{err}");
    }
    let total = find("sumsq_total", f).unwrap();
    let l = check_launch(total, &[t(&[3], DType::F64), t(&[1], f)], &[])?;
    assert_eq!((l.grid, l.block), ([1, 1, 1], [128, 1, 1]));
    assert_eq!(l.args, [T(0), T(1), I32(3), Null, Null]);
    assert!(check_launch(total, &[t(&[3], DType::F64), t(&[2], f)], &[]).is_err());
    assert!(find("sumsq_total", DType::BF16).is_none());
    // a step the CPU rejects
    assert!(scalars(&AdamWStep {
        beta1: 1.0,
        ..Default::default()
    })
    .is_err());
    Ok(())
}
