//! The committed cubins' own ELF sections (read with the `object` crate), against their
//! metadata and the launcher:
//!
//! * static shared memory: the size of `.nv.shared.<entry>` is the json's `static_shared_bytes`,
//!   and `shared_memory_opt_in` (the launcher's rule) opts in for every cubin whose static +
//!   dynamic shared memory is over 48 KiB, never for one within it, and accepts all of them on
//!   the GPU with the most shared memory of their architecture (H100: 227 KiB, A100: 163 KiB);
//! * the ptxas that built each cubin: the release in its `.note.nv.tkinfo` note is
//!   [`PTXAS_RELEASE`] (CUDA 13.0, the GPU machines' driver), and the json's `ptxas` records
//!   the same note.

use super::{crate_dir, json, str_of, u64_of};
use crate::cuda_kernels::{kernels, shared_memory_opt_in, ARCHS};
use anyhow::{anyhow, ensure, Context, Result};
use object::read::elf::{ElfFile64, SectionHeader};
use object::{LittleEndian, Object, ObjectSection};
use serde_json::Value;
use std::collections::BTreeMap;

/// The CUDA release of the ptxas every committed cubin is built with (`scripts/gpu/cubins.sh`,
/// the pin `PTXAS_RELEASE` of `scripts/python/triton_compile.py`).
const PTXAS_RELEASE: &str = "13.0";

const REBUILD: &str = "rebuild the cubins with CUDA 13.0's ptxas: scripts/gpu/cubins.sh \
    (TRITON_PTXAS_PATH=<the nvidia-cuda-nvcc==13.0.88 wheel's ptxas> \
    .venv-triton/bin/python scripts/python/triton_compile.py)";

/// The shared memory per block without an opt-in.
const NO_OPT_IN: u64 = 48 * 1024;

/// The largest opt-in shared memory per block among the GPUs a cubin of `arch` runs on.
fn opt_in_limit(arch: u32) -> u32 {
    match arch {
        80 => 163 * 1024, // A100 (8.6 / 8.9 allow 99 KiB)
        _ => 227 * 1024,  // H100 / H200
    }
}

/// A committed cubin.
struct Cubin {
    /// `<entry>.<dtype>.sm<NN>`.
    stem: String,
    entry: &'static str,
    arch: u32,
    bytes: Vec<u8>,
    /// Its json.
    meta: Value,
}

/// Every committed cubin of the launch tables.
fn cubins() -> Result<Vec<Cubin>> {
    let dir = crate_dir().join("kernels");
    let mut out = Vec::new();
    for spec in kernels() {
        for arch in ARCHS {
            let stem = format!("{}.sm{arch}", spec.name());
            let path = dir.join(format!("{stem}.cubin"));
            let bytes = std::fs::read(&path).with_context(|| format!("{}", path.display()))?;
            let meta = json(&dir.join(format!("{stem}.json")))?;
            out.push(Cubin {
                stem,
                entry: spec.entry,
                arch,
                bytes,
                meta,
            });
        }
    }
    ensure!(!out.is_empty(), "no cubins");
    Ok(out)
}

/// The size of the cubin's `.nv.shared.<entry>` section (its static shared memory; 0 without).
fn static_shared(cubin: &[u8], entry: &str) -> Result<u64> {
    let elf = ElfFile64::<LittleEndian>::parse(cubin)?;
    Ok(elf
        .section_by_name(&format!(".nv.shared.{entry}"))
        .map_or(0, |s| s.size()))
}

/// The tool name, version and build strings of the cubin's `.note.nv.tkinfo` note, e.g.
/// `ptxas`, `Cuda compilation tools, release 13.0, V13.0.88`, `Build cuda_13.0.r13.0/...`;
/// `None` without the note (ptxas 12.x writes none).
fn tkinfo(cubin: &[u8]) -> Result<Option<[String; 3]>> {
    let elf = ElfFile64::<LittleEndian>::parse(cubin)?;
    let Some(section) = elf.section_by_name(".note.nv.tkinfo") else {
        return Ok(None);
    };
    let mut notes = section
        .elf_section_header()
        .notes(elf.endian(), elf.data())?
        .ok_or_else(|| anyhow!(".note.nv.tkinfo is not a note section"))?;
    let note = notes.next()?.ok_or_else(|| anyhow!("empty tkinfo"))?;
    ensure!(
        note.name() == b"NVIDIA Corp",
        "tkinfo note of {:?}",
        note.name()
    );
    // desc: u32 version, u32 reserved, then the offsets of the tool name, version, build and
    // options strings in the NUL-terminated string table after the 24-byte header
    let desc = note.desc();
    let table = desc.get(24..).ok_or_else(|| anyhow!("short tkinfo"))?;
    let at = |i: usize| -> Result<String> {
        let off = desc
            .get(8 + 4 * i..12 + 4 * i)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_le_bytes)
            .ok_or_else(|| anyhow!("short tkinfo"))? as usize;
        let s = table
            .get(off..)
            .ok_or_else(|| anyhow!("tkinfo offset {off}"))?;
        let end = s.iter().position(|&b| b == 0).unwrap_or(s.len());
        Ok(String::from_utf8_lossy(&s[..end]).into_owned())
    };
    Ok(Some([at(0)?, at(1)?, at(2)?]))
}

/// `13.0` of `Cuda compilation tools, release 13.0, V13.0.88`.
fn release(version: &str) -> Option<&str> {
    version.split_once("release ")?.1.split(',').next()
}

#[test]
fn static_shared_memory_is_recorded_and_opted_into() -> Result<()> {
    let (mut with_static, mut opted) = (0, 0);
    for Cubin {
        stem,
        entry,
        arch,
        bytes,
        meta,
    } in cubins()?
    {
        let static_b = static_shared(&bytes, entry).with_context(|| stem.clone())?;
        ensure!(
            u64_of(&meta, "static_shared_bytes")? == static_b,
            "{stem}.json: static_shared_bytes is not the size of the cubin's .nv.shared.{entry} \
             ({static_b}); rerun scripts/gpu/cubins.sh"
        );
        let dynamic = u64_of(&meta, "shared_bytes")?;
        let (Ok(s), Ok(d)) = (u32::try_from(static_b), u32::try_from(dynamic)) else {
            anyhow::bail!("{stem}: shared memory sizes {static_b} + {dynamic}")
        };
        let total = static_b + dynamic;
        let rule = shared_memory_opt_in(s, d, opt_in_limit(arch)).map_err(|e| {
            anyhow!(
                "{stem}: refused on the largest sm_{arch} GPU ({} bytes): {e}",
                opt_in_limit(arch)
            )
        })?;
        if total > NO_OPT_IN {
            ensure!(
                rule == Some(d),
                "{stem}: {static_b} static + {dynamic} dynamic = {total} bytes of shared memory \
                 (over 48 KiB), but the launcher's rule gives {rule:?}, not an opt-in to {d} \
                 dynamic bytes"
            );
            opted += 1;
        } else {
            ensure!(rule.is_none(), "{stem}: opt-in {rule:?} for {total} bytes");
        }
        with_static += usize::from(static_b > 0);
    }
    // the sm_90 reductions declare static shared memory: a reader that finds none is broken
    ensure!(
        with_static > 0 && opted > 0,
        "no static shared memory found"
    );
    Ok(())
}

#[test]
fn cubins_are_built_by_the_pinned_ptxas() -> Result<()> {
    // every cubin built by another ptxas, grouped by that ptxas (a rebuild fixes all at once)
    let mut others: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for Cubin {
        stem, bytes, meta, ..
    } in cubins()?
    {
        let Some([tool, version, build]) = tkinfo(&bytes).with_context(|| stem.clone())? else {
            others
                .entry("a ptxas that writes no .note.nv.tkinfo (12.x)".into())
                .or_default()
                .push(stem);
            continue;
        };
        if release(&version) != Some(PTXAS_RELEASE) {
            others
                .entry(format!("{tool} {version:?} ({build})"))
                .or_default()
                .push(stem);
            continue;
        }
        let recorded = &meta["ptxas"];
        for (key, want) in [("tool", &tool), ("version", &version), ("build", &build)] {
            ensure!(
                str_of(recorded, key)? == want,
                "{stem}.json: ptxas.{key} is not the cubin's tkinfo {want:?}; {REBUILD}"
            );
        }
    }
    let report: Vec<String> = others
        .iter()
        .map(|(by, stems)| format!("{} built by {by}, e.g. {}", stems.len(), stems[0]))
        .collect();
    ensure!(
        report.is_empty(),
        "cubins not built by ptxas release {PTXAS_RELEASE}: {}; {REBUILD}",
        report.join("; ")
    );
    Ok(())
}

#[test]
fn the_tkinfo_release_is_parsed() {
    assert_eq!(
        release("Cuda compilation tools, release 13.0, V13.0.88"),
        Some("13.0")
    );
    assert_eq!(release("Cuda compilation tools"), None);
}
