//! Exactness of checkpointed gradients against plain `loss.backward()`.
//!
//! Tolerance: none. Every gradient is compared bit for bit (f32 and f64 on CPU), because the
//! recompute runs the same ops on the same values and the tape continues Candle's own gradient
//! accumulation order (see `candle_remat::tape`). The one documented exception has its own test.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use candle_remat::{ChainCosts, Policy, RematError, Tape};
use common::*;
use test_support::compare::{assert_bits_eq, rel_err, values};
use test_support::random::{normal, rng};

fn compare_stores(
    vars: &[&Var],
    plain: &candle_core::backprop::GradStore,
    ours: &candle_core::backprop::GradStore,
    what: &str,
) {
    for (i, v) in vars.iter().enumerate() {
        match (plain.get(v), ours.get(v)) {
            (Some(a), Some(b)) => assert_bits_eq(b, a, &format!("{what}: var {i}")),
            (None, None) => {}
            (a, b) => panic!(
                "{what}: var {i}: plain has grad {} / tape has grad {}",
                a.is_some(),
                b.is_some()
            ),
        }
    }
    // No extra entries (boundary leaves are removed; junk zero grads of constants mirror plain).
    assert!(
        ours.get_ids().count() <= plain.get_ids().count(),
        "{what}: tape store has {} entries, plain {}",
        ours.get_ids().count(),
        plain.get_ids().count()
    );
}

fn policies(n: usize, costs: &ChainCosts) -> Vec<Policy> {
    let mid = {
        let lo = candle_remat::policy::min_peak_bytes(costs);
        let hi = Policy::None.plan(costs).unwrap().predicted_peak_bytes;
        lo + (hi - lo) / 3
    };
    let mut p = vec![Policy::None, Policy::SqrtN, Policy::Budget(mid)];
    for k in 1..=n.min(3) {
        p.push(Policy::EveryK(k));
    }
    p
}

fn run_gpt(cfg: Cfg, dtype: DType, b: usize, t: usize, seed: u64) {
    let dev = Device::Cpu;
    let gpt = Gpt::new(seed, cfg, dtype, &dev).unwrap();
    let (idx, tgt) = tokens(seed + 1, b, t, cfg.vocab, &dev).unwrap();
    let vars = gpt.vars();
    let costs = uniform_costs(cfg.n_layer, 1000, 100, 10);
    // Plain reference: the same model (same dropout masks, keyed by the tape seed and block
    // index) without any checkpoint, differentiated by Candle's own backward.
    let tape = Tape::new(99);
    let loss_plain = gpt
        .loss(&tape, &Policy::None.plan(&costs).unwrap(), &idx, &tgt)
        .unwrap();
    let plain = loss_plain.backward().unwrap();
    for policy in policies(cfg.n_layer, &costs) {
        let plan = policy.plan(&costs).unwrap();
        let tape = Tape::new(99).with_verify(true);
        let loss = gpt.loss(&tape, &plan, &idx, &tgt).unwrap();
        assert_bits_eq(&loss, &loss_plain, "loss");
        let grads = tape.backward(&loss).unwrap();
        compare_stores(&vars, &plain, &grads, &format!("{policy:?} {cfg:?}"));
    }
}

#[test]
fn gpt_every_policy_bit_identical_with_dropout_f32() {
    run_gpt(Cfg::tiny(16, 2, 4, 8), DType::F32, 2, 8, 1);
    run_gpt(Cfg::tiny(12, 3, 5, 6), DType::F32, 3, 5, 2);
    run_gpt(Cfg::tiny(8, 1, 3, 7), DType::F32, 1, 7, 3);
}

#[test]
fn gpt_every_policy_bit_identical_with_dropout_f64() {
    run_gpt(Cfg::tiny(16, 4, 4, 8), DType::F64, 2, 6, 4);
}

#[test]
fn gpt_with_fused_ops_bit_identical_under_checkpointing() {
    // candle-fused's attention and LayerNorm recompute bit-identically, so checkpointing a
    // chain built from them gives exactly plain `loss.backward()`'s gradients.
    let mut cfg = Cfg::tiny(16, 2, 4, 8);
    cfg.fused_attention = true;
    cfg.fused_ln = true;
    run_gpt(cfg, DType::F32, 2, 8, 5);
}

#[test]
fn nested_checkpoints_bit_identical() {
    let dev = Device::Cpu;
    for (seed, (c, h, n, t)) in [(16, 2, 4, 8), (8, 2, 6, 5)].into_iter().enumerate() {
        let cfg = Cfg::tiny(c, h, n, t);
        let gpt = Gpt::new(seed as u64, cfg, DType::F32, &dev).unwrap();
        let (idx, tgt) = tokens(7, 2, t, cfg.vocab, &dev).unwrap();
        let tape = Tape::new(5);
        let mut x = gpt.embed(&tape, &idx).unwrap();
        for i in 0..n {
            let blk = &gpt.blocks[i];
            x = tape
                .scope(i as u64, || {
                    let x = (&x + blk.attn(&x)?)?;
                    // same seed scope as the nested checkpoint below, run inline
                    let m = tape.checkpoint_if(false, &[&x], move |xs| {
                        Ok(vec![(&xs[0] + blk.mlp(&xs[0])?)?])
                    })?;
                    Ok(m[0].clone())
                })
                .unwrap();
        }
        let plain = gpt.head_loss(&x, &tgt).unwrap().backward().unwrap();

        // Outer checkpoints over pairs of blocks; inside, every block is checkpointed again,
        // and inside each block the MLP is checkpointed a third time.
        let tape = Tape::new(5).with_verify(true);
        let gpt_ref = &gpt;
        let mut x = gpt.embed(&tape, &idx).unwrap();
        for pair in (0..n).step_by(2) {
            let end = (pair + 2).min(n);
            x = tape
                .checkpoint_nested(&[&x], move |t, xs| {
                    let mut h = xs[0].clone();
                    for i in pair..end {
                        let blk = &gpt_ref.blocks[i];
                        h = t
                            .checkpoint_nested(&[&h], move |t2, ys| {
                                t2.scope(i as u64, || {
                                    let x = (&ys[0] + blk.attn(&ys[0])?)?;
                                    let m = t2.checkpoint1(&x, move |x| x + blk.mlp(x)?)?;
                                    Ok(vec![m])
                                })
                                .map_err(Into::into)
                            })?
                            .remove(0);
                    }
                    Ok(vec![h])
                })
                .unwrap()
                .remove(0);
        }
        let loss = gpt.head_loss(&x, &tgt).unwrap();
        let grads = tape.backward(&loss).unwrap();
        compare_stores(&gpt.vars(), &plain, &grads, "nested");
    }
}

/// f(x, y, mask, ids) -> (a, b, ids_out): several inputs (one float without grad, one int),
/// several outputs (one integer), `a` consumed twice downstream.
#[test]
fn multi_input_multi_output_and_reused_output() {
    let dev = Device::Cpu;
    for (seed, (r, c)) in [(3usize, 4usize), (5, 7), (1, 9)].into_iter().enumerate() {
        let mut rng = rng(seed as u64);
        let w1 = param(&mut rng, &[c, c], 0.5, DType::F32, &dev);
        let w2 = param(&mut rng, &[c, c], 0.5, DType::F32, &dev);
        let x0 = param(&mut rng, &[r, c], 1.0, DType::F32, &dev);
        let y0 = param(&mut rng, &[r, c], 1.0, DType::F32, &dev);
        let mask = normal(&mut rng, &[r, c], 1.0, DType::F32, &dev)
            .ge(0.0)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let ids = Tensor::from_vec((0..r as u32).rev().collect::<Vec<_>>(), r, &dev).unwrap();
        let seg = |xs: &[Tensor]| -> candle_core::Result<Vec<Tensor>> {
            let h = xs[0].matmul(w1.as_tensor())?.tanh()?;
            let h = (h * &xs[2])?; // mask: no grad
            let a = (h.matmul(w2.as_tensor())? + &xs[1])?;
            let b = (xs[1].matmul(w1.as_tensor())? * h)?.index_select(&xs[3], 0)?;
            Ok(vec![a, b, xs[3].clone()])
        };
        // glue before: inputs carry graph
        let x = x0.as_tensor().exp().unwrap();
        let y = (y0.as_tensor() * 2.0).unwrap();
        let after = |o: &[Tensor]| -> Tensor {
            let a = &o[0];
            let u = (a.sqr().unwrap() + a.sin().unwrap()).unwrap(); // a used twice
            let v = o[1].index_select(&o[2], 0).unwrap();
            (u.sum_all().unwrap() + (v * a).unwrap().mean_all().unwrap()).unwrap()
        };
        let plain = after(&seg(&[x.clone(), y.clone(), mask.clone(), ids.clone()]).unwrap())
            .backward()
            .unwrap();
        let tape = Tape::new(0).with_verify(true);
        let outs = tape.checkpoint(&[&x, &y, &mask, &ids], seg).unwrap();
        assert_eq!(outs[2].dtype(), DType::U32);
        let grads = tape.backward(&after(&outs)).unwrap();
        compare_stores(&[&w1, &w2, &x0, &y0], &plain, &grads, "multi-io");
    }
}

/// Glue ops between segments, and a tied weight used in glue before, inside and after the
/// segments (three or more contributions to it, spread over several passes).
#[test]
fn glue_residuals_and_shared_weights_bit_identical() {
    let dev = Device::Cpu;
    for (seed, (r, c, n)) in [(4usize, 6usize, 3usize), (2, 5, 5), (6, 3, 4)]
        .into_iter()
        .enumerate()
    {
        let mut rng = rng(10 + seed as u64);
        let shared = param(&mut rng, &[c, c], 0.4, DType::F32, &dev);
        let ws: Vec<Var> = (0..n)
            .map(|_| param(&mut rng, &[c, c], 0.4, DType::F32, &dev))
            .collect();
        let x0 = param(&mut rng, &[r, c], 1.0, DType::F32, &dev);
        // residual inside the block; `shared` is used twice per block, in the glue before the
        // first block and in the head: contributions to it come from every pass.
        let block = |i: usize, h: &Tensor| -> candle_core::Result<Tensor> {
            let a = h.matmul(ws[i].as_tensor())?.tanh()?;
            let b = h.matmul(shared.as_tensor())?.sin()?;
            h + ((a * b)? + h.matmul(shared.as_tensor())?)?
        };
        let head = |h: &Tensor| {
            h.matmul(shared.as_tensor())
                .unwrap()
                .sqr()
                .unwrap()
                .mean_all()
                .unwrap()
        };
        let mut h = x0.as_tensor().matmul(shared.as_tensor()).unwrap();
        for i in 0..n {
            h = block(i, &h).unwrap().affine(0.9, 0.1).unwrap(); // glue between blocks
        }
        let plain = head(&h).backward().unwrap();

        let tape = Tape::new(1);
        let mut h = x0.as_tensor().matmul(shared.as_tensor()).unwrap();
        for i in 0..n {
            let o = tape.checkpoint1(&h, move |x| block(i, x)).unwrap();
            h = o.affine(0.9, 0.1).unwrap(); // non-leaf glue, consumed only by the next segment
        }
        let grads = tape.backward(&head(&h)).unwrap();
        let mut vars: Vec<&Var> = ws.iter().collect();
        vars.push(&shared);
        vars.push(&x0);
        compare_stores(&vars, &plain, &grads, "glue/shared");
    }
}

/// The documented exception: a *non-leaf* glue tensor that is both a segment input and used
/// outside it (a residual add outside the checkpoint). Its contributions are propagated
/// separately through the op that made it, so the result may differ by float reassociation;
/// it must still agree to 1e-6 relative (f32 rounding of a handful of additions).
#[test]
fn non_leaf_glue_input_shared_outside_is_close() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let mut rng = rng(3);
    let w = param(&mut rng, &[8, 8], 0.4, DType::F32, &dev);
    let x0 = param(&mut rng, &[5, 8], 1.0, DType::F32, &dev);
    let f = |x: &Tensor| x.matmul(w.as_tensor())?.tanh();
    let x = x0.as_tensor().sin()?.exp()?;
    let plain = (f(&x)? + &x)?.sqr()?.sum_all()?.backward()?;
    let tape = Tape::new(0);
    let x = x0.as_tensor().sin()?.exp()?;
    let y = tape.checkpoint1(&x, f)?;
    let grads = tape.backward(&(y + &x)?.sqr()?.sum_all()?)?;
    for v in [&w, &x0] {
        let e = rel_err(
            grads.get(v).expect("gradient"),
            plain.get(v).expect("gradient"),
        );
        assert!(e < 1e-6, "relative error {e}");
    }
    // The same with a chain of residual adds outside the checkpoints.
    let ws: Vec<Var> = (0..4)
        .map(|_| param(&mut rng, &[8, 8], 0.4, DType::F32, &dev))
        .collect();
    let blk = |i: usize, h: &Tensor| h.matmul(ws[i].as_tensor())?.tanh();
    let mut h = x0.as_tensor().exp()?;
    for i in 0..4 {
        h = (&h + blk(i, &h)?)?;
    }
    let plain = h.sqr()?.mean_all()?.backward()?;
    let tape = Tape::new(0);
    let mut h = x0.as_tensor().exp()?;
    for i in 0..4 {
        h = (&h + tape.checkpoint1(&h, move |x| blk(i, x))?)?;
    }
    let grads = tape.backward(&h.sqr()?.mean_all()?)?;
    for v in ws.iter().chain([&x0]) {
        let e = rel_err(
            grads.get(v).expect("gradient"),
            plain.get(v).expect("gradient"),
        );
        assert!(e < 1e-6, "relative error {e}");
    }
    // Tape::boundary makes the same program bit-identical.
    let tape = Tape::new(0);
    let mut h = x0.as_tensor().exp()?;
    for i in 0..4 {
        h = tape.boundary(&h)?;
        h = (&h + tape.checkpoint1(&h, move |x| blk(i, x))?)?;
    }
    let grads = tape.backward(&h.sqr()?.mean_all()?)?;
    let vars: Vec<&Var> = ws.iter().chain([&x0]).collect();
    compare_stores(&vars, &plain, &grads, "outside residuals with boundary()");
    Ok(())
}

#[test]
fn offloaded_boundaries_bit_identical() {
    let dev = Device::Cpu;
    let cfg = Cfg::tiny(16, 2, 4, 8);
    let gpt = Gpt::new(8, cfg, DType::F32, &dev).unwrap();
    let (idx, tgt) = tokens(9, 2, 8, cfg.vocab, &dev).unwrap();
    let costs = uniform_costs(4, 10, 1, 1);
    let tape = Tape::new(3);
    let plain = gpt
        .loss(&tape, &Policy::None.plan(&costs).unwrap(), &idx, &tgt)
        .unwrap()
        .backward()
        .unwrap();
    for verify in [false, true] {
        let tape = Tape::new(3).with_offload(Device::Cpu).with_verify(verify);
        let loss = gpt
            .loss(&tape, &Policy::EveryK(1).plan(&costs).unwrap(), &idx, &tgt)
            .unwrap();
        let grads = tape.backward(&loss).unwrap();
        compare_stores(&gpt.vars(), &plain, &grads, "offload");
    }
}

#[test]
fn dropout_needs_a_scope_and_is_seeded() {
    let x = Tensor::ones((16, 16), DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(
        candle_remat::dropout(&x, 0.5),
        Err(RematError::NoSeedContext)
    ));
    let a = Tape::new(1)
        .scope(0, || candle_remat::dropout(&x, 0.5))
        .unwrap();
    let b = Tape::new(1)
        .scope(0, || candle_remat::dropout(&x, 0.5))
        .unwrap();
    let c = Tape::new(2)
        .scope(0, || candle_remat::dropout(&x, 0.5))
        .unwrap();
    assert_bits_eq(&a, &b, "same seed");
    let (va, vc) = (values(&a), values(&c));
    assert!(va != vc, "different seeds gave the same mask");
    let kept = va.iter().filter(|&&v| v != 0.0).count() as f64 / va.len() as f64;
    assert!((kept - 0.5).abs() < 0.1, "keep rate {kept}");
}

#[test]
fn segment_without_grad_is_skipped_and_store_has_no_leaves() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let w = Var::new(&[[1f32, 2.], [3., 4.]], &dev)?;
    let x = Tensor::new(&[[1f32, -1.]], &dev)?;
    let tape = Tape::new(0);
    let unused = tape.checkpoint1(&x, |x| x.matmul(w.as_tensor()))?;
    let used = tape.checkpoint1(&x, |x| x.matmul(w.as_tensor())?.sqr())?;
    assert_eq!(tape.num_segments(), 2);
    let grads = tape.backward(&used.sum_all()?)?;
    assert!(grads.get(&unused).is_none() && grads.get(&used).is_none());
    let plain = x.matmul(w.as_tensor())?.sqr()?.sum_all()?.backward()?;
    assert_bits_eq(
        grads.get(&w).expect("gradient"),
        plain.get(&w).expect("gradient"),
        "w",
    );
    assert_eq!(tape.num_segments(), 0);
    Ok(())
}

/// Outputs of different dtypes (f32 and f64) from one segment.
#[test]
fn mixed_dtype_outputs_bit_identical() {
    let dev = Device::Cpu;
    let mut rng = rng(21);
    let w = param(&mut rng, &[5, 5], 0.5, DType::F32, &dev);
    let x = normal(&mut rng, &[3, 5], 1.0, DType::F32, &dev);
    let seg = |xs: &[Tensor]| -> candle_core::Result<Vec<Tensor>> {
        let a = xs[0].matmul(w.as_tensor())?.tanh()?;
        let b = (a.to_dtype(DType::F64)?.sqr()? * 3.0)?;
        Ok(vec![a, b])
    };
    let after = |o: &[Tensor]| -> Tensor {
        let s = o[1]
            .sin()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        (o[0].exp().unwrap().sum_all().unwrap() + s).unwrap()
    };
    let plain = after(&seg(std::slice::from_ref(&x)).unwrap())
        .backward()
        .unwrap();
    let tape = Tape::new(0).with_verify(true);
    let outs = tape.checkpoint(&[&x], seg).unwrap();
    assert_eq!(outs[1].dtype(), DType::F64);
    let grads = tape.backward(&after(&outs)).unwrap();
    compare_stores(&[&w], &plain, &grads, "mixed dtypes");
}
