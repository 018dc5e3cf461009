//! Launch contracts of the ahead-of-time compiled Triton kernels (`candle-fused/kernels/`),
//! independent of any feature: what a CUDA launcher (cudarc, in an op's `cuda_fwd`) must pass,
//! and [`check_launch`], the pure function it calls to get the grid, block, shared memory and
//! the exact argument list, so everything but the launch itself is tested on the CPU.
//!
//! The kernels are written in `candle-fused/triton/<family>.py`, compiled on a CPU-only
//! machine by `scripts/python/triton_compile.py` into `<entry>.<dtype>.sm<NN>.cubin` (sm_80,
//! sm_90; with CUDA 13.0's ptxas: `scripts/gpu/cubins.sh`) with a `.json` of metadata, and
//! checked under Triton's interpreter against this crate's CPU kernels by
//! `scripts/python/triton_interpret_check.py`. `tests/triton_record.rs` keeps the tables below,
//! the metadata and the recorded checks in agreement.
//!
//! **Running them** (`cuda` feature): the cubins are embedded in the library and launched on
//! Candle's stream inside the ops' `cuda_fwd` and `bwd` (`launch.rs`, whose module doc is the
//! recipe for wiring a family). They are on by default ([`TRITON_DEFAULT`], since they passed the GPU check
//! on an H200); [`set_triton`]`(false)`, [`choose_triton`] or `CANDLE_FUSED_TRITON=0`
//! ([`TRITON_ENV`]) switch them off, and CUDA then takes the composite fallback. Wired so
//! far: RMSNorm (forward, `dx`, `dW`), LayerNorm (forward, `dx`, `dW`, `dB`; with or without a
//! bias), RoPE (forward, `dx`), attention (forward, backward; `attention`, `attention_merged`,
//! `attention_qkv`), `cross_entropy` (forward, `dlogits`) and `linear_cross_entropy` (its chunk
//! loop: cuBLAS GEMMs, `ce_fwd_bwd` per chunk), dropout (forward, backward, `dropout_mask`: the
//! mask drawn in the kernel), SwiGLU, GELU with and without a bias (`db` by the ordered
//! reduction), the AdamW update (in place) and the sum of squares of `global_norm`.
//!
//! The compiled specialisation: every pointer is 16-byte aligned (`tt.divisibility = 16`),
//! tensors are contiguous, integer arguments are unspecialised i32. Each `.entry` takes the
//! kernel's own parameters, then two scratch pointers (global, profile) that these kernels do
//! not use: [`Arg::Null`].
//!
//! ```
//! use candle_core::DType;
//! use candle_fused::cuda_kernels::{check_launch, find, Arg, Scalar, TensorArg};
//! let spec = find("rms_norm_fwd", DType::BF16).unwrap();
//! let (n, c) = (8usize, 768usize);
//! let x = TensorArg::contiguous(&[n, c], DType::BF16, 0);
//! let w = TensorArg::contiguous(&[c], DType::BF16, 0);
//! let y = TensorArg::contiguous(&[n, c], DType::BF16, 0);
//! let rstd = TensorArg::contiguous(&[n], DType::F32, 0);
//! let launch = check_launch(spec, &[x, w, y, rstd], &[Scalar::F32(1e-5)])?;
//! assert_eq!((launch.grid, launch.block), ([8, 1, 1], [256, 1, 1]));
//! use Arg::*;
//! assert_eq!(
//!     launch.args,
//!     [Tensor(0), Tensor(1), Tensor(2), Tensor(3), I32(8), I32(768), F32(1e-5), Null, Null]
//! );
//! // a tensor starting 2 bytes into its buffer breaks the 16-byte alignment
//! let x = TensorArg::contiguous(&[n, c], DType::BF16, 2);
//! let w = TensorArg::contiguous(&[c], DType::BF16, 0);
//! let y = TensorArg::contiguous(&[n, c], DType::BF16, 0);
//! let rstd = TensorArg::contiguous(&[n], DType::F32, 0);
//! assert!(check_launch(spec, &[x, w, y, rstd], &[Scalar::F32(1e-5)]).is_err());
//! # Ok::<(), candle_core::Error>(())
//! ```

pub mod adamw;
pub mod attention;
pub mod cross_entropy;
#[cfg(feature = "cuda")]
pub(crate) mod cubins;
pub mod dropout;
pub mod gelu;
#[cfg(feature = "cuda")]
pub(crate) mod launch;
pub mod layer_norm;
pub mod rms_norm;
pub mod rope;
pub mod swiglu;
mod switch;

pub use switch::{
    choose_triton, launch_count, set_triton, triton_enabled, triton_from_env, TRITON_DEFAULT,
    TRITON_ENV,
};
pub(crate) use switch::{triton_flat, triton_for, triton_input};

use candle_core::{bail, DType, Result};

/// The launch tables of every kernel family (one Triton source file each).
pub const FAMILIES: &[(&str, &[KernelSpec])] = &[
    ("rms_norm", rms_norm::KERNELS),
    ("attention", attention::KERNELS),
    ("layer_norm", layer_norm::KERNELS),
    ("rope", rope::KERNELS),
    ("cross_entropy", cross_entropy::KERNELS),
    ("swiglu", swiglu::KERNELS),
    ("gelu", gelu::KERNELS),
    ("dropout", dropout::KERNELS),
    ("adamw", adamw::KERNELS),
];

/// Every compiled kernel, family by family.
pub fn kernels() -> impl Iterator<Item = &'static KernelSpec> {
    FAMILIES.iter().flat_map(|(_, k)| k.iter())
}

/// The kernel `entry` for `dtype`, if compiled.
pub fn find(entry: &str, dtype: DType) -> Option<&'static KernelSpec> {
    kernels().find(|k| k.entry == entry && k.dtype == dtype)
}

/// The element type of a tensor parameter.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Elem {
    /// The kernel variant's dtype (f32, bf16 or f16).
    Io,
    /// Always f32 (saved statistics, partial sums, optimizer state).
    F32,
    /// Always f64 (partial sums that must not round before the total, e.g. sums of squares).
    F64,
    /// Always i32 (indices, document ids).
    I32,
    /// Always u32 (class targets, as the CPU ops take them).
    U32,
}

/// One parameter of a kernel's `.entry`, in order.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Param {
    /// A pointer to a contiguous tensor: its name, its dimensions (named; the same name binds
    /// the same size across parameters) and element type.
    Tensor(&'static str, &'static [&'static str], Elem),
    /// An i32 holding the bound size of the named dimension: `(parameter, dimension)`.
    Dim(&'static str, &'static str),
    /// An i32 supplied by the caller (a [`Scalar::I32`], in order).
    Int(&'static str),
    /// An f32 supplied by the caller (a [`Scalar::F32`], in order), e.g. `eps`.
    Float(&'static str),
}

impl Param {
    /// The parameter's name in the Triton source.
    pub fn name(&self) -> &'static str {
        match *self {
            Param::Tensor(n, ..) | Param::Dim(n, _) | Param::Int(n) | Param::Float(n) => n,
        }
    }

    /// The Triton signature type (`*bf16`, `*fp32`, `*i32`, `*u32`, `i32`, `fp32`) for a kernel of
    /// `dtype`.
    pub fn triton_type(&self, dtype: DType) -> String {
        match self {
            Param::Tensor(_, _, Elem::Io) => format!("*{}", triton_dtype(dtype)),
            Param::Tensor(_, _, Elem::F32) => "*fp32".into(),
            Param::Tensor(_, _, Elem::F64) => "*fp64".into(),
            Param::Tensor(_, _, Elem::I32) => "*i32".into(),
            Param::Tensor(_, _, Elem::U32) => "*u32".into(),
            Param::Dim(..) | Param::Int(_) => "i32".into(),
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
    /// A grid dimension of 1.
    pub const ONE: Extent = Extent { dims: &[], div: 1 };

    /// One program per element of the product of `dims`.
    pub const fn of(dims: &'static [&'static str]) -> Self {
        Extent { dims, div: 1 }
    }

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

    /// `AtMost(dim, max)`'s bound for `dim`, if any.
    pub fn limit(&self, dim: &str) -> Option<usize> {
        self.rules.iter().find_map(|r| match *r {
            Rule::AtMost(d, max) if d == dim => Some(max),
            _ => None,
        })
    }
}

/// The compute capabilities the cubins are built for.
pub const ARCHS: [u32; 2] = [80, 90];
/// The pointer alignment the kernels are specialised for, in bytes.
pub const POINTER_ALIGNMENT: usize = 16;
/// The most blocks a CUDA grid has along y and z.
pub const MAX_GRID_YZ: usize = 65535;
/// The number of trailing scratch pointer parameters of every `.entry` (pass null).
pub const SCRATCH_PARAMS: usize = 2;

/// The shared memory per block that every CUDA architecture grants without an opt-in (48 KiB).
const SHARED_WITHOUT_OPT_IN: u64 = 48 * 1024;

/// The shared memory rule of a launch: what the launcher sets as the function's
/// `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES` before launching it with `dynamic_bytes`
/// of dynamic shared memory (the cubin's `metadata.shared`), given the function's static shared
/// memory (`CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES`: the cubin's `.nv.shared.<entry>` section, e.g.
/// 1 KiB for Triton's reductions on sm_90) and the device's opt-in limit per block
/// (`CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`: 227 KiB on an H100, 163 KiB on an
/// A100). A block needs static + dynamic bytes, so both count:
///
/// * `Ok(None)`: the total fits in 48 KiB, no opt-in;
/// * `Ok(Some(dynamic_bytes))`: above 48 KiB, opt in to that much dynamic shared memory;
/// * an error: the total is over the device's opt-in limit (the launch would be refused).
///
/// ```
/// use candle_fused::cuda_kernels::shared_memory_opt_in as rule;
/// const H100: u32 = 227 * 1024;
/// assert_eq!(rule(1024, 48 * 1024, H100)?, Some(48 * 1024)); // 49 KiB in all
/// assert_eq!(rule(0, 48 * 1024, H100)?, None);
/// assert!(rule(1024, H100, H100).is_err());
/// # Ok::<(), candle_core::Error>(())
/// ```
#[doc(hidden)]
pub fn shared_memory_opt_in(
    static_bytes: u32,
    dynamic_bytes: u32,
    opt_in_limit: u32,
) -> Result<Option<u32>> {
    let total = u64::from(static_bytes) + u64::from(dynamic_bytes);
    if total <= SHARED_WITHOUT_OPT_IN {
        return Ok(None);
    }
    if total > u64::from(opt_in_limit) {
        bail!(
            "needs {total} bytes of shared memory per block ({static_bytes} static + \
             {dynamic_bytes} dynamic), the device allows {opt_in_limit}"
        )
    }
    Ok(Some(dynamic_bytes))
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

/// A scalar the caller supplies for a [`Param::Int`] or [`Param::Float`].
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Scalar {
    /// For a `Param::Int`.
    I32(i32),
    /// For a `Param::Float`.
    F32(f32),
}

/// One argument of the `.entry`, in order, as the launcher pushes it.
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Arg {
    /// The device pointer of the tensor argument with this index (in the order given).
    Tensor(usize),
    /// An i32 (a dimension or a caller's integer).
    I32(i32),
    /// An f32.
    F32(f32),
    /// A null pointer (the trailing scratch pointers).
    Null,
}

/// A checked launch: grid and block, dynamic shared memory, the bound dimensions and the
/// `.entry`'s full argument list.
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    /// Programs (CUDA blocks).
    pub grid: [u32; 3],
    /// Threads per block.
    pub block: [u32; 3],
    /// Dynamic shared memory, bytes, per arch in [`ARCHS`] order (above 48 KB the launcher
    /// sets `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`).
    pub shared_bytes: [u32; 2],
    /// The dimensions bound from the tensors, by name.
    pub dims: Vec<(&'static str, usize)>,
    /// Every argument of the `.entry` in order, the two null scratch pointers last.
    pub args: Vec<Arg>,
}

impl Launch {
    /// The bound size of `dim`.
    pub fn dim(&self, dim: &str) -> Option<usize> {
        self.dims.iter().find(|(d, _)| *d == dim).map(|&(_, s)| s)
    }
}

/// Checks `tensors` (the kernel's `Param::Tensor` arguments, in order) and `scalars` (its
/// `Param::Int` / `Param::Float` arguments, in order) against `spec`: dtypes, shapes (binding
/// the named dimensions), contiguity, 16-byte alignment, the spec's [`Rule`]s, i32 ranges;
/// returns the launch configuration and argument list.
pub fn check_launch(
    spec: &KernelSpec,
    tensors: &[TensorArg],
    scalars: &[Scalar],
) -> Result<Launch> {
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
    let mut bound: Vec<(&'static str, usize)> = Vec::new();
    for ((pname, dims, elem), t) in tparams.iter().zip(tensors) {
        let want = match elem {
            Elem::Io => spec.dtype,
            Elem::F32 => DType::F32,
            Elem::F64 => DType::F64,
            Elem::I32 => DType::I32,
            Elem::U32 => DType::U32,
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
        for (&d, &size) in dims.iter().zip(&t.dims) {
            match bound.iter().find(|(b, _)| *b == d) {
                None => bound.push((d, size)),
                Some(&(_, s)) if s != size => {
                    bail!("{name}: {pname} has {d} = {size}, an earlier argument {s}")
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
    let get = |d: &str| -> Result<usize> {
        match bound.iter().find(|(b, _)| *b == d) {
            Some(&(_, s)) => Ok(s),
            None => bail!("{name}: no tensor argument gives the dimension {d}"),
        }
    };
    let product = |dims: &[&str]| -> Result<usize> {
        dims.iter().try_fold(1usize, |acc, d| Ok(acc * get(d)?))
    };
    for rule in spec.rules {
        match *rule {
            Rule::AtMost(d, max) => {
                let v = get(d)?;
                if v > max {
                    bail!("{name}: {d} = {v} exceeds {max}, the most this kernel covers (one tile)")
                }
            }
            Rule::Cdiv(d, dims, div) => {
                let (v, want) = (get(d)?, product(dims)?.div_ceil(div));
                if v != want {
                    bail!(
                        "{name}: {d} must be {} = {want}, got {v}",
                        Extent::cdiv(dims, div).describe()
                    )
                }
            }
            Rule::Product(d, dims, factor) => {
                let (v, want) = (get(d)?, factor * product(dims)?);
                if v != want {
                    bail!(
                        "{name}: {d} must be {factor} * {} = {want}, got {v}",
                        dims.join("*")
                    )
                }
            }
            Rule::Divides(a, b) => {
                let (va, vb) = (get(a)?, get(b)?);
                if va == 0 || vb % va != 0 {
                    bail!("{name}: {a} = {va} must divide {b} = {vb}")
                }
            }
            Rule::PowerOfTwo(d, lo, hi) => {
                let v = get(d)?;
                if !v.is_power_of_two() || v < lo || v > hi {
                    bail!("{name}: {d} = {v} must be a power of two in [{lo}, {hi}]")
                }
            }
            Rule::MultipleOf(d, factor) => {
                let v = get(d)?;
                if v % factor != 0 {
                    bail!("{name}: {d} = {v} must be a multiple of {factor}")
                }
            }
        }
    }
    let i32_of = |what: &str, v: usize| -> Result<i32> {
        match i32::try_from(v) {
            Ok(v) => Ok(v),
            Err(_) => bail!("{name}: {what} = {v} does not fit an i32"),
        }
    };
    let mut grid = [1u32; 3];
    for (axis, (g, e)) in grid.iter_mut().zip(&spec.grid).enumerate() {
        let programs = product(e.dims)?.div_ceil(e.div);
        if programs == 0 {
            bail!("{name}: empty grid ({} = 0): skip the launch", e.describe())
        }
        // CUDA allows 2^31 - 1 blocks along x, 65535 along y and z
        if axis > 0 && programs > MAX_GRID_YZ {
            bail!(
                "{name}: grid {} = {programs} exceeds CUDA's {MAX_GRID_YZ} along {}",
                e.describe(),
                ["x", "y", "z"][axis]
            )
        }
        *g = i32_of("grid", programs)? as u32;
    }
    let mut scalars = scalars.iter();
    let mut args = Vec::with_capacity(spec.params.len() + SCRATCH_PARAMS);
    let mut next_tensor = 0;
    for p in spec.params {
        args.push(match *p {
            Param::Tensor(..) => {
                next_tensor += 1;
                Arg::Tensor(next_tensor - 1)
            }
            Param::Dim(pname, d) => Arg::I32(i32_of(pname, get(d)?)?),
            Param::Int(pname) => match scalars.next() {
                Some(Scalar::I32(v)) => Arg::I32(*v),
                other => bail!("{name}: {pname} needs a Scalar::I32, got {other:?}"),
            },
            Param::Float(pname) => match scalars.next() {
                Some(Scalar::F32(v)) => Arg::F32(*v),
                other => bail!("{name}: {pname} needs a Scalar::F32, got {other:?}"),
            },
        });
    }
    if let Some(extra) = scalars.next() {
        bail!("{name}: more scalars than Int/Float parameters ({extra:?} left over)")
    }
    args.extend([Arg::Null; SCRATCH_PARAMS]);
    Ok(Launch {
        grid,
        block: spec.block(),
        shared_bytes: spec.shared_bytes,
        dims: bound,
        args,
    })
}

/// The first of `entries` (the builds of one kernel, most specialised first) compiled for
/// `dtype` whose launch [`check_launch`] accepts, with that launch; when none does, an error
/// with each candidate's reason. Entries not compiled for `dtype` are skipped (f32 has fewer
/// builds). This is how a launcher picks a variant: by the table's rules, not by hand.
///
/// ```
/// use candle_core::DType;
/// use candle_fused::cuda_kernels::{check_variants, Scalar, TensorArg};
/// let delta = ["attn_bwd_delta_d64", "attn_bwd_delta_d128", "attn_bwd_delta"];
/// let pick = |d: usize, dt: DType| {
///     let (qo, stat) = ([2, 6, 70, d], [2, 6, 70]);
///     let args = [
///         TensorArg::contiguous(&qo, dt, 0),
///         TensorArg::contiguous(&qo, dt, 0),
///         TensorArg::contiguous(&stat, DType::F32, 0),
///     ];
///     check_variants(&delta, dt, &args, &[]).map(|(spec, _)| spec.entry)
/// };
/// assert_eq!(pick(64, DType::BF16)?, "attn_bwd_delta_d64");
/// assert_eq!(pick(96, DType::BF16)?, "attn_bwd_delta_d128");
/// assert_eq!(pick(72, DType::BF16)?, "attn_bwd_delta"); // not a multiple of 16
/// assert_eq!(pick(64, DType::F32)?, "attn_bwd_delta"); // no f32 head-size builds
/// assert!(pick(256, DType::BF16).is_err()); // over every tile
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn check_variants(
    entries: &[&str],
    dtype: DType,
    tensors: &[TensorArg],
    scalars: &[Scalar],
) -> Result<(&'static KernelSpec, Launch)> {
    let mut refused = Vec::new();
    for spec in entries.iter().filter_map(|e| find(e, dtype)) {
        match check_launch(spec, tensors, scalars) {
            Ok(launch) => return Ok((spec, launch)),
            Err(e) => refused.push(e.to_string()),
        }
    }
    match refused.as_slice() {
        [] => bail!("no Triton kernel among {entries:?} for {dtype:?}"),
        [one] => bail!("{one}"),
        all => bail!("no build takes this launch: {}", all.join("; ")),
    }
}

#[cfg(test)]
mod tests {
    use super::shared_memory_opt_in as rule;

    #[test]
    fn shared_memory_counts_static_and_dynamic() {
        const LIMIT: u32 = 227 * 1024;
        // at 48 KiB in all: no opt-in; one byte more (static or dynamic): opt in
        assert_eq!(rule(1024, 47 * 1024, LIMIT).unwrap(), None);
        assert_eq!(rule(1025, 47 * 1024, LIMIT).unwrap(), Some(47 * 1024));
        assert_eq!(rule(1024, 48 * 1024, LIMIT).unwrap(), Some(48 * 1024));
        assert_eq!(rule(0, 48 * 1024 + 1, LIMIT).unwrap(), Some(48 * 1024 + 1));
        // the device limit holds the total
        assert_eq!(rule(1024, LIMIT - 1024, LIMIT).unwrap(), Some(LIMIT - 1024));
        let err = rule(1024, LIMIT - 1023, LIMIT).unwrap_err().to_string();
        assert!(err.contains("1024 static"), "{err}");
        assert!(rule(u32::MAX, u32::MAX, u32::MAX).is_err());
    }
}
