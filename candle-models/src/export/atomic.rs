//! Writing an export's directory atomically: filled beside its destination, renamed into
//! place, nothing left behind on failure (nor by killed exports, once their process is gone).

use std::fs;
use std::path::{Path, PathBuf};

use crate::load::ModelDir;
use crate::{Error, Result};
use candle_data::io;

/// Refuses an output that is a file, holds files (unless `force`), or holds the source.
pub(super) fn check_destination(source: &ModelDir, out: &Path, force: bool) -> Result<()> {
    if out.exists() && !out.is_dir() {
        return Err(Error::checkpoint(out, "exists and is not a directory"));
    }
    if !out.is_dir() {
        return Ok(());
    }
    let (o, s) = (fs::canonicalize(out), fs::canonicalize(&source.dir));
    if let (Ok(o), Ok(s)) = (o, s) {
        if s.starts_with(&o) {
            return Err(Error::checkpoint(
                out,
                format!(
                    "holds the model being exported ({}): export to another directory",
                    source.dir.display()
                ),
            ));
        }
    }
    let full = fs::read_dir(out)
        .map_err(|e| Error::io(out, e))?
        .next()
        .is_some();
    if full && !force {
        return Err(Error::checkpoint(
            out,
            "already holds files: export to a new or empty directory, or replace it with \
             --force",
        ));
    }
    Ok(())
}

/// A fresh temporary directory beside `out`, and `out`'s file name.
pub(super) fn temporary_beside(out: &Path) -> Result<(PathBuf, String)> {
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| Error::checkpoint(out, "names no directory"))?;
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    fs::create_dir_all(&parent).map_err(|e| Error::io(&parent, e))?;
    remove_stale_temporaries(&parent, &name);
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    fs::create_dir(&tmp).map_err(|e| Error::io(&tmp, e))?;
    Ok((tmp, name))
}

/// Renames the finished `tmp` to `out`, replacing what `out` held.
fn place(tmp: &Path, out: &Path, name: &str) -> Result<()> {
    if out.exists() {
        let old = out.with_file_name(format!(".{name}.old-{}", std::process::id()));
        fs::rename(out, &old).map_err(|e| Error::io(out, e))?;
        if let Err(e) = fs::rename(tmp, out) {
            let _ = fs::rename(&old, out);
            return Err(Error::io(out, e));
        }
        let _ = fs::remove_dir_all(&old);
    } else {
        fs::rename(tmp, out).map_err(|e| Error::io(out, e))?;
    }
    match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => io::sync_dir(p).map_err(|e| Error::io(p, e)),
        _ => Ok(()),
    }
}

/// Writes a directory at `out`: `write` fills a fresh temporary directory beside it, the
/// files `copies` are copied in, and it is renamed into place; on failure nothing is left.
pub(super) fn write_dir<T>(
    out: &Path,
    copies: &[(String, PathBuf)],
    write: impl FnOnce(&Path) -> Result<T>,
) -> Result<T> {
    let (tmp, name) = temporary_beside(out)?;
    let guard = RemoveOnDrop(Some(tmp.clone()));
    let t = write(&tmp)?;
    for (file, from) in copies {
        let bytes = fs::read(from).map_err(|e| Error::io(from, e))?;
        io::write_atomic(&tmp.join(file), &bytes)?;
    }
    io::sync_dir(&tmp).map_err(|e| Error::io(&tmp, e))?;
    place(&tmp, out, &name)?;
    guard.disarm();
    Ok(t)
}

/// Removes a temporary directory when dropped, unless disarmed: an error, an early return or
/// a panic between its creation and its rename into place leaves nothing behind.
pub(super) struct RemoveOnDrop(pub(super) Option<PathBuf>);

impl RemoveOnDrop {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(dir) = self.0.take() {
            let _ = fs::remove_dir_all(&dir);
        }
    }
}

/// Whether process `pid` is alive (unknown counts as alive, so that nothing of a running
/// export is ever removed).
fn process_alive(pid: u32) -> bool {
    #[cfg(unix)]
    {
        let Ok(pid) = libc::pid_t::try_from(pid) else {
            return true;
        };
        // SAFETY: signal 0 only checks that the process exists; nothing is sent.
        let r = unsafe { libc::kill(pid, 0) };
        r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
    }
    #[cfg(not(unix))]
    {
        let _ = pid;
        true
    }
}

/// Removes what exports to `name` in `parent` that were killed left behind: the temporary
/// directories (`.NAME.tmp-PID`) and moved-aside old outputs (`.NAME.old-PID`, when the new
/// one is in place) of processes no longer alive, and says so in one log line.
fn remove_stale_temporaries(parent: &Path, name: &str) {
    let Ok(entries) = fs::read_dir(parent) else {
        return;
    };
    let prefixes = [format!(".{name}.tmp-"), format!(".{name}.old-")];
    let own = std::process::id();
    let mut removed = Vec::new();
    let mut bytes = 0u64;
    for entry in entries.flatten() {
        let file = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = prefixes
            .iter()
            .find_map(|p| file.strip_prefix(p.as_str()))
            .and_then(|rest| rest.parse::<u32>().ok())
        else {
            continue;
        };
        let path = entry.path();
        // A moved-aside old output is the only copy while the output is missing: kept.
        let only_copy = file.contains(".old-") && !parent.join(name).exists();
        if pid == own || only_copy || !path.is_dir() || process_alive(pid) {
            continue;
        }
        let size = dir_size(&path);
        if fs::remove_dir_all(&path).is_ok() {
            removed.push(file);
            bytes += size;
        }
    }
    if !removed.is_empty() {
        tracing::warn!(
            "{}: removed {} left behind by interrupted exports of processes no longer alive \
             ({} MB): {}",
            parent.display(),
            removed.len(),
            bytes / 1_000_000,
            removed.join(", ")
        );
    }
}

/// Bytes of the files under `dir`.
fn dir_size(dir: &Path) -> u64 {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_size(&e.path()),
            _ => e.metadata().map_or(0, |m| m.len()),
        })
        .sum()
}
