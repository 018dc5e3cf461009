//! Dropout (`triton/dropout.py`): each file `dropout.<dtype>.<shape>.safetensors` holds `x`,
//! `dy` (inputs, in the dtype), the kernel's scalars (see [`kernel_scalars`]):
//! `key [6]` (i32: seed, site, offset as low/high words), `p`, `scale` (f32), and the CPU's
//! `words` (u32: the Philox word of every element, from `RngKey::block`), `mask` (u8: 1 kept, 0
//! dropped, from `dropout_mask`), `y = dropout(x)` and `dx` (its backward of `dy`).
//!
//! The element counts (4773, 3001, 1001) are multiples neither of 4 nor of the Triton block
//! (1024); the offsets are `5 * 2^32 + 7` (offset % 4 = 3, a high word), 0, and `2^34 - 6`
//! (offset % 4 = 2, the Philox block crossing 2^32: its high counter word carries); the seeds
//! and sites have high words, some with the top bit set (negative as i32). `x` has no zeros,
//! so `mask` is also visible in `y`.

use super::{
    forward_backward, input, shape_label, write_each, Check, Family, Mode, Outputs, Tensors,
};
use super::{ALL_DTYPES, EXACT};
use crate::common::{self, Lcg};
use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use candle_fused::dropout::{dropout, dropout_mask};
use candle_fused::RngKey;
use std::path::Path;

/// Launches: forward, backward, `dropout_mask`.
pub(crate) const FAMILY: Family = Family::new("dropout", DROPOUT, run, |_| Ok(3), write_vectors);

struct Case {
    shape: &'static [usize],
    p: f32,
    key: RngKey,
    dtypes: &'static [DType],
}

fn cases() -> [Case; 3] {
    [
        Case {
            shape: &[37, 129],
            p: 0.3,
            key: RngKey::new(0xDEAD_BEEF_1234_5678, 0x1_0000_0003).with_offset((5 << 32) + 7),
            dtypes: ALL_DTYPES,
        },
        Case {
            shape: &[3001],
            p: 0.5,
            key: RngKey::new(42, 7),
            dtypes: ALL_DTYPES,
        },
        Case {
            shape: &[7, 143],
            p: 0.1,
            key: RngKey::new(0x0123_4567_89AB_CDEF, 0xFFFF_FFFF_0000_0001)
                .with_offset((1 << 34) - 6),
            dtypes: &[DType::F32],
        },
    ]
}

fn vectors(c: &Case, dt: DType, seed: u64) -> Result<Vec<(&'static str, Tensor)>> {
    let mut rng = Lcg(seed);
    let n: usize = c.shape.iter().product();
    // |x| in [0.25, 2): no zeros
    let v: Vec<f64> = (0..n)
        .map(|_| {
            let r = rng.next();
            r.signum() * (0.25 + 1.75 * r.abs())
        })
        .collect();
    let x = Tensor::from_vec(v, c.shape, &Device::Cpu)?.to_dtype(dt)?;
    let dy = common::rand(c.shape, dt, &mut rng, 1.0, 0.0)?;
    let (y, [dx]) = forward_backward([&x], &dy, |[x]| dropout(x, c.p, c.key))?;
    let mask = dropout_mask(c.shape, c.p, c.key, DType::F32, &Device::Cpu)?
        .ne(0f64)?
        .to_dtype(DType::U8)?;
    let words: Vec<u32> = (0..n as u64)
        .map(|i| {
            let idx = c.key.offset + i;
            c.key.block(idx / 4)[(idx % 4) as usize]
        })
        .collect();
    let words = Tensor::from_vec(words, c.shape, &Device::Cpu)?;
    let (key, p, scale) = kernel_scalars(c.p, c.key, dt)?;
    let dev = &Device::Cpu;
    Ok(vec![
        ("x", x),
        ("dy", dy),
        ("key", Tensor::new(key.as_slice(), dev)?),
        ("p", Tensor::new(&[p], dev)?),
        ("scale", Tensor::new(&[scale], dev)?),
        ("words", words),
        ("mask", mask),
        ("y", y),
        ("dx", dx),
    ])
}

/// The kernel's scalars: the key's seed, site and offset as (low, high) i32 words of their
/// bits, `p`, and the keep scale `1 / (1 - p)` computed in f64 and rounded to `dtype` through
/// f32, as the CPU kernel rounds it (the crate's own, which its launches pass, are held to the
/// committed files by its unit test `dropout_scalars_are_the_vector_files`).
fn kernel_scalars(p: f32, key: RngKey, dtype: DType) -> Result<([i32; 6], f32, f32)> {
    let words = |v: u64| [v as u32 as i32, (v >> 32) as u32 as i32];
    let [a, b] = words(key.seed);
    let [c, d] = words(key.site);
    let [e, f] = words(key.offset);
    let scale = (1.0 / (1.0 - f64::from(p))) as f32;
    let scale = match dtype {
        DType::F32 => scale,
        DType::BF16 => half::bf16::from_f32(scale).to_f32(),
        DType::F16 => half::f16::from_f32(scale).to_f32(),
        other => anyhow::bail!("dropout: no kernel for {other:?}"),
    };
    Ok(([a, b, c, d, e, f], p, scale))
}

fn write_vectors(dir: &Path) -> Result<()> {
    let label = |c: &Case| shape_label(c.shape);
    write_each(dir, "dropout", 4000, &cases(), |c| c.dtypes, label, vectors)
}

// dropout (triton/dropout.py): y, dx and the mask bit-identical (integer Philox words, one f32
// multiply rounded once); the composite multiplies by the same mask: also exact.
const DROPOUT: &[Check] = &[
    Check::new("y", Mode::Abs, EXACT),
    Check::new("dx", Mode::Abs, EXACT),
    Check::new("mask", Mode::Abs, EXACT),
];

fn run(dev: &Device, t: &Tensors) -> Result<Outputs> {
    let [x, dy] = ["x", "dy"].map(|n| input(t, n, dev));
    let x = x?;
    let key = input(t, "key", &Device::Cpu)?.to_vec1::<i32>()?;
    let word = |i: usize| u64::from(key[i] as u32) | u64::from(key[i + 1] as u32) << 32;
    let key = RngKey::new(word(0), word(2)).with_offset(word(4));
    let p = input(t, "p", &Device::Cpu)?.to_vec1::<f32>()?[0];
    let scale = input(t, "scale", &Device::Cpu)?.to_vec1::<f32>()?[0];
    // the key and scale read back are the ones the vectors were written with
    let (_, _, want) = kernel_scalars(p, key, x.dtype())?;
    ensure!(want == scale, "dropout: scale {scale}, the key's {want}");
    let (y, [dx]) = forward_backward([&x], &dy?, |[x]| dropout(x, p, key))?;
    let mask = dropout_mask(x.shape(), p, key, DType::F32, dev)?
        .ne(0f64)?
        .to_dtype(DType::U8)?;
    Ok(vec![("y", y), ("dx", dx), ("mask", mask)])
}
