//! The examples that were the doctests of these (now crate-private) items: `check_launch` on
//! RMSNorm and the cross-entropy chunk, `check_variants` and attention's builds, the
//! shared-memory opt-in rule, and the AdamW and dropout kernels' scalars.

use crate::adamw::AdamWStep;
use crate::cuda_kernels::{
    adamw, attention::builds, check_launch, check_variants, dropout, find, shared_memory_opt_in,
    Arg, Scalar, TensorArg,
};
use crate::RngKey;
use candle_core::{DType, Device, Result};
use std::collections::HashMap;

type Tensors = HashMap<String, candle_core::Tensor>;

fn t(dims: &[usize], dtype: DType) -> TensorArg {
    TensorArg::contiguous(dims, dtype, 0)
}

#[test]
fn rms_norm_launch_and_a_misaligned_tensor() -> Result<()> {
    let spec = find("rms_norm_fwd", DType::BF16).expect("compiled");
    let (n, c) = (8usize, 768usize);
    let args = [
        t(&[n, c], DType::BF16),
        t(&[c], DType::BF16),
        t(&[n, c], DType::BF16),
        t(&[n], DType::F32),
    ];
    let launch = check_launch(spec, &args, &[Scalar::F32(1e-5)])?;
    assert_eq!((launch.grid, launch.block), ([8, 1, 1], [256, 1, 1]));
    use Arg::*;
    assert_eq!(
        launch.args,
        [
            Tensor(0),
            Tensor(1),
            Tensor(2),
            Tensor(3),
            I32(8),
            I32(768),
            F32(1e-5),
            Null,
            Null
        ]
    );
    // a tensor starting 2 bytes into its buffer breaks the 16-byte alignment
    let mut misaligned = args;
    misaligned[0] = TensorArg::contiguous(&[n, c], DType::BF16, 2);
    assert!(check_launch(spec, &misaligned, &[Scalar::F32(1e-5)]).is_err());
    Ok(())
}

#[test]
fn cross_entropy_chunk_launch() -> Result<()> {
    let (r, v) = (288usize, 49152usize); // SmolLM2's default chunk and vocabulary
    let spec = find("ce_fwd_bwd", DType::BF16).expect("compiled");
    let logits = t(&[r, v], DType::BF16);
    let args = [
        logits.clone(),
        t(&[r], DType::U32),
        t(&[r], DType::F32),
        t(&[r], DType::F32),
        t(&[r], DType::F32),
        logits, // in place
    ];
    let launch = check_launch(spec, &args, &[Scalar::I32(-1), Scalar::F32(1.0 / 288.0)])?;
    assert_eq!((launch.grid, launch.block), ([288, 1, 1], [256, 1, 1]));
    use Arg::{F32, I32};
    assert_eq!(
        launch.args[6..10],
        [I32(288), I32(49152), I32(-1), F32(1.0 / 288.0)]
    );
    Ok(())
}

#[test]
fn shared_memory_opt_in_rule() -> Result<()> {
    const H100: u32 = 227 * 1024;
    assert_eq!(
        shared_memory_opt_in(1024, 48 * 1024, H100)?,
        Some(48 * 1024)
    ); // 49 KiB in all
    assert_eq!(shared_memory_opt_in(0, 48 * 1024, H100)?, None);
    assert!(shared_memory_opt_in(1024, H100, H100).is_err());
    Ok(())
}

#[test]
fn variants_pick_the_head_size_build() -> Result<()> {
    assert_eq!(
        builds(false).fwd,
        ["attn_fwd_d64_nodrop", "attn_fwd_d128_nodrop", "attn_fwd"]
    );
    assert_eq!(
        builds(true).dq,
        ["attn_bwd_dq_d64", "attn_bwd_dq_d128", "attn_bwd_dq"]
    );
    let delta = [
        "attn_bwd_delta_d64",
        "attn_bwd_delta_d128",
        "attn_bwd_delta",
    ];
    let pick = |d: usize, dt: DType| {
        let (qo, stat) = ([2, 6, 70, d], [2, 6, 70]);
        let args = [t(&qo, dt), t(&qo, dt), t(&stat, DType::F32)];
        check_variants(&delta, dt, &args, &[]).map(|(spec, _)| spec.entry)
    };
    assert_eq!(pick(64, DType::BF16)?, "attn_bwd_delta_d64");
    assert_eq!(pick(96, DType::BF16)?, "attn_bwd_delta_d128");
    assert_eq!(pick(72, DType::BF16)?, "attn_bwd_delta"); // not a multiple of 16
    assert_eq!(pick(64, DType::F32)?, "attn_bwd_delta"); // no f32 head-size builds
    assert!(pick(256, DType::BF16).is_err()); // over every tile
    Ok(())
}

#[test]
fn adamw_scalars() -> Result<()> {
    let mut step = AdamWStep::default(); // PyTorch's defaults, step 1
    let s = adamw::scalars(&step)?;
    assert_eq!(s[0], Scalar::F32(1.0)); // grad scale
    assert_eq!(s[6], Scalar::F32((1e-3 / (1.0 - 0.9f64)) as f32)); // lr / bc1
    step.step = 0; // 1-based
    assert!(adamw::scalars(&step).is_err());
    Ok(())
}

#[test]
fn dropout_scalars() -> Result<()> {
    let key = RngKey::new(0x1_0000_0002, 3).with_offset(u64::MAX);
    let s = dropout::scalars(0.5, key, DType::BF16)?;
    assert_eq!(s[..6], [2i32, 1, 3, 0, -1, -1].map(Scalar::I32));
    assert_eq!(s[6..], [Scalar::F32(0.5), Scalar::F32(2.0)]);
    Ok(())
}

/// The committed vector files named `<family>.*` (`triton/vectors/`), loaded on the CPU.
fn vector_files(family: &str) -> anyhow::Result<Vec<(String, Tensors)>> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("triton/vectors");
    let mut files = Vec::new();
    for entry in std::fs::read_dir(&dir)? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if name.starts_with(&format!("{family}.")) {
            let tensors = candle_core::safetensors::load(dir.join(&name), &Device::Cpu)?;
            files.push((name, tensors));
        }
    }
    anyhow::ensure!(
        !files.is_empty(),
        "no {family} vector files in {}",
        dir.display()
    );
    Ok(files)
}

fn tensor<'a>(file: &'a (String, Tensors), name: &str) -> anyhow::Result<&'a candle_core::Tensor> {
    file.1
        .get(name)
        .ok_or_else(|| anyhow::anyhow!("{}: no tensor {name:?}", file.0))
}

/// The scalars the Triton interpreter was checked with (written by `tests/families/adamw.rs`)
/// are those `adamw::scalars` gives the launches for one of the two steps of the files.
#[test]
fn adamw_scalars_are_the_vector_files() -> anyhow::Result<()> {
    for file in vector_files("adamw")? {
        let want: Vec<Scalar> = (tensor(&file, "scalars")?.to_vec1::<f32>()?)
            .into_iter()
            .map(Scalar::F32)
            .collect();
        // the file's grad scale (the CPU's clip coefficient) rounds back to the same f32
        let Some(&Scalar::F32(grad_scale)) = want.first() else {
            anyhow::bail!("{}: no scalars", file.0)
        };
        let grad_scale = f64::from(grad_scale);
        let decayed = AdamWStep {
            lr: 3e-4,
            weight_decay: 0.1,
            step: 7,
            grad_scale,
            ..Default::default()
        };
        let plain = AdamWStep {
            weight_decay: 0.0,
            grad_scale,
            ..Default::default()
        };
        let steps = [adamw::scalars(&decayed)?, adamw::scalars(&plain)?];
        anyhow::ensure!(
            steps.iter().any(|s| s[..] == want[..]),
            "{}: scalars {want:?}, adamw::scalars {steps:?}",
            file.0
        );
    }
    Ok(())
}

/// The key words, `p` and keep scale the Triton interpreter was checked with (written by
/// `tests/families/dropout.rs`) are those `dropout::scalars` gives the launches.
#[test]
fn dropout_scalars_are_the_vector_files() -> anyhow::Result<()> {
    for file in vector_files("dropout")? {
        let key = tensor(&file, "key")?.to_vec1::<i32>()?;
        let word = |i: usize| u64::from(key[i] as u32) | (u64::from(key[i + 1] as u32) << 32);
        let rng = RngKey::new(word(0), word(2)).with_offset(word(4));
        let p = tensor(&file, "p")?.to_vec1::<f32>()?[0];
        let scale = tensor(&file, "scale")?.to_vec1::<f32>()?[0];
        let dtype = tensor(&file, "x")?.dtype();
        let mut want: Vec<Scalar> = key.iter().map(|&w| Scalar::I32(w)).collect();
        want.extend([Scalar::F32(p), Scalar::F32(scale)]);
        let got = dropout::scalars(p, rng, dtype)?;
        anyhow::ensure!(
            got[..] == want[..],
            "{}: scalars {want:?}, dropout::scalars {got:?}",
            file.0
        );
    }
    Ok(())
}
