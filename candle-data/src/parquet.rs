//! Parquet input (what the Hugging Face hub serves): the rows of a file as the records
//! `trainer prepare` reads from JSON lines, one row group at a time, from any row.
//!
//! - A string column (`--field`, default `text`) for `--format text` and `--format jsonl`:
//!   each row is one document.
//! - The SFT columns for `--format sft`: `messages` (a list of structs with `role` and
//!   `content`, as TRL's conversational datasets hold them), `prompt` + `completion` (strings,
//!   or lists of messages) or `text`; a row is the record the JSON object with these keys would
//!   be. A null column counts as absent (a Parquet table has a value, maybe null, in every
//!   column of every row), so one file can mix record formats.
//!
//! Only those columns are decoded, with the `parquet` crate's record reader, page by page: a
//! file is never read whole. A position is a row of the file (from 0); errors name the file,
//! the row group and the row in it. Training's `sft` source reads a `.parquet` file's records
//! the same way ([`read_records`]; it holds them all, as it does a JSONL file's).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ::parquet::basic::Type as Physical;
use ::parquet::errors::ParquetError;
use ::parquet::file::reader::{FileReader, SerializedFileReader};
use ::parquet::record::reader::{ReaderIter, TreeBuilder};
use ::parquet::record::{Field, Row};
use ::parquet::schema::types::{SchemaDescriptor, Type, TypePtr};
use minijinja::value::Value;

use super::sft::records::{parse_value, LineRecord, Record};
use crate::error::{Error, Result};

/// The columns that make a record (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Columns {
    /// One string column: a document a row.
    Text(String),
    /// The SFT columns the file has, of [`SFT_COLUMNS`].
    Sft,
}

/// The columns an SFT record is read from (the keys of a JSON line's record).
const SFT_COLUMNS: [&str; 4] = ["messages", "prompt", "completion", "text"];

/// Whether `path` names a Parquet file (by its extension, `.parquet`).
pub(crate) fn is_parquet(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("parquet"))
}

/// Where a row is, counting from 0: its row group, its index there and in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RowAt {
    /// The row group.
    pub group: usize,
    /// The row within the row group.
    pub row: u64,
    /// The row within the file.
    pub file_row: u64,
}

impl RowAt {
    /// `path` and this row, as errors name them.
    pub fn name(&self, path: &Path) -> PathBuf {
        PathBuf::from(format!(
            "{} (row group {}, row {}; row {} of the file; counting from 0)",
            path.display(),
            self.group,
            self.row,
            self.file_row
        ))
    }
}

/// What one row holds.
pub(crate) enum RowRecord {
    /// The string of a [`Columns::Text`] column.
    Text(String),
    /// An SFT record.
    Sft(Record),
}

/// One row read.
pub(crate) struct ParquetRow {
    /// Where it is.
    pub at: RowAt,
    /// Its record.
    pub record: RowRecord,
    /// Bytes of text it holds (how units are cut).
    pub size: usize,
}

/// The rows of one Parquet file, from a given row on (see the module docs).
pub(crate) struct ParquetRows {
    path: PathBuf,
    reader: SerializedFileReader<File>,
    schema: Arc<SchemaDescriptor>,
    columns: Columns,
    /// Rows in each row group.
    group_rows: Vec<u64>,
    /// The byte where each row group's data ends (the last: the file's end).
    group_ends: Vec<u64>,
    /// The next row's row group, and its index there.
    group: usize,
    row: u64,
    /// Rows before the row group `group`.
    before: u64,
    iter: Option<ReaderIter>,
}

impl ParquetRows {
    /// Opens `path` to read `columns` from the row `file_row` on (the number of rows: none
    /// left), checking that the columns exist and can hold what is read from them.
    pub fn open(path: &Path, columns: &Columns, file_row: u64) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        let reader = SerializedFileReader::new(file).map_err(|e| read_error(path, e))?;
        let meta = reader.metadata();
        let root = meta.file_metadata().schema_descr().root_schema();
        let fields = project(path, root, columns)?;
        let projection = Type::group_type_builder(root.name())
            .with_fields(fields)
            .build()
            .map_err(|e| read_error(path, e))?;
        let schema = Arc::new(SchemaDescriptor::new(Arc::new(projection)));
        let groups = meta.row_groups();
        let group_rows: Vec<u64> = groups.iter().map(|g| g.num_rows().max(0) as u64).collect();
        let mut group_ends: Vec<u64> = groups
            .iter()
            .map(|g| {
                g.columns()
                    .iter()
                    .map(|c| {
                        let (start, n) = c.byte_range();
                        start + n
                    })
                    .max()
                    .unwrap_or(0)
                    .min(len)
            })
            .collect();
        if let Some(last) = group_ends.last_mut() {
            *last = len;
        }
        let (mut group, mut before) = (0, 0);
        while group < group_rows.len() && before + group_rows[group] <= file_row {
            before += group_rows[group];
            group += 1;
        }
        let total: u64 = group_rows.iter().sum();
        if file_row > total {
            return Err(Error::data(
                path,
                format!(
                    "has {total} rows, fewer than the {file_row} an earlier `prepare` read \
                     (the file changed)"
                ),
            ));
        }
        Ok(ParquetRows {
            path: path.to_path_buf(),
            reader,
            schema,
            columns: columns.clone(),
            group_rows,
            group_ends,
            group,
            row: file_row - before,
            before,
            iter: None,
        })
    }

    /// Where the next row is (`None`: no row left).
    pub fn next_at(&self) -> Option<RowAt> {
        (self.group < self.group_rows.len()).then_some(RowAt {
            group: self.group,
            row: self.row,
            file_row: self.before + self.row,
        })
    }

    /// The byte where the data of row group `group` starts (0 for the first), for progress.
    pub fn group_start(&self, group: usize) -> u64 {
        match group.checked_sub(1) {
            None => 0,
            Some(g) => self
                .group_ends
                .get(g)
                .or(self.group_ends.last())
                .copied()
                .unwrap_or(0),
        }
    }

    /// The next row, `None` after the last.
    pub fn next_row(&mut self) -> Result<Option<ParquetRow>> {
        // Row groups the metadata says are empty, or whose rows ran out, are passed over.
        while self.group < self.group_rows.len() {
            if self.row >= self.group_rows[self.group] {
                self.next_group();
                continue;
            }
            if self.iter.is_none() {
                let path = &self.path;
                let group = self
                    .reader
                    .get_row_group(self.group)
                    .map_err(|e| read_error(path, e))?;
                let mut iter = TreeBuilder::new()
                    .as_iter(self.schema.clone(), &*group)
                    .map_err(|e| read_error(path, e))?;
                // Resuming inside a row group: its first rows are read and dropped.
                for _ in 0..self.row {
                    if let Some(r) = iter.next() {
                        r.map_err(|e| read_error(path, e))?;
                    }
                }
                self.iter = Some(iter);
            }
            let at = self.next_at().expect("a row group is left");
            match self.iter.as_mut().and_then(Iterator::next) {
                Some(row) => {
                    let row = row.map_err(|e| read_error(&self.path, e))?;
                    self.row += 1;
                    return self.record(row, at).map(Some);
                }
                None => self.next_group(),
            }
        }
        Ok(None)
    }

    fn next_group(&mut self) {
        self.before += self.group_rows[self.group];
        self.group += 1;
        self.row = 0;
        self.iter = None;
    }

    /// The record of `row` (of the projected columns), read at `at`.
    fn record(&self, row: Row, at: RowAt) -> Result<ParquetRow> {
        let here = || at.name(&self.path);
        match &self.columns {
            Columns::Text(name) => {
                let field = row.into_columns().into_iter().next().map(|(_, f)| f);
                match field {
                    Some(Field::Str(s)) => Ok(ParquetRow {
                        at,
                        size: s.len(),
                        record: RowRecord::Text(s),
                    }),
                    Some(Field::Null) | None => Err(Error::data(
                        here(),
                        format!("column `{name}` is null; each row needs a string"),
                    )),
                    Some(other) => Err(Error::data(
                        here(),
                        format!("column `{name}` holds {other}, not a UTF-8 string"),
                    )),
                }
            }
            Columns::Sft => {
                let mut nulls = Vec::new();
                let mut size = 0;
                let mut pairs = Vec::new();
                for (name, field) in row.into_columns() {
                    match field {
                        Field::Null => nulls.push(name),
                        field => pairs.push((name, to_value(field, &mut size))),
                    }
                }
                let record = parse_value(Value::from_pairs(pairs)).map_err(|msg| {
                    let msg = match nulls.is_empty() {
                        true => msg,
                        false => format!("{msg} (null here: {})", nulls.join(", ")),
                    };
                    Error::data(here(), msg)
                })?;
                Ok(ParquetRow {
                    at,
                    size,
                    record: RowRecord::Sft(record),
                })
            }
        }
    }
}

/// Every SFT record of `path`, with 1 + its row as its line (the `sft` training source, which
/// holds its examples in memory).
pub(crate) fn read_records(path: &Path) -> Result<Vec<LineRecord>> {
    let mut rows = ParquetRows::open(path, &Columns::Sft, 0)?;
    let mut out = Vec::new();
    while let Some(row) = rows.next_row()? {
        if let RowRecord::Sft(record) = row.record {
            let line = row.at.file_row as usize + 1;
            out.push(LineRecord { line, record });
        }
    }
    Ok(out)
}

/// The error for a file the `parquet` crate cannot read.
fn read_error(path: &Path, e: ParquetError) -> Error {
    let hint = match e.to_string().contains("Disabled feature") {
        true => {
            "; this build reads uncompressed and snappy-compressed Parquet only (rewrite the \
             file with snappy, pyarrow's default)"
        }
        false => "",
    };
    Error::data(path, format!("cannot read it as Parquet: {e}{hint}"))
}

/// The root fields of `root` that `columns` reads, checked.
fn project(path: &Path, root: &Type, columns: &Columns) -> Result<Vec<TypePtr>> {
    let fields = root.get_fields();
    let names: Vec<&str> = fields.iter().map(|f| f.name()).collect();
    let available = || format!("its columns: {}", names.join(", "));
    match columns {
        Columns::Text(name) => {
            let Some(field) = fields.iter().find(|f| f.name() == name) else {
                return Err(Error::data(
                    path,
                    format!(
                        "has no column `{name}` ({}); choose one with --field",
                        available()
                    ),
                ));
            };
            let kind = match field.is_primitive() {
                true => field.get_physical_type(),
                false => {
                    return Err(Error::data(
                        path,
                        format!(
                            "column `{name}` is a list or struct, not a string column; choose a \
                             string column with --field ({})",
                            available()
                        ),
                    ))
                }
            };
            if kind != Physical::BYTE_ARRAY {
                return Err(Error::data(
                    path,
                    format!(
                        "column `{name}` is {kind}, not a string column; choose a string column \
                         with --field ({})",
                        available()
                    ),
                ));
            }
            Ok(vec![field.clone()])
        }
        Columns::Sft => {
            let picked: Vec<TypePtr> = fields
                .iter()
                .filter(|f| SFT_COLUMNS.contains(&f.name()))
                .cloned()
                .collect();
            if picked.is_empty() {
                return Err(Error::data(
                    path,
                    format!(
                        "has none of the SFT columns `messages`, `prompt` + `completion` or \
                         `text` ({})",
                        available()
                    ),
                ));
            }
            Ok(picked)
        }
    }
}

/// `field` as the value its JSON form would parse to (dates, times and decimals as their
/// text), adding the bytes of its strings to `size`.
fn to_value(field: Field, size: &mut usize) -> Value {
    match field {
        Field::Null => Value::from(()),
        Field::Bool(v) => Value::from(v),
        Field::Byte(v) => Value::from(v),
        Field::Short(v) => Value::from(v),
        Field::Int(v) => Value::from(v),
        Field::Long(v) => Value::from(v),
        Field::UByte(v) => Value::from(v),
        Field::UShort(v) => Value::from(v),
        Field::UInt(v) => Value::from(v),
        Field::ULong(v) => Value::from(v),
        Field::Float16(v) => Value::from(f32::from(v)),
        Field::Float(v) => Value::from(v),
        Field::Double(v) => Value::from(v),
        Field::Str(s) => {
            *size += s.len();
            Value::from(s)
        }
        Field::Bytes(b) => {
            *size += b.len();
            Value::from_bytes(b.data().to_vec())
        }
        Field::Group(row) => Value::from_pairs(
            row.into_columns()
                .into_iter()
                .map(|(k, v)| (k, to_value(v, size))),
        ),
        Field::ListInternal(list) => list
            .elements()
            .iter()
            .map(|v| to_value(v.clone(), size))
            .collect(),
        Field::MapInternal(map) => Value::from_pairs(
            map.entries()
                .iter()
                .map(|(k, v)| (to_value(k.clone(), size), to_value(v.clone(), size))),
        ),
        other => Value::from(other.to_string()),
    }
}
