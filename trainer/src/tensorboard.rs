//! TensorBoard event files: scalars as TensorBoard's own `SummaryWriter` writes them.
//!
//! An event file is a sequence of TFRecords (a little-endian `u64` length, the masked CRC-32C
//! of those 8 bytes, the payload, the masked CRC-32C of the payload), each payload an `Event`
//! protobuf (`tensorboard/compat/proto/event.proto`): first a header holding the file version
//! `brain.Event:2`, then one event per scalar, a `Summary` with one `simple_value`. Only the
//! fields a scalar log uses are declared here; others are skipped when reading.
//!
//! A run writes its records beside `metrics.jsonl` as scalars (their tags are
//! [`crate::metrics::scalars_of`]'s), as `events.out.tfevents.<seconds>.<pid>.trainer`, which
//! `tensorboard --logdir RUN_DIR` (or its parent, one curve per run) reads. This module knows
//! the file format and the run directory's event files, nothing of what a run records.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use prost::Message;

use crate::{Error, Result};

/// The file version of the header event TensorBoard writes and expects.
pub(crate) const FILE_VERSION: &str = "brain.Event:2";

/// The suffix of the event files a run writes (TensorBoard's `filename_suffix`): the files a
/// resumed run rewrites, leaving any other event file in the directory alone.
pub(crate) const RUN_FILE_SUFFIX: &str = ".trainer";

/// What the header of the run's event files names as their writer.
const WRITER: &str = "candle-train trainer";

/// `tensorboard.Event`, the fields a scalar log uses.
#[derive(Clone, PartialEq, Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(oneof = "What", tags = "3, 5")]
    what: Option<What>,
    #[prost(message, optional, tag = "10")]
    source_metadata: Option<SourceMetadata>,
}

/// The `what` of an `Event`.
#[derive(Clone, PartialEq, prost::Oneof)]
enum What {
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
}

/// `tensorboard.SourceMetadata`.
#[derive(Clone, PartialEq, Message)]
struct SourceMetadata {
    #[prost(string, tag = "1")]
    writer: String,
}

/// `tensorboard.Summary`.
#[derive(Clone, PartialEq, Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

/// `tensorboard.Summary.Value`, as a scalar.
#[derive(Clone, PartialEq, Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(oneof = "Value", tags = "2")]
    value: Option<Value>,
}

/// The `value` of a `Summary.Value`.
#[derive(Clone, PartialEq, prost::Oneof)]
enum Value {
    #[prost(float, tag = "2")]
    SimpleValue(f32),
}

/// One scalar of an event file: what `SummaryWriter.add_scalar(tag, value, step, walltime)`
/// writes.
#[derive(Clone, Debug, PartialEq)]
pub struct Scalar {
    /// The series, e.g. `train/loss`.
    pub tag: String,
    /// The x-axis: the optimizer step.
    pub step: i64,
    /// The value, stored as f32 (`simple_value`).
    pub value: f32,
    /// Seconds since the Unix epoch.
    pub wall_time: f64,
}

/// An event file as read back: its header and its scalars, in file order.
#[derive(Clone, Debug, PartialEq)]
pub struct EventFile {
    /// The header's wall time (when the file was started).
    pub wall_time: f64,
    /// The header's writer name (`source_metadata.writer`; empty when absent).
    pub writer: String,
    /// Every scalar of the file.
    pub scalars: Vec<Scalar>,
}

/// Writes an event file.
///
/// ```
/// use trainer::tensorboard::{read, EventWriter, Scalar};
/// let dir = tempfile::tempdir()?;
/// let path = dir.path().join("events.out.tfevents.0.doc");
/// let mut w = EventWriter::create(&path, 1.5, "doc")?;
/// let s = Scalar { tag: "train/loss".into(), step: 1, value: 2.5, wall_time: 2.0 };
/// w.write(&s)?;
/// w.flush()?;
/// assert_eq!(read(&path)?.scalars, [s]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct EventWriter {
    path: PathBuf,
    file: BufWriter<File>,
}

impl EventWriter {
    /// Creates (or truncates) `path` and writes the header event: the file version, started at
    /// `wall_time`, by `writer`.
    pub fn create(path: &Path, wall_time: f64, writer: &str) -> Result<Self> {
        let file = File::create(path).map_err(|e| Error::io(path, e))?;
        let mut w = EventWriter {
            path: path.to_path_buf(),
            file: BufWriter::new(file),
        };
        w.file
            .write_all(&frame(&header(wall_time, writer)))
            .map_err(|e| Error::io(path, e))?;
        Ok(w)
    }

    /// Opens `path` to append events (buffered until [`EventWriter::flush`]).
    fn append(path: &Path) -> Result<Self> {
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(|e| Error::io(path, e))?;
        Ok(EventWriter {
            path: path.to_path_buf(),
            file: BufWriter::new(file),
        })
    }

    /// Writes one scalar as one event (buffered until [`EventWriter::flush`]).
    pub fn write(&mut self, scalar: &Scalar) -> Result<()> {
        self.file
            .write_all(&frame(&scalar_event(scalar)))
            .map_err(|e| Error::io(&self.path, e))
    }

    /// Writes what is buffered to the file.
    pub fn flush(&mut self) -> Result<()> {
        self.file.flush().map_err(|e| Error::io(&self.path, e))
    }

    /// The file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn header(wall_time: f64, writer: &str) -> Event {
    Event {
        wall_time,
        step: 0,
        what: Some(What::FileVersion(FILE_VERSION.to_string())),
        source_metadata: Some(SourceMetadata {
            writer: writer.to_string(),
        }),
    }
}

fn scalar_event(s: &Scalar) -> Event {
    Event {
        wall_time: s.wall_time,
        step: s.step,
        what: Some(What::Summary(Summary {
            value: vec![SummaryValue {
                tag: s.tag.clone(),
                value: Some(Value::SimpleValue(s.value)),
            }],
        })),
        source_metadata: None,
    }
}

/// The CRC TFRecords carry: CRC-32C, rotated right by 15 bits plus a constant.
fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// `event` as one TFRecord.
fn frame(event: &Event) -> Vec<u8> {
    let data = event.encode_to_vec();
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(&data);
    out.extend_from_slice(&masked_crc(&data).to_le_bytes());
    out
}

/// The events of `bytes`, up to the first damaged or cut record, and what was wrong there.
fn parse(bytes: &[u8]) -> (Vec<Event>, Option<String>) {
    let mut events = Vec::new();
    let mut at = 0usize;
    let u32_at =
        |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
    while at < bytes.len() {
        let damaged = |what: &str| Some(format!("{what} in the record at byte {at}"));
        if bytes.len() - at < 12 {
            return (events, damaged("a cut length"));
        }
        let len_bytes = &bytes[at..at + 8];
        if masked_crc(len_bytes) != u32_at(at + 8) {
            return (events, damaged("a length CRC mismatch"));
        }
        let mut len = [0u8; 8];
        len.copy_from_slice(len_bytes);
        let len = u64::from_le_bytes(len);
        let start = at + 12;
        let Some(end) = usize::try_from(len).ok().and_then(|l| start.checked_add(l)) else {
            return (events, damaged("an impossible length"));
        };
        if end.checked_add(4).is_none_or(|e| e > bytes.len()) {
            return (events, damaged("a cut payload"));
        }
        let data = &bytes[start..end];
        if masked_crc(data) != u32_at(end) {
            return (events, damaged("a payload CRC mismatch"));
        }
        match Event::decode(data) {
            Ok(e) => events.push(e),
            Err(e) => return (events, damaged(&format!("an undecodable Event ({e})"))),
        }
        at = end + 4;
    }
    (events, None)
}

/// The header and scalars of `events` (other events are skipped).
fn to_file(events: &[Event]) -> EventFile {
    let mut file = EventFile {
        wall_time: 0.0,
        writer: String::new(),
        scalars: Vec::new(),
    };
    for e in events {
        match &e.what {
            Some(What::FileVersion(_)) => {
                file.wall_time = e.wall_time;
                file.writer = e
                    .source_metadata
                    .as_ref()
                    .map(|m| m.writer.clone())
                    .unwrap_or_default();
            }
            Some(What::Summary(s)) => file.scalars.extend(s.value.iter().filter_map(|v| {
                let Some(Value::SimpleValue(value)) = v.value else {
                    return None;
                };
                Some(Scalar {
                    tag: v.tag.clone(),
                    step: e.step,
                    value,
                    wall_time: e.wall_time,
                })
            })),
            None => {}
        }
    }
    file
}

/// Reads the event file at `path`, checking every record's CRCs as TensorBoard does; a damaged
/// or cut record is an error naming the file and the record's byte offset.
pub fn read(path: &Path) -> Result<EventFile> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    match parse(&bytes) {
        (events, None) => Ok(to_file(&events)),
        (_, Some(damage)) => Err(Error::data(
            path,
            format!("not a TensorBoard event file: {damage}"),
        )),
    }
}

/// The event log of a run directory: one file of `RUN_FILE_SUFFIX`, rewritten when the run
/// starts or resumes.
pub(crate) struct RunEvents {
    writer: EventWriter,
}

impl RunEvents {
    /// Starts the event log of the run in `dir` that has completed `resume_step` steps.
    ///
    /// The scalars of the run's earlier event files up to `resume_step` (with their wall times
    /// and the first file's start) are written into one new file and the earlier files
    /// removed: events past the checkpoint (written by a run killed after it) are gone, so a
    /// resumed curve has no step twice. A fresh run (`resume_step` 0) starts empty. A
    /// damaged earlier file is kept up to its damage, with a warning.
    pub(crate) fn open(dir: &Path, resume_step: usize) -> Result<Self> {
        let now = now();
        let old = run_files(dir)?;
        let mut start = now;
        let mut kept = Vec::new();
        if resume_step > 0 {
            for path in &old {
                let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
                let (events, damage) = parse(&bytes);
                if let Some(d) = damage {
                    tracing::warn!("{}: events after {d} dropped", path.display());
                }
                let file = to_file(&events);
                if file.wall_time > 0.0 {
                    start = start.min(file.wall_time);
                }
                kept.extend(
                    file.scalars
                        .into_iter()
                        .filter(|s| s.step <= resume_step as i64),
                );
            }
        }
        let name = format!(
            "events.out.tfevents.{:010}.{}{RUN_FILE_SUFFIX}",
            now as u64,
            std::process::id()
        );
        let path = dir.join(name);
        let mut bytes = frame(&header(start, WRITER));
        for s in &kept {
            bytes.extend(frame(&scalar_event(s)));
        }
        crate::checkpoint::io::write_atomic(&path, &bytes)?;
        for p in old.iter().filter(|p| **p != path) {
            std::fs::remove_file(p).map_err(|e| Error::io(p, e))?;
        }
        Ok(RunEvents {
            writer: EventWriter::append(&path)?,
        })
    }

    /// Appends `scalars` and flushes them.
    pub(crate) fn push(&mut self, scalars: &[Scalar]) -> Result<()> {
        for s in scalars {
            self.writer.write(s)?;
        }
        self.writer.flush()
    }
}

/// Seconds since the Unix epoch.
pub(crate) fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The run's event files in `dir`, in name order.
fn run_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("events.out.tfevents.") && name.ends_with(RUN_FILE_SUFFIX) {
            files.push(entry.path());
        }
    }
    files.sort();
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cut_or_damaged_record_is_reported_with_its_offset() {
        let s = Scalar {
            tag: "t".into(),
            step: 3,
            value: 1.0,
            wall_time: 1.0,
        };
        let mut bytes = frame(&header(0.5, "w"));
        let second = bytes.len();
        bytes.extend(frame(&scalar_event(&s)));
        let (events, damage) = parse(&bytes);
        assert_eq!((events.len(), damage), (2, None));
        let (events, damage) = parse(&bytes[..bytes.len() - 1]);
        assert_eq!(events.len(), 1);
        assert_eq!(
            damage.unwrap(),
            format!("a cut payload in the record at byte {second}")
        );
        let n = bytes.len();
        bytes[n - 6] ^= 1;
        let (_, damage) = parse(&bytes);
        assert!(damage.unwrap().starts_with("a payload CRC mismatch"));
    }
}
