//! Parquet files read as units of rows: a unit ends at the end of a row group or after about
//! `chunk` bytes of text, and a resume point is a row.

use std::path::Path;

use super::unit::{FileReader, Position, Unit};
use crate::error::Result;
use crate::parquet::{Columns, ParquetRows};

/// One Parquet file read as units of rows (the `columns` of each).
pub(super) struct ParquetUnits {
    rows: ParquetRows,
    chunk: usize,
}

impl ParquetUnits {
    /// `path` opened at the row `at.line - 1`.
    pub(super) fn open(
        path: &Path,
        at: &Position,
        columns: &Columns,
        chunk: usize,
    ) -> Result<Self> {
        let first = at.line.saturating_sub(1);
        Ok(ParquetUnits {
            rows: ParquetRows::open(path, columns, first)?,
            chunk,
        })
    }
}

impl FileReader for ParquetUnits {
    fn next_unit(&mut self, at: &mut Position) -> Result<Option<Unit>> {
        let reader = &mut self.rows;
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
        let start = Position {
            offset: reader.group_start(first.group),
            line: first.file_row + 1,
            ..at.clone()
        };
        let (next, eof) = match reader.next_at() {
            Some(a) => {
                let next = Position {
                    offset: reader.group_start(a.group),
                    line: a.file_row + 1,
                    ..at.clone()
                };
                (next, false)
            }
            None => {
                let end = reader.group_start(usize::MAX);
                let next = Position {
                    offset: end,
                    ..start.clone()
                };
                (next, true)
            }
        };
        let size = next.offset - start.offset;
        *at = next;
        Ok(Some(Unit {
            at: start,
            next: at.clone(),
            size,
            bytes: Vec::new(),
            rows: Some(rows),
            eof,
        }))
    }
}
