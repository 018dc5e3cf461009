//! `prepare`'s inputs read as a sequence of *units* (byte units cut by a rule that depends only on the bytes, so the token stream never
//! depends on timing or thread count; or runs of Parquet rows). [`super::encode`] turns a unit
//! into document pieces.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;

use super::options::{Container, InputFormat, PrepareOptions};
use crate::data::lines::too_long;
use crate::data::parquet::{is_parquet, Columns, ParquetRow, ParquetRows};
use crate::error::{Error, Result};

/// Where a unit starts, and the stream counters there: enough to restart `prepare` at it.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Position {
    /// Index of the file in the expanded input list.
    pub file: usize,
    /// Byte offset in that file (Parquet: where the data of the row's row group starts).
    pub offset: u64,
    /// 1-based line number at that offset (Parquet: 1 + the row's index in the file).
    pub line: u64,
    /// Documents started before this point.
    pub doc: u64,
    /// Tokens emitted to the train and val streams before this point.
    pub pos: [u64; 2],
}

/// A run of whole lines of one file, or of rows of one row group of a Parquet file.
pub(crate) struct Unit {
    pub at: Position,
    /// The position after the unit (file, offset, line; the counters are the caller's).
    pub next: Position,
    /// Bytes of input the unit stands for (progress).
    pub size: u64,
    /// The lines (empty for Parquet rows).
    pub bytes: Vec<u8>,
    /// Parquet: the rows.
    pub rows: Option<Vec<ParquetRow>>,
    /// Whether the unit ends its file.
    pub eof: bool,
}

/// A text unit is cut at any newline when none followed by a non-space byte comes within
/// this many chunks.
const MAX_UNIT_CHUNKS: usize = 8;

/// Reads the input files as units of about `chunk` bytes: cut after the first newline at or
/// beyond `chunk` bytes (for text, the first newline followed by a non-space byte, so that no
/// pre-tokenizer token spans a cut, unless none comes within [`MAX_UNIT_CHUNKS`] chunks: then
/// any newline). A file without newlines is one unit. The cuts depend on the bytes alone.
pub(crate) struct UnitReader<'a> {
    files: &'a [PathBuf],
    text: bool,
    /// The longest line of a JSON-lines file (see [`crate::data::lines`]).
    max_line: usize,
    chunk: usize,
    at: Position,
    file: Option<File>,
    buf: Vec<u8>,
    eof: bool,
    /// Which files are read as Parquet, the columns read from them, and the open one.
    parquet: Vec<bool>,
    columns: Columns,
    rows: Option<ParquetRows>,
}

impl<'a> UnitReader<'a> {
    /// A reader starting at `at` (file, offset and line; the counters are the caller's).
    /// Lines of JSON-lines files (`!text`) longer than `max_line` bytes are refused before
    /// they are read whole.
    pub fn new(
        files: &'a [PathBuf],
        text: bool,
        chunk: usize,
        max_line: usize,
        at: Position,
    ) -> Self {
        UnitReader {
            files,
            text,
            max_line,
            chunk: chunk.max(1),
            at,
            file: None,
            buf: Vec::new(),
            eof: false,
            parquet: Vec::new(),
            columns: Columns::Sft,
            rows: None,
        }
    }

    /// The same reader, reading the files flagged in `parquet` as Parquet rows (`columns` of
    /// them), cut into units at the end of each row group and after about `chunk` bytes of
    /// text.
    pub fn with_parquet(self, parquet: Vec<bool>, columns: Columns) -> Self {
        UnitReader {
            parquet,
            columns,
            ..self
        }
    }

    /// Moves to the start of the next file.
    fn next_file(&mut self) {
        self.file = None;
        self.rows = None;
        self.at.file += 1;
        self.at.offset = 0;
        self.at.line = 1;
    }

    /// The next unit of rows of the Parquet file `self.at.file`, `None` after its last row.
    fn next_rows(&mut self) -> Result<Option<Unit>> {
        if self.rows.is_none() {
            let path = &self.files[self.at.file];
            let first = self.at.line.saturating_sub(1);
            self.rows = Some(ParquetRows::open(path, &self.columns, first)?);
        }
        let reader = self.rows.as_mut().expect("opened");
        let Some(first) = reader.next_at() else {
            return Ok(None);
        };
        let mut rows = Vec::new();
        let mut text = 0;
        while text < self.chunk && reader.next_at().is_some_and(|a| a.group == first.group) {
            let Some(row) = reader.next_row()? else {
                break;
            };
            text += row.size.max(1);
            rows.push(row);
        }
        let at = Position {
            offset: reader.group_start(first.group),
            line: first.file_row + 1,
            ..self.at.clone()
        };
        let (next, eof) = match reader.next_at() {
            Some(a) => {
                let next = Position {
                    offset: reader.group_start(a.group),
                    line: a.file_row + 1,
                    ..self.at.clone()
                };
                (next, false)
            }
            None => {
                let end = reader.group_start(usize::MAX);
                let next = Position {
                    offset: end,
                    ..at.clone()
                };
                (next, true)
            }
        };
        let size = next.offset - at.offset;
        self.at = next;
        if eof {
            self.next_file();
        }
        Ok(Some(Unit {
            at,
            next: self.at.clone(),
            size,
            bytes: Vec::new(),
            rows: Some(rows),
            eof,
        }))
    }

    fn fill(&mut self, want: usize) -> Result<()> {
        let path = &self.files[self.at.file];
        let f = self.file.as_mut().expect("file opened");
        while self.buf.len() < want && !self.eof {
            let old = self.buf.len();
            let step = (want - old).max(1 << 16);
            self.buf.resize(old + step, 0);
            let n = f
                .read(&mut self.buf[old..])
                .map_err(|e| Error::io(path, e))?;
            self.buf.truncate(old + n);
            if n == 0 {
                self.eof = true;
            }
        }
        Ok(())
    }

    /// The end (one past a newline) of the first cut at or after `from` and before `end`,
    /// reading more as needed; `None` if there is none before `end` or the end of the file.
    /// `strict`: only a newline followed by a non-space byte.
    fn find(&mut self, mut from: usize, end: Option<usize>, strict: bool) -> Result<Option<usize>> {
        loop {
            let stop = end.map_or(self.buf.len(), |e| e.min(self.buf.len()));
            // A strict cut needs the byte after the newline.
            let last = if strict && !self.eof {
                stop.saturating_sub(1)
            } else {
                stop
            };
            for i in from..last {
                let next_ok = !strict
                    || self
                        .buf
                        .get(i + 1)
                        .is_some_and(|n| !n.is_ascii_whitespace());
                if self.buf[i] == b'\n' && next_ok {
                    return Ok(Some(i + 1));
                }
            }
            if self.eof || end.is_some_and(|e| last >= e) {
                return Ok(None);
            }
            from = from.max(last);
            let want = (self.buf.len() * 2).max(from + 2);
            self.fill(want)?;
        }
    }

    /// The end of the line holding byte `from` of a JSON-lines file, reading at most about
    /// twice [`UnitReader::max_line`] bytes past its start; `None` for a last line without
    /// `\n`; an error naming `file:line` for a line longer than the limit.
    fn find_line_end(&mut self, from: usize) -> Result<Option<usize>> {
        let head = &self.buf[..from.min(self.buf.len())];
        let start = head.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        let bound = start + self.max_line + 1;
        match self.find(from, Some(bound), false)? {
            Some(c) => Ok(Some(c)),
            None if self.eof && self.buf.len() <= bound => Ok(None),
            None => {
                let line =
                    self.at.line + self.buf[..start].iter().filter(|&&b| b == b'\n').count() as u64;
                Err(too_long(&self.files[self.at.file], line, self.max_line))
            }
        }
    }

    /// Checks that no line of the next `len` buffered bytes is longer than the limit.
    fn check_lines(&self, len: usize) -> Result<()> {
        for (i, line) in self.buf[..len].split(|&b| b == b'\n').enumerate() {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if line.len() > self.max_line {
                let path = &self.files[self.at.file];
                return Err(too_long(path, self.at.line + i as u64, self.max_line));
            }
        }
        Ok(())
    }

    /// The next unit, `None` after the last file. Empty files give no unit.
    pub fn next_unit(&mut self) -> Result<Option<Unit>> {
        loop {
            if self.at.file >= self.files.len() {
                return Ok(None);
            }
            if self.parquet.get(self.at.file) == Some(&true) {
                match self.next_rows()? {
                    Some(unit) => return Ok(Some(unit)),
                    None => {
                        self.next_file();
                        continue;
                    }
                }
            }
            if self.file.is_none() {
                let path = &self.files[self.at.file];
                let mut f = File::open(path).map_err(|e| Error::io(path, e))?;
                f.seek(SeekFrom::Start(self.at.offset))
                    .map_err(|e| Error::io(path, e))?;
                self.file = Some(f);
                self.buf.clear();
                self.eof = false;
            }
            self.fill(self.chunk + 1)?;
            if self.buf.is_empty() {
                self.next_file();
                continue;
            }
            let from = self.chunk - 1;
            let found = if self.text {
                match self.find(from, Some(MAX_UNIT_CHUNKS * self.chunk), true)? {
                    Some(c) => Some(c),
                    None => self.find(from, None, false)?,
                }
            } else {
                self.find_line_end(from)?
            };
            let cut = found.unwrap_or(self.buf.len());
            if !self.text {
                self.check_lines(cut)?;
            }
            let bytes: Vec<u8> = self.buf.drain(..cut).collect();
            self.fill(1)?;
            let eof = self.buf.is_empty() && self.eof;
            let at = self.at.clone();
            self.at.offset += cut as u64;
            self.at.line += bytes.iter().filter(|&&b| b == b'\n').count() as u64;
            if eof {
                self.next_file();
            }
            return Ok(Some(Unit {
                at,
                next: self.at.clone(),
                size: cut as u64,
                bytes,
                rows: None,
                eof,
            }));
        }
    }
}

/// Which of `files` are read as Parquet: by extension unless `opts.container` says; refuses a
/// container that contradicts the format.
pub(crate) fn parquet_files(opts: &PrepareOptions, files: &[PathBuf]) -> Result<Vec<bool>> {
    let all = |p: bool| Ok(vec![p; files.len()]);
    match (opts.container, opts.format) {
        (Container::Auto, _) => Ok(files.iter().map(|p| is_parquet(p)).collect()),
        (Container::Parquet, _) => all(true),
        (Container::Jsonl, InputFormat::Jsonl | InputFormat::Sft)
        | (Container::Text, InputFormat::Text) => all(false),
        (container, format) => Err(Error::Config(format!(
            "--input-format {container} cannot hold --format {format} records (text files \
             hold --format text, JSON lines --format jsonl or sft, Parquet any)"
        ))),
    }
}

/// A reader of `files` as `opts` says, from `at`.
pub(crate) fn unit_reader<'a>(
    opts: &PrepareOptions,
    files: &'a [PathBuf],
    at: Position,
) -> Result<UnitReader<'a>> {
    let text = opts.format == InputFormat::Text;
    let columns = match opts.format {
        InputFormat::Sft => Columns::Sft,
        InputFormat::Text | InputFormat::Jsonl => Columns::Text(opts.field.clone()),
    };
    let reader = UnitReader::new(files, text, opts.chunk_bytes, opts.max_line_bytes, at);
    Ok(reader.with_parquet(parquet_files(opts, files)?, columns))
}

/// The position of the first byte of the first file.
pub(crate) fn start() -> Position {
    Position {
        line: 1,
        ..Position::default()
    }
}

#[cfg(test)]
#[path = "input_tests.rs"]
mod tests;
