//! `check_launch` on the flash attention launch table.

use super::*;

/// The attention scalars: scale, causal, window, p_drop, keep, seed lo/hi, site lo/hi,
/// offset lo/hi.
fn attn_cfg() -> Vec<Scalar> {
    use Scalar::{F32, I32};
    vec![
        F32(0.125),
        I32(1),
        I32(20),
        F32(0.2),
        F32(1.25),
        I32(0x9abc_def0_u32 as i32),
        I32(0x1234_5678),
        I32(3),
        I32(5),
        I32(1_000_003),
        I32(0),
    ]
}

#[test]
fn attention_launches() -> Result<()> {
    use crate::cuda_kernels::attention::{BLOCK_16, BLOCK_F32};
    use Arg::{Null, Tensor as T, F32, I32};
    let (b, h, kv, n, d) = (2usize, 6usize, 2usize, 70usize, 64usize);
    let cfg = attn_cfg();
    // the scalars in order, then the two scratch pointers
    let cfg_args: Vec<Arg> = (cfg.iter())
        .map(|s| match *s {
            Scalar::F32(v) => F32(v),
            Scalar::I32(v) => I32(v),
        })
        .chain([Null, Null])
        .collect();
    let dims = [I32(6), I32(2), I32(70), I32(64)];
    // the (B, heads, T) strides of contiguous [B, H, T, D] and [B, KV, T, D] tensors
    let (sh, skv) = (
        [I32(6 * 70 * 64), I32(70 * 64), I32(64)],
        [I32(2 * 70 * 64), I32(70 * 64), I32(64)],
    );
    for (dt, block) in [
        (DType::F32, BLOCK_F32),
        (DType::BF16, BLOCK_16),
        (DType::F16, BLOCK_16),
    ] {
        let (qo, kvt) = (t(&[b, h, n, d], dt), t(&[b, kv, n, d], dt));
        let (doc, stat) = (t(&[b, n], DType::I32), t(&[b, h, n], DType::F32));
        let programs = n.div_ceil(block) as u32;

        let fwd = find("attn_fwd", dt).unwrap();
        let args = [&qo, &kvt, &kvt, &doc, &qo, &stat].map(Clone::clone);
        let l = check_launch(fwd, &args, &cfg)?;
        assert_eq!((l.grid, l.block), ([programs, 12, 1], [128, 1, 1]));
        let want: Vec<Arg> = (0..6)
            .map(T)
            .chain(dims)
            .chain([sh, skv, skv, sh].concat())
            .chain(cfg_args.iter().copied())
            .collect();
        assert_eq!(l.args, want);
        assert_eq!(l.shared_bytes, fwd.shared_bytes);

        let delta = find("attn_bwd_delta", dt).unwrap();
        let l = check_launch(delta, &[qo.clone(), qo.clone(), stat.clone()], &[])?;
        assert_eq!((l.grid, l.block), ([2, 12, 1], [128, 1, 1]));
        let want = [
            &[T(0), T(1), T(2), I32(6), I32(70), I32(64)][..],
            &sh,
            &sh,
            &[Null, Null],
        ];
        assert_eq!(l.args, want.concat());

        let dkdv = find("attn_bwd_dkdv", dt).unwrap();
        let bwd_in = [&qo, &kvt, &kvt, &doc, &qo, &stat, &stat].map(Clone::clone);
        let mut args = bwd_in.to_vec();
        args.extend([kvt.clone(), kvt.clone()]);
        let l = check_launch(dkdv, &args, &cfg)?;
        assert_eq!((l.grid, l.block), ([programs, 4, 1], [256, 1, 1]));
        assert_eq!(l.args.len(), 9 + 4 + 18 + 11 + 2);
        assert_eq!(&l.args[9..13], &dims);
        assert_eq!(l.args[13..31], [sh, skv, skv, sh, skv, skv].concat());

        let dq = find("attn_bwd_dq", dt).unwrap();
        let mut args = bwd_in.to_vec();
        args.push(qo.clone());
        let l = check_launch(dq, &args, &cfg)?;
        assert_eq!((l.grid, l.block), ([programs, 12, 1], [256, 1, 1]));
        assert_eq!(l.args[8..12], dims);
        assert_eq!(l.args[12..27], [sh, skv, skv, sh, sh].concat());
    }
    // what the kernels do not cover, or a wrong layout
    let dt = DType::BF16;
    let fwd = find("attn_fwd", dt).unwrap();
    let args = |h: usize, kv: usize, tk: usize, d: usize, doc: DType| {
        [
            t(&[b, h, n, d], dt),
            t(&[b, kv, tk, d], dt),
            t(&[b, kv, tk, d], dt),
            t(&[b, n], doc),
            t(&[b, h, n, d], dt),
            t(&[b, h, n], DType::F32),
        ]
    };
    check_launch(fwd, &args(6, 2, n, 128, DType::I32), &cfg)?;
    refuses(
        fwd,
        &args(6, 2, n, 129, DType::I32),
        &cfg,
        "D = 129 exceeds 128",
    );
    refuses(
        fwd,
        &args(6, 4, n, d, DType::I32),
        &cfg,
        "KV = 4 must divide H = 6",
    );
    refuses(
        fwd,
        &args(6, 2, n + 1, d, DType::I32),
        &cfg,
        "K has T = 71, an earlier argument 70",
    );
    refuses(fwd, &args(6, 2, n, d, DType::U32), &cfg, "DOC must be I32");
    refuses(
        fwd,
        &args(6, 2, n, d, DType::I32),
        &cfg[..10],
        "off_hi needs a Scalar::I32",
    );
    // B*H programs along y: at most CUDA's 65535 (B = 2, H = 32770: 65540)
    check_launch(fwd, &args(32766, 2, n, d, DType::I32), &cfg)?;
    refuses(
        fwd,
        &args(32770, 2, n, d, DType::I32),
        &cfg,
        "grid B*H = 65540 exceeds CUDA's 65535 along y",
    );
    Ok(())
}

/// The forward's tensor arguments for `[B, H, T, D]` queries over `KV` kv heads.
fn fwd_args(b: usize, h: usize, kv: usize, n: usize, d: usize, dt: DType) -> Vec<TensorArg> {
    vec![
        t(&[b, h, n, d], dt),
        t(&[b, kv, n, d], dt),
        t(&[b, kv, n, d], dt),
        t(&[b, n], DType::I32),
        t(&[b, h, n, d], dt),
        t(&[b, h, n], DType::F32),
    ]
}

/// The backward's: `[dK, dV]` (`dkdv`) or `[dQ]` after the shared inputs.
fn bwd_args(d: usize, dt: DType, dkdv: bool) -> Vec<TensorArg> {
    let (b, h, kv, n) = (2, 6, 2, 70);
    let (qo, kvt, stat) = (
        t(&[b, h, n, d], dt),
        t(&[b, kv, n, d], dt),
        t(&[b, h, n], DType::F32),
    );
    let mut args = vec![
        qo.clone(),
        kvt.clone(),
        kvt.clone(),
        t(&[b, n], DType::I32),
        qo.clone(),
        stat.clone(),
        stat,
    ];
    if dkdv {
        args.extend([kvt.clone(), kvt]);
    } else {
        args.push(qo);
    }
    args
}

#[test]
fn attention_builds_are_chosen_by_the_rules() -> Result<()> {
    use crate::cuda_kernels::attention::builds;
    use crate::cuda_kernels::check_variants;
    let cfg = attn_cfg();
    let entry = |e: &[&str], args: &[TensorArg], dt, s: &[Scalar]| {
        check_variants(e, dt, args, s).map(|(spec, _)| spec.entry)
    };
    for dropout in [false, true] {
        let b = builds(dropout);
        let sfx = if dropout { "" } else { "_nodrop" };
        for dt in [DType::BF16, DType::F16] {
            for (d, tile) in [(16, "_d64"), (64, "_d64"), (80, "_d128"), (128, "_d128")] {
                let pick = entry(&b.fwd, &fwd_args(2, 6, 2, 70, d, dt), dt, &cfg)?;
                assert_eq!(pick, format!("attn_fwd{tile}{sfx}"), "D = {d}");
                let pick = entry(&b.dkdv, &bwd_args(d, dt, true), dt, &cfg)?;
                assert_eq!(pick, format!("attn_bwd_dkdv{tile}{sfx}"), "D = {d}");
                let pick = entry(&b.dq, &bwd_args(d, dt, false), dt, &cfg)?;
                assert_eq!(pick, format!("attn_bwd_dq{tile}{sfx}"), "D = {d}");
                let delta = [
                    t(&[2, 6, 70, d], dt),
                    t(&[2, 6, 70, d], dt),
                    t(&[2, 6, 70], DType::F32),
                ];
                assert_eq!(
                    entry(&b.delta, &delta, dt, &[])?,
                    format!("attn_bwd_delta{tile}")
                );
            }
            // not a multiple of 16: the generic build
            for d in [40, 72, 127] {
                assert_eq!(
                    entry(&b.fwd, &fwd_args(2, 6, 2, 70, d, dt), dt, &cfg)?,
                    "attn_fwd"
                );
                assert_eq!(
                    entry(&b.dkdv, &bwd_args(d, dt, true), dt, &cfg)?,
                    "attn_bwd_dkdv"
                );
            }
            // D = 256 (Gemma 3): no build; the error says why for each
            let e = entry(&b.fwd, &fwd_args(2, 6, 2, 70, 256, dt), dt, &cfg)
                .unwrap_err()
                .to_string();
            for want in [
                "D = 256 exceeds 64",
                "D = 256 exceeds 128",
                "no build takes",
            ] {
                assert!(e.contains(want), "{e}");
            }
            // a rule other than the head size fails every build alike
            let e = entry(&b.fwd, &fwd_args(2, 6, 4, 70, 64, dt), dt, &cfg)
                .unwrap_err()
                .to_string();
            assert!(e.contains("KV = 4 must divide H = 6"), "{e}");
        }
        // f32 has the generic build only
        let f = DType::F32;
        assert_eq!(
            entry(&b.fwd, &fwd_args(2, 6, 2, 70, 64, f), f, &cfg)?,
            "attn_fwd"
        );
        assert_eq!(
            entry(&b.dq, &bwd_args(128, f, false), f, &cfg)?,
            "attn_bwd_dq"
        );
    }
    Ok(())
}

/// A launch with dropout never reaches a build compiled without it (`HAS_DROPOUT = False`),
/// and the builds without dropout are compiled without it.
#[test]
fn attention_dropout_builds_match_their_constexpr() -> Result<()> {
    use crate::cuda_kernels::attention::builds;
    let dir = crate_dir().join("kernels");
    for dropout in [false, true] {
        let b = builds(dropout);
        // the last of each list is the generic build
        for (i, &entry) in [b.fwd, b.dkdv, b.dq]
            .iter()
            .flat_map(|l| l.iter().enumerate())
        {
            for dt in [DType::F32, DType::BF16, DType::F16] {
                let Some(spec) = find(entry, dt) else {
                    continue;
                };
                for arch in ARCHS {
                    let stem = format!("{}.sm{arch}", spec.name());
                    let meta = json(&dir.join(format!("{stem}.json")))?;
                    let has = meta["constexprs"]["HAS_DROPOUT"].as_bool();
                    // the generic build decides at run time: compiled with dropout
                    let want = dropout || i == 2;
                    ensure!(
                        has == Some(want),
                        "{stem}: HAS_DROPOUT {has:?}, want {want}"
                    );
                }
            }
        }
    }
    Ok(())
}

/// Every build a launcher picks for bf16 / f16 runs on some committed vector case, so the
/// interpreter check (and a GPU session's `cuda_triton`) covers each of them.
#[test]
fn attention_vectors_cover_every_build() -> Result<()> {
    use crate::cuda_kernels::attention::builds;
    use crate::cuda_kernels::check_variants;
    let dir = crate_dir().join("triton/vectors");
    let mut seen = Vec::new();
    for e in std::fs::read_dir(&dir)? {
        let name = e?.file_name().to_string_lossy().into_owned();
        let Some(dt) = [("bf16", DType::BF16), ("f16", DType::F16)]
            .into_iter()
            .find(|(s, _)| name.starts_with(&format!("attention.{s}.")))
            .map(|(_, d)| d)
        else {
            continue;
        };
        let t = candle_core::safetensors::load(dir.join(&name), &candle_core::Device::Cpu)?;
        let q = t
            .get("q")
            .ok_or_else(|| anyhow!("{name}: no q"))?
            .dims()
            .to_vec();
        let kv = t.get("k").ok_or_else(|| anyhow!("{name}: no k"))?.dim(1)?;
        let p = t
            .get("dropout")
            .ok_or_else(|| anyhow!("{name}: no dropout"))?;
        let dropout = p.to_vec1::<f32>()?[0] > 0.0;
        let args = fwd_args(q[0], q[1], kv, q[2], q[3], dt);
        let (spec, _) = check_variants(&builds(dropout).fwd, dt, &args, &attn_cfg())?;
        seen.push((spec.entry, dt));
    }
    for dropout in [false, true] {
        for entry in builds(dropout).fwd {
            for dt in [DType::BF16, DType::F16] {
                ensure!(
                    seen.contains(&(entry, dt)),
                    "no attention vector case runs {entry} in {dt:?}: add one to \
                     tests/families/attention.rs"
                );
            }
        }
    }
    Ok(())
}

/// `[B, heads, T, D]` views of `[B, T, W]` rows whose heads start at column `col` (GPT-2's
/// packed projection, merged outputs), `offset` elements into an aligned buffer.
fn rows(b: usize, heads: usize, n: usize, d: usize, w: usize, col: usize, dt: DType) -> TensorArg {
    TensorArg {
        dims: vec![b, heads, n, d],
        strides: vec![n * w, d, w, 1],
        dtype: dt,
        offset_bytes: col * dt.size_in_bytes(),
    }
}

/// The kernels read q, k, v in place from a packed `[B, T, 3C]` projection and write the
/// output as `[B, T, C]` rows: the strides reach the kernel as its `s*` arguments, the
/// head-size builds take them when every stride is a multiple of 16, the generic build
/// otherwise; a non-unit last stride or a misaligned start is refused with its name.
#[test]
fn attention_reads_and_writes_rows_in_place() -> Result<()> {
    use crate::cuda_kernels::attention::builds;
    use crate::cuda_kernels::check_variants;
    use Arg::{Tensor as T, I32};
    let (b, h, n, d, dt) = (2usize, 12usize, 70usize, 64usize, DType::BF16);
    let c = h * d;
    let fwd = |w: usize, cols: [usize; 3]| {
        vec![
            rows(b, h, n, d, w, cols[0], dt),
            rows(b, h, n, d, w, cols[1], dt),
            rows(b, h, n, d, w, cols[2], dt),
            t(&[b, n], DType::I32),
            rows(b, h, n, d, c, 0, dt),
            t(&[b, h, n], DType::F32),
        ]
    };
    let cfg = attn_cfg();
    let (spec, l) = check_variants(&builds(true).fwd, dt, &fwd(3 * c, [0, c, 2 * c]), &cfg)?;
    assert_eq!(spec.entry, "attn_fwd_d64");
    let packed = [I32((n * 3 * c) as i32), I32(d as i32), I32(3 * c as i32)];
    let merged = [I32((n * c) as i32), I32(d as i32), I32(c as i32)];
    let want = [
        &(0..6).map(T).collect::<Vec<_>>()[..],
        &[I32(12), I32(12), I32(70), I32(64)],
    ];
    assert_eq!(l.args[..10], want.concat());
    assert_eq!(l.args[10..22], [packed, packed, packed, merged].concat());
    // a row stride that is not a multiple of 16: the generic build, strides passed as they are
    let (spec, l) = check_variants(&builds(true).fwd, dt, &fwd(3 * c + 8, [0, c, 2 * c]), &cfg)?;
    assert_eq!(spec.entry, "attn_fwd");
    assert_eq!(l.args[12], I32(3 * c as i32 + 8));
    // q, k, v must have unit stride along D
    let spec = find("attn_fwd", dt).unwrap();
    let mut args = fwd(3 * c, [0, c, 2 * c]);
    args[1].strides[3] = 2;
    let e = check_launch(spec, &args, &cfg).unwrap_err().to_string();
    assert!(e.contains("K must have unit stride along D"), "{e}");
    // a head starting 8 bytes into the buffer is not 16-byte aligned
    let e = check_launch(spec, &fwd(3 * c, [0, c + 4, 2 * c]), &cfg)
        .unwrap_err()
        .to_string();
    assert!(e.contains("K starts at byte offset"), "{e}");
    // the packed gradient: dK and dV written as views of one [B, T, 3C] buffer
    let dkdv = find("attn_bwd_dkdv_d64", dt).unwrap();
    let mut args = fwd(3 * c, [0, c, 2 * c])[..4].to_vec();
    args.extend([rows(b, h, n, d, c, 0, dt), t(&[b, h, n], DType::F32)]);
    args.push(t(&[b, h, n], DType::F32));
    args.extend([
        rows(b, h, n, d, 3 * c, c, dt),
        rows(b, h, n, d, 3 * c, 2 * c, dt),
    ]);
    let l = check_launch(dkdv, &args, &cfg)?;
    assert_eq!(
        l.args[13..31],
        [packed, packed, packed, merged, packed, packed].concat()
    );
    Ok(())
}
