//! The one bound on a JSON line: every JSONL reader (`trainer prepare --format jsonl|sft`,
//! SFT training's records) refuses a line longer than a limit before reading the rest of it,
//! naming `file:line` and the limit. Parsing and rendering one line costs a few hundred times
//! its size (one 50 MB line took 11 GB), so an unbounded line is an unbounded allocation.

use std::io::{BufRead, Read};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The default longest JSON line, in bytes: 4 MiB, a long book (one 3.6 MB line of short words
/// peaked at 0.6 GB to tokenise with a BPE tokenizer); `trainer prepare --max-line-bytes`
/// changes it for prepare. A longer document belongs in a text file (`--format text`: a file
/// is one document, read in 1 MiB pieces).
pub const MAX_LINE_BYTES: usize = 4 << 20;

/// The error for line `line` of `path`, longer than `limit` bytes.
pub(crate) fn too_long(path: &Path, line: u64, limit: usize) -> Error {
    Error::data(
        PathBuf::from(format!("{}:{line}", path.display())),
        format!(
            "a JSON line longer than {limit} bytes, the limit on one line (default \
             {MAX_LINE_BYTES}, `trainer prepare --max-line-bytes`); split the record, or give a \
             long document as a text file"
        ),
    )
}

/// Reads the next line of `reader` (line number `line` of `path`) into `buf`, without its
/// `\n`, reading at most `limit + 1` bytes of it: `Ok(false)` at the end of the input, an
/// error naming `path:line` for a longer line.
pub(crate) fn read_line(
    reader: &mut impl BufRead,
    buf: &mut Vec<u8>,
    limit: usize,
    path: &Path,
    line: u64,
) -> Result<bool> {
    buf.clear();
    let n = reader
        .by_ref()
        .take(limit as u64 + 2)
        .read_until(b'\n', buf)
        .map_err(|e| Error::io(path, e))?;
    if n == 0 {
        return Ok(false);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
    }
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    if buf.len() > limit {
        return Err(too_long(path, line, limit));
    }
    Ok(true)
}

/// Calls `each` with the number (1-based) and the text of every line of the JSONL file `path`,
/// without its line end, each refused past [`MAX_LINE_BYTES`] as [`read_line`] does; a line
/// that is not UTF-8 is an error naming `file:line` and the column of its first invalid byte.
pub(crate) fn for_each_line(
    path: &Path,
    mut each: impl FnMut(usize, &str) -> Result<()>,
) -> Result<()> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut reader = std::io::BufReader::new(file);
    let mut buf = Vec::new();
    let mut n = 0;
    while read_line(&mut reader, &mut buf, MAX_LINE_BYTES, path, n as u64 + 1)? {
        n += 1;
        let line = std::str::from_utf8(&buf).map_err(|e| {
            Error::data(
                format!("{}:{n}", path.display()),
                format!(
                    "not valid UTF-8 (first invalid byte at column {})",
                    e.valid_up_to() + 1
                ),
            )
        })?;
        each(n, line)?;
    }
    Ok(())
}
