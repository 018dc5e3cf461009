//! `prepare`'s input files: the files, directories and globs it is given, expanded in order.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Files named by `inputs`, in order: a file as it is, a directory's regular files (recursive,
/// hidden ones skipped, sorted by path), a glob's matches (sorted).
pub(crate) fn expand_inputs(inputs: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for input in inputs {
        let text = input.to_string_lossy();
        if input.is_dir() {
            let mut found = Vec::new();
            walk(input, &mut found)?;
            found.sort();
            if found.is_empty() {
                return Err(Error::data(input, "directory holds no files"));
            }
            out.extend(found);
        } else if !input.exists() && text.contains(['*', '?', '[']) {
            let paths = glob::glob(&text)
                .map_err(|e| Error::data(input, format!("not a valid glob: {e}")))?;
            let mut found = Vec::new();
            for p in paths {
                let p = p.map_err(|e| {
                    let path = e.path().to_path_buf();
                    Error::io(path, e.into())
                })?;
                if p.is_file() {
                    found.push(p);
                }
            }
            found.sort();
            if found.is_empty() {
                return Err(Error::data(input, "the glob matches no file"));
            }
            out.extend(found);
        } else {
            let meta = std::fs::metadata(input).map_err(|e| Error::io(input, e))?;
            if !meta.is_file() {
                return Err(Error::data(input, "not a regular file"));
            }
            out.push(input.clone());
        }
    }
    Ok(out)
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        let path = entry.path();
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        if path.is_dir() {
            walk(&path, out)?;
        } else if path.is_file() {
            out.push(path);
        }
    }
    Ok(())
}
