//! `prepare`'s inputs as a sequence of *units* from a resumable [`Position`]: byte units cut
//! by a rule that depends only on the bytes (so the token stream never depends on timing or
//! thread count), or runs of Parquet rows. A storage format is one [`FileReader`]
//! ([`super::read_bytes`], [`super::read_parquet`]); [`super::input`] reads the files in
//! order with the reader each one needs, and [`super::encode`] turns a unit into document
//! pieces.

use crate::error::Result;
use crate::parquet::ParquetRow;

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

/// The position of the first byte of the first file.
pub(crate) fn start() -> Position {
    Position {
        line: 1,
        ..Position::default()
    }
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

/// One input file, opened at a [`Position`], read a unit at a time.
pub(crate) trait FileReader {
    /// The unit that starts at `at` (inside this reader's file), `at` moved past it; `None`
    /// after the file's last unit.
    fn next_unit(&mut self, at: &mut Position) -> Result<Option<Unit>>;
}
