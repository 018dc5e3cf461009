//! A checkpoint is one unit: every mix of the files of two checkpoints (of the same run at two
//! steps, and of two runs at the same step) is refused on resume, except the mixes that are,
//! byte for byte, one intact checkpoint in its own step's directory. All 2^6 mixes of each
//! pair's six files are tried. Also: a different dtype or an extra tensor in a checkpoint's
//! files is refused even when the manifest is sealed again; and what the loader reads of
//! `trainer_state.json` is what the trainer wrote.

mod common;

use std::fs;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use common::{tiny_config, train};
use trainer::checkpoint::{self, io, manifest};
use trainer::config::TrainConfig;
use trainer::train::Trainer;

/// A run of 4 steps keeping its checkpoints at steps 2 and 4.
fn run(dir: &Path, seed: u64) -> PathBuf {
    train(TrainConfig {
        seed,
        max_iters: 4,
        eval_interval: 2,
        keep_last: 2,
        ..tiny_config(dir)
    });
    dir.to_path_buf()
}

fn files(ckpt: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(ckpt)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Tries every mix of the files of checkpoints `a` and `b` in a copy of run `home`, in the
/// directory of `a`'s name; returns how many were accepted.
fn every_mix(home: &Path, a: &Path, b: &Path, tmp: &Path, tag: &str) -> usize {
    let names = files(a);
    assert_eq!(names, files(b));
    assert!(names.contains(&manifest::MANIFEST_FILE.to_string()));
    assert_eq!(names.len(), 6, "{names:?}");
    let name_of_a = a.file_name().unwrap();
    let step_of = |c: &Path| manifest_step(c);
    let mut accepted = 0;
    for mask in 0u32..(1 << names.len()) {
        let copy = tmp.join(format!("{tag}-{mask}"));
        copy_dir(home, &copy);
        let target = copy.join("checkpoints").join(name_of_a);
        let mut from_a = true;
        let mut from_b = true;
        for (i, n) in names.iter().enumerate() {
            let src = if mask & (1 << i) == 0 { a } else { b };
            let bytes = fs::read(src.join(n)).unwrap();
            from_a &= bytes == fs::read(a.join(n)).unwrap();
            from_b &= bytes == fs::read(b.join(n)).unwrap();
            fs::write(target.join(n), bytes).unwrap();
        }
        // Intact: one checkpoint's bytes, in the directory of its own step.
        let intact = from_a || (from_b && step_of(b) == step_of(a));
        let r = Trainer::resume(&target, |_| {});
        match (&r, intact) {
            (Ok(_), true) => accepted += 1,
            (Err(_), false) => {}
            (Ok(_), false) => panic!("{tag}: mix {mask:06b} of {names:?} was accepted"),
            (Err(e), true) => panic!("{tag}: intact mix {mask:06b} refused: {e}"),
        }
        if let Err(e) = r {
            // Every refusal names a file of the checkpoint.
            let e = e.to_string();
            assert!(
                names.iter().any(|n| e.contains(n.as_str())),
                "{tag} {mask:06b}: {e}"
            );
        }
        fs::remove_dir_all(&copy).unwrap();
    }
    accepted
}

fn manifest_step(ckpt: &Path) -> usize {
    io::read_json::<manifest::Manifest>(&ckpt.join(manifest::MANIFEST_FILE))
        .unwrap()
        .step
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let (src, dst) = (e.path(), to.join(e.file_name()));
        if src.is_dir() {
            copy_dir(&src, &dst);
        } else {
            fs::copy(&src, &dst).unwrap();
        }
    }
}

#[test]
fn every_mix_of_two_checkpoints_but_an_intact_one_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let a = run(&tmp.path().join("a"), 1);
    let b = run(&tmp.path().join("b"), 2);
    let ck =
        |run: &Path, step: usize| checkpoint::checkpoints_dir(run).join(format!("step-{step:07}"));
    // Same run, steps 2 and 4: only all of step 2's files in step 2's directory resume.
    let same_run = every_mix(&a, &ck(&a, 2), &ck(&a, 4), tmp.path(), "steps");
    // Two runs at step 4: each run's intact checkpoint resumes (a checkpoint is its files, not
    // its directory's run); every mix of the two is refused.
    let two_runs = every_mix(&a, &ck(&a, 4), &ck(&b, 4), tmp.path(), "runs");
    // Files equal in both checkpoints (e.g. config.json) make several masks intact.
    assert!(same_run >= 1 && two_runs >= 2, "{same_run} {two_runs}");
}

#[test]
fn a_narrower_dtype_or_an_extra_tensor_is_refused_even_when_sealed_again() {
    let tmp = tempfile::tempdir().unwrap();
    let a = run(&tmp.path().join("a"), 1);
    let ckpt = checkpoint::checkpoints_dir(&a).join("step-0000004");
    let step = manifest_step(&ckpt);
    let dev = Device::Cpu;
    for (file, edit) in [
        ("model.safetensors", "bf16"),
        ("model.safetensors", "extra"),
        ("optimizer.safetensors", "bf16"),
        ("optimizer.safetensors", "extra"),
    ] {
        let path = ckpt.join(file);
        let original = fs::read(&path).unwrap();
        let loaded = io::load_safetensors(&path, &dev).unwrap();
        let mut tensors: Vec<(String, Tensor)> = loaded.tensors.into_iter().collect();
        tensors.sort_by(|x, y| x.0.cmp(&y.0));
        if edit == "bf16" {
            tensors[0].1 = tensors[0].1.to_dtype(DType::BF16).unwrap();
        } else {
            tensors.push((
                "stray.weight".into(),
                Tensor::zeros(3, DType::F32, &dev).unwrap(),
            ));
        }
        io::save_safetensors(&path, &tensors, Some(loaded.metadata.clone())).unwrap();
        manifest::write(&ckpt, step).unwrap();
        let e = Trainer::resume(&ckpt, |_| {}).err().unwrap().to_string();
        let named = match edit {
            "bf16" => e.contains("BF16") && e.contains("f32"),
            _ => e.contains("stray.weight"),
        };
        assert!(
            named && (e.contains(file) || e.contains("optimizer")),
            "{file} {edit}: {e}"
        );
        fs::write(&path, original).unwrap();
        manifest::write(&ckpt, step).unwrap();
        Trainer::resume(&ckpt, |_| {}).unwrap();
    }
}

#[test]
fn every_command_refuses_a_mixed_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let a = run(&tmp.path().join("a"), 1);
    let ck = |step: usize| checkpoint::checkpoints_dir(&a).join(format!("step-{step:07}"));
    fs::copy(
        ck(2).join("optimizer.safetensors"),
        ck(4).join("optimizer.safetensors"),
    )
    .unwrap();
    let mixed = ck(4);
    let named = |e: String| assert!(e.contains("optimizer.safetensors"), "{e}");
    named(Trainer::resume(&mixed, |_| {}).err().unwrap().to_string());
    let init = Trainer::new(TrainConfig {
        init_from: Some(mixed.display().to_string()),
        ..tiny_config(&tmp.path().join("tuned"))
    });
    named(init.err().unwrap().to_string());
    let model = trainer::pretrained::ModelDir::open(mixed.to_str().unwrap()).unwrap();
    named(model.load(&Device::Cpu).err().unwrap().to_string()); // eval and sample load so
    let out = common::run_cli(&["inspect", mixed.to_str().unwrap()], tmp.path());
    assert!(!out.status.success());
    named(common::output_text(&out));
}

/// What the loader reads of `trainer_state.json` ([`trainer::load::RunState`]) is what the
/// trainer wrote: the step, the shape, the origin, the tokenizer and the 4-bit settings.
#[test]
fn the_loaders_view_reads_what_the_state_records() {
    use rand::SeedableRng;
    use trainer::checkpoint::{RngState, TrainerState};
    use trainer::config::{BaseQuant, ModuleList};
    let quants = [
        (BaseQuant::None, vec![]),
        (
            BaseQuant::Nf4,
            vec!["lm_head".into(), "mlp.down_proj".into()],
        ),
    ];
    for (quant, skip) in quants {
        let config = TrainConfig {
            n_layer: 5,
            n_head: 3,
            n_embd: 48,
            bias: false,
            block_size: 17,
            init_from: Some("base/model".into()),
            tokenizer_path: Some("tok/tokenizer.json".into()),
            base_quant: quant,
            base_quant_double: true,
            base_quant_skip: ModuleList(skip),
            ..TrainConfig::default()
        };
        let state = TrainerState {
            step: 12,
            rng: RngState::capture(&rand_chacha::ChaCha8Rng::seed_from_u64(1)),
            tokens_seen: 0,
            best_val_loss: None,
            best_checkpoint: None,
            elapsed_secs: 0.0,
            config: config.clone(),
            data: None,
            world_size: 1,
            base: None,
            files: None,
        };
        let json = serde_json::to_string(&state).unwrap();
        let view: trainer::load::RunState = serde_json::from_str(&json).unwrap();
        let c = &view.config;
        assert_eq!(view.step, 12);
        let shape = (c.n_layer, c.n_head, c.n_embd, c.bias, c.block_size);
        assert_eq!(shape, (5, 3, 48, false, 17));
        assert_eq!(c.init_from, config.init_from);
        assert_eq!(c.tokenizer_path, config.tokenizer_path);
        assert_eq!(c.data, config.data);
        assert_eq!(c.nf4_settings(), config.nf4_settings());
    }
}
