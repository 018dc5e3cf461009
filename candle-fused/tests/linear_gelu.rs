//! `linear_gelu`: bit-identical values and gradients to the two ops it fuses
//! (`bias_gelu(linear(x, w, None), b)`) in every dtype, with and without bias, with a
//! transposed weight and odd sizes; the same on 1-3 threads; the fallback path; NaN from a
//! random index; bad arguments. Tolerance 0 throughout: the op runs the same kernels in the
//! same order, only without the graph node between them. (The two ops are checked against the
//! composite Candle expressions and finite differences in `linear.rs` and `gelu.rs`.)

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_fused::gelu::bias_gelu;
use candle_fused::linear::linear;
use candle_fused::linear_gelu::linear_gelu;
use common::*;

type Op = dyn Fn(&[Tensor]) -> candle_core::Result<Tensor> + Sync;

/// `f` over inputs `[x, w]` or `[x, w, b]`, with the weight used as stored or transposed.
fn apply(x: &[Tensor], w_t: bool, f: &dyn Fn(&Tensor, &Tensor, Option<&Tensor>) -> R) -> R {
    let w = if w_t { x[1].t()? } else { x[1].clone() };
    f(&x[0], &w, x.get(2))
}

type R = candle_core::Result<Tensor>;

fn fused(w_t: bool) -> impl Fn(&[Tensor]) -> R + Sync {
    move |x: &[Tensor]| apply(x, w_t, &|x, w, b| linear_gelu(x, w, b))
}

fn two_ops(w_t: bool) -> impl Fn(&[Tensor]) -> R + Sync {
    move |x: &[Tensor]| apply(x, w_t, &|x, w, b| bias_gelu(&linear(x, w, None)?, b))
}

fn inputs(
    dt: DType,
    rng: &mut Lcg,
    lead: &[usize],
    n_in: usize,
    n_out: usize,
    w_t: bool,
    bias: bool,
) -> Result<Vec<Tensor>> {
    let mut xs = lead.to_vec();
    xs.push(n_in);
    let mut v = vec![rand(&xs, dt, rng, 1.5, 0.0)?];
    v.push(if w_t {
        rand(&[n_out, n_in], dt, rng, 0.5, 0.0)?
    } else {
        rand(&[n_in, n_out], dt, rng, 0.5, 0.0)?
    });
    if bias {
        v.push(rand(&[n_out], dt, rng, 1.0, 0.0)?);
    }
    Ok(v)
}

#[test]
fn bit_identical_to_linear_then_bias_gelu() -> Result<()> {
    let mut rng = Lcg(11);
    for dt in [DType::F32, DType::F64, DType::BF16, DType::F16] {
        for &(lead, n_in, n_out) in &[
            (&[1usize][..], 1usize, 1usize),
            (&[3, 5], 7, 33),
            (&[2, 65], 64, 130),
            (&[127], 33, 512),
        ] {
            for w_t in [false, true] {
                for bias in [false, true] {
                    let what = format!("{dt:?} {lead:?}x{n_in}->{n_out} w_t={w_t} bias={bias}");
                    let ins = inputs(dt, &mut rng, lead, n_in, n_out, w_t, bias)?;
                    let (y, g) = grads(&fused(w_t), &ins, 5)?;
                    let (yr, gr) = grads(&two_ops(w_t), &ins, 5)?;
                    same_bits(&y, &yr, &format!("{what} y"))?;
                    for (k, (a, b)) in g.iter().zip(&gr).enumerate() {
                        same_bits(a, b, &format!("{what} grad {k}"))?;
                    }
                }
            }
        }
    }
    Ok(())
}

#[test]
fn same_bits_on_every_thread_count_and_on_the_fallback_path() -> Result<()> {
    let mut rng = Lcg(12);
    let ins = inputs(DType::F32, &mut rng, &[4, 33], 40, 160, true, true)?;
    let probe = rand(&[4, 33, 160], DType::F32, &mut rng, 1.0, 0.0)?;
    let f: &Op = &fused(true);
    assert_same_bits_on_thread_counts(f, &ins, &probe, "linear_gelu")?;
    // Devices without a kernel run the two ops (their own fallbacks).
    assert_fallback_matches(f, &ins, &probe, 1e-5, "linear_gelu fallback")?;
    Ok(())
}

#[test]
fn nan_propagates_from_a_random_index() -> Result<()> {
    let mut rng = Lcg(13);
    let (rows, n_in, n_out) = (9, 6, 5);
    let (x, idx, w, b) = linear_inputs_with_nan(&mut rng, rows, n_in, n_out)?;
    let (y, g) = grads(&fused(false), &[x, w, b], 3)?;
    let r = idx / n_in;
    // Row r of the output and of dx is NaN, nothing else; dW and db sum over every row.
    for (i, v) in values(&y).iter().enumerate() {
        assert_eq!(v.is_nan(), i / n_out == r, "y[{i}] (NaN input in row {r})");
    }
    for (i, v) in values(&g[0]).iter().enumerate() {
        assert_eq!(v.is_nan(), i / n_in == r, "dx[{i}] (NaN input in row {r})");
    }
    assert!(values(&g[1]).iter().all(|v| v.is_nan()), "dw");
    assert!(values(&g[2]).iter().all(|v| v.is_nan()), "db");
    Ok(())
}

#[test]
fn rejects_bad_arguments() -> Result<()> {
    let dev = Device::Cpu;
    let x = Tensor::zeros((2, 3), DType::F32, &dev)?;
    let w = Tensor::zeros((3, 4), DType::F32, &dev)?;
    let cases: [(&str, R); 4] = [
        ("in-features", linear_gelu(&x, &w.t()?, None)),
        (
            "bias shape",
            linear_gelu(&x, &w, Some(&Tensor::zeros(3, DType::F32, &dev)?)),
        ),
        (
            "bias dtype",
            linear_gelu(&x, &w, Some(&Tensor::zeros(4, DType::F64, &dev)?)),
        ),
        (
            "weight dtype",
            linear_gelu(&x, &w.to_dtype(DType::F64)?, None),
        ),
    ];
    for (what, r) in cases {
        let e = r.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("candle-fused linear"), "{what}: {e:?}");
    }
    Ok(())
}
