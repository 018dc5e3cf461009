//! Assertions and file set-ups repeated across the integration tests.

use std::path::{Path, PathBuf};

/// Asserts that `text` (an error or a command's output) mentions every one of `parts`;
/// the panic names the missing parts and shows the whole text.
pub fn assert_mentions(text: &str, parts: &[&str]) {
    let missing: Vec<&str> = parts
        .iter()
        .copied()
        .filter(|p| !text.contains(p))
        .collect();
    assert!(missing.is_empty(), "{missing:?} not in: {text}");
}

/// Copies a model directory's `config.json` and `model.safetensors` from `from` into `to`
/// (created with its parents).
pub fn copy_model(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(from.join(f), to.join(f)).unwrap();
    }
}

/// `path` under the committed test fixtures (`trainer/tests/fixtures`).
pub fn fixtures(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(path)
}

/// The JSON document in file `path`.
pub fn read_json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap();
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The words of a fixed command line (split at white space, no quoting: for flags and values
/// without spaces; paths go in as words of their own).
pub fn words(line: &str) -> Vec<&str> {
    line.split_whitespace().collect()
}

/// A fresh temporary directory (removed when dropped) and `name` inside it.
pub fn temp_join(name: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join(name);
    (tmp, path)
}

/// A fresh temporary directory (removed when dropped) and the folder `name` inside it, made
/// and holding `files` (file name, contents).
pub fn temp_files(name: &str, files: &[(&str, &str)]) -> (tempfile::TempDir, PathBuf) {
    let (tmp, dir) = temp_join(name);
    std::fs::create_dir_all(&dir).unwrap();
    for (file, text) in files {
        std::fs::write(dir.join(file), text).unwrap();
    }
    (tmp, dir)
}
