//! Run directories: which one a run writes into, and the rules that keep runs from destroying
//! each other.
//!
//! - A fresh run never writes into an existing run directory (one with `run.toml`,
//!   `metrics.jsonl` or `checkpoints/`) unless told to overwrite it; `RunDir::claim` refuses
//!   with a message naming `--resume` and `--overwrite`.
//! - A resumed run continues in the run directory that holds the checkpoint it resumed from
//!   (`run_dir_of`), never in the `out_dir` recorded in the checkpoint (which may be another
//!   copy of the run, or relative to another working directory).
//! - One process at a time: a claimed directory is locked (`.lock`, an advisory OS file lock
//!   released when the process exits, even when killed).
//! - Leftovers of a process killed while writing (`checkpoints/.tmp-*` checkpoints, an `.old-*`
//!   directory moved aside while re-saving a step, and the `.NAME.tmp-*` files of atomic writes
//!   in the run and checkpoints directories) are cleaned up when the directory is claimed.

use std::fs::{self, File};
use std::path::{Path, PathBuf};

use crate::checkpoint;
use crate::{Error, Result};

/// Files and directories whose presence makes a directory a run directory.
const RUN_MARKERS: [&str; 3] = ["run.toml", "metrics.jsonl", "checkpoints"];

/// Files a run writes at the top of its directory (removed by an overwrite).
const RUN_FILES: [&str; 4] = ["run.toml", "metrics.jsonl", "loss.svg", "checkpoints"];

/// The lock file of a run directory.
pub(crate) const LOCK_FILE: &str = ".lock";

/// Whether `dir` holds (part of) a run: a `run.toml`, `metrics.jsonl` or `checkpoints/`.
pub(crate) fn is_run_dir(dir: &Path) -> bool {
    RUN_MARKERS.iter().any(|m| dir.join(m).exists())
}

/// The run directory a checkpoint directory belongs to (`RUN/checkpoints/step-N` gives `RUN`),
/// or `None` for a checkpoint that is not inside a run's `checkpoints/`.
pub(crate) fn run_dir_of(checkpoint_dir: &Path) -> Option<PathBuf> {
    let real = fs::canonicalize(checkpoint_dir).ok()?;
    let parent = real.parent()?;
    if parent.file_name()? != "checkpoints" {
        return None;
    }
    parent.parent().map(Path::to_path_buf)
}

/// `base` if it is not a run directory yet, else the first of `base-2`, `base-3`, ... that is
/// not: a fresh name for a run whose directory was not chosen by the user.
pub fn fresh_name(base: &Path) -> PathBuf {
    fresh_name_besides(base, &[])
}

/// [`fresh_name`], skipping the names in `taken` too (names another process claimed first,
/// before it wrote anything that marks a run directory).
pub fn fresh_name_besides(base: &Path, taken: &[PathBuf]) -> PathBuf {
    let free = |p: &Path| !is_run_dir(p) && !taken.iter().any(|t| t == p);
    if free(base) {
        return base.to_path_buf();
    }
    let name = base
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "run".into());
    (2..)
        .map(|i| base.with_file_name(format!("{name}-{i}")))
        .find(|p| free(p))
        .unwrap_or_else(|| base.to_path_buf())
}

/// How a run may use its directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Claim {
    /// A new run: the directory must not hold a run.
    Fresh,
    /// A new run that replaces the run in the directory (its checkpoints, metrics and curve
    /// are deleted first), like Hugging Face's `overwrite_output_dir`.
    Overwrite,
    /// The continuation of the run in this directory.
    Continue,
}

/// A run directory claimed by this process: locked, and cleaned of a killed writer's leftovers.
#[derive(Debug)]
pub(crate) struct RunDir {
    _lock: File,
}

impl RunDir {
    /// Claims `path` for a run (see [`Claim`]), creating it if needed.
    pub fn claim(path: &Path, claim: Claim) -> Result<Self> {
        if claim == Claim::Fresh && is_run_dir(path) {
            return Err(Error::RunDirExists {
                path: path.to_path_buf(),
            });
        }
        crate::io::create_dir_all(path)?;
        let lock_path = path.join(LOCK_FILE);
        let lock = File::create(&lock_path).map_err(|e| Error::io(&lock_path, e))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => {
                return Err(Error::RunDirBusy {
                    path: path.to_path_buf(),
                })
            }
            Err(fs::TryLockError::Error(e)) => return Err(Error::io(&lock_path, e)),
        }
        if claim == Claim::Overwrite {
            for f in RUN_FILES {
                let p = path.join(f);
                let removed = if p.is_dir() {
                    fs::remove_dir_all(&p)
                } else if p.exists() {
                    fs::remove_file(&p)
                } else {
                    Ok(())
                };
                removed.map_err(|e| Error::io(&p, e))?;
            }
        }
        let ckpts = checkpoint::checkpoints_dir(path);
        clean_partial_checkpoints(&ckpts)?;
        clean_partial_writes(path)?;
        clean_partial_writes(&ckpts)?;
        Ok(RunDir { _lock: lock })
    }
}

/// Removes what a process killed while writing a checkpoint leaves in `ckpts`: `.tmp-*`
/// directories (incomplete checkpoints, never pointed to by `latest`), and `.old-*` ones (a
/// complete checkpoint moved aside while the same step was re-saved), which are put back if
/// their step is missing and deleted otherwise. Only called with the run directory locked.
pub(crate) fn clean_partial_checkpoints(ckpts: &Path) -> Result<()> {
    let Ok(entries) = fs::read_dir(ckpts) else {
        return Ok(()); // no checkpoints yet
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if name.starts_with(".tmp-") {
            tracing::warn!("removing an incomplete checkpoint: {}", path.display());
            remove_any(&path)?;
        } else if let Some(rest) = name.strip_prefix(".old-") {
            // `.old-step-0000100-<pid>`: the step's name is everything before the last '-'.
            let step = rest.rsplit_once('-').map_or(rest, |(s, _)| s);
            let target = ckpts.join(step);
            if step.starts_with("step-") && !target.exists() {
                fs::rename(&path, &target).map_err(|e| Error::io(&target, e))?;
            } else {
                remove_any(&path)?;
            }
        }
    }
    Ok(())
}

/// Removes the temporary files of atomic writes ([`crate::io::write_atomic`]: `.NAME.tmp-*`)
/// that a process killed mid-write left in `dir` (metrics, the run config, the loss curve,
/// `latest`). Only called with the run directory locked, so no writer is alive.
pub(crate) fn clean_partial_writes(dir: &Path) -> Result<()> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if name.starts_with('.') && name.contains(".tmp-") && path.is_file() {
            tracing::warn!("removing a partial write: {}", path.display());
            remove_any(&path)?;
        }
    }
    Ok(())
}

fn remove_any(path: &Path) -> Result<()> {
    let r = if path.is_dir() {
        fs::remove_dir_all(path)
    } else {
        fs::remove_file(path)
    };
    r.map_err(|e| Error::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_runs_refuse_existing_runs_and_fresh_names_skip_them() {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("run");
        assert_eq!(fresh_name(&run), run);
        let claimed = RunDir::claim(&run, Claim::Fresh).unwrap();
        fs::write(run.join("metrics.jsonl"), "{}\n").unwrap();
        drop(claimed);
        let e = RunDir::claim(&run, Claim::Fresh).unwrap_err().to_string();
        assert!(e.contains("--resume") && e.contains("--overwrite"), "{e}");
        assert_eq!(fresh_name(&run), tmp.path().join("run-2"));
        // A directory that holds something else (a data cache) is not a run.
        fs::create_dir_all(tmp.path().join("other/cache")).unwrap();
        RunDir::claim(&tmp.path().join("other"), Claim::Fresh).unwrap();
        // Overwrite removes the old run's files and nothing else.
        fs::write(run.join("notes.txt"), "mine").unwrap();
        RunDir::claim(&run, Claim::Overwrite).unwrap();
        assert!(!run.join("metrics.jsonl").exists());
        assert!(run.join("notes.txt").exists());
    }

    #[test]
    fn a_claimed_directory_is_locked() {
        let tmp = tempfile::tempdir().unwrap();
        let a = RunDir::claim(tmp.path(), Claim::Continue).unwrap();
        let e = RunDir::claim(tmp.path(), Claim::Continue)
            .unwrap_err()
            .to_string();
        assert!(e.contains("another process"), "{e}");
        drop(a);
        RunDir::claim(tmp.path(), Claim::Continue).unwrap();
    }

    #[test]
    fn leftovers_of_a_killed_writer_are_cleaned() {
        let tmp = tempfile::tempdir().unwrap();
        let ckpts = tmp.path().join("checkpoints");
        for d in [
            ".tmp-step-0000008-123",
            "step-0000004",
            ".old-step-0000004-77",
            ".old-step-0000006-77",
        ] {
            fs::create_dir_all(ckpts.join(d)).unwrap();
            fs::write(ckpts.join(d).join("f"), d).unwrap();
        }
        RunDir::claim(tmp.path(), Claim::Continue).unwrap();
        let mut left: Vec<String> = fs::read_dir(&ckpts)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["step-0000004", "step-0000006"]);
        // The step that existed kept its own files; the missing one was restored.
        assert_eq!(
            fs::read_to_string(ckpts.join("step-0000004/f")).unwrap(),
            "step-0000004"
        );
        assert_eq!(
            fs::read_to_string(ckpts.join("step-0000006/f")).unwrap(),
            ".old-step-0000006-77"
        );
    }

    #[test]
    fn run_dir_of_a_checkpoint() {
        let tmp = tempfile::tempdir().unwrap();
        let ck = tmp.path().join("r/checkpoints/step-0000001");
        fs::create_dir_all(&ck).unwrap();
        let real = fs::canonicalize(tmp.path().join("r")).unwrap();
        assert_eq!(run_dir_of(&ck), Some(real));
        assert_eq!(run_dir_of(tmp.path()), None);
    }

    #[test]
    fn partial_writes_are_removed_when_the_directory_is_claimed() {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("run");
        let ckpts = checkpoint::checkpoints_dir(&run);
        fs::create_dir_all(&ckpts).unwrap();
        let leftovers = [
            run.join(".metrics.jsonl.tmp-4242-3"),
            run.join(".loss.svg.tmp-4242-7"),
            ckpts.join(".latest.tmp-4242-9"),
        ];
        for p in &leftovers {
            fs::write(p, b"half").unwrap();
        }
        let kept = [run.join("metrics.jsonl"), run.join(".notes")];
        for p in &kept {
            fs::write(p, b"x").unwrap();
        }
        let _claimed = RunDir::claim(&run, Claim::Continue).unwrap();
        for p in &leftovers {
            assert!(!p.exists(), "{} survived", p.display());
        }
        for p in &kept {
            assert!(p.exists(), "{} was removed", p.display());
        }
    }
}
