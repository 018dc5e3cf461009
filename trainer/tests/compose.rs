//! The trainer composes candle-remat and candle-amp by flags: checkpointing changes nothing
//! in the numbers, mixed precision trains and resumes exactly.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{
    assert_same_losses, assert_same_steps, finish, run_to_end, tiny_config, tiny_run, weights, Run,
};
use trainer::config::TrainConfig;
use trainer::data::Batch;
use trainer::metrics::StepStats;
use trainer::model::Ctx;
use trainer::train::PipelineRun;
use trainer::train::Trainer;

fn run(cfg: TrainConfig) -> Run {
    finish(Trainer::new(cfg).unwrap())
}

#[test]
fn remat_policies_give_bit_identical_training() {
    let tmp = tempfile::tempdir().unwrap();
    let base = |name: &str, remat: &str| TrainConfig {
        n_layer: 4,
        dropout: 0.1,
        grad_accum: 2,
        max_iters: 3,
        remat: remat.parse().unwrap(),
        ..tiny_config(&tmp.path().join(name))
    };
    let (plain_steps, plain_w) = run(base("plain", "none"));
    for remat in ["all", "every:2", "sqrt", "budget:400KiB"] {
        let (steps, w) = run(base(remat, remat));
        assert_same_steps(&plain_steps, &steps, remat);
        assert_eq!(plain_w, w, "{remat}: weights differ");
    }
    let e = Trainer::new(base("bad", "budget:1")).err().unwrap();
    assert!(e.to_string().contains("budget"), "{e}");
}

#[test]
fn mixed_precision_trains_and_resumes_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    for dtype in ["f16", "bf16"] {
        let cfg = |name: &str, max_iters| TrainConfig {
            dtype: dtype.parse().unwrap(),
            max_iters,
            ..tiny_config(&tmp.path().join(format!("{dtype}-{name}")))
        };
        let (full, full_w) = run(cfg("full", 8));
        assert!(full.iter().all(|s| s.loss.is_finite()));
        assert!(full.iter().all(|s| s.loss_scale.is_some()));
        // f16: the dynamic scaler's 2^16; bf16 ("auto"): no scaling. That overflow really
        // skips a step and backs off is f16_overflow_skips_the_step_and_backs_off's business.
        let want_scale = if dtype == "f16" { 65536.0 } else { 1.0 };
        assert_eq!(full[0].loss_scale, Some(want_scale), "{dtype}");
        let split = tmp.path().join(format!("{dtype}-split"));
        run(TrainConfig {
            out_dir: split.clone(),
            ..cfg("split", 4)
        });
        assert!(split
            .join("checkpoints/step-0000004/amp.safetensors")
            .is_file());
        let mut t = Trainer::resume(&split, |c| c.max_iters = 8).unwrap();
        assert_same_losses(&full[4..], &run_to_end(&mut t), dtype);
        assert_eq!(full_w, weights(&t), "{dtype}: weights after resume");
    }
}

#[test]
fn f16_overflow_skips_the_step_and_backs_off() {
    // At the default 2^16 this model's f16 gradients fit; at 2^20 they overflow (wte's
    // gradient sums (p - y) * scale / 64 over the tokens, far past f16's 65504), and a few
    // skipped steps halve the scale until they fit (measured: 3 skips, then 2^17 fits). The
    // config cannot set the initial scale: the scaler state goes into a step-0 checkpoint, and
    // the run resumes from it.
    let (_tmp, dir) = common::temp_join("f16-overflow");
    let mut t = Trainer::new(TrainConfig {
        dtype: "f16".parse().unwrap(),
        loss_scale: "dynamic".parse().unwrap(),
        ..tiny_config(&dir)
    })
    .unwrap();
    let start = t.save_checkpoint().unwrap();
    drop(t);
    let huge = 1048576.0;
    candle_amp::ScalerState::initial(huge, 1)
        .save(start.join(trainer::train::AMP_FILE))
        .unwrap();
    // The checkpoint was changed on purpose: seal it again (a changed file is refused).
    assert!(Trainer::resume(&start, |_| {}).is_err());
    trainer::checkpoint::manifest::write(&start, 0).unwrap();
    let mut t = Trainer::resume(&start, |_| {}).unwrap();
    assert_eq!(t.amp().scale(), huge);
    let (mut skipped, mut applied_after_skip) = (0, 0);
    for _ in 0..8 {
        let scale = t.amp().scale();
        let before = weights(&t);
        let s = t.train_step().unwrap();
        let after = weights(&t);
        assert_eq!(s.loss_scale, Some(scale), "step {}", s.step);
        if s.skipped {
            skipped += 1;
            assert!(
                s.loss.is_finite(),
                "step {}: the loss itself is fine",
                s.step
            );
            assert!(s.grad_norm.is_nan(), "step {}: no norm for a skip", s.step);
            assert!(
                before == after,
                "step {}: skipped but weights moved",
                s.step
            );
            assert_eq!(t.amp().scale(), scale / 2.0, "step {}", s.step);
        } else {
            assert!(skipped > 0, "step {}: applied at the initial 2^20", s.step);
            applied_after_skip += 1;
            assert!(s.grad_norm.is_finite());
            assert!(
                before != after,
                "step {}: applied but weights unchanged",
                s.step
            );
            assert_eq!(t.amp().scale(), scale, "no growth before 2000 clean steps");
        }
    }
    assert!(
        applied_after_skip > 0,
        "the scale never came down far enough"
    );
    let st = t.amp().state();
    assert_eq!((st.skipped, st.backoffs), (skipped, skipped));
}

#[test]
fn remat_and_mixed_precision_compose_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    for dtype in ["f16", "bf16"] {
        let cfg = |remat: &str| TrainConfig {
            n_layer: 3,
            dtype: dtype.parse().unwrap(),
            remat: remat.parse().unwrap(),
            dropout: 0.1,
            max_iters: 3,
            ..tiny_config(&tmp.path().join(format!("{dtype}-{remat}")))
        };
        let (a, wa) = run(cfg("none"));
        let (b, wb) = run(cfg("all"));
        assert_same_losses(&a, &b, dtype);
        assert_eq!(wa, wb, "{dtype}: weights differ with remat");
    }
}

/// Relative tolerances of the pipeline against plain training, per step.
struct Tol {
    loss: f32,
    norm: f32,
}

/// Largest relative difference of `f(plain step)` and `f(pipeline step)` over the steps.
fn worst_rel(a: &[StepStats], b: &[StepStats], f: impl Fn(&StepStats) -> f32) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            let (x, y) = (f(x), f(y));
            // NaN (a skipped step's norm) on one side only is infinitely wrong.
            if x.is_nan() || y.is_nan() {
                return if x.is_nan() && y.is_nan() {
                    0.0
                } else {
                    f32::INFINITY
                };
            }
            (x - y).abs() / x.abs().max(1e-12)
        })
        .fold(0.0, f32::max)
}

#[test]
fn pipeline_training_matches_plain_training() {
    // Per step: loss and gradient norm (before clipping, unscaled), which AdamW and clipping
    // cannot hide: a gradient off by a uniform factor leaves clipped AdamW updates (and so the
    // weights and the next losses) almost unchanged, but not the norm.
    let tmp = tempfile::tempdir().unwrap();
    let cfg = |name: &str, dtype: &str| TrainConfig {
        n_layer: 3,
        batch_size: 6,
        grad_accum: 2,
        max_iters: 3,
        dtype: dtype.parse().unwrap(),
        ..tiny_config(&tmp.path().join(format!("{dtype}-{name}")))
    };
    let f32_runs = [
        (2, 3, "gpipe"),
        (2, 6, "1f1b"),
        (2, 2, "interleaved:2"),
        (4, 3, "1f1b"),
    ];
    let amp_runs = [(2, 3, "1f1b"), (2, 2, "interleaved:2")];
    for (dtype, runs) in [
        ("f32", &f32_runs[..]),
        ("bf16", &amp_runs),
        ("f16", &amp_runs),
    ] {
        let (plain, plain_w) = run(cfg("plain", dtype));
        for &(stages, m, schedule) in runs {
            let what = format!("{dtype} {schedule} S={stages} m={m}");
            let (steps, w) = run(TrainConfig {
                pipeline_stages: stages,
                microbatches: m,
                schedule: schedule.parse().unwrap(),
                ..cfg(&format!("{schedule}-{stages}-{m}"), dtype)
            });
            let loss = worst_rel(&plain, &steps, |s| s.loss);
            let norm = worst_rel(&plain, &steps, |s| s.grad_norm);
            let mut wdiff = 0f32;
            for ((_, a), (_, b)) in plain_w.iter().zip(&w) {
                for (x, y) in a.iter().zip(b) {
                    wdiff = wdiff.max((x - y).abs());
                }
            }
            for (a, b) in plain.iter().zip(&steps) {
                assert_eq!(
                    (a.skipped, a.loss_scale),
                    (b.skipped, b.loss_scale),
                    "{what}"
                );
            }
            let tol = match dtype {
                // f32: the pipeline sums per-microbatch partial gradients, a different f32
                // summation order: a few ulps (measured: loss 1e-7, norm equal to the bit).
                "f32" => Tol {
                    loss: 1e-5,
                    norm: 1e-5,
                },
                // 16-bit: each microbatch's weight gradient is rounded to bf16/f16 before the
                // f32 sum, the plain step rounds the full-batch gradient once. Bounds: half a
                // unit of roundoff (bf16 2^-9, f16 2^-12) for the norm, less for the loss
                // (computed in f32); measured: bf16 norm 3.8e-4, loss 2.6e-5; f16 norm
                // 5.8e-5, loss 9.8e-6 (after steps whose weights already differ).
                "bf16" => Tol {
                    loss: 1e-3,
                    norm: 2e-3,
                },
                _ => Tol {
                    loss: 1e-4,
                    norm: 2.4e-4,
                },
            };
            assert!(loss <= tol.loss, "{what}: loss rel err {loss:e}");
            assert!(norm <= tol.norm, "{what}: grad norm rel err {norm:e}");
            // f32: a few f32 ulps of gradient difference move AdamW's update by about as much
            // (measured 9e-7). Not for 16-bit: the rounding differences flip the sign of tiny
            // gradients, which moves a weight by up to 2 lr per step: a bound that loose could
            // not fail; the per-step loss and norm above are the check there.
            if dtype == "f32" {
                assert!(wdiff <= 1e-4, "{what}: weights differ by {wdiff:e}");
            }
        }
    }
}

/// Deterministic token ids in `[0, vocab)`.
fn ids(b: usize, t: usize, vocab: usize, salt: usize, dev: &Device) -> Tensor {
    let v: Vec<u32> = (0..b * t)
        .map(|i| ((i * 7 + salt * 13 + i / 3) % vocab) as u32)
        .collect();
    Tensor::from_vec(v, (b, t), dev).unwrap()
}

#[test]
fn pipeline_gradients_match_plain_backward() {
    // The trainer's pipeline (stages of links told their microbatch, the mask folded into the
    // targets, microbatches weighted by their share of counted tokens) against a plain
    // forward/backward of the same batch, gradient by gradient, with dropout 0.1: every row
    // must draw the masks it draws in the plain step. Row r of the mask counts 16 - 3r tokens,
    // so the three microbatches (rows 0-1, 2-3, 4) hold 26, 14 and 4 tokens: weighting them by
    // rows instead of tokens would be wrong by up to 3x.
    let tmp = tempfile::tempdir().unwrap();
    let dev = Device::Cpu;
    for (name, dtype, kernels) in [
        ("f32", DType::F32, "fused"),
        ("bf16", DType::BF16, "fused"),
        ("f16", DType::F16, "fused"),
        // The reference ops draw the same Philox masks on the host, offset to each
        // microbatch's rows (a mask keyed off by one row fails here).
        ("f32", DType::F32, "reference"),
    ] {
        let cfg = TrainConfig {
            kernels: kernels.parse().unwrap(),
            n_layer: 3,
            batch_size: 5,
            pipeline_stages: 2,
            microbatches: 3,
            schedule: "1f1b".parse().unwrap(),
            dtype: name.parse().unwrap(),
            dropout: 0.1,
            ..tiny_config(&tmp.path().join(format!("{name}-{kernels}")))
        };
        let t = Trainer::new(cfg.clone()).unwrap();
        let pipe = PipelineRun::build(&(&cfg).into(), t.model.as_ref(), &t.params, &dev, dtype)
            .unwrap()
            .unwrap();
        let (b, tt, vocab) = (5, cfg.block_size, t.model.config().vocab_size());
        let (x, y) = (ids(b, tt, vocab, 1, &dev), ids(b, tt, vocab, 2, &dev));
        let mask: Vec<f32> = (0..b * tt)
            .map(|i| f32::from(i % tt >= 3 * (i / tt)))
            .collect();
        let mask = Tensor::from_vec(mask, (b, tt), &dev).unwrap();
        // The weight a micro-batch gets with grad_accum = 2, times a loss scale.
        let weight = 0.5 * 256.0;
        let (seed, kernels) = (9, cfg.kernels);
        let ctx = Ctx::train(seed).with_dtype(dtype).with_kernels(kernels);
        let batch = Batch::new(x.clone(), y.clone()).with_mask(Some(mask.clone()));
        let (loss_p, count, got) = pipe
            .forward_backward(&batch, &ctx, weight, &t.objective)
            .unwrap();
        // As Trainer::train_step does it: the weights cast once, then one forward/backward.
        let model = t.model.to_dtype(dtype).unwrap();
        let logits = model.forward(&x, &ctx).unwrap();
        let loss = kernels.cross_entropy(&logits, &y, Some(&mask)).unwrap();
        let want = (&loss * weight).unwrap().backward().unwrap();
        let loss = loss.to_scalar::<f32>().unwrap();
        let counted = mask.sum_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(count, counted as usize, "{name}: counted targets");
        let mut worst = (0f64, String::new());
        let (mut sq_got, mut sq_want) = (0f64, 0f64);
        for (pname, var) in t.params.iter() {
            let g = values(
                got.get(var)
                    .unwrap_or_else(|| panic!("{name}: no grad {pname}")),
            );
            let r = values(want.get(var).unwrap());
            let (mut d2, mut r2) = (0f64, 0f64);
            for (a, b) in g.iter().zip(&r) {
                assert!(a.is_finite() && b.is_finite(), "{name} {pname}: {a} vs {b}");
                d2 += (a - b) * (a - b);
                r2 += b * b;
            }
            sq_got += g.iter().map(|a| a * a).sum::<f64>();
            sq_want += r2;
            let rel = (d2 / r2.max(1e-300)).sqrt();
            if rel > worst.0 {
                worst = (rel, pname.clone());
            }
        }
        let norm_rel = (sq_got.sqrt() - sq_want.sqrt()).abs() / sq_want.sqrt();
        // Per parameter, ||pipeline - plain|| / ||plain||. f32: summation order only
        // (measured 1.7e-7). 16-bit: microbatch gradients rounded separately, so about one
        // unit of roundoff (bf16 2^-8 = 3.9e-3, f16 2^-11 = 4.9e-4) on the parameters whose
        // gradient sums over the batch rows (wpe: measured bf16 2.6e-3, f16 3.8e-4): allowed
        // two ulps (bf16 2^-6, f16 2^-9). The global norm averages the rounding out (measured
        // <= 2.3e-5).
        let (tol_param, tol_norm) = match dtype {
            DType::F32 => (1e-5, 1e-6),
            DType::BF16 => (1.6e-2, 1e-3),
            _ => (2e-3, 2e-4),
        };
        assert!(
            worst.0 <= tol_param,
            "{name} {kernels}: gradient of {} off by {:e} (relative L2)",
            worst.1,
            worst.0
        );
        assert!(
            norm_rel <= tol_norm,
            "{name}: global norm off by {norm_rel:e}"
        );
        // The loss is the token mean over the whole batch, computed in f32 from the logits.
        assert!(
            (loss_p - loss).abs() <= 1e-6 * loss.abs(),
            "{name}: loss {loss_p} vs {loss}"
        );
        // A batch with no counted target (a data-parallel shard may get one): loss 0 and zero
        // gradients, as in the plain step, not an error.
        let none = Batch {
            mask: Some(mask.zeros_like().unwrap()),
            ..batch
        };
        let (l0, c0, g0) = pipe
            .forward_backward(&none, &ctx, weight, &t.objective)
            .unwrap();
        assert_eq!((l0, c0), (0.0, 0), "{name}");
        for (pname, var) in t.params.iter() {
            if let Some(g) = g0.get(var) {
                assert!(values(g).iter().all(|&v| v == 0.0), "{name}: {pname}");
            }
        }
    }
}

/// A gradient's values as f64.
fn values(t: &Tensor) -> Vec<f64> {
    common::values(t)
}

#[test]
fn resuming_in_another_precision_starts_a_fresh_scaler() {
    // Every checkpoint holds the scaler's state (f32's is the no-op scale 1). Resumed in f16,
    // the run must start f16's dynamic scaler at 2^16, not continue at 1 (f16's minimum);
    // resumed back in f32, the f16 run's 2^16 must not stay on.
    let (_tmp, f32_run, _) = tiny_run(|c| c.max_iters = 2);
    let mut t = Trainer::resume(&f32_run, |c| {
        c.max_iters = 4;
        c.dtype = "f16".parse().unwrap();
    })
    .unwrap();
    assert_eq!(t.amp().scale(), 65536.0);
    assert_eq!(run_to_end(&mut t)[0].loss_scale, Some(65536.0));
    let t = Trainer::resume(&f32_run, |c| {
        c.max_iters = 6;
        c.dtype = "f32".parse().unwrap();
    })
    .unwrap();
    assert_eq!(t.amp().scale(), 1.0);
    // The same precision and loss scale continue the saved state (the f16 run's 2 steps).
    let t = Trainer::resume(&f32_run, |c| c.max_iters = 6).unwrap();
    assert_eq!(t.config.dtype.to_string(), "f16");
    assert_eq!(t.amp().state().steps, 2);
}
