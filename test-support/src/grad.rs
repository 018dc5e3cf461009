//! Gradients through Candle's backward, and central finite differences to check them.

use candle_core::{Device, Result, Tensor, Var};

use crate::compare::values;

/// A function of several tensors, as the checks here take it.
pub type TensorFn<'a> = &'a dyn Fn(&[Tensor]) -> Result<Tensor>;

/// `y = f(inputs)` (detached) and the gradients of `sum(y * probe)` with respect to every
/// input (each input is differentiated as a fresh [`Var`]).
pub fn value_and_grads(
    f: TensorFn<'_>,
    inputs: &[Tensor],
    probe: &Tensor,
) -> Result<(Tensor, Vec<Tensor>)> {
    let vars: Vec<Var> = inputs.iter().map(Var::from_tensor).collect::<Result<_>>()?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&ts)?;
    let loss = (y.to_dtype(probe.dtype())? * probe)?.sum_all()?;
    let g = loss.backward()?;
    let grads = ts
        .iter()
        .enumerate()
        .map(|(k, t)| {
            g.get(t)
                .cloned()
                .ok_or_else(|| candle_core::Error::Msg(format!("input {k}: no gradient")))
        })
        .collect::<Result<_>>()?;
    Ok((y.detach(), grads))
}

/// Central differences (step `h`) of `sum(f(inputs) * probe)` for every element of every input,
/// against the backward ([`value_and_grads`]): asserts `|fd - grad| <= tol * scale`, `scale`
/// being `max(1, max |grad|)` over that input, and names the input and element that fail.
///
/// Run it in f64 (inputs and probe on the CPU): with `h = 1e-5` the truncation error is about
/// `1e-10` and the rounding error about `1e-11`.
pub fn check_fd(
    f: TensorFn<'_>,
    inputs: &[Tensor],
    probe: &Tensor,
    h: f64,
    tol: f64,
) -> Result<()> {
    let (_, grads) = value_and_grads(f, inputs, probe)?;
    for (k, (inp, g)) in inputs.iter().zip(&grads).enumerate() {
        let base = values(inp);
        let g = values(g);
        let scale = g.iter().fold(1f64, |m, v| m.max(v.abs()));
        for e in 0..base.len() {
            let eval = |d: f64| -> Result<f64> {
                let mut v = base.clone();
                v[e] += d;
                let mut ins = inputs.to_vec();
                ins[k] = Tensor::from_vec(v, inp.dims(), &Device::Cpu)?.to_dtype(inp.dtype())?;
                (f(&ins)? * probe)?.sum_all()?.to_scalar::<f64>()
            };
            let fd = (eval(h)? - eval(-h)?) / (2.0 * h);
            assert!(
                (fd - g[e]).abs() <= tol * scale,
                "input {k} element {e}: finite difference {fd:e} vs gradient {:e} (tolerance \
                 {tol:e} x {scale:e})",
                g[e]
            );
        }
    }
    Ok(())
}
