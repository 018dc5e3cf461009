//! The registry of the Triton tests (`tests/families`) against the interpreter's records: the
//! tolerances the CUDA trials hold each output to are those the Triton interpreter was checked
//! with (`TOL` and `ERROR` of `triton/<family>.py`, recorded in `triton/records/<family>.json`),
//! and every kernel family has an entry. (The records, metadata, cubins and launch tables are
//! audited against one another by the crate's unit tests: `src/cuda_kernels/audit_tests.rs`.)

#[path = "../common/mod.rs"]
mod common;
#[path = "../families/mod.rs"]
mod families;

use anyhow::{anyhow, ensure, Context, Result};
use families::{Mode, FAMILIES};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn json(path: &Path) -> Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(serde_json::from_str(&text)?)
}

/// Every entry's checks: for each dtype, the record's tolerance of that output, and its error
/// measure (a zero tolerance is bit-exactness in any measure: the record's `exact`).
#[test]
fn registry_tolerances_are_the_interpreters() -> Result<()> {
    for entry in FAMILIES {
        let path = crate_dir().join(format!("triton/records/{}.json", entry.family));
        let record = json(&path).with_context(|| {
            format!(
                "family {}: no interpreter record (scripts/python/triton_interpret_check.py)",
                entry.family
            )
        })?;
        for check in entry.checks {
            let what = format!("{} output {}", entry.name, check.name);
            let measure = record["error_measure"][check.name]
                .as_str()
                .ok_or_else(|| anyhow!("{what}: not in {}", path.display()))?;
            let exact = check.tol.iter().all(|&t| t == 0.0);
            ensure!(
                measure == check.mode.name() || (exact && measure == Mode::Exact.name()),
                "{what}: measured {:?} in tests/families, {measure:?} in {}",
                check.mode,
                path.display()
            );
            for (k, dt) in ["f32", "bf16", "f16"].into_iter().enumerate() {
                let recorded = record["tolerances"][dt][check.name]
                    .as_f64()
                    .ok_or_else(|| anyhow!("{what}: no {dt} tolerance in {}", path.display()))?;
                ensure!(
                    recorded == check.tol[k],
                    "{what} {dt}: tolerance {} in tests/families, {recorded} in {}",
                    check.tol[k],
                    path.display()
                );
            }
        }
    }
    Ok(())
}

/// Every kernel family has a registry entry that writes its vectors: the families are those
/// with an interpreter record (the crate's launch audit holds the records and the launch
/// tables to one another).
#[test]
fn every_kernel_family_is_in_the_registry() -> Result<()> {
    let mut families = 0;
    for entry in std::fs::read_dir(crate_dir().join("triton/records"))? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        let Some(family) = name.strip_suffix(".json").filter(|f| *f != "sass") else {
            continue;
        };
        families += 1;
        ensure!(
            FAMILIES
                .iter()
                .any(|e| e.family == family && e.write_vectors.is_some()),
            "{family}: no entry writing its vectors in tests/families"
        );
    }
    ensure!(families > 0, "no interpreter records in triton/records");
    Ok(())
}
