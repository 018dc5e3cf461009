//! `nf4_linear` and `qlora_linear`: values and gradients against the dense reference over the
//! dequantized weight (`qlora_linear_composite`, `lora_linear_composite` over
//! `Nf4Weight::dequantize`), with and without bias and dropout, leading dims, a weight of
//! several tiles, plain and double-quantized absmaxes; the frozen base (no gradient to the bias
//! even as a `Var`); the Candle-ops path (bits equal to the host path); bf16; errors.
//!
//! Tolerances (relative to the largest reference magnitude): f32 1e-5 (the same products,
//! summed over the output tiles in another order for `dx`, and candle's GEMM blocking); f64
//! 1e-12; bf16 2e-2 against the f32 composite on the same (bf16) values: one bf16 rounding of
//! each output after f32 sums, as `lora_linear`'s bound.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_fused::nf4::Nf4Weight;
use candle_fused::qlora::{nf4_linear, qlora_linear, qlora_linear_composite, TILE_ELEMS};
use candle_fused::{with_composite_fallback, RngKey};
use common::*;

type Drop = Option<(f32, RngKey)>;

/// `(y, [dx, da, db])` of `qlora_linear` (or its composite) for the upstream gradient `up`.
fn run(
    composite: bool,
    w: &Nf4Weight,
    bias: Option<&Tensor>,
    ins: &[Tensor],
    up: &Tensor,
    drop: Drop,
) -> Result<(Tensor, Vec<Tensor>)> {
    let f = |t: &[Tensor]| match composite {
        true => qlora_linear_composite(&t[0], w, bias, &t[1], &t[2], 1.5, drop),
        false => qlora_linear(&t[0], w, bias, &t[1], &t[2], 1.5, drop),
    };
    Ok(value_and_grads(&f, ins, up)?)
}

#[test]
fn qlora_matches_the_dense_reference() -> Result<()> {
    let mut rng = Lcg(5);
    // (leading dims, in, out, r): the last has 2 tiles of rows (1024 x 4100 > TILE_ELEMS).
    let shapes: [(&[usize], usize, usize, usize); 3] = [
        (&[3], 64, 5, 2),
        (&[2, 7], 96, 33, 4),
        (&[2], 1024, 4100, 3),
    ];
    const _: () = assert!(1024 * 4100 > TILE_ELEMS);
    for (lead, n_in, n_out, r) in shapes {
        for double in [false, true] {
            for bias in [false, true] {
                for drop in [None, Some((0.25, RngKey::new(3, 9)))] {
                    let w = rand(&[n_out, n_in], DType::F32, &mut rng, 0.1, 0.0)?;
                    let w = Nf4Weight::quantize(&w, double)?;
                    let mut xs = lead.to_vec();
                    xs.push(n_in);
                    let x = rand(&xs, DType::F32, &mut rng, 1.0, 0.0)?;
                    let a = rand(&[r, n_in], DType::F32, &mut rng, 0.2, 0.0)?;
                    let b = rand(&[n_out, r], DType::F32, &mut rng, 0.2, 0.0)?;
                    let b0 = rand(&[n_out], DType::F32, &mut rng, 1.0, 0.0)?;
                    *xs.last_mut().unwrap() = n_out;
                    let up = rand(&xs, DType::F32, &mut rng, 1.0, 0.0)?;
                    let bias = bias.then_some(&b0);
                    let ins = [x, a, b];
                    let (y, g) = run(false, &w, bias, &ins, &up, drop)?;
                    let (yc, gc) = run(true, &w, bias, &ins, &up, drop)?;
                    let what = format!("{xs:?} in {n_in} r {r} double {double} drop {drop:?}");
                    compare::assert_close(&y, &yc, 1e-5, &format!("y {what}"));
                    for (k, name) in ["dx", "da", "db"].iter().enumerate() {
                        compare::assert_close(&g[k], &gc[k], 1e-5, &format!("{name} {what}"));
                    }
                }
            }
        }
    }
    Ok(())
}

#[test]
fn base_is_frozen_and_ops_path_is_bit_equal() -> Result<()> {
    let mut rng = Lcg(8);
    let w = Nf4Weight::quantize(&rand(&[40, 64], DType::F32, &mut rng, 0.1, 0.0)?, true)?;
    let x = Var::from_tensor(&rand(&[6, 64], DType::F32, &mut rng, 1.0, 0.0)?)?;
    let bias = Var::from_tensor(&rand(&[40], DType::F32, &mut rng, 1.0, 0.0)?)?;
    let a = Var::from_tensor(&rand(&[2, 64], DType::F32, &mut rng, 0.2, 0.0)?)?;
    let b = Var::from_tensor(&rand(&[40, 2], DType::F32, &mut rng, 0.2, 0.0)?)?;
    let y = qlora_linear(&x, &w, Some(&bias), &a, &b, 2.0, None)?;
    let g = y.sum_all()?.backward()?;
    assert!(g.get(&bias).is_none(), "the bias is frozen");
    for t in [&x, &a, &b] {
        assert!(g.get(t).is_some());
    }
    // The Candle-ops dequantization (other devices) gives the same output and dx bits.
    let host = nf4_linear(&x, &w, Some(&bias))?;
    let ops = with_composite_fallback(|| nf4_linear(&x, &w, Some(&bias)))?;
    compare::assert_bits_eq(&host, &ops, "nf4_linear via Candle ops");
    let up = rand(&[6, 40], DType::F32, &mut rng, 1.0, 0.0)?;
    let dx = |ops: bool| -> Result<Tensor> {
        let f = |t: &[Tensor]| nf4_linear(&t[0], &w, None);
        let (_, g) = match ops {
            true => with_composite_fallback(|| value_and_grads(&f, &[x.as_tensor().clone()], &up))?,
            false => value_and_grads(&f, &[x.as_tensor().clone()], &up)?,
        };
        Ok(g[0].clone())
    };
    compare::assert_bits_eq(&dx(false)?, &dx(true)?, "nf4_linear dx via Candle ops");
    // An untracked input: no node, the same value.
    let plain = nf4_linear(&x.as_tensor().detach(), &w, None)?;
    assert!(!plain.track_op());
    Ok(())
}

#[test]
fn bf16_and_f64() -> Result<()> {
    let mut rng = Lcg(13);
    let w = Nf4Weight::quantize(&rand(&[48, 64], DType::F32, &mut rng, 0.1, 0.0)?, false)?;
    let (x, a, b) = (
        rand(&[5, 64], DType::F32, &mut rng, 1.0, 0.0)?,
        rand(&[3, 64], DType::F32, &mut rng, 0.2, 0.0)?,
        rand(&[48, 3], DType::F32, &mut rng, 0.2, 0.0)?,
    );
    let up = rand(&[5, 48], DType::F32, &mut rng, 1.0, 0.0)?;
    for (dt, tol) in [(DType::BF16, 2e-2), (DType::F64, 1e-12)] {
        // The reference: the composite in f32 (f64) on the values the dtype holds.
        let ins: Vec<Tensor> = [&x, &a, &b]
            .iter()
            .map(|t| t.to_dtype(dt))
            .collect::<candle_core::Result<_>>()?;
        let upd = up.to_dtype(dt)?;
        let (y, g) = run(false, &w, None, &ins, &upd, None)?;
        let wide = if dt == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let ins_w: Vec<Tensor> = ins
            .iter()
            .map(|t| t.to_dtype(wide))
            .collect::<candle_core::Result<_>>()?;
        // The dequantized weight rounded to dt, as the layer rounds it, then widened.
        let wd = w.dequantize(dt)?.to_dtype(wide)?;
        let f = |t: &[Tensor]| {
            candle_fused::lora::lora_linear_composite(
                &t[0],
                &wd.t()?,
                None,
                &t[1],
                &t[2],
                1.5,
                None,
            )
        };
        let (yc, gc) = value_and_grads(&f, &ins_w, &upd.to_dtype(wide)?)?;
        assert_eq!(y.dtype(), dt);
        compare::assert_close(&y, &yc, tol, &format!("{dt:?} y"));
        for k in 0..3 {
            compare::assert_close(&g[k], &gc[k], tol, &format!("{dt:?} grad {k}"));
        }
    }
    Ok(())
}

/// On the CPU `qlora_linear` is `lora_linear`'s op over the dequantized weight: the same bits
/// (y and every gradient) where the tiles' boundaries meet the GEMM's 512-long sums (in 512,
/// so tiles of 8192 rows; out 8704, which one GEMM sums in 512-long chunks: two tiles), f32 and
/// bf16, with bias and dropout.
#[test]
fn cpu_kernel_is_lora_over_the_dequantized_weight() -> Result<()> {
    let mut rng = Lcg(21);
    let (n_in, n_out, r) = (512, 8704, 4);
    assert_eq!(TILE_ELEMS / n_in, 8192);
    let w = Nf4Weight::quantize(&rand(&[n_out, n_in], DType::F32, &mut rng, 0.1, 0.0)?, true)?;
    for dt in [DType::F32, DType::BF16] {
        let t = |rng: &mut Lcg, d: &[usize], s: f64| -> Result<Tensor> {
            Ok(rand(d, DType::F32, rng, s, 0.0)?.to_dtype(dt)?)
        };
        let ins = [
            t(&mut rng, &[2, 3, n_in], 1.0)?,
            t(&mut rng, &[r, n_in], 0.2)?,
            t(&mut rng, &[n_out, r], 0.2)?,
        ];
        let bias = t(&mut rng, &[n_out], 1.0)?;
        let up = t(&mut rng, &[2, 3, n_out], 1.0)?;
        let drop = Some((0.25, RngKey::new(4, 2)));
        let (y, g) = run(false, &w, Some(&bias), &ins, &up, drop)?;
        let wd = w.dequantize(dt)?;
        let f = |t: &[Tensor]| {
            let wt = wd.t()?;
            candle_fused::lora::lora_linear(&t[0], &wt, Some(&bias), &t[1], &t[2], 1.5, drop)
        };
        let (yl, gl) = value_and_grads(&f, &ins, &up)?;
        compare::assert_bits_eq(&y, &yl, &format!("{dt:?} y"));
        for (k, name) in ["dx", "da", "db"].iter().enumerate() {
            compare::assert_bits_eq(&g[k], &gl[k], &format!("{dt:?} {name}"));
        }
    }
    Ok(())
}

#[test]
fn errors_name_the_problem() -> Result<()> {
    let dev = Device::Cpu;
    let w = Nf4Weight::quantize(&Tensor::ones((8, 64), DType::F32, &dev)?, false)?;
    let x = Tensor::ones((2, 32), DType::F32, &dev)?;
    let e = nf4_linear(&x, &w, None).unwrap_err().to_string();
    assert!(e.contains("in-features 64"), "{e}");
    let x = Tensor::ones((2, 64), DType::F32, &dev)?;
    let a = Tensor::ones((2, 64), DType::F32, &dev)?;
    let b = Tensor::ones((9, 2), DType::F32, &dev)?;
    let e = qlora_linear(&x, &w, None, &a, &b, 1.0, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("lora_B") && e.contains("[8, 2]"), "{e}");
    let bias = Tensor::ones(7, DType::F32, &dev)?;
    let e = nf4_linear(&x, &w, Some(&bias)).unwrap_err().to_string();
    assert!(e.contains("bias") && e.contains("[8]"), "{e}");
    Ok(())
}
