//! NF4 dequantization (`triton/nf4.py`): each file `nf4.<dtype>.<case>.safetensors` holds a
//! weight's parts as `Nf4Weight` keeps them (`packed` u8, and `absmax` f32, or `codes` u8,
//! `nested_absmax`, `nested_map` f32 and `offset [1]` f32), `range` (i64 `[start, end, n]`: the
//! values dequantized, of `n`), `blocksize` (i64 `[BS]` or `[BS, NBS]`) and the CPU's
//! `Nf4Weight::dequantize_range` of that range in the dtype (the weight quantized from that
//! dtype, so one rounding). Ranges start and end on odd values (the low nibble) inside blocks;
//! the weights hold an all-zero block and an outlier; `n` is odd in one case (a padding
//! nibble); the nested case has 265 blocks (two nested blocks of 256, the second partial); one
//! case has blocks of 128 (absmaxes given, not quantized).

use super::{input, write_each, Check, Family, Mode, Outputs, Tensors, ALL_DTYPES, EXACT};
use crate::common::{self, Lcg};
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use candle_fused::nf4::{Absmax, Nested, Nf4Weight};
use std::path::Path;

/// Launches: one dequantization.
pub(crate) const FAMILY: Family = Family::new("nf4", NF4, run, |_| Ok(1), write_vectors);

/// `(label, rows, columns, double quantization, block size, range start, values cut at the
/// end)`.
type Case = (&'static str, usize, usize, bool, usize, usize, usize);
const CASES: [Case; 4] = [
    ("plain-37x129", 37, 129, false, 64, 65, 3),
    ("plain-7x129", 7, 129, false, 64, 0, 0),
    ("nested-131x129", 131, 129, true, 64, 1, 0),
    ("bs128-9x100", 9, 100, false, 128, 131, 1),
];

fn vectors(case: &Case, dt: DType, seed: u64) -> Result<Vec<(&'static str, Tensor)>> {
    let &(_, rows, cols, double, bs, start, cut) = case;
    let n = rows * cols;
    let mut rng = Lcg(seed);
    let mut v: Vec<f64> = (0..n).map(|_| rng.next()).collect();
    // an all-zero block and an outlier in another
    v[64..128].iter_mut().for_each(|x| *x = 0.0);
    v[200] = 40.0;
    let w = Tensor::from_vec(v, n, &Device::Cpu)?.to_dtype(dt)?;
    let mut q = Nf4Weight::quantize(&w, double)?;
    if bs != 64 {
        let absmax = common::rand(&[n.div_ceil(bs)], DType::F32, &mut rng, 1.0, 2.0)?;
        q = Nf4Weight::new(vec![n], q.packed().clone(), Absmax::Plain(absmax), bs, dt)?;
    }
    let end = n - cut;
    let out = q.dequantize_range(&q.absmax_f32()?, start, end, dt)?;
    let i64s = |v: &[usize]| -> Result<Tensor> {
        let v: Vec<i64> = v.iter().map(|&x| x as i64).collect();
        Ok(Tensor::new(v.as_slice(), &Device::Cpu)?)
    };
    let mut t = vec![
        ("packed", q.packed().clone()),
        ("range", i64s(&[start, end, n])?),
    ];
    match q.absmax() {
        Absmax::Plain(a) => t.extend([("absmax", a.clone()), ("blocksize", i64s(&[bs])?)]),
        Absmax::Nested(m) => t.extend([
            ("codes", m.codes.clone()),
            ("nested_absmax", m.absmax.clone()),
            ("nested_map", m.map.clone()),
            ("offset", Tensor::new(&[m.offset], &Device::Cpu)?),
            ("blocksize", i64s(&[bs, m.blocksize])?),
        ]),
    }
    t.push(("out", out));
    Ok(t)
}

fn write_vectors(dir: &Path) -> Result<()> {
    let label = |c: &Case| c.0.to_string();
    write_each(dir, "nf4", 6000, &CASES, |_| ALL_DTYPES, label, vectors)
}

// nf4 (triton/nf4.py): the dequantized values bit-identical, every dtype.
const NF4: &[Check] = &[Check::new("out", Mode::Row, EXACT)];

/// The vector file's weight on `dev`, its range dequantized in the file's output dtype.
fn run(dev: &Device, t: &Tensors) -> Result<Outputs> {
    let ints = |name: &str| -> Result<Vec<usize>> {
        let v = input(t, name, &Device::Cpu)?.to_vec1::<i64>()?;
        Ok(v.into_iter().map(|x| x as usize).collect())
    };
    let (range, bs) = (ints("range")?, ints("blocksize")?);
    let (start, end, n) = (range[0], range[1], range[2]);
    let dt = t.get("out").map_or(DType::F32, Tensor::dtype);
    let absmax = if t.contains_key("codes") {
        let [codes, absmax, map] =
            ["codes", "nested_absmax", "nested_map"].map(|k| input(t, k, dev));
        let offset = input(t, "offset", &Device::Cpu)?.to_vec1::<f32>()?[0];
        Absmax::Nested(Nested {
            codes: codes?,
            absmax: absmax?,
            map: map?,
            offset,
            blocksize: bs[1],
        })
    } else {
        Absmax::Plain(input(t, "absmax", dev)?)
    };
    let w = Nf4Weight::new(vec![n], input(t, "packed", dev)?, absmax, bs[0], dt)?;
    let out = w.dequantize_range(&w.absmax_f32()?, start, end, dt)?;
    if out.dims() != [end - start] {
        bail!(
            "nf4: {} values dequantized, {} asked",
            out.elem_count(),
            end - start
        )
    }
    Ok(vec![("out", out)])
}
