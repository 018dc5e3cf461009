use super::*;
use crate::shards::write::{shard_writer, ShardWriter};

/// Writes the shard `w` to `path` atomically and returns its header.
fn finish(path: &Path, w: Result<ShardWriter>) -> Result<ShardHeader> {
    let (header, bytes) = w?.to_bytes(path)?;
    crate::io::write_atomic(path, &bytes)?;
    Ok(header)
}
use crate::hash::Hasher64;

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

#[test]
fn round_trip_both_widths_with_docs_and_mask() {
    let dir = tmp();
    for (width, top) in [(2u32, 65_535u32), (4, 70_000)] {
        let tokens: Vec<u32> = (0..37u32).map(|i| (i * 7919) % (top + 1)).collect();
        let counted: Vec<bool> = (0..37).map(|i| i % 3 != 0).collect();
        let starts = [0u64, 5, 20];
        let p = dir.path().join(format!("w{width}.tok"));
        let h = finish(
            &p,
            shard_writer(&p, width, 42, &tokens, Some(&starts), Some(&counted)),
        )
        .unwrap();
        assert_eq!(h.width, width);
        assert_eq!((h.n_tokens, h.n_docs), (37, 3));
        let s = open_shard(
            &p,
            &Expect {
                vocab: Some(42),
                width: Some(width),
            },
        )
        .unwrap();
        s.verify().unwrap();
        assert_eq!(s.tokens(), tokens);
        assert_eq!(s.doc_starts().collect::<Vec<_>>(), starts);
        let mut got = Vec::new();
        s.read_counted(0, 37, &mut got);
        assert_eq!(got, counted);
        assert_eq!(s.token(36), tokens[36]);
        assert_eq!(std::fs::metadata(&p).unwrap().len(), h.file_len());
    }
    assert_eq!(width_for_vocab(65_536), 2);
    assert_eq!(width_for_vocab(65_537), 4);
}

#[test]
fn without_streams_every_token_counts() {
    let dir = tmp();
    let p = dir.path().join("plain.tok");
    let h = finish(&p, shard_writer(&p, 2, 1, &[1, 2, 3], None, None)).unwrap();
    assert!(!h.has_docs() && !h.has_mask());
    let s = open_shard(&p, &Expect::default()).unwrap();
    assert!(s.counted(2));
    assert_eq!(s.doc_starts().count(), 0);
    assert!(s.mask_bytes().is_none());
}

#[test]
fn corrupt_truncated_and_mismatched_shards_are_refused_naming_the_file() {
    let dir = tmp();
    let p = dir.path().join("train-00000.tok");
    let tokens: Vec<u32> = (0..100).collect();
    finish(&p, shard_writer(&p, 2, 7, &tokens, Some(&[0, 50]), None)).unwrap();
    let good = std::fs::read(&p).unwrap();
    let check = |bytes: &[u8], expect: Expect, want: &str| {
        std::fs::write(&p, bytes).unwrap();
        let err = verify(&p, &expect).unwrap_err().to_string();
        assert!(err.contains("train-00000.tok"), "{err}");
        assert!(err.contains(want), "{want}: {err}");
    };
    let mut flipped = good.clone();
    flipped[HEADER_LEN + 11] ^= 0x10;
    check(&flipped, Expect::default(), "checksum");
    check(&good[..good.len() - 3], Expect::default(), "truncated");
    check(&good[..10], Expect::default(), "truncated");
    check(
        &good,
        Expect {
            vocab: Some(8),
            width: None,
        },
        "vocabulary",
    );
    check(
        &good,
        Expect {
            vocab: None,
            width: Some(4),
        },
        "width",
    );
    let mut magic = good.clone();
    magic[0] = b'X';
    check(&magic, Expect::default(), "magic");
    std::fs::write(&p, &good).unwrap();
    verify(
        &p,
        &Expect {
            vocab: Some(7),
            width: Some(2),
        },
    )
    .unwrap();
}

#[test]
fn pair_tables_round_trip_and_one_that_does_not_fit_its_documents_is_refused() {
    let dir = tmp();
    let pair = |prompt, chosen, rejected, line| PairEntry {
        prompt_len: prompt,
        chosen_len: chosen,
        rejected_len: rejected,
        line,
    };
    // two pairs, the second continuing into the next shard (5 + 4 + 3 = 12 > 9)
    let entries = [pair(2, 3, 2, 1), pair(1, 3, 3, 7)];
    let write = |name: &str, entries: &[PairEntry]| {
        let p = dir.path().join(name);
        let mut w = ShardWriter::new(2, 9, true, false).with_pairs(&[]);
        w.start_pair(&entries[0]);
        w.push(&[1, 2, 3, 4, 5], None);
        w.start_pair(&entries[1]);
        w.push(&[6, 7, 8, 9], None);
        finish(&p, Ok(w)).unwrap();
        p
    };
    let p = write("pairs.tok", &entries);
    let s = open_shard(&p, &Expect::default()).unwrap();
    assert!(s.header().has_pairs() && s.header().has_docs());
    s.verify().unwrap();
    assert_eq!(s.pairs().collect::<Vec<_>>(), entries);
    assert_eq!(s.doc_starts().collect::<Vec<_>>(), [0, 5]);
    assert_eq!(std::fs::metadata(&p).unwrap().len(), s.header().file_len());
    // the first pair says 6 tokens where its document holds 5
    let p = write("bad.tok", &[pair(2, 4, 2, 1), entries[1]]);
    let e = open_shard(&p, &Expect::default())
        .unwrap()
        .verify()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("bad.tok") && e.contains("corrupt pair table") && e.contains("line 1"),
        "{e}"
    );
}

#[test]
fn wide_tokens_in_a_narrow_shard_are_refused() {
    let dir = tmp();
    let p = dir.path().join("x.tok");
    let err = finish(&p, shard_writer(&p, 2, 0, &[70_000], None, None))
        .unwrap_err()
        .to_string();
    assert!(err.contains("x.tok") && err.contains("70000"), "{err}");
}

#[test]
fn streamed_checksum_equals_one_call() {
    let body: Vec<u8> = (0..1000u32).map(|i| (i * 31) as u8).collect();
    let mut h = Hasher64::new();
    for c in body.chunks(64) {
        h.update(c);
    }
    assert_eq!(h.finish(), checksum(&body));
}

#[test]
fn manifest_round_trip_and_fingerprint() {
    let dir = tmp();
    let entry = |f: &str, c: &str| ShardEntry {
        file: f.into(),
        tokens: 10,
        docs: 1,
        checksum: c.into(),
        chunk_sums: String::new(),
    };
    let mut m = Manifest {
        format: MANIFEST_FORMAT,
        tokenizer: TokenizerInfo {
            kind: "byte".into(),
            path: None,
            hash: format!("{:016x}", byte_vocab_hash()),
            chars: None,
        },
        vocab_size: 256,
        eos_id: None,
        width: 2,
        docs: true,
        mask: false,
        pairs: false,
        train: vec![entry("train-00000.tok", "00000000000000aa")],
        val: vec![],
        inputs: vec![],
        settings: serde_json::json!({"shard_tokens": 10}),
    };
    m.write(dir.path()).unwrap();
    let back = Manifest::read(dir.path()).unwrap();
    assert_eq!(back, m);
    assert_eq!(back.vocab_hash(), Some(byte_vocab_hash()));
    let f = m.fingerprint();
    m.train[0].checksum = "00000000000000ab".into();
    assert_ne!(f, m.fingerprint());
}
