//! Launch contracts of the ahead-of-time compiled Triton kernels (`candle-fused/kernels/`),
//! independent of any feature: what a CUDA launcher (cudarc, in a `cuda_fwd`) must pass, and
//! [`check_launch`], the pure check it calls before launching.
//!
//! The kernels are written in `candle-fused/triton/*.py`, compiled on a CPU-only machine by
//! `scripts/python/triton_compile.py` into `<kernel>.<dtype>.sm<NN>.cubin` (sm_80, sm_90) with
//! a `.json` of metadata, and checked under Triton's interpreter against this crate's CPU
//! kernels by `scripts/python/triton_interpret_check.py`. `tests/triton_record.rs` keeps the
//! table below, the metadata and the recorded check in agreement.
//!
//! The compiled specialisation: every pointer is 16-byte aligned (`tt.divisibility = 16`),
//! tensors are contiguous, integer arguments are unspecialised i32. Each `.entry` takes the
//! kernel's own parameters, then two scratch pointers (global, profile) that these kernels do
//! not use: pass null.
//!
//! ```
//! use candle_core::DType;
//! use candle_fused::cuda_kernels::{check_launch, find, TensorArg};
//! let spec = find("rms_norm_fwd", DType::BF16).unwrap();
//! let (n, c) = (8usize, 768usize);
//! let x = TensorArg::contiguous(&[n, c], DType::BF16, 0);
//! let w = TensorArg::contiguous(&[c], DType::BF16, 0);
//! let y = TensorArg::contiguous(&[n, c], DType::BF16, 0);
//! let rstd = TensorArg::contiguous(&[n], DType::F32, 0);
//! let launch = check_launch(spec, &[x, w, y, rstd])?;
//! assert_eq!((launch.grid, launch.block), ([8, 1, 1], [256, 1, 1]));
//! assert_eq!(launch.ints, [8, 768]); // N, C (then eps: f32, then two null scratch pointers)
//! // a tensor starting 2 bytes into its buffer breaks the 16-byte alignment
//! let x = TensorArg::contiguous(&[n, c], DType::BF16, 2);
//! let w = TensorArg::contiguous(&[c], DType::BF16, 0);
//! let y = TensorArg::contiguous(&[n, c], DType::BF16, 0);
//! let rstd = TensorArg::contiguous(&[n], DType::F32, 0);
//! assert!(check_launch(spec, &[x, w, y, rstd]).is_err());
//! # Ok::<(), candle_core::Error>(())
//! ```

use candle_core::{bail, DType, Result};

/// A symbolic dimension of a kernel's tensor parameters, bound from the tensors passed.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Dim {
    /// Rows.
    N,
    /// Columns (the normalised dimension).
    C,
    /// Partial-sum rows of the backward: `cdiv(N, rows_per_program)`.
    P,
}

/// The element type of a tensor parameter.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Elem {
    /// The kernel variant's dtype (f32, bf16 or f16).
    Io,
    /// Always f32 (saved statistics, partial sums).
    F32,
}

/// One parameter of a kernel's `.entry`, in order.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Param {
    /// A pointer to a contiguous tensor of this shape and element type.
    Tensor(&'static str, &'static [Dim], Elem),
    /// An i32 scalar holding the bound value of the dimension.
    Int(&'static str, Dim),
    /// An f32 scalar supplied by the caller (e.g. `eps`).
    Float(&'static str),
}

impl Param {
    /// The parameter's name in the Triton source.
    pub fn name(&self) -> &'static str {
        match *self {
            Param::Tensor(n, ..) | Param::Int(n, _) | Param::Float(n) => n,
        }
    }

    /// The Triton signature type (`*bf16`, `*fp32`, `i32`, `fp32`) for a kernel of `dtype`.
    pub fn triton_type(&self, dtype: DType) -> String {
        match self {
            Param::Tensor(_, _, Elem::Io) => format!("*{}", triton_dtype(dtype)),
            Param::Tensor(_, _, Elem::F32) => "*fp32".into(),
            Param::Int(..) => "i32".into(),
            Param::Float(_) => "fp32".into(),
        }
    }
}

/// Triton's name of a dtype (`fp32`, `bf16`, `fp16`; `?` for others).
pub fn triton_dtype(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "fp32",
        DType::BF16 => "bf16",
        DType::F16 => "fp16",
        _ => "?",
    }
}

/// The program grid of a kernel (always one-dimensional here).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Grid {
    /// One program per row: `(N, 1, 1)`.
    Rows,
    /// One program per block of `r` rows: `(cdiv(N, r), 1, 1)`.
    RowBlocks(usize),
    /// One program per block of `b` columns: `(cdiv(C, b), 1, 1)`.
    ColBlocks(usize),
}

impl Grid {
    /// The rule as the metadata json writes it, e.g. `(cdiv(N, 32), 1, 1)`.
    pub fn describe(&self) -> String {
        match self {
            Grid::Rows => "(N, 1, 1)".into(),
            Grid::RowBlocks(r) => format!("(cdiv(N, {r}), 1, 1)"),
            Grid::ColBlocks(b) => format!("(cdiv(C, {b}), 1, 1)"),
        }
    }
}

/// What a launcher needs to know about one compiled kernel (one dtype; the sm_80 and sm_90
/// cubins share it).
#[derive(Clone, Copy, Debug)]
pub struct KernelSpec {
    /// The `.entry` name (the Triton function).
    pub entry: &'static str,
    /// The dtype of the variant (`Elem::Io` tensors).
    pub dtype: DType,
    /// Warps per program; the block is `32 * num_warps` threads.
    pub num_warps: u32,
    /// Dynamic shared memory in bytes (`metadata.shared`).
    pub shared_bytes: u32,
    /// The grid rule.
    pub grid: Grid,
    /// The `BLOCK_C` constexpr: the largest `C` a program covers (a row is one tile for
    /// `Grid::Rows` / `Grid::RowBlocks` kernels; a column block for `Grid::ColBlocks`).
    pub block_c: usize,
    /// The kernel's own parameters in `.entry` order (the two scratch pointers follow).
    pub params: &'static [Param],
}

impl KernelSpec {
    /// `<entry>.<dtype>`, e.g. `rms_norm_fwd.bf16`: the stem of the kernel's files.
    pub fn name(&self) -> String {
        format!("{}.{}", self.entry, dtype_suffix(self.dtype))
    }

    /// Threads per block.
    pub fn block(&self) -> [u32; 3] {
        [32 * self.num_warps, 1, 1]
    }
}

/// `f32`, `bf16`, `f16` (the file-name suffix of a dtype; `?` for others).
pub fn dtype_suffix(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        _ => "?",
    }
}

/// The compute capabilities the cubins are built for.
pub const ARCHS: [u32; 2] = [80, 90];
/// The pointer alignment the kernels are specialised for, in bytes.
pub const POINTER_ALIGNMENT: usize = 16;
/// The number of trailing scratch pointer parameters of every `.entry` (pass null).
pub const SCRATCH_PARAMS: usize = 2;

use Dim::{C, N, P};
use Elem::{Io, F32};

const RMS_FWD: &[Param] = &[
    Param::Tensor("X", &[N, C], Io),
    Param::Tensor("W", &[C], Io),
    Param::Tensor("Y", &[N, C], Io),
    Param::Tensor("RSTD", &[N], F32),
    Param::Int("N", N),
    Param::Int("C", C),
    Param::Float("eps"),
];
const RMS_BWD_DX: &[Param] = &[
    Param::Tensor("X", &[N, C], Io),
    Param::Tensor("W", &[C], Io),
    Param::Tensor("DY", &[N, C], Io),
    Param::Tensor("RSTD", &[N], F32),
    Param::Tensor("DX", &[N, C], Io),
    Param::Tensor("DW_PARTIAL", &[P, C], F32),
    Param::Int("N", N),
    Param::Int("C", C),
];
const RMS_BWD_DW: &[Param] = &[
    Param::Tensor("DW_PARTIAL", &[P, C], F32),
    Param::Tensor("DW", &[C], Io),
    Param::Int("P", P),
    Param::Int("C", C),
];

/// Rows per program of `rms_norm_bwd_dx` (`ROWS_PER_PROGRAM`): `DW_PARTIAL` has
/// `cdiv(N, RMS_BWD_ROWS_PER_PROGRAM)` rows.
pub const RMS_BWD_ROWS_PER_PROGRAM: usize = 32;

const fn rms(dtype: DType, shared_io: u32) -> [KernelSpec; 3] {
    [
        KernelSpec {
            entry: "rms_norm_fwd",
            dtype,
            num_warps: 8,
            shared_bytes: shared_io,
            grid: Grid::Rows,
            block_c: 4096,
            params: RMS_FWD,
        },
        KernelSpec {
            entry: "rms_norm_bwd_dx",
            dtype,
            num_warps: 8,
            shared_bytes: shared_io,
            grid: Grid::RowBlocks(RMS_BWD_ROWS_PER_PROGRAM),
            block_c: 4096,
            params: RMS_BWD_DX,
        },
        KernelSpec {
            entry: "rms_norm_bwd_dw",
            dtype,
            num_warps: 2,
            shared_bytes: 0,
            grid: Grid::ColBlocks(256),
            block_c: 256,
            params: RMS_BWD_DW,
        },
    ]
}

const F32_RMS: [KernelSpec; 3] = rms(DType::F32, 4096);
const BF16_RMS: [KernelSpec; 3] = rms(DType::BF16, 8192);
const F16_RMS: [KernelSpec; 3] = rms(DType::F16, 8192);

/// Every compiled kernel: RMSNorm forward, backward `dx` (+ `dW` partial sums) and the
/// ordered `dW` reduction, for f32, bf16 and f16.
pub const KERNELS: [KernelSpec; 9] = [
    F32_RMS[0],
    F32_RMS[1],
    F32_RMS[2],
    BF16_RMS[0],
    BF16_RMS[1],
    BF16_RMS[2],
    F16_RMS[0],
    F16_RMS[1],
    F16_RMS[2],
];

/// The kernel `entry` for `dtype`, if compiled.
pub fn find(entry: &str, dtype: DType) -> Option<&'static KernelSpec> {
    KERNELS
        .iter()
        .find(|k| k.entry == entry && k.dtype == dtype)
}

/// A tensor argument as the launcher sees it: dims, strides (in elements), dtype and the
/// byte offset of its first element. `offset_bytes` is either the device address itself or
/// the offset into an allocation whose base is at least 16-byte aligned (CUDA's allocations
/// are 256-byte aligned); only its remainder modulo 16 matters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorArg {
    /// The shape.
    pub dims: Vec<usize>,
    /// The strides, in elements.
    pub strides: Vec<usize>,
    /// The element type.
    pub dtype: DType,
    /// The byte offset (or address) of the first element.
    pub offset_bytes: usize,
}

impl TensorArg {
    /// A row-major contiguous tensor starting `offset_bytes` into an aligned buffer.
    pub fn contiguous(dims: &[usize], dtype: DType, offset_bytes: usize) -> Self {
        let mut strides = vec![1; dims.len()];
        for i in (0..dims.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * dims[i + 1];
        }
        Self {
            dims: dims.to_vec(),
            strides,
            dtype,
            offset_bytes,
        }
    }
}

/// A checked launch: grid and block, dynamic shared memory and the i32 scalars in parameter
/// order (the f32 scalars and the two null scratch pointers are the caller's to append).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    /// Programs (CUDA blocks).
    pub grid: [u32; 3],
    /// Threads per block.
    pub block: [u32; 3],
    /// Dynamic shared memory, bytes.
    pub shared_bytes: u32,
    /// The values of the `Param::Int` parameters, in order.
    pub ints: Vec<i32>,
}

/// Checks `tensors` (the kernel's `Param::Tensor` parameters, in order) against `spec`:
/// dtypes, shapes (binding `N`, `C`, `P`), contiguity, 16-byte alignment, `C <= BLOCK_C`,
/// `P == cdiv(N, rows per program)`, i32 ranges; returns the launch configuration.
pub fn check_launch(spec: &KernelSpec, tensors: &[TensorArg]) -> Result<Launch> {
    let name = spec.name();
    let tparams: Vec<_> = spec
        .params
        .iter()
        .filter_map(|p| match *p {
            Param::Tensor(n, dims, elem) => Some((n, dims, elem)),
            _ => None,
        })
        .collect();
    if tparams.len() != tensors.len() {
        bail!(
            "{name}: expected {} tensor arguments ({}), got {}",
            tparams.len(),
            tparams.iter().map(|t| t.0).collect::<Vec<_>>().join(", "),
            tensors.len()
        )
    }
    let mut bound: [Option<usize>; 3] = [None; 3];
    for ((pname, dims, elem), t) in tparams.iter().zip(tensors) {
        let want = match elem {
            Elem::Io => spec.dtype,
            Elem::F32 => DType::F32,
        };
        if t.dtype != want {
            bail!("{name}: {pname} must be {want:?}, got {:?}", t.dtype)
        }
        if t.dims.len() != dims.len() || t.strides.len() != dims.len() {
            bail!(
                "{name}: {pname} must have rank {} ({dims:?}), got dims {:?} strides {:?}",
                dims.len(),
                t.dims,
                t.strides
            )
        }
        for (d, &size) in dims.iter().zip(&t.dims) {
            let slot = &mut bound[*d as usize];
            match *slot {
                None => *slot = Some(size),
                Some(s) if s != size => {
                    bail!("{name}: {pname} has {d:?} = {size}, an earlier argument {s}")
                }
                Some(_) => {}
            }
        }
        let contiguous = TensorArg::contiguous(&t.dims, t.dtype, t.offset_bytes);
        let strides_ok = t
            .dims
            .iter()
            .zip(t.strides.iter().zip(&contiguous.strides))
            .all(|(&d, (s, c))| d <= 1 || s == c);
        if !strides_ok {
            bail!(
                "{name}: {pname} must be contiguous (row-major), got dims {:?} strides {:?}",
                t.dims,
                t.strides
            )
        }
        if t.offset_bytes % POINTER_ALIGNMENT != 0 {
            bail!(
                "{name}: {pname} starts at byte offset {} (mod 16 = {}); the kernel was compiled \
                 for {POINTER_ALIGNMENT}-byte aligned pointers (tt.divisibility = 16): copy it to \
                 a fresh buffer (.contiguous() of a new allocation) or use an unspecialised variant",
                t.offset_bytes,
                t.offset_bytes % POINTER_ALIGNMENT
            )
        }
    }
    let get = |d: Dim| bound[d as usize];
    let c = get(Dim::C).unwrap_or(0);
    if c == 0 {
        bail!("{name}: C must be > 0")
    }
    if !matches!(spec.grid, Grid::ColBlocks(_)) && c > spec.block_c {
        bail!(
            "{name}: C = {c} exceeds BLOCK_C = {} (one row per tile)",
            spec.block_c
        )
    }
    if let (Grid::RowBlocks(r), Some(n), Some(p)) = (spec.grid, get(Dim::N), get(Dim::P)) {
        if p != n.div_ceil(r) {
            bail!(
                "{name}: DW_PARTIAL must have cdiv(N, {r}) = {} rows, got {p}",
                n.div_ceil(r)
            )
        }
    }
    let i32_of = |what: &str, v: usize| -> Result<u32> {
        match i32::try_from(v) {
            Ok(_) => Ok(v as u32),
            Err(_) => bail!("{name}: {what} = {v} does not fit an i32"),
        }
    };
    let programs = match spec.grid {
        Grid::Rows => get(Dim::N).unwrap_or(0),
        Grid::RowBlocks(r) => get(Dim::N).unwrap_or(0).div_ceil(r),
        Grid::ColBlocks(b) => c.div_ceil(b),
    };
    if programs == 0 {
        bail!("{name}: empty grid (N = 0): skip the launch")
    }
    let mut ints = Vec::new();
    for p in spec.params {
        if let Param::Int(pname, d) = *p {
            let Some(v) = get(d) else {
                bail!("{name}: no tensor argument gives {pname}")
            };
            ints.push(i32_of(pname, v)? as i32);
        }
    }
    Ok(Launch {
        grid: [i32_of("grid", programs)?, 1, 1],
        block: spec.block(),
        shared_bytes: spec.shared_bytes,
        ints,
    })
}
