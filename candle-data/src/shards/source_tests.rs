use std::collections::HashSet;

use rand::{Rng, SeedableRng};

use candle_core::Device;

use super::*;
use crate::shards::format::{byte_vocab_hash, TokenizerInfo};
use crate::shards::{write_prepared, ShardData};

fn byte_info() -> TokenizerInfo {
    TokenizerInfo {
        kind: "byte".into(),
        path: None,
        hash: format!("{:016x}", byte_vocab_hash()),
        chars: None,
    }
}

/// Writes a prepared byte-vocabulary directory with shards of the given lengths (token `i` of
/// shard `s` is `(7 s + i) % 251`).
fn prepared(dir: &Path, train: &[usize], val: &[usize]) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let make = |lens: &[usize], salt: usize| -> Vec<Vec<u32>> {
        lens.iter()
            .enumerate()
            .map(|(s, &n)| {
                (0..n)
                    .map(|i| ((7 * (s + salt) + i) % 251) as u32)
                    .collect()
            })
            .collect()
    };
    let (t, v) = (make(train, 0), make(val, 100));
    let (td, vd) = (shard_data(&t), shard_data(&v));
    write_prepared(
        dir,
        byte_info(),
        256,
        None,
        &td,
        &vd,
        serde_json::Value::Null,
    )
    .unwrap();
    (t, v)
}

fn shard_data(x: &[Vec<u32>]) -> Vec<ShardData<'_>> {
    x.iter()
        .map(|tokens| ShardData {
            tokens,
            ..ShardData::default()
        })
        .collect()
}

fn open(dir: &Path, order: DataOrder) -> ShardSource {
    ShardSource::open(
        dir,
        ShardOptions {
            order,
            ..ShardOptions::default()
        },
    )
    .unwrap()
}

fn rows(b: &Batch) -> Vec<Vec<u32>> {
    b.x.to_vec2().unwrap()
}

#[test]
fn mapped_tokens_equal_the_tokens_written() {
    let tmp = tempfile::tempdir().unwrap();
    let (train, val) = prepared(tmp.path(), &[1000, 17, 300], &[64]);
    let src = open(tmp.path(), DataOrder::Random);
    for (split, want) in [(Split::Train, &train), (Split::Val, &val)] {
        for (s, tokens) in want.iter().enumerate() {
            assert_eq!(&src.read(split, s, 0, tokens.len()).unwrap(), tokens);
        }
    }
    assert_eq!(src.len(Split::Train), 1317);
    assert_eq!(src.vocab_size(), 256);
    assert!(src
        .describe()
        .starts_with(&tmp.path().display().to_string()));
    // A batch's rows are the windows it names, and the targets are shifted by one.
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let windows = src.windows(Split::Train, 8, 16, &mut rng.clone()).unwrap();
    let b = src
        .batch(Split::Train, 8, 16, &mut rng, &Device::Cpu)
        .unwrap();
    let y: Vec<Vec<u32>> = b.y.to_vec2().unwrap();
    for (i, &(s, t)) in windows.iter().enumerate() {
        assert_eq!(rows(&b)[i], train[s][t..t + 16]);
        assert_eq!(y[i], train[s][t + 1..t + 17]);
    }
    assert!(b.mask.is_none() && b.rows.is_empty());
}

#[test]
fn one_shard_random_order_is_the_text_sampling() {
    let tmp = tempfile::tempdir().unwrap();
    let (train, _) = prepared(tmp.path(), &[500], &[40]);
    let src = open(tmp.path(), DataOrder::Random);
    let mut a = ChaCha8Rng::seed_from_u64(9);
    let mut b = a.clone();
    let batch = src.batch(Split::Train, 4, 8, &mut a, &Device::Cpu).unwrap();
    // TextSource's historical sampler: `random_range(0..=len - (block + 1))` a row.
    let want: Vec<Vec<u32>> = (0..4)
        .map(|_| {
            let s = b.random_range(0..=(500u64 - 9)) as usize;
            train[0][s..s + 8].to_vec()
        })
        .collect();
    assert_eq!(rows(&batch), want);
    assert_eq!(a.get_word_pos(), b.get_word_pos());
}

#[test]
fn both_orders_are_deterministic_from_the_seed() {
    let tmp = tempfile::tempdir().unwrap();
    prepared(tmp.path(), &[400, 250, 90], &[50]);
    for order in [DataOrder::Random, DataOrder::Epoch] {
        let src = open(tmp.path(), order);
        let draw = |seed: u64| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            (0..5)
                .map(|_| {
                    rows(
                        &src.batch(Split::Train, 6, 10, &mut rng, &Device::Cpu)
                            .unwrap(),
                    )
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(1), draw(1), "{order}");
        assert_ne!(draw(1), draw(2), "{order}");
    }
}

#[test]
fn an_epoch_reads_each_window_once_and_ranks_never_share_a_token() {
    let tmp = tempfile::tempdir().unwrap();
    // Windows of 11: 36 + 22 + 8 = 66 per epoch.
    prepared(tmp.path(), &[400, 250, 90], &[50]);
    let src = open(tmp.path(), DataOrder::Epoch);
    let (world, per_rank, block) = (2, 3, 10);
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let mut seen: Vec<HashSet<(usize, usize)>> = vec![HashSet::new(); world];
    // 11 steps of a global batch of 6 windows = one epoch of 66.
    for _ in 0..11 {
        let global = src
            .windows(Split::Train, world * per_rank, block, &mut rng)
            .unwrap();
        // Rank r trains on rows r * per_rank .. (DataParallel::shard).
        for (rank, mine) in global.chunks(per_rank).enumerate() {
            for &(s, t) in mine {
                assert_eq!(t % (block + 1), 0);
                for pos in t..t + block + 1 {
                    assert!(seen[rank].insert((s, pos)), "rank {rank} reread {s}:{pos}");
                }
            }
        }
    }
    let (a, b) = (&seen[0], &seen[1]);
    assert!(a.is_disjoint(b), "two ranks read the same token position");
    assert_eq!(a.len() + b.len(), 66 * 11, "every window read once");
    assert_eq!(order::cursor(&rng), 66);
    // The next epoch is another order of the same windows.
    let next = src.windows(Split::Train, 66, block, &mut rng).unwrap();
    let set: HashSet<_> = next.iter().collect();
    assert_eq!(set.len(), 66);
}

#[test]
fn loss_mask_and_document_rows_come_from_the_streams() {
    let tmp = tempfile::tempdir().unwrap();
    let tokens: Vec<u32> = (0..200).map(|i| i % 256).collect();
    let counted: Vec<bool> = (0..200).map(|i| i % 3 != 0).collect();
    let starts: Vec<u64> = vec![0, 7, 30, 31, 120];
    let shard = ShardData {
        tokens: &tokens,
        doc_starts: Some(&starts),
        counted: Some(&counted),
    };
    write_prepared(
        tmp.path(),
        byte_info(),
        256,
        None,
        &[shard],
        &[shard],
        serde_json::Value::Null,
    )
    .unwrap();
    let src = ShardSource::open(
        tmp.path(),
        ShardOptions {
            doc_mask: true,
            ..ShardOptions::default()
        },
    )
    .unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let windows = src.windows(Split::Train, 16, 12, &mut rng.clone()).unwrap();
    let b = src
        .batch(Split::Train, 16, 12, &mut rng, &Device::Cpu)
        .unwrap();
    let mask: Vec<Vec<f32>> = b.mask.as_ref().unwrap().to_vec2().unwrap();
    let pos: Vec<Vec<u32>> = b.rows.positions.as_ref().unwrap().to_vec2().unwrap();
    let ids: Vec<Vec<u32>> = b.rows.doc_ids.as_ref().unwrap().to_vec2().unwrap();
    for (i, &(_, t)) in windows.iter().enumerate() {
        let (mut doc, mut p) = (0, 0);
        for j in 0..12 {
            // Target j is token t + j + 1: its mask bit.
            let want = if counted[t + j + 1] { 1.0 } else { 0.0 };
            assert_eq!(mask[i][j], want);
            if j > 0 && starts.contains(&((t + j) as u64)) {
                doc += 1;
                p = 0;
            }
            assert_eq!((pos[i][j], ids[i][j]), (p, doc), "row {i} at {t} col {j}");
            p += 1;
        }
    }
    // Without document starts, --doc-mask is refused naming the directory.
    let plain = tempfile::tempdir().unwrap();
    prepared(plain.path(), &[100], &[100]);
    let err = ShardSource::open(
        plain.path(),
        ShardOptions {
            doc_mask: true,
            ..ShardOptions::default()
        },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("doc-mask") && err.contains(&plain.path().display().to_string()));
}

#[test]
fn nanogpt_bins_are_read_as_they_are() {
    let tmp = tempfile::tempdir().unwrap();
    let train: Vec<u16> = (0..1000u16).map(|i| i.wrapping_mul(37) % 50257).collect();
    let val: Vec<u16> = (0..100u16).collect();
    let bytes = |v: &[u16]| v.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>();
    std::fs::write(tmp.path().join("train.bin"), bytes(&train)).unwrap();
    std::fs::write(tmp.path().join("val.bin"), bytes(&val)).unwrap();
    let src = open(tmp.path(), DataOrder::Random);
    let want: Vec<u32> = train.iter().map(|&t| u32::from(t)).collect();
    assert_eq!(src.read(Split::Train, 0, 0, 1000).unwrap(), want);
    assert_eq!(src.len(Split::Val), 100);
    assert_eq!(src.vocab_size(), *train.iter().max().unwrap() as usize + 1);
    assert_eq!(src.decode(&[1, 2]).unwrap(), "<1><2>");
    let before = src.fingerprint();
    // An odd-sized file is refused naming it; a changed file changes the fingerprint.
    std::fs::write(tmp.path().join("val.bin"), [1u8, 2, 3]).unwrap();
    let err = ShardSource::open(tmp.path(), ShardOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("val.bin"), "{err}");
    std::fs::write(tmp.path().join("val.bin"), bytes(&val[1..])).unwrap();
    assert_ne!(open(tmp.path(), DataOrder::Random).fingerprint(), before);
}

#[test]
fn shards_that_disagree_with_the_manifest_are_refused_naming_them() {
    let tmp = tempfile::tempdir().unwrap();
    prepared(tmp.path(), &[100, 100], &[50]);
    let before = open(tmp.path(), DataOrder::Random).fingerprint();
    // Another shard put in place of train-00001.tok.
    let other = tempfile::tempdir().unwrap();
    prepared(other.path(), &[100, 99], &[50]);
    std::fs::copy(
        other.path().join("train-00001.tok"),
        tmp.path().join("train-00001.tok"),
    )
    .unwrap();
    let err = ShardSource::open(tmp.path(), ShardOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("train-00001.tok"), "{err}");
    // Prepared again with other contents: opens, with another fingerprint.
    prepared(tmp.path(), &[100, 99], &[50]);
    assert_ne!(open(tmp.path(), DataOrder::Random).fingerprint(), before);
    // Too short for the block.
    let src = open(tmp.path(), DataOrder::Epoch);
    let err = src.check_block_size(100).unwrap_err().to_string();
    assert!(err.contains("block_size"), "{err}");
    // Not a shard directory.
    let empty = tempfile::tempdir().unwrap();
    let err = ShardSource::open(empty.path(), ShardOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("manifest.json"), "{err}");
}
