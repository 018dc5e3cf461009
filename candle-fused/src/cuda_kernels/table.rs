//! The launch tables' types: a kernel's parameters ([`Param`], [`Elem`]), its grid
//! ([`Extent`]), the rules on its dimensions ([`Rule`]) and its whole entry ([`KernelSpec`]),
//! with the constants every compiled kernel shares. Nothing here depends on the rest of
//! `cuda_kernels`: the generated tables, the checks and the launcher build on it.

use candle_core::DType;

/// The element type of a tensor parameter.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Elem {
    /// The kernel variant's dtype (f32, bf16 or f16; the generated table of an f32 variant
    /// writes every f32 pointer so).
    Io,
    /// Always f32 (saved statistics, partial sums, optimizer state).
    F32,
    /// Always f64 (partial sums that must not round before the total, e.g. sums of squares).
    F64,
    /// Always i32 (indices, document ids).
    I32,
    /// Always u32 (class targets, as the CPU ops take them).
    U32,
    /// Always u8 (packed 4-bit codes, 8-bit absmax codes).
    U8,
    /// Always i64 (tables of device addresses and sizes: the multi-tensor kernels).
    I64,
}

/// One parameter of a kernel's `.entry`, in order.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Param {
    /// A pointer to a tensor: its name, its dimensions (named; the same name binds the same
    /// size across parameters) and element type. Contiguous, unless a [`Param::Stride`] names
    /// it: then any strides with the last one 1, passed to the kernel.
    Tensor(&'static str, &'static [&'static str], Elem),
    /// An i32 holding a stride (in elements) of a tensor parameter: `(parameter, tensor,
    /// dimension)`, e.g. `("sqt", "Q", "T")`. The launcher binds it as a dimension of the
    /// parameter's name, so a [`Rule`] can constrain it (`MultipleOf("sqt", 16)`).
    Stride(&'static str, &'static str, &'static str),
    /// An i32 holding the bound size of the named dimension: `(parameter, dimension)`.
    Dim(&'static str, &'static str),
    /// An i32 supplied by the caller (a [`Scalar::I32`](super::Scalar::I32), in order).
    Int(&'static str),
    /// An f32 supplied by the caller (a [`Scalar::F32`](super::Scalar::F32), in order), e.g. `eps`.
    Float(&'static str),
}

impl Param {
    /// The parameter's name in the Triton source.
    pub fn name(&self) -> &'static str {
        match *self {
            Param::Tensor(n, ..)
            | Param::Dim(n, _)
            | Param::Stride(n, ..)
            | Param::Int(n)
            | Param::Float(n) => n,
        }
    }

    /// The Triton signature type (`*bf16`, `*fp32`, `*i32`, `*u32`, `*u8`, `i32`, `fp32`) for a kernel of
    /// `dtype`.
    pub fn triton_type(&self, dtype: DType) -> String {
        match self {
            Param::Tensor(_, _, Elem::Io) => format!("*{}", triton_dtype(dtype)),
            Param::Tensor(_, _, Elem::F32) => "*fp32".into(),
            Param::Tensor(_, _, Elem::F64) => "*fp64".into(),
            Param::Tensor(_, _, Elem::I32) => "*i32".into(),
            Param::Tensor(_, _, Elem::U32) => "*u32".into(),
            Param::Tensor(_, _, Elem::U8) => "*u8".into(),
            Param::Tensor(_, _, Elem::I64) => "*i64".into(),
            Param::Dim(..) | Param::Stride(..) | Param::Int(_) => "i32".into(),
            Param::Float(_) => "fp32".into(),
        }
    }
}

/// Triton's name of a dtype (`fp32`, `bf16`, `fp16`; `?` for others).
pub(crate) fn triton_dtype(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "fp32",
        DType::BF16 => "bf16",
        DType::F16 => "fp16",
        _ => "?",
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

/// One grid dimension: `cdiv(product of the named dimensions, div)` (1 when `dims` is empty).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Extent {
    /// The dimensions multiplied.
    pub dims: &'static [&'static str],
    /// The divisor (rounded up); 1 for one program per element of the product.
    pub div: usize,
}

impl Extent {
    /// One program per `div` elements of the product of `dims`, rounded up.
    pub const fn cdiv(dims: &'static [&'static str], div: usize) -> Self {
        Extent { dims, div }
    }

    /// As the metadata json writes it: `1`, `N`, `B*H`, `cdiv(T, 64)`.
    pub fn describe(&self) -> String {
        let prod = if self.dims.is_empty() {
            "1".to_string()
        } else {
            self.dims.join("*")
        };
        if self.div == 1 {
            prod
        } else {
            format!("cdiv({prod}, {})", self.div)
        }
    }
}

/// The grid rule as the metadata json writes it, e.g. `(cdiv(N, 32), 1, 1)`.
pub fn describe_grid(grid: &[Extent; 3]) -> String {
    let [a, b, c] = grid.map(|e| e.describe());
    format!("({a}, {b}, {c})")
}

/// A constraint the compiled kernel puts on the bound dimensions.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Rule {
    /// `dim <= max` (e.g. a row held in one tile: `C <= BLOCK_C`).
    AtMost(&'static str, usize),
    /// `dim == cdiv(product of dims, div)` (e.g. partial-sum rows `P == cdiv(N, 32)`).
    Cdiv(&'static str, &'static [&'static str], usize),
    /// `dim == factor * product of dims` (e.g. an even head dim split in halves:
    /// `D == 2 * HALF`).
    Product(&'static str, &'static [&'static str], usize),
    /// `a` divides `b` (e.g. key/value heads divide query heads).
    Divides(&'static str, &'static str),
    /// `dim` is a power of two between the bounds (e.g. a head dimension a tile covers exactly).
    #[allow(dead_code)] // checked by `check_launch`; no table declares it today
    PowerOfTwo(&'static str, usize, usize),
    /// `dim` is a multiple of the factor: the kernel was compiled with the dimension declared
    /// divisible by it (`divisible_by_16` in its metadata), e.g. a head size whose rows then
    /// load in 16-byte vectors.
    MultipleOf(&'static str, usize),
}

/// What a launcher needs to know about one compiled kernel (one dtype; the sm_80 and sm_90
/// cubins share it).
#[derive(Clone, Copy, Debug)]
pub struct KernelSpec {
    /// The family: `candle-fused/triton/<family>.py` holds the source.
    pub family: &'static str,
    /// The `.entry` name (the Triton function).
    pub entry: &'static str,
    /// The dtype of the variant (`Elem::Io` tensors).
    pub dtype: DType,
    /// Warps per program; the block is `32 * num_warps` threads.
    pub num_warps: u32,
    /// Dynamic shared memory in bytes (`metadata.shared`), per arch in [`ARCHS`] order (kernels
    /// with `tl.dot` differ: sm_90 lays its operands out for wgmma).
    pub shared_bytes: [u32; 2],
    /// The grid rule.
    pub grid: [Extent; 3],
    /// The compile-time constants (`tl.constexpr`) the kernel was compiled with, e.g.
    /// `("BLOCK_D", 128)`.
    pub constexprs: &'static [(&'static str, u32)],
    /// The constraints on the dimensions.
    pub rules: &'static [Rule],
    /// The kernel's own parameters in `.entry` order (the two scratch pointers follow).
    pub params: &'static [Param],
}

impl KernelSpec {
    /// `<entry>.<dtype>`, e.g. `rms_norm_fwd.bf16`: the stem of the kernel's files.
    pub fn name(&self) -> String {
        format!("{}.{}", self.entry, dtype_suffix(self.dtype))
    }

    /// The dynamic shared memory of the cubin for `arch` (80, 90), if compiled for it.
    pub fn shared_bytes_for(&self, arch: u32) -> Option<u32> {
        ARCHS
            .iter()
            .position(|&a| a == arch)
            .map(|i| self.shared_bytes[i])
    }

    /// Threads per block.
    pub fn block(&self) -> [u32; 3] {
        [32 * self.num_warps, 1, 1]
    }

    /// The value of the constexpr `name` the kernel was compiled with, if any.
    pub fn constexpr(&self, name: &str) -> Option<u32> {
        self.constexprs
            .iter()
            .find(|(n, _)| *n == name)
            .map(|&(_, v)| v)
    }
}

/// The rules of `entry` in a family's hand-written table `(entry, rules)` (the generated tables
/// call it; a kernel without a line there stops the build).
pub(super) const fn rules_of(
    table: &'static [(&str, &'static [Rule])],
    entry: &str,
) -> &'static [Rule] {
    let mut i = 0;
    while i < table.len() {
        let (name, rules) = table[i];
        if name.len() == entry.len() {
            let (a, b) = (name.as_bytes(), entry.as_bytes());
            let mut j = 0;
            while j < a.len() && a[j] == b[j] {
                j += 1;
            }
            if j == a.len() {
                return rules;
            }
        }
        i += 1;
    }
    panic!(
        "a kernel of kernels/*.json has no line in its family's RULES (cuda_kernels/<family>.rs)"
    )
}

/// The compute capabilities the cubins are built for.
pub const ARCHS: [u32; 2] = [80, 90];
/// The pointer alignment the kernels are specialised for, in bytes.
pub const POINTER_ALIGNMENT: usize = 16;
/// The most blocks a CUDA grid has along y and z.
pub(crate) const MAX_GRID_YZ: usize = 65535;
/// The number of trailing scratch pointer parameters of every `.entry` (pass null).
pub const SCRATCH_PARAMS: usize = 2;
