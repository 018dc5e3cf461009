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

/// `optimizer = "sgd"` against `torch.optim.SGD` (scripts/python/make_optim_fixtures.py: four
/// steps at changing learning rates, with and without momentum, dampening, Nesterov and weight
/// decay): every parameter after every step, and the final `momentum_buffer`s.
///
/// Tolerance: 2 ulp of the larger of the value and 1 (2^-22 ≈ 2.4e-7 absolute near 1). The
/// operations are PyTorch's, in its order and in f32, but PyTorch's CPU `add(x, alpha = a)`
/// may fuse the multiply and the add (one rounding) where Candle's `affine` then `add` rounds
/// twice: each step can differ by an ulp, and four steps carry it.
#[test]
fn sgd_matches_torch_optim_sgd() {
    use trainer::optim::{Sgd, SgdConfig};
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/optim/sgd.json");
    let fx: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let f32s = |v: &serde_json::Value| -> Vec<f32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect()
    };
    let shape = |n: &str| -> Vec<usize> {
        fx["shapes"][n]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect()
    };
    let tensor =
        |v: &serde_json::Value, n: &str| Tensor::from_vec(f32s(v), shape(n), &Device::Cpu).unwrap();
    let names = ["b", "w"];
    let lrs: Vec<f64> = fx["lrs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    let close = |got: &[f32], want: &[f32], what: &str| {
        assert_eq!(got.len(), want.len(), "{what}");
        for (g, w) in got.iter().zip(want) {
            let tol = 2.0 * f32::EPSILON * w.abs().max(1.0);
            assert!((g - w).abs() <= tol, "{what}: {g} vs torch {w}");
        }
    };
    for case in fx["cases"].as_array().unwrap() {
        let config = SgdConfig {
            lr: lrs[0],
            momentum: case["momentum"].as_f64().unwrap(),
            dampening: case["dampening"].as_f64().unwrap(),
            weight_decay: case["weight_decay"].as_f64().unwrap(),
            nesterov: case["nesterov"].as_bool().unwrap(),
        };
        let vars: Vec<Var> = names
            .iter()
            .map(|n| Var::from_tensor(&tensor(&fx["init"][n], n)).unwrap())
            .collect();
        let params = Params::from_vars(names.iter().map(|n| n.to_string()).zip(vars.clone()));
        let mut sgd = Sgd::new(&params, config.clone()).unwrap();
        for (step, lr) in lrs.iter().enumerate() {
            // sum(p * G) has the gradient G, exactly.
            let mut loss = Tensor::new(0f32, &Device::Cpu).unwrap();
            for (n, v) in names.iter().zip(&vars) {
                let g = tensor(&fx["grads"][step][n], n);
                loss = (loss + (v.as_tensor() * g).unwrap().sum_all().unwrap()).unwrap();
            }
            sgd.step(&loss.backward().unwrap(), 1.0, *lr).unwrap();
            for (n, v) in names.iter().zip(&vars) {
                let got = v
                    .as_tensor()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                let want = f32s(&case["params_after"][step][n]);
                close(&got, &want, &format!("{config:?} step {} {n}", step + 1));
            }
        }
        let state: HashMap<String, Tensor> = sgd.state().into_iter().collect();
        for n in names {
            let want = &case["momentum_buffer"][n];
            let got = state.get(&format!("{n}.momentum_buffer"));
            match (want.is_null(), got) {
                (true, None) => {}
                (false, Some(t)) => {
                    let got = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    close(
                        &got,
                        &f32s(want),
                        &format!("{config:?} {n}.momentum_buffer"),
                    );
                }
                _ => panic!("{config:?} {n}: buffer {got:?}, torch {want}"),
            }
        }
    }
}

/// The run names its optimiser (`optimizer`, default `adamw`) and the optimiser reads its own
/// options (`optimizer_options`): from TOML and the command line, written back by
/// `--print-config`, and refused naming the key and what is known.
#[test]
fn a_run_names_its_optimizer_and_the_optimizer_checks_its_options() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // A config without the key (every config before it) is AdamW's.
    std::fs::write(dir.join("old.toml"), "lr = 0.01\nbeta1 = 0.8\n").unwrap();
    let old = TrainConfig::from_toml_file(&dir.join("old.toml")).unwrap();
    assert_eq!(old.optimizer, "adamw");
    assert!(old.optimizer_options.is_empty());
    let toml = "optimizer = \"sgd\"\n[optimizer_options]\nmomentum = 0.9\nnesterov = true\n";
    std::fs::write(dir.join("sgd.toml"), toml).unwrap();
    let cfg = TrainConfig {
        eval_problems: 0,
        ..TrainConfig::from_toml_file(&dir.join("sgd.toml")).unwrap()
    };
    assert_eq!(
        cfg.optimizer_options.to_string(),
        "momentum=0.9,nesterov=true"
    );
    let back: TrainConfig = toml::from_str(&cfg.to_toml()).unwrap();
    assert_eq!(back, cfg, "{}", cfg.to_toml());
    let json: TrainConfig = serde_json::from_str(&serde_json::to_string(&cfg).unwrap()).unwrap();
    assert_eq!(json, cfg);
    let t = Trainer::new(TrainConfig {
        out_dir: dir.join("run"),
        ..cfg.clone()
    })
    .unwrap();
    assert_eq!(t.optimizer.name(), "sgd");
    assert!(t
        .optimizer
        .state()
        .iter()
        .all(|(n, _)| n.ends_with(".momentum_buffer")));

    // The command line, and what --print-config writes.
    let args = [
        "train",
        "--print-config",
        "--optimizer",
        "sgd",
        "--optimizer-options",
        "momentum=0.5,dampening=0.1",
    ];
    let o = common::run_cli(&args, dir);
    let out = common::output_text(&o);
    assert!(o.status.success(), "{out}");
    let printed: TrainConfig = toml::from_str(&String::from_utf8_lossy(&o.stdout)).unwrap();
    assert_eq!(printed.optimizer, "sgd");
    assert_eq!(
        printed.optimizer_options.to_string(),
        "dampening=0.1,momentum=0.5"
    );

    // Refusals name the key and what is known.
    let refused = |set: &dyn Fn(&mut TrainConfig), words: &[&str]| {
        let mut c = cfg.clone();
        set(&mut c);
        let e = c.validate().unwrap_err().to_string();
        common::assert_mentions(&e, words);
    };
    let opts = |s: &str| s.parse::<trainer::config::Options>().unwrap();
    refused(
        &|c| c.optimizer = "lion".into(),
        &["optimizer `lion`", "adamw, sgd"],
    );
    refused(
        &|c| c.optimizer_options = opts("momentun=0.9"),
        &["optimizer_options.momentun", "momentum, dampening"],
    );
    refused(
        &|c| c.optimizer_options = opts("momentum=fast"),
        &["optimizer_options.momentum", "number"],
    );
    refused(
        &|c| c.optimizer_options = opts("momentum=-1"),
        &["optimizer_options.momentum", ">= 0"],
    );
    refused(
        &|c| c.optimizer_options = opts("nesterov=true"),
        &["optimizer_options.nesterov", "momentum > 0"],
    );
    refused(
        &|c| {
            c.optimizer = "adamw".into();
            c.optimizer_options = opts("momentum=0.9");
        },
        &["optimizer_options.momentum", "`adamw`", "beta1"],
    );
}
