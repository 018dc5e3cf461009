//! The GGUF container, version 3, as llama.cpp reads it (`ggml/src/gguf.cpp`): a header, the
//! metadata key-values, the tensor infos, then each tensor's bytes at its offset (aligned to
//! [`ALIGNMENT`]). The writer knows every tensor's size before any data, so the header is
//! written first and the tensors are streamed one at a time after it.

use std::io::Write;

/// `general.alignment`'s default, which this writer uses (and does not write).
pub const ALIGNMENT: u64 = 32;

const MAGIC: &[u8; 4] = b"GGUF";
const VERSION: u32 = 3;

/// A metadata value (GGUF's value types that llama.cpp's keys use).
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// `UINT32`.
    U32(u32),
    /// `FLOAT32`.
    F32(f32),
    /// `BOOL`.
    Bool(bool),
    /// `STRING`.
    Str(String),
    /// `ARRAY` of `STRING`.
    Strs(Vec<String>),
    /// `ARRAY` of `INT32`.
    I32s(Vec<i32>),
    /// `ARRAY` of `FLOAT32`.
    F32s(Vec<f32>),
}

impl Value {
    fn type_id(&self) -> u32 {
        match self {
            Value::U32(_) => 4,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::Str(_) => 8,
            Value::Strs(_) | Value::I32s(_) | Value::F32s(_) => 9,
        }
    }

    fn write(&self, w: &mut impl Write) -> std::io::Result<()> {
        match self {
            Value::U32(v) => w.write_all(&v.to_le_bytes()),
            Value::F32(v) => w.write_all(&v.to_le_bytes()),
            Value::Bool(v) => w.write_all(&[*v as u8]),
            Value::Str(s) => write_str(w, s),
            Value::Strs(v) => {
                w.write_all(&8u32.to_le_bytes())?;
                w.write_all(&(v.len() as u64).to_le_bytes())?;
                v.iter().try_for_each(|s| write_str(w, s))
            }
            Value::I32s(v) => {
                w.write_all(&5u32.to_le_bytes())?;
                w.write_all(&(v.len() as u64).to_le_bytes())?;
                v.iter().try_for_each(|x| w.write_all(&x.to_le_bytes()))
            }
            Value::F32s(v) => {
                w.write_all(&6u32.to_le_bytes())?;
                w.write_all(&(v.len() as u64).to_le_bytes())?;
                v.iter().try_for_each(|x| w.write_all(&x.to_le_bytes()))
            }
        }
    }
}

fn write_str(w: &mut impl Write, s: &str) -> std::io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

/// A tensor type of ggml's, with its block layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// Blocks of 32: an f16 scale and 32 signed bytes.
    Q8_0,
    /// Blocks of 32: an f16 scale, 32 5-bit quants (the fallback of q4_k rows).
    Q5_0,
    /// Super-blocks of 256 with 4-bit quants and 6-bit scales (k-quants).
    Q4K,
    /// Super-blocks of 256 with 6-bit quants (k-quants).
    Q6K,
}

impl GgmlType {
    /// ggml's `enum ggml_type` value.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q5_0 => 6,
            GgmlType::Q8_0 => 8,
            GgmlType::Q4K => 12,
            GgmlType::Q6K => 14,
            GgmlType::Bf16 => 30,
        }
    }

    /// Elements per block, and bytes per block.
    pub fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::Bf16 => (1, 2),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q5_0 => (32, 22),
            GgmlType::Q4K => (256, 144),
            GgmlType::Q6K => (256, 210),
        }
    }

    /// Bytes of a row-major tensor of `shape` (rows of its last dimension), or `None` when
    /// the rows are not whole blocks.
    pub fn bytes(self, shape: &[usize]) -> Option<u64> {
        let (elems, bytes) = self.block();
        let row = *shape.last().unwrap_or(&1);
        if !row.is_multiple_of(elems) {
            return None;
        }
        let n: usize = shape.iter().product();
        Some((n / elems * bytes) as u64)
    }
}

/// One tensor of the file: its llama.cpp name, its shape as PyTorch writes it (outermost
/// first: `[rows, columns]`; GGUF stores the reverse), and its type.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// llama.cpp's name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Outermost first.
    pub shape: Vec<usize>,
    /// The stored type.
    pub ty: GgmlType,
}

fn padding(n: u64) -> u64 {
    (ALIGNMENT - n % ALIGNMENT) % ALIGNMENT
}

/// Writes a GGUF file's header (metadata and tensor infos) to `w`; the tensors' data must
/// follow, in the same order, through [`Data`].
pub fn write_header<W: Write>(
    mut w: W,
    metadata: &[(String, Value)],
    tensors: &[TensorInfo],
) -> std::io::Result<Data<W>> {
    let mut head = Vec::new();
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(&VERSION.to_le_bytes());
    head.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    head.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (key, value) in metadata {
        write_str(&mut head, key)?;
        head.extend_from_slice(&value.type_id().to_le_bytes());
        value.write(&mut head)?;
    }
    let mut offset = 0u64;
    let mut sizes = Vec::with_capacity(tensors.len());
    for t in tensors {
        write_str(&mut head, &t.name)?;
        head.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
        for d in t.shape.iter().rev() {
            head.extend_from_slice(&(*d as u64).to_le_bytes());
        }
        head.extend_from_slice(&t.ty.id().to_le_bytes());
        head.extend_from_slice(&offset.to_le_bytes());
        let size = t.ty.bytes(&t.shape).ok_or_else(|| {
            std::io::Error::other(format!(
                "{}: rows of {} are not whole {:?} blocks",
                t.name,
                t.shape.last().unwrap_or(&1),
                t.ty
            ))
        })?;
        sizes.push((t.name.clone(), size));
        offset += size + padding(size);
    }
    let pad = padding(head.len() as u64);
    head.resize(head.len() + pad as usize, 0);
    w.write_all(&head)?;
    Ok(Data { w, sizes, next: 0 })
}

/// The data section of a file whose header is written: each tensor's bytes in turn.
pub struct Data<W: Write> {
    w: W,
    sizes: Vec<(String, u64)>,
    next: usize,
}

impl<W: Write> Data<W> {
    /// Writes the next tensor's bytes (their length is checked against its info).
    pub fn tensor(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        let Some((name, size)) = self.sizes.get(self.next) else {
            return Err(std::io::Error::other("more tensors than the header lists"));
        };
        if bytes.len() as u64 != *size {
            return Err(std::io::Error::other(format!(
                "{name}: {} bytes where the header says {size}",
                bytes.len()
            )));
        }
        self.w.write_all(bytes)?;
        self.w.write_all(&vec![0u8; padding(*size) as usize])?;
        self.next += 1;
        Ok(())
    }

    /// The writer, once every tensor is written.
    pub fn finish(self) -> std::io::Result<W> {
        if self.next != self.sizes.len() {
            return Err(std::io::Error::other(format!(
                "{} of {} tensors written",
                self.next,
                self.sizes.len()
            )));
        }
        Ok(self.w)
    }
}
