//! Token-embedding backward (`triton/embedding.py`): each file
//! `embedding.<dtype>.<V>x<C>-n<N>.safetensors` holds the table `w [V, C]`, the ids `ids [N]`
//! (u32) and `dy [N, C]` (inputs) and the CPU kernel's `dw [V, C]`. Ids repeat (the first five
//! are all 1) and some rows are absent (ids are drawn below `V - 3`, or far below `V`); the
//! last case has two ids ~50 times each (segments much longer than the kernel's 8-row trips,
//! not multiples of them); `C` is not a multiple of the 256-column block (129, 300, 1, 40) and
//! `V` is any size.

use crate::common::{self, Lcg};
use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_fused::embedding::embedding;

const ALL: &[DType] = &[DType::F32, DType::BF16, DType::F16];
/// `(V, C, N, ids drawn below)`.
const CASES: [(usize, usize, usize, usize); 5] = [
    (37, 129, 123, 34),
    (300, 300, 211, 297),
    (5, 1, 7, 3),
    (1000, 64, 50, 1000),
    (7, 40, 101, 2),
];

fn vectors(
    (v, c, n, used): (usize, usize, usize, usize),
    dt: DType,
    seed: u64,
) -> Result<Vec<(&'static str, Tensor)>> {
    let mut rng = Lcg(seed);
    let ids: Vec<u32> = (0..n)
        .map(|p| if p < 5 { 1 } else { rng.below(used) as u32 })
        .collect();
    let w = common::rand(&[v, c], dt, &mut rng, 1.0, 0.0)?;
    let dy = common::rand(&[n, c], dt, &mut rng, 1.0, 0.0)?;
    let t = Tensor::new(ids.as_slice(), &Device::Cpu)?;
    let wv = Var::from_tensor(&w)?;
    // d(sum(y * dy))/dy = dy exactly, so dW is the backward of `dy`.
    let y = embedding(wv.as_tensor(), &t, Some(&ids))?;
    let g = (&y * &dy)?.sum_all()?.backward()?;
    let dw = g.get(wv.as_tensor()).expect("dW").clone();
    Ok(vec![("w", w), ("ids", t), ("dy", dy), ("dw", dw)])
}

#[test]
fn write_vectors() -> Result<()> {
    let Some(dir) = crate::out_dir()? else {
        return Ok(());
    };
    for (s, case) in CASES.into_iter().enumerate() {
        for (k, &dt) in ALL.iter().enumerate() {
            let t = vectors(case, dt, 5000 + 10 * k as u64 + s as u64)?;
            let name = candle_fused::cuda_kernels::dtype_suffix(dt);
            let (v, c, n, _) = case;
            crate::write(&dir, &format!("embedding.{name}.{v}x{c}-n{n}"), t)?;
        }
    }
    Ok(())
}
