//! Text and JSON-lines files read as byte units of about `chunk` bytes: cut after the first
//! newline at or beyond `chunk` bytes (for text, the first newline followed by a non-space
//! byte, so that no pre-tokenizer token spans a cut, unless none comes within
//! [`MAX_UNIT_CHUNKS`] chunks: then any newline). A file without newlines is one unit. The
//! cuts depend on the bytes alone.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use super::unit::{FileReader, Position, Unit};
use crate::error::{Error, Result};
use crate::lines::too_long;

/// A text unit is cut at any newline when none followed by a non-space byte comes within
/// this many chunks.
const MAX_UNIT_CHUNKS: usize = 8;

/// One text (`text`) or JSON-lines file read as byte units.
pub(super) struct ByteUnits {
    path: PathBuf,
    text: bool,
    /// The longest line of a JSON-lines file (see [`crate::lines`]).
    max_line: usize,
    chunk: usize,
    file: File,
    buf: Vec<u8>,
    eof: bool,
}

impl ByteUnits {
    /// `path` opened at `at.offset`, cut into units of about `chunk` bytes. Lines of
    /// JSON-lines files (`!text`) longer than `max_line` bytes are refused before they are
    /// read whole.
    pub(super) fn open(
        path: &Path,
        at: &Position,
        text: bool,
        chunk: usize,
        max_line: usize,
    ) -> Result<Self> {
        let mut file = File::open(path).map_err(|e| Error::io(path, e))?;
        file.seek(SeekFrom::Start(at.offset))
            .map_err(|e| Error::io(path, e))?;
        Ok(ByteUnits {
            path: path.to_path_buf(),
            text,
            max_line,
            chunk,
            file,
            buf: Vec::new(),
            eof: false,
        })
    }

    fn fill(&mut self, want: usize) -> Result<()> {
        while self.buf.len() < want && !self.eof {
            let old = self.buf.len();
            let step = (want - old).max(1 << 16);
            self.buf.resize(old + step, 0);
            let n = self
                .file
                .read(&mut self.buf[old..])
                .map_err(|e| Error::io(&self.path, e))?;
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
    /// twice [`ByteUnits::max_line`] bytes past its start; `None` for a last line without
    /// `\n`; an error naming `file:line` for a line longer than the limit (`line`: the line
    /// the buffer starts at).
    fn find_line_end(&mut self, from: usize, line: u64) -> Result<Option<usize>> {
        let head = &self.buf[..from.min(self.buf.len())];
        let start = head.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        let bound = start + self.max_line + 1;
        match self.find(from, Some(bound), false)? {
            Some(c) => Ok(Some(c)),
            None if self.eof && self.buf.len() <= bound => Ok(None),
            None => {
                let line = line + self.buf[..start].iter().filter(|&&b| b == b'\n').count() as u64;
                Err(too_long(&self.path, line, self.max_line))
            }
        }
    }

    /// Checks that no line of the next `len` buffered bytes (from line `line`) is longer than
    /// the limit.
    fn check_lines(&self, len: usize, line: u64) -> Result<()> {
        for (i, text) in self.buf[..len].split(|&b| b == b'\n').enumerate() {
            let text = text.strip_suffix(b"\r").unwrap_or(text);
            if text.len() > self.max_line {
                return Err(too_long(&self.path, line + i as u64, self.max_line));
            }
        }
        Ok(())
    }
}

impl FileReader for ByteUnits {
    fn next_unit(&mut self, at: &mut Position) -> Result<Option<Unit>> {
        self.fill(self.chunk + 1)?;
        if self.buf.is_empty() {
            return Ok(None);
        }
        let from = self.chunk - 1;
        let found = if self.text {
            match self.find(from, Some(MAX_UNIT_CHUNKS * self.chunk), true)? {
                Some(c) => Some(c),
                None => self.find(from, None, false)?,
            }
        } else {
            self.find_line_end(from, at.line)?
        };
        let cut = found.unwrap_or(self.buf.len());
        if !self.text {
            self.check_lines(cut, at.line)?;
        }
        let bytes: Vec<u8> = self.buf.drain(..cut).collect();
        self.fill(1)?;
        let eof = self.buf.is_empty() && self.eof;
        let start = at.clone();
        at.offset += cut as u64;
        at.line += bytes.iter().filter(|&&b| b == b'\n').count() as u64;
        Ok(Some(Unit {
            at: start,
            next: at.clone(),
            size: cut as u64,
            bytes,
            rows: None,
            eof,
        }))
    }
}
