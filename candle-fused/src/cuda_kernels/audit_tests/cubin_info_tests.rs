//! A static audit of every committed cubin (no Python, no GPU, no CUDA toolkit): the kernel's
//! own `.nv.info` records, read from its ELF, against the launch tables, and the SASS record
//! `triton/records/sass.json` (`scripts/python/cubin_record.py`) against the cubins it describes.
//!
//! `.nv.info` (the cubin-wide table) and `.nv.info.<entry>` (the kernel's) are sequences of
//! NVIDIA's `EIATTR_*` records: a format byte, an attribute byte, then a 2-byte value
//! (`EIFMT_NVAL` 1, `EIFMT_BVAL` 2, `EIFMT_HVAL` 3) or a 2-byte size and that many bytes
//! (`EIFMT_SVAL` 4), little-endian. The attribute numbers below are those `cuobjdump -elf`
//! names (checked against its listing of the committed cubins); the others are skipped.
//!
//! Checked, for every table entry, sm_80 and sm_90:
//!
//! * the parameters (`EIATTR_KPARAM_INFO`: ordinal, offset, size): the table's, in order, a
//!   pointer 8 bytes, an i32 or f32 4, each at its natural alignment, then the two scratch
//!   pointers; `EIATTR_CBANK_PARAM_SIZE` is their total (what the launcher's argument list
//!   fills);
//! * the required block (`EIATTR_REQNTID`, when the cubin states one) is `32 * num_warps`,
//!   within the maximum (`EIATTR_MAX_THREADS`, PTX `.maxntid`) when one is stated, and
//!   registers x threads fit an SM's 64 Ki registers;
//! * the stack frame (`EIATTR_FRAME_SIZE` of the entry) and registers (`EIATTR_REGCOUNT`) are
//!   the record's `stack_bytes` / `registers` (cuobjdump's own reading: a cross-check of this
//!   parser), and 0 with no `LDL`/`STL` in the recorded SASS for every kernel but
//!   [`MAY_SPILL`];
//! * the record is the cubin's (sha256), for every cubin and no other.
//!
//! Static shared memory and its opt-in rule: `cubin_elf.rs`.

use super::{crate_dir, json, sha256};
use crate::cuda_kernels::{kernels, KernelSpec, Param, ARCHS, SCRATCH_PARAMS};
use anyhow::{anyhow, bail, ensure, Context, Result};
use object::read::elf::ElfFile64;
use object::{LittleEndian, Object, ObjectSection, ObjectSymbol};
use serde_json::Value;
use std::collections::BTreeSet;

/// The command that rewrites the SASS record.
const RECORD_SASS: &str = ".venv-triton/bin/python scripts/python/cubin_record.py \
    (environment: scripts/python/triton_setup.sh)";

/// The `.entry` names whose cubins may use a stack frame (register spills) today: the
/// attention kernels, compiled with 128-wide head tiles for every head size (issue #33; the
/// per-head-size variants remove their spills and this list with them). Every other kernel must
/// compile to a frame of 0 bytes with no local loads or stores.
const MAY_SPILL: &[&str] = &["attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq"];

/// Registers per SM (every sm_80 / sm_90 GPU).
const REGISTERS_PER_SM: u64 = 64 * 1024;

/// `EIATTR_*` numbers (`cuobjdump -elf` prints their names; `MAX_THREADS` checked on a cubin
/// ptxas made from a `.maxntid` entry, the others on the committed cubins).
mod eiattr {
    pub const MAX_THREADS: u8 = 0x05;
    pub const REQNTID: u8 = 0x10;
    pub const FRAME_SIZE: u8 = 0x11;
    pub const KPARAM_INFO: u8 = 0x17;
    pub const CBANK_PARAM_SIZE: u8 = 0x19;
    pub const REGCOUNT: u8 = 0x2f;
}

/// One `EIATTR_*` record: its attribute and value bytes (2 for the fixed formats).
struct Attr<'a> {
    attr: u8,
    value: &'a [u8],
}

/// The records of a `.nv.info*` section.
fn attrs(data: &[u8]) -> Result<Vec<Attr<'_>>> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < data.len() {
        let head = data
            .get(at..at + 4)
            .ok_or_else(|| anyhow!("record at byte {at} cut short"))?;
        let (format, attr) = (head[0], head[1]);
        let short = u16::from_le_bytes([head[2], head[3]]) as usize;
        let (value, len) = match format {
            1..=3 => (&head[2..4], 4),
            4 => (
                data.get(at + 4..at + 4 + short)
                    .ok_or_else(|| anyhow!("record {attr:#x} at byte {at}: {short} bytes cut"))?,
                4 + short,
            ),
            _ => bail!("record at byte {at}: unknown format {format:#x}"),
        };
        out.push(Attr { attr, value });
        at += len;
    }
    Ok(out)
}

fn u32_at(b: &[u8], i: usize) -> Result<u32> {
    b.get(4 * i..4 * i + 4)
        .and_then(|s| s.try_into().ok())
        .map(u32::from_le_bytes)
        .ok_or_else(|| anyhow!("value of {} bytes, wanted word {i}", b.len()))
}

/// One parameter as the cubin declares it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct KParam {
    ordinal: u32,
    offset: u32,
    size: u32,
}

/// An `EIATTR_KPARAM_INFO` value: u32 index, u16 ordinal, u16 offset, u32 flags whose bits
/// 18..32 are the size in bytes.
fn kparam(value: &[u8]) -> Result<KParam> {
    let ord_off = u32_at(value, 1)?;
    Ok(KParam {
        ordinal: ord_off & 0xffff,
        offset: ord_off >> 16,
        size: u32_at(value, 2)? >> 18,
    })
}

/// What a cubin's `.nv.info` records say about its kernel.
#[derive(Debug, Default)]
struct Info {
    /// By ordinal.
    params: Vec<KParam>,
    cbank_param_size: Option<u32>,
    reqntid: Option<[u32; 3]>,
    max_threads: Option<[u32; 3]>,
    /// Of the entry function.
    frame_size: Option<u32>,
    registers: Option<u32>,
}

/// Reads the `.nv.info` records of `entry` from a cubin.
fn info(cubin: &[u8], entry: &str) -> Result<Info> {
    let elf = ElfFile64::<LittleEndian>::parse(cubin)?;
    let symbol = elf
        .symbols()
        .find(|s| s.name() == Ok(entry))
        .ok_or_else(|| anyhow!("no symbol {entry}"))?
        .index()
        .0 as u32;
    let section = |name: &str| -> Result<Vec<u8>> {
        let s = elf
            .section_by_name(name)
            .ok_or_else(|| anyhow!("no section {name}"))?;
        Ok(s.data()?.to_vec())
    };
    let mut info = Info::default();
    let global = section(".nv.info")?;
    for a in attrs(&global).context(".nv.info")? {
        // (function symbol, value) pairs
        if u32_at(a.value, 0).ok() != Some(symbol) {
            continue;
        }
        match a.attr {
            eiattr::FRAME_SIZE => info.frame_size = Some(u32_at(a.value, 1)?),
            eiattr::REGCOUNT => info.registers = Some(u32_at(a.value, 1)?),
            _ => {}
        }
    }
    let own = section(&format!(".nv.info.{entry}"))?;
    for a in attrs(&own).with_context(|| format!(".nv.info.{entry}"))? {
        let three =
            |v: &[u8]| -> Result<[u32; 3]> { Ok([u32_at(v, 0)?, u32_at(v, 1)?, u32_at(v, 2)?]) };
        match a.attr {
            eiattr::KPARAM_INFO => info.params.push(kparam(a.value)?),
            eiattr::CBANK_PARAM_SIZE => {
                let v = a
                    .value
                    .get(..2)
                    .ok_or_else(|| anyhow!("short CBANK_PARAM_SIZE"))?;
                info.cbank_param_size = Some(u32::from(u16::from_le_bytes([v[0], v[1]])));
            }
            eiattr::REQNTID => info.reqntid = Some(three(a.value)?),
            eiattr::MAX_THREADS => info.max_threads = Some(three(a.value)?),
            _ => {}
        }
    }
    info.params.sort_by_key(|p| p.ordinal);
    Ok(info)
}

/// The parameter layout the launcher's argument list makes: each parameter's size (a pointer
/// 8, an i32 or f32 4, the scratch pointers 8) at its natural alignment.
fn expected_params(spec: &KernelSpec) -> Vec<KParam> {
    let sizes = spec
        .params
        .iter()
        .map(|p| match p {
            Param::Tensor(..) => 8,
            Param::Dim(..) | Param::Stride(..) | Param::Int(_) | Param::Float(_) => 4,
        })
        .chain([8; SCRATCH_PARAMS]);
    let mut offset = 0u32;
    sizes
        .enumerate()
        .map(|(ordinal, size)| {
            offset = offset.next_multiple_of(size);
            let p = KParam {
                ordinal: ordinal as u32,
                offset,
                size,
            };
            offset += size;
            p
        })
        .collect()
}

/// Checks one cubin's `.nv.info` against the table and its SASS record.
fn audit(spec: &KernelSpec, stem: &str, info: &Info, record: &Value) -> Result<()> {
    let want = expected_params(spec);
    if info.params != want {
        let show = |ps: &[KParam]| -> String {
            let v: Vec<String> = ps
                .iter()
                .map(|p| format!("{}@{}", p.size, p.offset))
                .collect();
            v.join(" ")
        };
        bail!(
            "{stem}: the cubin's parameters (size@offset) [{}] are not the launch table's + 2 \
             scratch pointers [{}]",
            show(&info.params),
            show(&want)
        )
    }
    let end = want.last().map_or(0, |p| p.offset + p.size);
    ensure!(
        info.cbank_param_size == Some(end),
        "{stem}: parameter bank {:?} bytes, the table's arguments take {end}",
        info.cbank_param_size
    );
    let block = spec.block();
    if let Some(b) = info.reqntid {
        ensure!(
            b == block,
            "{stem}: the cubin requires a block of {b:?} (EIATTR_REQNTID), the table launches \
             {block:?} (32 * num_warps {})",
            spec.num_warps
        );
    }
    if let Some(max) = info.max_threads {
        ensure!(
            block.iter().zip(max).all(|(&b, m)| b <= m),
            "{stem}: the cubin allows a block of at most {max:?} (EIATTR_MAX_THREADS), the table \
             launches {block:?} (32 * num_warps {})",
            spec.num_warps
        );
    }
    let registers = info
        .registers
        .ok_or_else(|| anyhow!("{stem}: no EIATTR_REGCOUNT"))?;
    ensure!(
        u64::from(registers) * u64::from(block[0]) <= REGISTERS_PER_SM,
        "{stem}: {registers} registers x {} threads do not fit an SM",
        block[0]
    );
    let frame = info.frame_size.unwrap_or(0);
    let num = |key: &str| -> Result<u64> {
        record[key]
            .as_u64()
            .ok_or_else(|| anyhow!("{stem}: no {key} in the SASS record; {RECORD_SASS}"))
    };
    ensure!(
        u64::from(registers) == num("registers")? && u64::from(frame) == num("stack_bytes")?,
        "{stem}: the cubin has {registers} registers and a {frame}-byte frame, the SASS record \
         {} and {}",
        num("registers")?,
        num("stack_bytes")?
    );
    if !MAY_SPILL.contains(&spec.entry) {
        let (ldl, stl) = (num("local_loads")?, num("local_stores")?);
        ensure!(
            frame == 0 && ldl == 0 && stl == 0,
            "{stem}: spills registers ({frame}-byte stack frame, {ldl} LDL / {stl} STL); only \
             {MAY_SPILL:?} may"
        );
    }
    Ok(())
}

/// The SASS record, checked to be the committed cubins' (every one, by sha256, and no other).
fn sass_record() -> Result<Value> {
    let path = crate_dir().join("triton/records/sass.json");
    let record = json(&path).with_context(|| RECORD_SASS.to_string())?;
    let cubins = record["cubins"]
        .as_object()
        .ok_or_else(|| anyhow!("{}: no cubins", path.display()))?;
    let dir = crate_dir().join("kernels");
    let mut on_disk = BTreeSet::new();
    for entry in std::fs::read_dir(&dir)? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if let Some(stem) = name.strip_suffix(".cubin") {
            on_disk.insert(stem.to_string());
        }
    }
    for stem in &on_disk {
        let r = cubins
            .get(stem)
            .ok_or_else(|| anyhow!("{stem}.cubin is not in the SASS record; {RECORD_SASS}"))?;
        let got = sha256(&dir.join(format!("{stem}.cubin")))?;
        ensure!(
            r["sha256"].as_str() == Some(got.as_str()),
            "{stem}.cubin changed after its SASS record (sha256 {got}, recorded {}); {RECORD_SASS}",
            r["sha256"]
        );
    }
    for stem in cubins.keys() {
        ensure!(
            on_disk.contains(stem),
            "the SASS record lists {stem}, which has no cubin; {RECORD_SASS}"
        );
    }
    Ok(record)
}

#[test]
fn every_cubin_matches_its_table_entry_and_record() -> Result<()> {
    let record = sass_record()?;
    let dir = crate_dir().join("kernels");
    let (mut audited, mut stating_block) = (0, 0);
    for spec in kernels() {
        for arch in ARCHS {
            let stem = format!("{}.sm{arch}", spec.name());
            let bytes = std::fs::read(dir.join(format!("{stem}.cubin")))
                .with_context(|| format!("{stem}.cubin"))?;
            let info = info(&bytes, spec.entry).with_context(|| format!("{stem}.cubin"))?;
            audit(spec, &stem, &info, &record["cubins"][&stem])?;
            stating_block += usize::from(info.reqntid.is_some());
            audited += 1;
        }
    }
    // Triton states the block of every kernel: a reader that finds none is broken
    ensure!(
        audited > 0 && stating_block == audited,
        "{stating_block} of {audited} cubins state EIATTR_REQNTID"
    );
    Ok(())
}

#[test]
fn nv_info_records_are_parsed() -> Result<()> {
    // REQNTID (SVAL, 12 bytes) 128 x 1 x 1, then CBANK_PARAM_SIZE (HVAL) 0x80, then a BVAL
    let data = [
        4, 0x10, 12, 0, 128, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 3, 0x19, 0x80, 0, 2, 0x4c, 1, 0,
    ];
    let a = attrs(&data)?;
    assert_eq!(a.len(), 3);
    assert_eq!((a[0].attr, u32_at(a[0].value, 0)?), (eiattr::REQNTID, 128));
    assert_eq!(
        (a[1].attr, a[1].value),
        (eiattr::CBANK_PARAM_SIZE, &[0x80, 0][..])
    );
    // attn_fwd.bf16.sm90's last parameter (a scratch pointer: ordinal 22, offset 0x78, 8
    // bytes) and a `.maxntid 256, 1, 1` entry's MAX_THREADS, as ptxas writes them
    let kp = attrs(&[
        4, 0x17, 12, 0, 0, 0, 0, 0, 0x16, 0, 0x78, 0, 0, 0xf4, 0x21, 0,
    ])?;
    let want = KParam {
        ordinal: 22,
        offset: 0x78,
        size: 8,
    };
    assert_eq!(
        (kp[0].attr, kparam(kp[0].value)?),
        (eiattr::KPARAM_INFO, want)
    );
    let mt = attrs(&[4, 0x05, 12, 0, 0, 1, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0])?;
    assert_eq!(mt[0].attr, eiattr::MAX_THREADS);
    assert_eq!(u32_at(mt[0].value, 0)?, 256);
    // a record cut short and an unknown format are errors, not a silent stop
    assert!(attrs(&data[..10]).is_err());
    assert!(attrs(&[9, 0x10, 0, 0]).is_err());
    Ok(())
}
