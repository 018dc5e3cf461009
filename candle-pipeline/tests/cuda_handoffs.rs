//! On a GPU only (feature `cuda`; skipped when no device is visible): several workers on ONE
//! CUDA device, each on its own thread and so its own per-thread stream. Each stage queues a long
//! chain of kernels, so an activation or gradient read by the next worker without the executor's
//! ordering would be read before its producer finished. The step must match the plain step on
//! one thread, every hand-off must be ordered, and repeated steps must agree.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, Tensor, Var};
use candle_pipeline::{Layer, LossReduction, Microbatches, Pipeline, Schedule};
use test_support::compare::grads_rel_err;
use test_support::random::{rng, uniform, var};

const DIM: usize = 512;
/// Matmuls per layer: enough GPU work that the host runs far ahead of the stream.
const REPEAT: usize = 16;

fn layers(n: usize, dev: &Device) -> (Vec<Layer>, Vec<Var>) {
    let mut r = rng(3);
    let (mut out, mut all) = (vec![], vec![]);
    for _ in 0..n {
        let w = var(&uniform(&mut r, &[DIM, DIM], -0.08, 0.08, dev));
        let b = var(&uniform(&mut r, &[DIM], -0.1, 0.1, dev));
        all.push(w.clone());
        all.push(b.clone());
        let (wt, bt) = (w.as_tensor().clone(), b.as_tensor().clone());
        out.push(Layer::new(vec![w, b], move |x| {
            let mut h = x.clone();
            for _ in 0..REPEAT {
                h = h.matmul(&wt)?.broadcast_add(&bt)?.tanh()?;
            }
            Ok(h)
        }));
    }
    (out, all)
}

fn sse(y: &Tensor, t: &Tensor) -> candle_core::Result<Tensor> {
    (y - t)?.sqr()?.sum_all()
}

#[test]
fn workers_sharing_one_gpu_match_the_plain_step() {
    // `cuda_is_available()` only says the feature is compiled in: open the device to know
    let dev = match Device::new_cuda(0) {
        Ok(dev) => dev,
        Err(e) => {
            eprintln!(
                "workers_sharing_one_gpu_match_the_plain_step: no CUDA device ({e}), skipped"
            );
            return;
        }
    };
    let mut r = rng(5);
    let x = uniform(&mut r, &[64, DIM], -1.0, 1.0, &dev);
    let t = uniform(&mut r, &[64, DIM], -1.0, 1.0, &dev);
    for workers in [2, 3] {
        let (ls, vars) = layers(workers, &dev);
        // The plain step, on this thread.
        let mut h = x.clone();
        for l in &ls {
            h = l.forward(&h).unwrap();
        }
        let l = sse(&h, &t).unwrap();
        let want_loss = l.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap();
        let want = l.backward().unwrap();
        let stages = candle_pipeline::split_by_params(ls, workers).unwrap();
        let pipe = Pipeline::new(stages, vec![dev.clone(); workers], sse).unwrap();
        let mbs = Microbatches::split(&x, &t, 8, LossReduction::Sum).unwrap();
        for s in [
            Schedule::gpipe(workers, 8).unwrap(),
            Schedule::one_f_one_b(workers, 8).unwrap(),
        ] {
            let first = pipe.step(&s, &mbs).unwrap();
            let moved = 2 * 8 * (workers - 1);
            assert_eq!(first.handoffs.ordered_sends, moved, "{}", s.name);
            assert_eq!(first.handoffs.ordered_receives, moved, "{}", s.name);
            let rel = (first.loss - want_loss).abs() / want_loss.abs().max(1e-12);
            assert!(rel < 1e-3, "{} S={workers}: loss rel err {rel}", s.name);
            let g = grads_rel_err(&vars, &first.grads, &want);
            assert!(g < 1e-3, "{} S={workers}: gradient rel err {g}", s.name);
            for _ in 0..3 {
                let again = pipe.step(&s, &mbs).unwrap();
                let rel = (again.loss - first.loss).abs() / first.loss.abs().max(1e-12);
                assert!(
                    rel < 1e-6,
                    "{} S={workers}: repeat loss rel err {rel}",
                    s.name
                );
                let g = grads_rel_err(&vars, &again.grads, &first.grads);
                assert!(
                    g < 1e-6,
                    "{} S={workers}: repeat gradient rel err {g}",
                    s.name
                );
            }
        }
    }
}
