//! The registry of the Triton tests (`tests/families`) against the interpreter's records: the
//! tolerances the CUDA trials hold each output to are those the Triton interpreter was checked
//! with (`TOL` and `ERROR` of `triton/<family>.py`, recorded in `triton/records/<family>.json`),
//! and every family of the launch tables has an entry.

use super::*;
use crate::families::{Mode, FAMILIES as REGISTRY};

/// Every entry's checks: for each dtype, the record's tolerance of that output, and its error
/// measure (a zero tolerance is bit-exactness in any measure: the record's `exact`).
#[test]
fn registry_tolerances_are_the_interpreters() -> Result<()> {
    for entry in REGISTRY {
        let path = crate_dir().join(format!("triton/records/{}.json", entry.family));
        let record = json(&path).with_context(|| format!("family {}: {RERUN}", entry.family))?;
        for check in entry.checks {
            let what = format!("{} output {}", entry.name, check.name);
            let measure = str_of(&record["error_measure"], check.name)
                .with_context(|| format!("{what}: not in {}", path.display()))?;
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

/// Every family of the launch tables has a registry entry that writes its vectors.
#[test]
fn every_kernel_family_is_in_the_registry() -> Result<()> {
    for (family, _) in FAMILIES {
        ensure!(
            REGISTRY
                .iter()
                .any(|e| e.family == *family && e.write_vectors.is_some()),
            "{family}: no entry writing its vectors in tests/families"
        );
    }
    Ok(())
}
