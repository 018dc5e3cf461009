//! Dropout (`triton/dropout.py`): each file `dropout.<dtype>.<shape>.safetensors` holds `x`,
//! `dy` (inputs, in the dtype), the kernel's scalars from `cuda_kernels::dropout::scalars`:
//! `key [6]` (i32: seed, site, offset as low/high words), `p`, `scale` (f32), and the CPU's
//! `words` (u32: the Philox word of every element, from `RngKey::block`), `mask` (u8: 1 kept, 0
//! dropped, from `dropout_mask`), `y = dropout(x)` and `dx` (its backward of `dy`).
//!
//! The element counts (4773, 3001, 1001) are multiples neither of 4 nor of the Triton block
//! (1024); the offsets are `5 * 2^32 + 7` (offset % 4 = 3, a high word), 0, and `2^34 - 6`
//! (offset % 4 = 2, the Philox block crossing 2^32: its high counter word carries); the seeds
//! and sites have high words, some with the top bit set (negative as i32). `x` has no zeros,
//! so `mask` is also visible in `y`.

use crate::common::{self, Lcg};
use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_fused::cuda_kernels::{dropout::scalars, Scalar};
use candle_fused::dropout::{dropout, dropout_mask};
use candle_fused::RngKey;

struct Case {
    shape: &'static [usize],
    p: f32,
    key: RngKey,
    dtypes: &'static [DType],
}

const ALL: &[DType] = &[DType::F32, DType::BF16, DType::F16];

fn cases() -> [Case; 3] {
    [
        Case {
            shape: &[37, 129],
            p: 0.3,
            key: RngKey::new(0xDEAD_BEEF_1234_5678, 0x1_0000_0003).with_offset((5 << 32) + 7),
            dtypes: ALL,
        },
        Case {
            shape: &[3001],
            p: 0.5,
            key: RngKey::new(42, 7),
            dtypes: ALL,
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
    let xv = Var::from_tensor(&x)?;
    let y = dropout(xv.as_tensor(), c.p, c.key)?;
    // d(sum(y * dy))/dy = dy exactly, so dx is the backward of `dy`.
    let g = (&y * &dy)?.sum_all()?.backward()?;
    let dx = g.get(xv.as_tensor()).expect("dx").clone();
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
    let s = scalars(c.p, c.key, dt)?;
    let key: Vec<i32> = s[..6]
        .iter()
        .map(|s| match s {
            Scalar::I32(v) => *v,
            Scalar::F32(_) => unreachable!("the key words are i32"),
        })
        .collect();
    let [Scalar::F32(p), Scalar::F32(scale)] = [s[6], s[7]] else {
        unreachable!("p and scale are f32")
    };
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

#[test]
fn write_vectors() -> Result<()> {
    let Some(dir) = crate::out_dir()? else {
        return Ok(());
    };
    for (s, c) in cases().iter().enumerate() {
        for (k, &dt) in c.dtypes.iter().enumerate() {
            let t = vectors(c, dt, 4000 + 10 * k as u64 + s as u64)?;
            let name = candle_fused::cuda_kernels::dtype_suffix(dt);
            let case = c.shape.iter().map(|d| d.to_string()).collect::<Vec<_>>();
            crate::write(&dir, &format!("dropout.{name}.{}", case.join("x")), t)?;
        }
    }
    Ok(())
}
