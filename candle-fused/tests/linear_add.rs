//! `linear_add` (`r + x W (+ b)`): bit-identical values and gradients to the two ops it
//! replaces (`linear` then Candle's add) on f32, f64, bf16 and f16, with and without a bias,
//! a transposed weight, leading dims, on 1-3 threads and on the fallback path; one graph node
//! where there is no bias; against the composite (`matmul`, `broadcast_add`, add) within
//! `linear`'s tolerances (f64 1e-12, f32 1e-5: GEMM order; bf16 / f16 2e-2 / 4e-3 against the
//! f32 composite rounded to the dtype); a residual of the wrong shape or dtype named in the
//! error.

mod common;

use anyhow::Result;
use candle_core::{DType, Tensor, Var};
use candle_fused::linear::linear;
use candle_fused::linear_add::{linear_add, linear_add_composite};
use common::*;

/// `(x, w, r, b?)` of `dt`: `x [lead.., n_in]`, `w [n_in, n_out]` (stored `[n_out, n_in]` and
/// read transposed when `w_t`), `r [lead.., n_out]`.
fn inputs(
    dt: DType,
    (lead, n_in, n_out): (&[usize], usize, usize),
    bias: bool,
    rng: &mut Lcg,
) -> Result<Vec<Tensor>> {
    let dims = |last| [lead, &[last]].concat();
    let mut v = vec![
        rand(&dims(n_in), dt, rng, 1.0, 0.0)?,
        rand(&[n_in, n_out], dt, rng, 1.0, 0.0)?,
        rand(&dims(n_out), dt, rng, 1.0, 0.0)?,
    ];
    if bias {
        v.push(rand(&[n_out], dt, rng, 1.0, 0.0)?);
    }
    Ok(v)
}

/// The weight as the ops read it: `[in, out]`, a transposed view of a `[out, in]` copy when
/// `w_t` (a strided operand, as a candle-nn weight is read).
fn weight(w: &Tensor, w_t: bool) -> candle_core::Result<Tensor> {
    match w_t {
        true => w.t()?.contiguous()?.t(),
        false => Ok(w.clone()),
    }
}

fn fused(i: &[Tensor], w_t: bool) -> candle_core::Result<Tensor> {
    linear_add(&i[0], &weight(&i[1], w_t)?, i.get(3), &i[2])
}

fn two_ops(i: &[Tensor], w_t: bool) -> candle_core::Result<Tensor> {
    &i[2] + linear(&i[0], &weight(&i[1], w_t)?, i.get(3))?
}

/// The output's dims for a shape `(lead, n_in, n_out)`.
fn out_dims((lead, _, n_out): Shape) -> Vec<usize> {
    [lead, &[n_out]].concat()
}

type Shape = (&'static [usize], usize, usize);

const SHAPES: [Shape; 4] = [
    (&[1], 1, 1),
    (&[3, 5], 7, 33),
    (&[2, 65], 64, 130),
    (&[127], 33, 1),
];

/// A value and its inputs' gradients ([`value_and_grads`]).
type Run = (Tensor, Vec<Tensor>);

/// Every tensor of run `a` against run `b` by `check` (same bits, or close), named `what`.
fn check_runs(
    a: &Run,
    b: &Run,
    what: &str,
    check: impl Fn(&Tensor, &Tensor, &str) -> Result<()>,
) -> Result<()> {
    let (ta, tb) = (
        std::iter::once(&a.0).chain(&a.1),
        std::iter::once(&b.0).chain(&b.1),
    );
    for (k, (x, y)) in ta.zip(tb).enumerate() {
        check(x, y, &format!("{what}: y and grads, #{k}"))?;
    }
    Ok(())
}

#[test]
fn same_bits_as_linear_then_add() -> Result<()> {
    let mut rng = Lcg(5);
    for dt in [DType::F32, DType::BF16, DType::F64, DType::F16] {
        for shape in SHAPES {
            for (w_t, bias) in [(false, false), (true, false), (true, true)] {
                let ins = inputs(dt, shape, bias, &mut rng)?;
                let what = format!("{dt:?} {shape:?} w_t={w_t} bias={bias}");
                let probe = rand(&out_dims(shape), DType::F64, &mut rng, 1.0, 0.0)?;
                let f = move |i: &[Tensor]| fused(i, w_t);
                let g = move |i: &[Tensor]| two_ops(i, w_t);
                let run = |op: &dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>| {
                    value_and_grads(op, &ins, &probe)
                };
                check_runs(&run(&f)?, &run(&g)?, &what, same_bits)?;
                // the fallback path: the two ops, whose own bits `linear`'s tests check
                let (fb, gb) = with_fallback(|| (run(&f), run(&g)));
                check_runs(&fb?, &gb?, &format!("{what}, fallback"), same_bits)?;
            }
        }
    }
    Ok(())
}

#[test]
fn same_bits_on_every_thread_count() -> Result<()> {
    let mut rng = Lcg(6);
    for dt in [DType::F32, DType::BF16] {
        // above the GEMM's parallel threshold
        let ins = inputs(dt, (&[3, 100], 257, 129), false, &mut rng)?;
        let probe = rand(&[3, 100, 129], DType::F64, &mut rng, 1.0, 0.0)?;
        let f = |i: &[Tensor]| fused(i, true);
        assert_same_bits_on_thread_counts(&f, &ins, &probe, &format!("{dt:?}"))?;
    }
    Ok(())
}

/// Without a bias the projection and the add are one graph node (two with a bias: the op
/// would need four inputs).
#[test]
fn one_graph_node_without_bias() -> Result<()> {
    let mut rng = Lcg(7);
    for (bias, want) in [(false, 1), (true, 2)] {
        let ins = inputs(DType::F32, (&[2, 3], 4, 5), bias, &mut rng)?;
        let vars: Vec<Var> = ins.iter().map(Var::from_tensor).collect::<Result<_, _>>()?;
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let y = fused(&ts, false)?;
        let ops = y.sorted_nodes().iter().filter(|t| !t.is_variable()).count();
        assert_eq!(ops, want, "bias={bias}: {ops} nodes");
    }
    Ok(())
}

fn compare(dt: DType, tol: f64, rng: &mut Lcg) -> Result<()> {
    let half = matches!(dt, DType::BF16 | DType::F16);
    for shape in SHAPES {
        for bias in [false, true] {
            let ins = inputs(dt, shape, bias, rng)?;
            let probe = rand(&out_dims(shape), DType::F64, rng, 1.0, 0.0)?;
            let composite = |i: &[Tensor]| linear_add_composite(&i[0], &i[1], i.get(3), &i[2]);
            let (y, g) = value_and_grads(&|i: &[Tensor]| fused(i, false), &ins, &probe)?;
            let (yc, gc) = if half {
                // the reference in f32, rounded to the dtype at the end
                let ins32 = ins.iter().map(|t| t.to_dtype(DType::F32));
                let ins32: Vec<Tensor> = ins32.collect::<Result<_, _>>()?;
                let (y, g) = value_and_grads(&composite, &ins32, &probe)?;
                (y.to_dtype(dt)?, g)
            } else {
                value_and_grads(&composite, &ins, &probe)?
            };
            let what = format!("{dt:?} {shape:?} bias={bias}");
            check_runs(&(y, g), &(yc, gc), &what, |a, b, w| {
                assert_close(a, b, tol, w)
            })?;
        }
    }
    Ok(())
}

common::composite_precision_tests!(compare);

#[test]
fn a_bad_residual_is_named() -> Result<()> {
    let mut rng = Lcg(9);
    let ins = inputs(DType::F32, (&[2], 3, 4), false, &mut rng)?;
    let short = rand(&[2, 3], DType::F32, &mut rng, 1.0, 0.0)?;
    let err = linear_add(&ins[0], &ins[1], None, &short).unwrap_err();
    assert!(err.to_string().contains("residual [2, 3]"), "{err}");
    let bf = ins[2].to_dtype(DType::BF16)?;
    let err = linear_add(&ins[0], &ins[1], None, &bf).unwrap_err();
    assert!(err.to_string().contains("residual has dtype BF16"), "{err}");
    Ok(())
}
