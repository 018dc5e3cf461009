//! The optimiser is a part: an optimiser defined here (momentum SGD, state
//! `{param}.momentum_buffer`) trains a run through the public API, is checkpointed by name
//! and resumes bit-exactly (`Trainer::resume_with`); its state cannot be resumed as AdamW's,
//! and it is sharded by ZeRO-1 by the names it reports.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use candle_comm::{run_threads, ThreadComm};
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use common::{assert_same_losses, finish, tiny_config, Run};
use trainer::config::TrainConfig;
use trainer::model::Params;
use trainer::optim::Optimizer;
use trainer::train::Trainer;

/// Momentum SGD (PyTorch's `momentum_buffer`), the test's own optimiser.
struct Sgd {
    params: Vec<(String, Var, Tensor)>,
    steps: usize,
}

impl Sgd {
    fn boxed(params: &Params) -> trainer::Result<Box<dyn Optimizer>> {
        let params = params
            .iter()
            .map(|(n, v)| Ok((n.clone(), v.clone(), v.zeros_like()?)))
            .collect::<candle_core::Result<_>>()?;
        Ok(Box::new(Sgd { params, steps: 0 }))
    }

    fn key(name: &str) -> String {
        format!("{name}.momentum_buffer")
    }
}

impl Optimizer for Sgd {
    fn name(&self) -> &str {
        "sgd"
    }

    fn step(&mut self, grads: &GradStore, scale: f64, lr: f64) -> candle_core::Result<()> {
        self.steps += 1;
        for (_, var, buf) in &mut self.params {
            if let Some(g) = grads.get(var) {
                *buf = ((&*buf * 0.9)? + g.detach().affine(scale, 0.0)?)?;
                var.set(&(var.as_tensor() - buf.affine(lr, 0.0)?)?)?;
            }
        }
        Ok(())
    }

    fn step_count(&self) -> usize {
        self.steps
    }

    fn state(&self) -> Vec<(String, Tensor)> {
        let named = |(n, _, b): &(String, Var, Tensor)| (Sgd::key(n), b.clone());
        self.params.iter().map(named).collect()
    }

    fn load_state(&mut self, state: &HashMap<String, Tensor>, steps: usize) -> trainer::Result<()> {
        if state.len() != self.params.len() {
            let msg = format!(
                "{} tensors for {} parameters",
                state.len(),
                self.params.len()
            );
            return Err(trainer::Error::checkpoint("optimizer state", msg));
        }
        for (n, _, b) in &mut self.params {
            let key = Sgd::key(n);
            let t = state.get(&key).ok_or_else(|| {
                trainer::Error::checkpoint("optimizer state", format!("missing `{key}`"))
            })?;
            *b = t.copy()?;
        }
        self.steps = steps;
        Ok(())
    }

    fn retain(&mut self, keep: &dyn Fn(&str) -> bool) {
        self.params.retain(|p| keep(&p.0));
    }

    fn state_bytes_per_param(&self) -> usize {
        4
    }
}

fn config(dir: &std::path::Path) -> TrainConfig {
    TrainConfig {
        eval_problems: 0,
        ..tiny_config(dir)
    }
}

fn with_sgd(cfg: TrainConfig) -> Trainer {
    let mut t = Trainer::new(cfg).unwrap();
    t.optimizer = Sgd::boxed(&t.params).unwrap();
    t
}

#[test]
fn an_optimizer_of_its_own_trains_checkpoints_and_resumes_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let whole: Run = finish(with_sgd(config(&tmp.path().join("whole"))));
    let adamw: Run = finish(Trainer::new(config(&tmp.path().join("adamw"))).unwrap());
    assert_ne!(
        whole.1, adamw.1,
        "the run did not use the optimiser it was given"
    );

    // The checkpoint holds the optimiser's own state, under its names.
    let ckpt = tmp.path().join("whole/checkpoints/step-0000004");
    let file = ckpt.join("optimizer.safetensors");
    let saved = candle_core::safetensors::load(&file, &Device::Cpu).unwrap();
    let mut names: Vec<&String> = saved.keys().collect();
    names.sort();
    assert!(
        !names.is_empty() && names.iter().all(|n| n.ends_with(".momentum_buffer")),
        "{names:?}"
    );

    // Resumed with the same optimiser: the same steps and weights, to the bit.
    let fork = tmp.path().join("fork");
    let resumed = finish(
        Trainer::resume_with(&ckpt, |c| c.out_dir = fork.clone(), |_, p| Sgd::boxed(p)).unwrap(),
    );
    assert_same_losses(
        &whole.0[4..],
        &resumed.0,
        "resumed with the custom optimiser",
    );
    assert_eq!(whole.1, resumed.1, "resumed weights differ");

    // Resumed as AdamW: refused, naming the file, the optimiser and a tensor it cannot take.
    let e = Trainer::resume(&ckpt, |c| c.out_dir = tmp.path().join("wrong"))
        .err()
        .expect("AdamW resumed SGD's state")
        .to_string();
    common::assert_mentions(&e, &["optimizer.safetensors", "adamw", ".momentum_buffer`"]);
}

#[test]
fn zero1_shards_an_optimizer_of_its_own_by_the_names_it_reports() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |dir: std::path::PathBuf, zero: usize| {
        let cfg = TrainConfig {
            zero,
            max_iters: 4,
            ..config(&dir)
        };
        run_threads(2, Duration::from_secs(60), |comm: ThreadComm| {
            let t = with_sgd(cfg.clone()).with_comm(Box::new(comm)).unwrap();
            let held: usize = t.optimizer.state().len();
            (finish(t), held)
        })
        .into_iter()
        .map(|r| r.unwrap_or_else(|_| panic!("a rank panicked")))
        .collect::<Vec<_>>()
    };
    let plain = run(tmp.path().join("plain"), 0);
    let sharded = run(tmp.path().join("zero"), 1);
    let total = plain[0].1;
    assert_eq!(sharded.iter().map(|r| r.1).sum::<usize>(), total);
    assert!(sharded.iter().all(|r| r.1 < total), "not sharded");
    for ((z, _), (p, _)) in sharded.iter().zip(&plain) {
        assert_same_losses(&z.0, &p.0, "ZeRO-1 with the custom optimiser");
        assert_eq!(z.1, p.1, "ZeRO-1 weights differ");
    }
    // The gathered checkpoint is the unsharded one.
    for f in ["optimizer.safetensors", "model.safetensors"] {
        let at = |run: &str| {
            std::fs::read(
                tmp.path()
                    .join(run)
                    .join("checkpoints/step-0000004")
                    .join(f),
            )
            .unwrap()
        };
        assert!(at("zero") == at("plain"), "{f} differs");
    }
}

#[test]
fn the_memory_estimate_counts_the_state_the_optimizer_holds() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = config(&tmp.path().join("run"));
    let t = Trainer::new(cfg.clone()).unwrap();
    let held: usize = t
        .optimizer
        .state()
        .iter()
        .map(|(_, s)| s.elem_count() * s.dtype().size_in_bytes())
        .sum();
    let per_param = t.optimizer.state_bytes_per_param();
    assert_eq!(
        held,
        per_param * t.params.num_elements(),
        "{}",
        t.optimizer.name()
    );
    // Weight and gradient in f32, and that state.
    let estimated = trainer::train::trained_bytes_per_param(&(&cfg).into());
    assert_eq!(estimated, 8 + per_param as u64);
}
