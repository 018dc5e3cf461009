//! Atomic file writes and checked safetensors reads.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::Path;

use candle_core::{Device, Tensor};

use crate::{Error, Result};

/// Writes `bytes` to `path` atomically: a temporary file in the same directory is written,
/// fsynced and renamed over `path`, then the directory is fsynced. A crash leaves either the old
/// file or the new one, never a torn one. Concurrent writers (threads or processes) each use a
/// temporary file of their own; the last rename wins.
///
/// The trainer's one atomic writer: checkpoints, metrics, `latest`, run configs and the token
/// cache all go through it.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |w| w.write_all(bytes))
}

/// [`write_atomic`] for contents streamed by `write` into a buffered writer (a large file is
/// never held in memory whole).
///
/// The one place the trainer creates the files it writes: every file is created by
/// `File::create_new`, so it gets the mode every other file gets (`0666` less the umask,
/// usually `0644`), never a temporary-file crate's `0600`.
pub(crate) fn write_atomic_with(
    path: &Path,
    write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> Result<()> {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "file".into());
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(".{name}.tmp-{}-{n}", std::process::id()));
    let result = (|| -> std::io::Result<()> {
        let mut w = std::io::BufWriter::with_capacity(1 << 20, File::create_new(&tmp)?);
        write(&mut w)?;
        let f = w.into_inner().map_err(|e| e.into_error())?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, path)?;
        sync_dir(dir)
    })();
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp);
        return Err(Error::io(path, e));
    }
    Ok(())
}

/// Refuses a path that cannot become a directory because it, or a directory it would be
/// created in, is a file (or anything but a directory): the error names that file and says
/// so, where creating it would only say "File exists" or "Not a directory".
pub fn check_dir_path(path: &Path) -> Result<()> {
    let Some(blocker) = path
        .ancestors()
        .filter(|p| !p.as_os_str().is_empty())
        .find(|p| fs::symlink_metadata(p).is_ok())
        .filter(|p| !p.is_dir())
    else {
        return Ok(());
    };
    let inside = match blocker == path {
        true => String::new(),
        false => format!(" (cannot create {} in it)", path.display()),
    };
    Err(Error::Config(format!(
        "{} is a file, not a directory{inside}",
        blocker.display()
    )))
}

/// Creates the directory `path` and its parents ([`fs::create_dir_all`]), refusing first a
/// path that is a file ([`check_dir_path`]); errors name the path.
pub fn create_dir_all(path: &Path) -> Result<()> {
    check_dir_path(path)?;
    fs::create_dir_all(path).map_err(|e| Error::io(path, e))
}

/// fsyncs a directory so that renames inside it are durable (no-op where unsupported).
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        File::open(dir)?.sync_all()?;
    }
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// Writes named tensors (and string metadata) in the safetensors format (the `safetensors`
/// crate's serialiser), atomically, through [`write_atomic`] (so with the usual file mode, not
/// the 0600 of the crate's `serialize_to_file`).
pub fn save_safetensors(
    path: &Path,
    tensors: &[(String, Tensor)],
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    // safetensors needs contiguous data; `View` for Tensor handles the copy to the host.
    let mut items = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        items.push((name.as_str(), t.contiguous()?));
    }
    let bytes = safetensors::serialize(items, metadata)
        .map_err(|e| Error::checkpoint(path, format!("cannot serialise: {e}")))?;
    write_atomic(path, &bytes)
}

/// A safetensors file read and validated: tensors on `device` and the metadata.
pub struct Loaded {
    /// The tensors by name.
    pub tensors: HashMap<String, Tensor>,
    /// The string metadata of the header (empty if none).
    pub metadata: HashMap<String, String>,
}

/// The string metadata of the safetensors file at `path`, read from its header alone (the
/// file is mapped, its tensors not read).
pub fn read_safetensors_metadata(path: &Path) -> Result<HashMap<String, String>> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: the map is only read, for the header, while the file is open.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
    let (_, meta) = safetensors::SafeTensors::read_metadata(&map).map_err(|e| {
        Error::checkpoint(
            path,
            format!("not a valid safetensors file (truncated or corrupt?): {e}"),
        )
    })?;
    Ok(meta.metadata().clone().unwrap_or_default())
}

/// Reads a safetensors file, turning a missing, truncated or corrupt file into an error that
/// names the file and the problem.
pub fn load_safetensors(path: &Path, device: &Device) -> Result<Loaded> {
    let bytes = fs::read(path).map_err(|e| Error::io(path, e))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| {
        Error::checkpoint(
            path,
            format!("not a valid safetensors file (truncated or corrupt?): {e}"),
        )
    })?;
    let metadata = safetensors::SafeTensors::read_metadata(&bytes)
        .ok()
        .and_then(|(_, m)| m.metadata().clone())
        .unwrap_or_default();
    let mut tensors = HashMap::new();
    for (name, view) in st.tensors() {
        let t = candle_core::safetensors::Load::load(&view, device)
            .map_err(|e| Error::checkpoint(path, format!("tensor `{name}`: {e}")))?;
        tensors.insert(name, t);
    }
    Ok(Loaded { tensors, metadata })
}

/// Reads a JSON file into `T`, naming the file on error.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::checkpoint(path, format!("invalid JSON: {e}")))
}

/// Writes `value` as pretty JSON, atomically.
pub fn write_json<T: serde::Serialize>(path: &Path, value: &T) -> Result<()> {
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| Error::checkpoint(path, format!("cannot serialise: {e}")))?;
    write_atomic(path, text.as_bytes())
}
