//! Run directories never lose data: a resumed run writes where it was resumed from, a fresh
//! run never mixes into an existing one, a killed checkpoint write leaves `latest` and resume
//! intact and its leftovers are removed, and `latest` may be a symlink.

mod common;

use std::fs;
use std::path::Path;
use std::sync::atomic::AtomicBool;

use common::{run_to_end, snapshot, tiny_config, tiny_run, train, Recorder};
use trainer::checkpoint;
use trainer::config::TrainConfig;
use trainer::train::Trainer;

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dst = to.join(e.file_name());
        if e.path().is_dir() {
            copy_dir(&e.path(), &dst);
        } else {
            fs::copy(e.path(), dst).unwrap();
        }
    }
}

fn latest(run: &Path) -> String {
    fs::read_to_string(run.join("checkpoints/latest")).unwrap()
}

#[test]
fn resume_continues_in_the_directory_it_was_given() {
    let (tmp, original, _) = tiny_run(|c| c.max_iters = 4);
    let copy = tmp.path().join("copy");
    copy_dir(&original, &copy);
    let before = snapshot(&original);

    // The copy's checkpoint records `original` as its out_dir: resuming the copy must write
    // into the copy and leave the original alone.
    run_to_end(&mut Trainer::resume(&copy, |c| c.max_iters = 8).unwrap());
    assert_eq!(
        snapshot(&original),
        before,
        "resuming the copy changed the original"
    );
    assert_eq!(latest(&copy), "step-0000008");
    let steps = fs::read_to_string(copy.join("metrics.jsonl")).unwrap();
    assert!(steps.contains("\"step\":8"), "{steps}");

    // A relative out_dir in the checkpoint (written from another working directory) must not
    // fork the run into the current directory either.
    let state_path = copy.join("checkpoints/step-0000008/trainer_state.json");
    let state = fs::read_to_string(&state_path).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&state).unwrap();
    json["config"]["out_dir"] = "relative/run".into();
    fs::write(&state_path, json.to_string()).unwrap();
    // (An edited checkpoint is refused until it is sealed again.)
    assert!(Trainer::resume(&copy, |_| {}).is_err());
    let ckpt = state_path.parent().unwrap();
    trainer::checkpoint::manifest::write(ckpt, 8).unwrap();
    run_to_end(&mut Trainer::resume(&copy, |c| c.max_iters = 9).unwrap());
    assert!(!Path::new("relative").exists());
    assert_eq!(latest(&copy), "step-0000009");
}

#[test]
fn a_fresh_run_refuses_an_existing_run_directory() {
    let (_tmp, dir, _) = tiny_run(|c| c.max_iters = 8);
    let before = snapshot(&dir);
    let shorter = TrainConfig {
        max_iters: 4,
        ..tiny_config(&dir)
    };
    let e = Trainer::new(shorter.clone())
        .unwrap()
        .run(&mut Recorder::default(), &AtomicBool::new(false))
        .unwrap_err()
        .to_string();
    assert!(e.contains("--resume") && e.contains("--overwrite"), "{e}");
    assert_eq!(
        snapshot(&dir),
        before,
        "a refused run touched the directory"
    );

    // With overwrite, the old run's checkpoints are gone rather than mixed with the new ones.
    run_to_end(&mut Trainer::new(shorter).unwrap().overwrite(true));
    assert!(!dir.join("checkpoints/step-0000008").exists());
    assert_eq!(latest(&dir), "step-0000004");
    let metrics = fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    assert!(!metrics.contains("\"step\":8"), "{metrics}");
}

#[test]
fn a_killed_checkpoint_write_keeps_latest_and_resume_and_is_cleaned_up() {
    let (tmp, dir) = common::temp_join("run");
    let cfg = TrainConfig {
        max_iters: 4,
        ..tiny_config(&dir)
    };
    let mut t = train(cfg.clone());
    let good = snapshot(&dir.join("checkpoints/step-0000004"));

    // Fault injection: the writer dies (a panic stands in for a kill: nothing after it runs,
    // no cleanup) after the weights, optimiser and state files of step 5 are written and
    // before the checkpoint is renamed into place.
    t.train_step().unwrap();
    let died = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        common::save_with(
            &t,
            &dir,
            &[("killed", &|path: &Path| {
                let tmp = path.parent().unwrap();
                assert!(tmp.join(checkpoint::MODEL_FILE).is_file());
                panic!("killed between files");
            })],
        )
    }));
    assert!(died.is_err());
    let ckpts = dir.join("checkpoints");
    let leftovers = |d: &Path| -> Vec<String> {
        fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".tmp-"))
            .collect()
    };
    assert_eq!(
        leftovers(&ckpts).len(),
        1,
        "the injected fault left no partial write"
    );
    assert_eq!(latest(&dir), "step-0000004");
    assert_eq!(snapshot(&ckpts.join("step-0000004")), good);

    // Resume picks the last complete checkpoint, continues exactly, and removes the leftover.
    let mut resumed = Trainer::resume(&dir, |c| c.max_iters = 6).unwrap();
    assert_eq!(resumed.step(), 4);
    run_to_end(&mut resumed);
    assert!(leftovers(&ckpts).is_empty(), "{:?}", leftovers(&ckpts));
    let straight = train(TrainConfig {
        max_iters: 6,
        out_dir: tmp.path().join("straight"),
        ..cfg
    });
    assert_eq!(common::weights(&resumed), common::weights(&straight));
}

#[cfg(unix)]
#[test]
fn latest_may_be_a_symlink_to_the_checkpoint() {
    let (_tmp, dir, _) = tiny_run(|c| c.max_iters = 4);
    let latest = dir.join("checkpoints/latest");
    fs::remove_file(&latest).unwrap();
    std::os::unix::fs::symlink("step-0000004", &latest).unwrap();
    let t = Trainer::resume(&dir, |_| {}).unwrap();
    assert_eq!(t.step(), 4);
    fs::remove_file(&latest).unwrap();
    std::os::unix::fs::symlink("step-0000099", &latest).unwrap();
    let e = Trainer::resume(&dir, |_| {}).err().unwrap().to_string();
    assert!(e.contains("dangling") && e.contains("step-0000099"), "{e}");
}

#[test]
fn memory_is_estimated_before_allocating() {
    let tmp = tempfile::tempdir().unwrap();
    let e = Trainer::new(TrainConfig {
        block_size: 100_000,
        batch_size: 128,
        ..TrainConfig {
            out_dir: tmp.path().join("run"),
            ..TrainConfig::default()
        }
    })
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("GiB") && e.contains("block_size"), "{e}");
    assert!(!tmp.path().join("run").exists());
}
