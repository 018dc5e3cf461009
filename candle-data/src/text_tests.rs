//! Tests of the text sources (kept apart from `text.rs` to keep both files short).

use candle_core::Device;

use super::*;
use crate::open;
use rand::SeedableRng;

const CORPUS: &str = "First Citizen:\nBefore we proceed any further, hear me speak.\n\n\
                      All:\nSpeak, speak.\n\nFirst Citizen:\nYou are all resolved rather to die \
                      than to famish?\n\u{e9}t\u{e9}\n";

struct Fixture {
    dir: tempfile::TempDir,
}

impl Fixture {
    fn new() -> Self {
        Fixture {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn file(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.dir.path().join("data").join(name);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(&p, bytes).unwrap();
        p
    }

    fn cache(&self) -> PathBuf {
        self.dir.path().join("cache")
    }

    fn spec(&self, kind: DataKind, path: &Path) -> DataSpec {
        DataSpec {
            kind,
            path: Some(path.to_path_buf()),
            cache_dir: Some(self.cache()),
            ..DataSpec::default()
        }
    }

    /// A word-level tokenizer.json built with the `tokenizers` crate (no download).
    fn tokenizer(&self) -> PathBuf {
        let words = ["<unk>", "hello", "world", "the", "cat", "sat", ",", "."];
        let p = self.dir.path().join("tokenizer.json");
        let tok = crate::tokenizer::word_level(&words, &[]).unwrap();
        tok.save(&p, false).unwrap();
        p
    }
}

/// Asserts that `src`'s description mentions `what`.
fn assert_describes(src: &TextSource, what: &str) {
    let d = src.describe();
    assert!(d.contains(what), "{d}");
}

fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// Every token of both splits, in order.
fn all_tokens(s: &TextSource) -> Vec<u32> {
    [
        s.tokens(Split::Train).unwrap(),
        s.tokens(Split::Val).unwrap(),
    ]
    .concat()
}

fn err_of(spec: &DataSpec) -> String {
    match open(spec) {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn char_vocab_split_and_round_trip() {
    let fx = Fixture::new();
    let p = fx.file("corpus.txt", CORPUS.as_bytes());
    let src = TextSource::open(&fx.spec(DataKind::Char, &p)).unwrap();
    let mut chars: Vec<char> = CORPUS.chars().collect();
    chars.sort_unstable();
    chars.dedup();
    assert_eq!(src.vocab_size(), chars.len());
    let all: Vec<u32> = CORPUS
        .chars()
        .map(|c| chars.binary_search(&c).unwrap() as u32)
        .collect();
    let n_train = (all.len() as f64 * 0.9).floor() as usize;
    assert_eq!(src.tokens(Split::Train).unwrap(), &all[..n_train]);
    assert_eq!(src.tokens(Split::Val).unwrap(), &all[n_train..]);
    assert_eq!(src.encode(CORPUS).unwrap(), all);
    assert_eq!(src.decode(&all).unwrap(), CORPUS);
    let d = src.describe();
    assert!(
        d.starts_with("corpus.txt:") && d.contains("char vocab"),
        "{d}"
    );
    let err = src.encode("Zebra").unwrap_err().to_string();
    assert!(err.contains("'Z'") && err.contains("corpus.txt"), "{err}");
    assert!(src.decode(&[chars.len() as u32]).is_err());
}

#[test]
fn byte_mode_takes_any_bytes() {
    let fx = Fixture::new();
    let bytes: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
    let p = fx.file("blob.bin", &bytes);
    let src = TextSource::open(&fx.spec(DataKind::Byte, &p)).unwrap();
    assert_eq!(src.vocab_size(), 256);
    let all: Vec<u32> = bytes.iter().map(|&b| u32::from(b)).collect();
    assert_eq!(src.tokens(Split::Train).unwrap(), &all[..900]);
    assert_eq!(src.encode("h\u{e9}").unwrap(), vec![104, 0xc3, 0xa9]);
    assert_eq!(src.decode(&[104, 0xc3, 0xa9]).unwrap(), "h\u{e9}");
    assert!(src.decode(&[256]).is_err());
    // No cache for bytes: the file is its own token list.
    assert!(!fx.cache().exists());
}

#[test]
fn windows_come_from_their_split_and_y_is_shifted() {
    let fx = Fixture::new();
    let text: String = (0..3000)
        .map(|i| char::from(b'a' + (i * 7 % 26) as u8))
        .collect();
    let p = fx.file("abc.txt", text.as_bytes());
    let src = TextSource::open(&fx.spec(DataKind::Char, &p)).unwrap();
    let mut r = rng(3);
    for split in [Split::Train, Split::Val] {
        let data = src.tokens(split).unwrap();
        let b = src.batch(split, 8, 16, &mut r, &Device::Cpu).unwrap();
        assert_eq!(b.x.dims(), &[8, 16]);
        assert!(b.mask.is_none());
        let x = b.x.to_vec2::<u32>().unwrap();
        let y = b.y.to_vec2::<u32>().unwrap();
        for (xr, yr) in x.iter().zip(&y) {
            let mut window = xr.clone();
            window.push(*yr.last().unwrap());
            assert_eq!(&xr[1..], &yr[..15]);
            assert!(data.windows(17).any(|w| w == window.as_slice()));
        }
    }
    // The last possible window is reachable: a split of exactly block_size + 1 tokens works.
    let val_len = src.tokens(Split::Val).unwrap().len();
    let b = src
        .batch(Split::Val, 2, val_len - 1, &mut r, &Device::Cpu)
        .unwrap();
    assert_eq!(
        b.x.to_vec2::<u32>().unwrap()[0],
        &src.tokens(Split::Val).unwrap()[..val_len - 1]
    );
}

#[test]
fn batches_are_determined_by_rng_state() {
    let fx = Fixture::new();
    let p = fx.file("c.txt", CORPUS.repeat(20).as_bytes());
    let src = open(&fx.spec(DataKind::Char, &p)).unwrap();
    let mut r1 = rng(11);
    let mut r2 = rng(11);
    let a = src
        .batch(Split::Train, 4, 32, &mut r1, &Device::Cpu)
        .unwrap();
    let b = src
        .batch(Split::Train, 4, 32, &mut r2, &Device::Cpu)
        .unwrap();
    assert_eq!(a.x.to_vec2::<u32>().unwrap(), b.x.to_vec2::<u32>().unwrap());
    let saved = r1.clone();
    let c = src
        .batch(Split::Train, 4, 32, &mut r1, &Device::Cpu)
        .unwrap();
    let d = src
        .batch(Split::Train, 4, 32, &mut saved.clone(), &Device::Cpu)
        .unwrap();
    assert_eq!(c.y.to_vec2::<u32>().unwrap(), d.y.to_vec2::<u32>().unwrap());
    assert_ne!(a.x.to_vec2::<u32>().unwrap(), c.x.to_vec2::<u32>().unwrap());
}

#[test]
fn cache_hit_is_identical_and_corrupt_cache_is_rebuilt() {
    let fx = Fixture::new();
    let p = fx.file("corpus.txt", CORPUS.as_bytes());
    let spec = fx.spec(DataKind::Char, &p);
    let first = TextSource::open(&spec).unwrap();
    assert_describes(&first, "tokenised, cached");
    let entries: Vec<_> = fs::read_dir(fx.cache()).unwrap().collect();
    assert_eq!(entries.len(), 1, "one cache entry, no temp leftovers");
    // The entry is a prepared shard directory: manifest.json, one shard a split.
    let entry = entries[0].as_ref().unwrap().path();
    let mut files: Vec<String> = fs::read_dir(&entry)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(files, ["manifest.json", "train-00000.tok", "val-00000.tok"]);
    let shard = entry.join("train-00000.tok");
    // Nothing is written next to the data file.
    assert_eq!(fs::read_dir(p.parent().unwrap()).unwrap().count(), 1);

    let all = all_tokens;
    let second = TextSource::open(&spec).unwrap();
    assert_describes(&second, "cache hit");
    assert_eq!(all(&second), all(&first));
    assert_eq!(second.fingerprint(), first.fingerprint());
    assert_eq!(second.vocab_size(), first.vocab_size());
    assert_eq!(second.decode(&all(&second)).unwrap(), CORPUS);

    // Captured before the shard is corrupted in place below (which `first`, mapping it,
    // would see: the cache itself is only ever replaced by renaming a new directory in).
    let want = all(&first);
    let good = fs::read(&shard).unwrap();
    for corrupt in [good[..good.len() - 3].to_vec(), {
        let mut b = good.clone();
        let last = b.len() - 1;
        b[last] ^= 1;
        b
    }] {
        fs::write(&shard, corrupt).unwrap();
        let rebuilt = TextSource::open(&spec).unwrap();
        assert_describes(&rebuilt, "tokenised");
        assert_eq!(all(&rebuilt), want);
        assert_eq!(fs::read(&shard).unwrap(), good, "cache rewritten");
    }

    // A changed file misses the cache.
    fs::write(&p, format!("{CORPUS}more")).unwrap();
    let changed = TextSource::open(&spec).unwrap();
    assert!(changed.describe().contains("tokenised"));
    assert_eq!(all(&changed).len(), want.len() + 4);
}

#[test]
fn unwritable_cache_is_only_a_warning() {
    let fx = Fixture::new();
    let p = fx.file("corpus.txt", CORPUS.as_bytes());
    let blocker = fx.file("not-a-dir", b"x");
    let mut spec = fx.spec(DataKind::Char, &p);
    spec.cache_dir = Some(blocker.join("cache"));
    let src = TextSource::open(&spec).unwrap();
    assert!(src.describe().contains("cache not written"));
}

#[test]
fn tokenizer_json_source() {
    let fx = Fixture::new();
    let tok = fx.tokenizer();
    let text = "hello world , the cat sat .\nthe cat sat on the world .\n".repeat(10);
    let p = fx.file("words.txt", text.as_bytes());
    let mut spec = fx.spec(DataKind::Tokenizer, &p);
    spec.tokenizer = Some(tok.clone());
    let src = open(&spec).unwrap();
    assert_eq!(src.vocab_size(), 8);
    assert_eq!(src.encode("hello world .").unwrap(), vec![1, 2, 7]);
    assert_eq!(src.encode("hello dog").unwrap(), vec![1, 0]);
    assert_eq!(src.decode(&[1, 2, 7]).unwrap(), "hello world .");
    let b = src
        .batch(Split::Train, 2, 5, &mut rng(0), &Device::Cpu)
        .unwrap();
    assert_eq!(b.x.dims(), &[2, 5]);
    let d = src.describe();
    assert!(d.contains("tokenizer.json vocab 8"), "{d}");
    // 14 tokens per line, 10 times ("on" is unknown).
    let again = TextSource::open(&spec).unwrap();
    assert!(again.describe().contains("cache hit"));
    assert_eq!(all_tokens(&again).len(), 140);
    assert_eq!(&all_tokens(&again)[..7], &[1, 2, 6, 3, 4, 5, 7]);

    // A different tokenizer file content misses the cache.
    let other = fx.dir.path().join("other.json");
    let json = fs::read_to_string(&tok)
        .unwrap()
        .replace("\"cat\"", "\"dog\"");
    fs::write(&other, json).unwrap();
    spec.tokenizer = Some(other);
    let third = TextSource::open(&spec).unwrap();
    assert!(third.describe().contains("tokenised"));
    assert_eq!(&all_tokens(&third)[..7], &[1, 2, 6, 3, 0, 5, 7]);
}

#[test]
fn bad_inputs_give_clear_errors_naming_the_file() {
    let fx = Fixture::new();
    // Missing file.
    let missing = fx.dir.path().join("nope.txt");
    let err = err_of(&fx.spec(DataKind::Char, &missing));
    assert!(err.contains("nope.txt"), "{err}");
    // A directory.
    let err = err_of(&fx.spec(DataKind::Byte, fx.dir.path()));
    assert!(err.contains("directory"), "{err}");
    // Empty file.
    let empty = fx.file("empty.txt", b"");
    for kind in [DataKind::Char, DataKind::Byte] {
        let err = err_of(&fx.spec(kind, &empty));
        assert!(err.contains("empty.txt") && err.contains("empty"), "{err}");
    }
    // Invalid UTF-8 for char mode (fine for byte mode).
    let latin1 = fx.file("latin1.txt", b"caf\xe9 au lait");
    let err = err_of(&fx.spec(DataKind::Char, &latin1));
    assert!(err.contains("latin1.txt") && err.contains("UTF-8") && err.contains("offset 3"));
    assert!(open(&fx.spec(DataKind::Byte, &latin1)).is_ok());
    // Corpus too short for the block size, in either split.
    let short = fx.file("short.txt", &[b'x'; 100]);
    let src = open(&fx.spec(DataKind::Byte, &short)).unwrap();
    assert!(src.check_block_size(9).is_ok());
    let err = src.check_block_size(10).unwrap_err().to_string();
    assert!(
        err.contains("short.txt") && err.contains("val split"),
        "{err}"
    );
    assert!(
        err.contains("has 10 tokens") && err.contains("= 11"),
        "{err}"
    );
    let err = src
        .batch(Split::Train, 1, 95, &mut rng(0), &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("train split") && err.contains("has 90 tokens"),
        "{err}"
    );
    // Missing and malformed tokenizer.json.
    let text = fx.file("t.txt", b"hello world");
    let mut spec = fx.spec(DataKind::Tokenizer, &text);
    spec.tokenizer = Some(fx.dir.path().join("missing.json"));
    assert!(err_of(&spec).contains("missing.json"));
    // A tokenizer that yields nothing for this text (whitespace only).
    spec.tokenizer = Some(fx.tokenizer());
    spec.path = Some(fx.file("blank.txt", b"   \n\t\n"));
    let err = err_of(&spec);
    assert!(
        err.contains("blank.txt") && err.contains("no tokens"),
        "{err}"
    );
    let bad = fx.file("bad.json", b"{\"model\": 42}");
    spec.tokenizer = Some(bad);
    let err = err_of(&spec);
    assert!(
        err.contains("bad.json") && err.contains("tokenizer"),
        "{err}"
    );
}

#[test]
fn tokenizer_chunks_cover_text_and_cut_at_line_starts() {
    let line = "word ".repeat(50) + "\n  indented\n";
    let text = line.repeat(TOKENIZER_CHUNK_BYTES / line.len() * 3);
    let chunks = tokenizer_chunks(&text);
    assert!(chunks.len() >= 3);
    assert_eq!(chunks.concat(), text);
    for c in &chunks[..chunks.len() - 1] {
        assert!(c.ends_with('\n'));
    }
    for c in &chunks[1..] {
        assert!(c.starts_with("word"));
    }
    assert_eq!(tokenizer_chunks("abc"), vec!["abc"]);
    assert!(tokenizer_chunks("").is_empty());
}

#[test]
fn human_sizes() {
    assert_eq!(human(950), "950");
    assert_eq!(human(12_345), "12.3k");
    assert_eq!(human(1_115_394), "1.1M");
}

/// The real corpus of the "baby GPT" recipe, shipped in the repository's `data/`.
#[test]
fn tinyshakespeare_matches_nanogpt_split() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/tinyshakespeare.txt");
    assert!(
        path.exists(),
        "{} is shipped with the repository",
        path.display()
    );
    let fx = Fixture::new();
    let spec = fx.spec(DataKind::Char, &path);
    let src = TextSource::open(&spec).unwrap();
    // nanoGPT's shakespeare_char/prepare.py: 65 chars, 1003854 train / 111540 val tokens.
    assert_eq!(src.vocab_size(), 65);
    assert_eq!(src.tokens(Split::Train).unwrap().len(), 1_003_854);
    assert_eq!(src.tokens(Split::Val).unwrap().len(), 111_540);
    let d = src.describe();
    assert!(
        d.starts_with("tinyshakespeare.txt: 1.1M chars, char vocab 65, 1003854 train / 111540 val"),
        "{d}"
    );
    let again = TextSource::open(&spec).unwrap();
    assert!(again.describe().contains("cache hit"));
    assert_eq!(all_tokens(&again), all_tokens(&src));
    let text = fs::read_to_string(&path).unwrap();
    assert_eq!(
        src.decode(&all_tokens(&src)[..1000]).unwrap(),
        text.chars().take(1000).collect::<String>()
    );
}
