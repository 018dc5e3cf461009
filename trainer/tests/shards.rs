//! Training on memory-mapped token shards (`--data shards`): a resume in epoch order continues
//! the data stream bit-exactly (the cursor is the checkpointed generator's position), a changed
//! shard directory is refused at resume naming it, and two data-parallel ranks in epoch order
//! train like one process with twice the batch.

mod common;

use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use candle_comm::run_threads;
use common::{assert_same_steps, run_to_end, tiny_config, weights, Recorder};
use trainer::config::TrainConfig;
use trainer::data::shards::format::{byte_vocab_hash, TokenizerInfo};
use trainer::data::shards::{write_prepared, ShardData, ShardOptions, ShardSource};
use trainer::data::{DataKind, DataOrder, Split};
use trainer::train::Trainer;

/// A prepared byte-vocabulary directory: three train shards and one val shard of English-ish
/// text (`salt` changes one byte of the second shard).
fn prepare(dir: &Path, salt: u8) {
    let text = "the quick brown fox jumps over the lazy dog; pack my box with five dozen \
                liquor jugs. ";
    let bytes: Vec<u32> = text.bytes().cycle().take(3000).map(u32::from).collect();
    let mut second = bytes[..700].to_vec();
    second[10] = u32::from(salt);
    let shards = [&bytes[..1100], &second[..], &bytes[1100..1600]];
    let train: Vec<ShardData<'_>> = shards
        .iter()
        .map(|&tokens| ShardData {
            tokens,
            ..ShardData::default()
        })
        .collect();
    let val = [ShardData {
        tokens: &bytes[2000..2400],
        ..ShardData::default()
    }];
    let info = TokenizerInfo {
        kind: "byte".into(),
        path: None,
        hash: format!("{:016x}", byte_vocab_hash()),
        chars: None,
    };
    write_prepared(dir, info, 256, None, &train, &val, serde_json::Value::Null).unwrap();
}

fn config(run: &Path, data: &Path) -> TrainConfig {
    TrainConfig {
        data: DataKind::Shards,
        data_path: Some(data.to_path_buf()),
        data_order: DataOrder::Epoch,
        grad_accum: 2,
        dropout: 0.1,
        ..tiny_config(run)
    }
}

#[test]
fn resume_on_shards_is_bit_exact_across_epochs() {
    let (tmp, data) = common::temp_join("data");
    prepare(&data, b'x');
    // Train shards of 1100 + 700 + 500 tokens = 64 + 41 + 29 = 134 windows of 17; a step
    // reads 2 x 12 = 24, so the run turns over into its second epoch at step 6, after the
    // resume at step 5.
    let cfg = |run: &Path| TrainConfig {
        batch_size: 12,
        ..config(run, &data)
    };
    let mut full = Trainer::new(cfg(&tmp.path().join("full"))).unwrap();
    let full_steps = run_to_end(&mut full);
    assert_eq!(full_steps.len(), 8);

    let split = tmp.path().join("split");
    let half = TrainConfig {
        max_iters: 5,
        ..cfg(&split)
    };
    let (split_steps, second) = common::split_run(half, 8);
    assert_same_steps(&full_steps, &split_steps, "resumed on shards");
    assert_eq!(weights(&full), weights(&second), "final weights differ");
}

#[test]
fn a_changed_shard_directory_is_refused_at_resume_naming_it() {
    let (tmp, data) = common::temp_join("data");
    prepare(&data, b'x');
    let run = tmp.path().join("run");
    let mut t = Trainer::new(TrainConfig {
        max_iters: 4,
        ..config(&run, &data)
    })
    .unwrap();
    run_to_end(&mut t);
    drop(t);
    // Prepared again from other text: a consistent directory, but not the run's data.
    prepare(&data, b'y');
    let err = Trainer::resume(&run, |c| c.max_iters = 8)
        .err()
        .expect("resume must be refused")
        .to_string();
    assert!(err.contains(&data.display().to_string()), "{err}");
    assert!(err.contains("differs"), "{err}");
    // The original data resumes.
    prepare(&data, b'x');
    Trainer::resume(&run, |c| c.max_iters = 8).unwrap();
}

#[test]
fn two_ranks_in_epoch_order_train_like_one_rank_with_twice_the_batch() {
    let (tmp, data) = common::temp_join("data");
    prepare(&data, b'x');
    let cfg = |run: &Path, batch_size| TrainConfig {
        batch_size,
        max_iters: 4,
        dropout: 0.0,
        ..config(run, &data)
    };
    let mut one = Trainer::new(cfg(&tmp.path().join("one"), 8)).unwrap();
    let one_steps = run_to_end(&mut one);
    let two = cfg(&tmp.path().join("two"), 4);
    let ranks: Vec<_> = run_threads(2, Duration::from_secs(60), move |comm| {
        let mut t = Trainer::new(two.clone())
            .unwrap()
            .with_comm(Box::new(comm))
            .unwrap();
        run_to_end(&mut t)
    })
    .into_iter()
    .map(|r| r.unwrap_or_else(|_| panic!("a rank panicked")))
    .collect();
    for steps in &ranks {
        for (a, b) in one_steps.iter().zip(steps) {
            assert!(
                (a.loss - b.loss).abs() < 1e-4,
                "step {}: {} vs {}",
                a.step,
                a.loss,
                b.loss
            );
        }
    }
}

/// A byte-vocabulary directory with one train shard of `n` tokens (width 2) and one val shard.
fn prepare_one(dir: &Path, n: usize) {
    let tokens: Vec<u32> = (0..n).map(|i| (i % 251) as u32).collect();
    let info = TokenizerInfo {
        kind: "byte".into(),
        path: None,
        hash: format!("{:016x}", byte_vocab_hash()),
        chars: None,
    };
    let shard = |tokens| ShardData {
        tokens,
        ..ShardData::default()
    };
    let (train, val) = ([shard(&tokens[..])], [shard(&tokens[..500])]);
    write_prepared(dir, info, 256, None, &train, &val, serde_json::Value::Null).unwrap();
}

/// Flips the byte at `offset` of `path`.
fn flip(path: &Path, offset: usize) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[offset] ^= 0x40;
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn a_flipped_byte_in_a_shard_body_is_refused_naming_the_shard_and_window() {
    let (tmp, data) = common::temp_join("data");
    // 600k tokens of 2 bytes: a body of two 1 MiB checksum chunks.
    prepare_one(&data, 600_000);
    let shard = data.join("train-00000.tok");
    flip(&shard, 64 + 1_100_000);
    let src = ShardSource::open(&data, ShardOptions::default()).unwrap();
    // The first chunk is intact: its windows read (the second is not read to open or read them).
    assert_eq!(src.read(Split::Train, 0, 0, 4).unwrap(), [0, 1, 2, 3]);
    let err = src
        .read(Split::Train, 0, 560_000, 10)
        .expect_err("a window in the corrupt chunk must be refused")
        .to_string();
    assert!(err.contains("train-00000.tok"), "{err}");
    assert!(err.contains("tokens 560000..560010"), "{err}");
    assert!(err.contains("corrupt"), "{err}");
    assert!(err.contains("trainer prepare --verify"), "{err}");
    // Training on it stops with that error instead of training on the flipped byte.
    let mut t = Trainer::new(TrainConfig {
        max_iters: 50,
        ..config(&tmp.path().join("run"), &data)
    })
    .unwrap();
    let err = t
        .run(&mut Recorder::default(), &AtomicBool::new(false))
        .expect_err("training must stop at the corrupt chunk")
        .to_string();
    common::assert_mentions(&err, &["train-00000.tok", "corrupt"]);
}

#[test]
fn shards_of_a_manifest_without_chunk_checksums_are_verified_whole() {
    let (_tmp, data) = common::temp_join("data");
    prepare_one(&data, 3000);
    // A manifest as an older trainer wrote it: no chunk_sums.
    let path = data.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for split in ["train", "val"] {
        for e in m[split].as_array_mut().unwrap() {
            e.as_object_mut().unwrap().remove("chunk_sums").unwrap();
        }
    }
    std::fs::write(&path, m.to_string()).unwrap();
    let src = ShardSource::open(&data, ShardOptions::default()).unwrap();
    assert_eq!(src.read(Split::Train, 0, 0, 3).unwrap(), [0, 1, 2]);
    flip(&data.join("val-00000.tok"), 64 + 900);
    let src = ShardSource::open(&data, ShardOptions::default()).unwrap();
    let err = src.read(Split::Val, 0, 0, 3).unwrap_err().to_string();
    common::assert_mentions(&err, &["val-00000.tok", "corrupt"]);
}

#[test]
fn shards_without_a_validation_split_say_so_instead_of_asking_for_a_smaller_block() {
    let (tmp, data) = common::temp_join("data");
    let tokens: Vec<u32> = (0..3000).map(|i| i % 200).collect();
    let info = TokenizerInfo {
        kind: "byte".into(),
        path: None,
        hash: format!("{:016x}", byte_vocab_hash()),
        chars: None,
    };
    let train = [ShardData {
        tokens: &tokens,
        ..ShardData::default()
    }];
    write_prepared(&data, info, 256, None, &train, &[], serde_json::Value::Null).unwrap();
    let err = Trainer::new(config(&tmp.path().join("run"), &data))
        .err()
        .expect("no validation split")
        .to_string();
    assert!(err.contains("no validation tokens"), "{err}");
    assert!(err.contains("--val-fraction 0.005"), "{err}");
    assert!(!err.contains("smaller block_size"), "{err}");
}
