//! Token-embedding backward (`triton/embedding.py`): each file
//! `embedding.<dtype>.<V>x<C>-n<N>.safetensors` holds the table `w [V, C]`, the ids `ids [N]`
//! (u32) and `dy [N, C]` (inputs) and the CPU kernel's `dw [V, C]`. Ids repeat (the first five
//! are all 1) and some rows are absent (ids are drawn below `V - 3`, or far below `V`); the
//! last case has two ids ~50 times each (segments much longer than the kernel's 8-row trips,
//! not multiples of them); `C` is not a multiple of the 256-column block (129, 300, 1, 40) and
//! `V` is any size.
//!
//! Checked: `dW` bit-identical to the CPU kernel, every dtype (the same f32 adds in the same
//! order, each row rounded once). The ids' order comes from the host copy of the ids, as the
//! trainer passes it (no read-back). The composite fallback (Candle's `index_add` into an f32
//! zero table, one thread per column adding the ids in position order) gives the same bits.

use super::{
    forward_backward, input, write_each, Check, Family, Mode, Outputs, Tensors, ALL_DTYPES, EXACT,
};
use crate::common::{self, Lcg};
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_fused::embedding::embedding;
use std::path::Path;

/// Launches: the backward (the forward is Candle's index_select).
pub(crate) const FAMILY: Family =
    Family::new("embedding", EMBEDDING, run, |_| Ok(1), write_vectors);
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
    let (_, [dw]) = forward_backward([&w], &dy, |[w]| embedding(w, &t, Some(&ids)))?;
    Ok(vec![("w", w), ("ids", t), ("dy", dy), ("dw", dw)])
}

fn write_vectors(dir: &Path) -> Result<()> {
    let label = |&(v, c, n, _): &(usize, usize, usize, usize)| format!("{v}x{c}-n{n}");
    write_each(
        dir,
        "embedding",
        5000,
        &CASES,
        |_| ALL_DTYPES,
        label,
        |&case, dt, seed| vectors(case, dt, seed),
    )
}

const EMBEDDING: &[Check] = &[Check::new("dw", Mode::Row, EXACT)];

fn run(dev: &Device, t: &Tensors) -> Result<Outputs> {
    let host = input(t, "ids", &Device::Cpu)?.to_vec1::<u32>()?;
    let [w, ids, dy] = ["w", "ids", "dy"].map(|n| input(t, n, dev));
    let ids = ids?;
    let (_, [dw]) = forward_backward([&w?], &dy?, |[w]| embedding(w, &ids, Some(&host)))?;
    Ok(vec![("dw", dw)])
}
