//! `prepare`'s input files read in order, each with the [`FileReader`] of its storage
//! format, as one sequence of units (see [`super::unit`]).

use std::path::PathBuf;

use super::options::{Container, InputFormat, PrepareOptions};
use super::read_bytes::ByteUnits;
use super::read_parquet::ParquetUnits;
use super::unit::{FileReader, Position, Unit};
use crate::error::{Error, Result};
use crate::parquet::{is_parquet, Columns};

/// Reads the input files, in order, as units (see [`super::unit`]): each file with the
/// reader of its format, from a resumable position.
pub(crate) struct UnitReader<'a> {
    files: &'a [PathBuf],
    text: bool,
    /// The longest line of a JSON-lines file (see [`crate::lines`]).
    max_line: usize,
    chunk: usize,
    at: Position,
    /// The reader of the file `at.file`, once opened.
    current: Option<Box<dyn FileReader>>,
    /// Which files are read as Parquet, and the columns read from them.
    parquet: Vec<bool>,
    columns: Columns,
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
            current: None,
            parquet: Vec::new(),
            columns: Columns::Sft,
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

    /// The reader of the file `self.at.file`, at `self.at`.
    fn open_file(&self) -> Result<Box<dyn FileReader>> {
        let path = &self.files[self.at.file];
        Ok(match self.parquet.get(self.at.file) == Some(&true) {
            true => Box::new(ParquetUnits::open(
                path,
                &self.at,
                &self.columns,
                self.chunk,
            )?),
            false => Box::new(ByteUnits::open(
                path,
                &self.at,
                self.text,
                self.chunk,
                self.max_line,
            )?),
        })
    }

    /// Moves to the start of the next file.
    fn next_file(&mut self) {
        self.current = None;
        self.at.file += 1;
        self.at.offset = 0;
        self.at.line = 1;
    }

    /// The next unit, `None` after the last file. Empty files give no unit.
    pub fn next_unit(&mut self) -> Result<Option<Unit>> {
        loop {
            if self.at.file >= self.files.len() {
                return Ok(None);
            }
            if self.current.is_none() {
                self.current = Some(self.open_file()?);
            }
            let reader = self.current.as_mut().expect("opened above");
            let Some(mut unit) = reader.next_unit(&mut self.at)? else {
                self.next_file();
                continue;
            };
            if unit.eof {
                self.next_file();
                unit.next = self.at.clone();
            }
            return Ok(Some(unit));
        }
    }
}

/// Which of `files` are read as Parquet: by extension unless `opts.container` says; refuses a
/// container that contradicts the format.
pub(crate) fn parquet_files(opts: &PrepareOptions, files: &[PathBuf]) -> Result<Vec<bool>> {
    let all = |p: bool| Ok(vec![p; files.len()]);
    match (opts.container, opts.format) {
        (Container::Auto | Container::Parquet, InputFormat::Preference) => {
            match files
                .iter()
                .find(|p| opts.container == Container::Parquet || is_parquet(p))
            {
                Some(p) => Err(Error::data(
                    p,
                    "is read as Parquet; --format preference reads JSON lines, one record a \
                     line (as data = preference does)",
                )),
                None => all(false),
            }
        }
        (Container::Auto, _) => Ok(files.iter().map(|p| is_parquet(p)).collect()),
        (Container::Parquet, _) => all(true),
        (Container::Jsonl, InputFormat::Jsonl | InputFormat::Sft | InputFormat::Preference)
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
        // (preference records are never Parquet rows: `parquet_files` refuses them)
        InputFormat::Sft | InputFormat::Preference => Columns::Sft,
        InputFormat::Text | InputFormat::Jsonl => Columns::Text(opts.field.clone()),
    };
    let reader = UnitReader::new(files, text, opts.chunk_bytes, opts.max_line_bytes, at);
    Ok(reader.with_parquet(parquet_files(opts, files)?, columns))
}

#[cfg(test)]
#[path = "input_tests.rs"]
mod tests;
