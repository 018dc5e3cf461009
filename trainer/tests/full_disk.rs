//! A checkpoint written onto a full disk (#20): the save fails with an error naming the file
//! being written, leaves no partial checkpoint behind (no temporary directory, no step
//! directory, `latest` unchanged), the previous checkpoint still resumes, and the same run
//! saves once there is room again. The disk is a 1 MiB tmpfs, which needs the permission to
//! mount one (root on Linux): elsewhere the test is skipped with a notice.
#![allow(clippy::disallowed_macros)] // prints as it likes (see clippy.toml)

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{snapshot, tiny_config};
use trainer::train::Trainer;

/// Unmounts the tmpfs when dropped (also when the test panics).
struct Mounted(PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// Mounts a tmpfs of `size` at `dir`, or says why not.
fn mount_tmpfs(dir: &Path, size: &str) -> Result<Mounted, String> {
    let out = Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
        .arg(dir)
        .output()
        .map_err(|e| e.to_string())?;
    match out.status.success() {
        true => Ok(Mounted(dir.to_path_buf())),
        false => Err(String::from_utf8_lossy(&out.stderr).trim().to_string()),
    }
}

/// Bytes free for unprivileged writes on the filesystem of `path`.
fn free_bytes(path: &Path) -> u64 {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid C string and a zeroed out-struct of the right type.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
    st.f_bavail as u64 * st.f_frsize as u64
}

#[test]
fn a_checkpoint_onto_a_full_disk_fails_cleanly() {
    let (_tmp, disk) = common::temp_join("disk");
    fs::create_dir(&disk).unwrap();
    let _mounted = match mount_tmpfs(&disk, "1m") {
        Ok(m) => m,
        Err(why) => {
            println!("skipped: cannot mount a tmpfs to fill ({why}); run as root to test");
            return;
        }
    };
    let run = disk.join("run");
    let mut t = Trainer::new(trainer::config::TrainConfig {
        max_iters: 2,
        eval_interval: 2,
        sample_tokens: 0,
        ..tiny_config(&run)
    })
    .unwrap();
    common::run_to_end(&mut t);
    let ckpts = run.join("checkpoints");
    let first = ckpts.join("step-0000002");
    assert!(first.join("manifest.json").is_file());
    let before = snapshot(&ckpts);

    // Fill the disk so that the next checkpoint's weights fit but its optimiser state (twice
    // their size) does not.
    let weights = fs::metadata(first.join("model.safetensors")).unwrap().len();
    let filler = disk.join("filler");
    let room = weights + 16 * 1024;
    let free = free_bytes(&disk);
    assert!(
        free > room,
        "the tmpfs is too small for the test: {free} bytes free"
    );
    fs::write(&filler, vec![0u8; (free - room) as usize]).unwrap();

    t.train_step().unwrap();
    let e = t.save_checkpoint().unwrap_err().to_string();
    let names_a_file = [
        "model.safetensors",
        "optimizer.safetensors",
        "amp.safetensors",
    ]
    .iter()
    .any(|f| e.contains(f));
    assert!(
        names_a_file && e.contains("step-0000003") && e.contains("No space left"),
        "{e}"
    );
    assert_eq!(snapshot(&ckpts), before, "a failed save left files behind");
    let names: Vec<String> = fs::read_dir(&ckpts)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.starts_with('.')), "{names:?}");
    assert_eq!(
        fs::read_to_string(ckpts.join("latest")).unwrap(),
        "step-0000002"
    );
    Trainer::resume(&run, |_| {}).unwrap();

    // With room again, the same run saves.
    fs::remove_file(&filler).unwrap();
    let dir = t.save_checkpoint().unwrap();
    assert!(dir.ends_with("step-0000003") && dir.join("manifest.json").is_file());
    drop(t);
}
