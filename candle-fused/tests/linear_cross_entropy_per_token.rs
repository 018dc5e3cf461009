//! The per-token fused linear cross-entropy (`[N]` losses) against its unchunked composite,
//! with a non-uniform upstream gradient (one value per row, among them 0, negative and large
//! ones): the losses, `dx` (the forward's rows scaled after the fact) and `dW` (the recomputing
//! backward from the saved `lse`), with `W` tracked or frozen and `x` tracked or frozen, over
//! several chunks and ignored rows, on the CPU kernel and on the fallback path (the plain-op
//! chunk loop devices without a kernel run); thread-count determinism; ignored rows' zero
//! gradient whatever their upstream gradient.
//!
//! Tolerances (relative to max(largest magnitude of the reference, 1e-3),
//! `common::assert_close`):
//! * f64: 1e-12: the same sums in another order (as `linear_cross_entropy.rs`).
//! * f32: losses 1e-6, gradients 1e-5: that reordering in f32 and the kernel's exp (< 1 ulp),
//!   plus the one extra f32 rounding of `dx` (computed for g = 1, then times g_i).
//! * bf16: losses 1e-5 (both round each logit to bf16 after an f32 GEMM), gradients 2e-2:
//!   the mean form's 1.5e-2 (two bf16 units, see `linear_cross_entropy.rs`) plus the second
//!   rounding of `dx` to bf16 after the scaling by g_i (half a unit, 2^-9).

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_fused::linear_cross_entropy::{
    linear_cross_entropy, linear_cross_entropy_per_token, linear_cross_entropy_per_token_chunked,
    linear_cross_entropy_per_token_composite,
};
use common::*;

const N: usize = 13;
const C: usize = 24;
const V: usize = 311;
const IGNORE: u32 = 7;

/// The targets: rows 2, 5 and 6 ignored.
fn targets() -> Result<Tensor> {
    let mut rng = Lcg(11);
    let t: Vec<u32> = (0..N)
        .map(|i| match i {
            2 | 5 | 6 => IGNORE,
            _ => loop {
                let t = rng.below(V) as u32;
                if t != IGNORE {
                    break t;
                }
            },
        })
        .collect();
    Ok(Tensor::from_vec(t, N, &Device::Cpu)?)
}

/// A non-uniform upstream gradient: 0, negative, large and small values (a NaN at the ignored
/// row 5 with `nan_at_ignored`).
fn upstream(dt: DType, nan_at_ignored: bool) -> Result<Tensor> {
    let mut g = vec![
        1.0, 0.0, 3.0, -0.75, 2.5, 1.0, 0.3, -2.0, 0.0, 1.25, 7.0, -0.1, 0.6,
    ];
    if nan_at_ignored {
        g[5] = f64::NAN;
    }
    Ok(Tensor::from_vec(g, N, &Device::Cpu)?.to_dtype(dt)?)
}

/// The inputs `x [N, C]`, `w [V, C]` (logits of standard deviation about 1.5).
fn inputs(dt: DType, seed: u64) -> Result<(Tensor, Tensor)> {
    let mut rng = Lcg(seed);
    let amp = 4.0 / (C as f64).sqrt();
    Ok((
        rand(&[N, C], dt, &mut rng, 1.0, 0.0)?,
        rand(&[V, C], dt, &mut rng, amp, 0.0)?,
    ))
}

type PerToken<'a> = &'a dyn Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>;

/// The losses of `f(x, w)` and the gradients of `Σ g_i loss_i` for the inputs in `track`
/// (`[x, w]`; a frozen input is a plain tensor, with no gradient).
fn run(
    f: PerToken<'_>,
    (x, w): (&Tensor, &Tensor),
    track: [bool; 2],
    g: &Tensor,
) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
    let input = |t: &Tensor, on: bool| -> Result<Tensor> {
        Ok(match on {
            true => Var::from_tensor(t)?.as_tensor().clone(),
            false => t.clone(),
        })
    };
    let (x, w) = (input(x, track[0])?, input(w, track[1])?);
    let y = f(&x, &w)?;
    let grads = (&y * g)?.sum_all()?.backward()?;
    let (dx, dw) = (grads.get(&x).cloned(), grads.get(&w).cloned());
    if dx.is_some() != track[0] || dw.is_some() != track[1] {
        anyhow::bail!(
            "gradients {:?} for tracked {track:?}",
            [dx.is_some(), dw.is_some()]
        )
    }
    Ok((y.detach(), dx, dw))
}

/// Asserts the op's (chunks of 3: five chunks over the ten counted rows) losses and gradients
/// against the composite's for `g`, for every combination of tracked inputs, on the CPU kernel
/// or the fallback path.
fn check(dt: DType, (loss_tol, grad_tol): (f64, f64), fallback: bool) -> Result<()> {
    let (x, w) = inputs(dt, 3)?;
    let t = targets()?;
    let acc = if dt == DType::F64 { dt } else { DType::F32 };
    let g = upstream(acc, false)?;
    let fused =
        |x: &Tensor, w: &Tensor| linear_cross_entropy_per_token_chunked(x, w, &t, Some(IGNORE), 3);
    let reference =
        |x: &Tensor, w: &Tensor| linear_cross_entropy_per_token_composite(x, w, &t, Some(IGNORE));
    for track in [[true, true], [true, false], [false, true]] {
        let what = format!("{dt:?} fallback {fallback} tracked {track:?}");
        let (y, dx, dw) = fallback_if(fallback, || run(&fused, (&x, &w), track, &g))?;
        let (yr, dxr, dwr) = run(&reference, (&x, &w), track, &g)?;
        assert_close(&y, &yr, loss_tol, &format!("{what}: losses"))?;
        for (name, a, b) in [("dx", dx, dxr), ("dW", dw, dwr)] {
            if let (Some(a), Some(b)) = (a, b) {
                assert_eq!(a.dtype(), dt, "{what}: {name} dtype");
                assert_close(&a, &b, grad_tol, &format!("{what}: {name}"))?;
            }
        }
    }
    Ok(())
}

#[test]
fn a_per_row_upstream_gradient_gives_the_composites_gradients() -> Result<()> {
    for fallback in [false, true] {
        check(DType::F64, (1e-12, 1e-12), fallback)?;
        check(DType::F32, (1e-6, 1e-5), fallback)?;
        check(DType::BF16, (1e-5, 2e-2), fallback)?;
    }
    Ok(())
}

#[test]
fn losses_are_zero_at_ignored_rows_and_average_to_the_mean_form() -> Result<()> {
    let (x, w) = inputs(DType::F64, 5)?;
    let t = targets()?;
    let y = linear_cross_entropy_per_token(&x, &w, &t, Some(IGNORE))?;
    assert_eq!(y.dims(), &[N]);
    let v = y.to_vec1::<f64>()?;
    for i in [2, 5, 6] {
        assert_eq!(v[i], 0.0, "ignored row {i}");
    }
    assert!(v
        .iter()
        .enumerate()
        .all(|(i, &l)| [2, 5, 6].contains(&i) || l > 0.0));
    let mean = linear_cross_entropy(&x, &w, &t, Some(IGNORE))?.to_scalar::<f64>()?;
    let ours = v.iter().sum::<f64>() / (N - 3) as f64;
    assert!((ours - mean).abs() < 1e-12 * mean, "{ours} vs {mean}");
    // the leading dims are the targets'
    let y2 = linear_cross_entropy_per_token(&x.reshape((1, N, C))?, &w, &t.reshape((1, N))?, None)?;
    assert_eq!(y2.dims(), &[1, N]);
    Ok(())
}

#[test]
fn ignored_rows_get_zero_gradient_whatever_their_upstream_gradient() -> Result<()> {
    let (x, w) = inputs(DType::F32, 7)?;
    let t = targets()?;
    let g = upstream(DType::F32, true)?;
    for fallback in [false, true] {
        let f = |x: &Tensor, w: &Tensor| {
            linear_cross_entropy_per_token_chunked(x, w, &t, Some(IGNORE), 4)
        };
        let (_, dx, dw) = fallback_if(fallback, || run(&f, (&x, &w), [true, true], &g))?;
        let (dx, dw) = (dx.unwrap(), dw.unwrap());
        assert_eq!(nan_count(&dx) + nan_count(&dw), 0, "fallback {fallback}");
        let dx = dx.to_vec2::<f32>()?;
        for i in [2, 5, 6] {
            assert!(
                dx[i].iter().all(|&e| e == 0.0),
                "row {i}, fallback {fallback}"
            );
        }
        // and a row whose g is 0 (row 1) too
        assert!(dx[1].iter().all(|&e| e == 0.0));
    }
    Ok(())
}

#[test]
fn the_results_are_the_same_bits_on_any_thread_count() -> Result<()> {
    // big enough for the kernel to split rows and blocks over threads
    let (n, c, v) = (64, 48, 5000);
    let mut rng = Lcg(9);
    let x = rand(&[n, c], DType::F32, &mut rng, 1.0, 0.0)?;
    let w = rand(&[v, c], DType::F32, &mut rng, 0.5, 0.0)?;
    let t: Vec<u32> = (0..n).map(|i| (i * 37 % v) as u32).collect();
    let t = Tensor::from_vec(t, n, &Device::Cpu)?;
    let probe = rand(&[n], DType::F32, &mut rng, 2.0, 0.0)?;
    let f = |ins: &[Tensor]| linear_cross_entropy_per_token_chunked(&ins[0], &ins[1], &t, None, 20);
    assert_same_bits_on_thread_counts(&f, &[x, w], &probe, "per-token")
}

#[test]
fn a_second_backward_recomputes_the_same_gradients() -> Result<()> {
    let (x, w) = inputs(DType::F64, 13)?;
    let t = targets()?;
    let (x, w) = (Var::from_tensor(&x)?, Var::from_tensor(&w)?);
    let y = linear_cross_entropy_per_token_chunked(&x, &w, &t, Some(IGNORE), 3)?;
    let loss = (&y * upstream(DType::F64, false)?)?.sum_all()?;
    let (a, b) = (loss.backward()?, loss.backward()?);
    for v in [&x, &w] {
        assert_close(
            a.get(v).unwrap(),
            b.get(v).unwrap(),
            1e-14,
            "second backward",
        )?;
    }
    Ok(())
}
