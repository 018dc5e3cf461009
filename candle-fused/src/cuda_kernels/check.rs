//! The launch contract checked on the host: [`check_launch`] turns a kernel's table entry
//! ([`KernelSpec`]) and the caller's tensors and scalars into the grid, block, shared memory and
//! argument list (or an error naming what does not fit), `check_variants` (in `mod.rs`) picks the first of
//! several builds that takes a launch, and [`shared_memory_opt_in`] is the launcher's
//! shared-memory rule. Pure functions: tested on the CPU (`audit_tests`).

use super::table::{
    Elem, Extent, KernelSpec, Param, Rule, MAX_GRID_YZ, POINTER_ALIGNMENT, SCRATCH_PARAMS,
};
use candle_core::{bail, DType, Result};

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
    /// Dynamic shared memory, bytes, per arch in [`ARCHS`](super::table::ARCHS) order (above 48 KB the launcher
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
    let mut bound = Bound {
        name: spec.name(),
        dims: Vec::new(),
    };
    bound.tensors(spec, tensors)?;
    bound.grid_scalars(spec, scalars)?;
    bound.rules(spec.rules)?;
    let grid = bound.grid(&spec.grid)?;
    let args = bound.arguments(spec.params, scalars)?;
    Ok(Launch {
        grid,
        block: spec.block(),
        shared_bytes: spec.shared_bytes,
        dims: bound.dims,
        args,
    })
}

/// The dimensions a launch binds, by name, as [`check_launch`] collects them (`name`: the
/// kernel's, for the errors).
struct Bound {
    name: String,
    dims: Vec<(&'static str, usize)>,
}

impl Bound {
    /// Checks each tensor against its `Param::Tensor` (dtype, rank, contiguity, alignment) and
    /// binds the dimensions it names (the same name, the same size).
    fn tensors(&mut self, spec: &KernelSpec, tensors: &[TensorArg]) -> Result<()> {
        let name = &self.name.clone();
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
        for ((pname, dims, elem), t) in tparams.iter().zip(tensors) {
            let want = match elem {
                Elem::Io => spec.dtype,
                Elem::F32 => DType::F32,
                Elem::F64 => DType::F64,
                Elem::I32 => DType::I32,
                Elem::U32 => DType::U32,
                Elem::U8 => DType::U8,
                Elem::I64 => DType::I64,
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
                match self.dims.iter().find(|(b, _)| *b == d) {
                    None => self.dims.push((d, size)),
                    Some(&(_, s)) if s != size => {
                        bail!("{name}: {pname} has {d} = {size}, an earlier argument {s}")
                    }
                    Some(_) => {}
                }
            }
            let strides: Vec<_> = spec
                .params
                .iter()
                .filter_map(|p| match *p {
                    Param::Stride(s, tensor, dim) if tensor == *pname => Some((s, dim)),
                    _ => None,
                })
                .collect();
            if strides.is_empty() {
                check_layout(name, pname, t)?;
            } else {
                self.strides(pname, dims, t, &strides)?;
            }
        }
        Ok(())
    }

    /// Binds the strides a strided tensor argument passes (`(parameter, dimension)` each), after
    /// checking its layout: the last stride 1, every other stride named by a parameter, the
    /// start aligned.
    fn strides(
        &mut self,
        pname: &str,
        dims: &[&str],
        t: &TensorArg,
        strides: &[(&'static str, &str)],
    ) -> Result<()> {
        let name = &self.name;
        let last = dims.len() - 1;
        if t.dims[last] > 1 && t.strides[last] != 1 {
            bail!(
                "{name}: {pname} must have unit stride along {} (dims {:?}, strides {:?})",
                dims[last],
                t.dims,
                t.strides
            )
        }
        for (i, dim) in dims.iter().enumerate().take(last) {
            let Some(&(sname, _)) = strides.iter().find(|(_, d)| d == dim) else {
                bail!("{name}: {pname} has no stride parameter along {dim}")
            };
            // a dimension of size 1 is never stepped along: its stride is 0 to the kernel
            let stride = if t.dims[i] > 1 { t.strides[i] } else { 0 };
            self.i32_of(sname, stride)?;
            self.dims.push((sname, stride));
        }
        check_aligned(name, pname, t)
    }

    /// Binds an Int parameter the grid names (`NB`, the blocks of a multi-tensor launch) to the
    /// caller's value.
    fn grid_scalars(&mut self, spec: &KernelSpec, scalars: &[Scalar]) -> Result<()> {
        let mut values = scalars.iter();
        for p in spec.params {
            let (Param::Int(pname) | Param::Float(pname)) = *p else {
                continue;
            };
            let value = values.next();
            let in_grid = spec.grid.iter().any(|e| e.dims.contains(&pname));
            if let (Param::Int(_), Some(&Scalar::I32(v)), true) = (p, value, in_grid) {
                match usize::try_from(v) {
                    Ok(v) => self.dims.push((pname, v)),
                    Err(_) => bail!(
                        "{}: {pname} = {v} sizes the grid: it must not be negative",
                        self.name
                    ),
                }
            }
        }
        Ok(())
    }

    /// The bound size of `d`.
    fn get(&self, d: &str) -> Result<usize> {
        match self.dims.iter().find(|(b, _)| *b == d) {
            Some(&(_, s)) => Ok(s),
            None => bail!("{}: no tensor argument gives the dimension {d}", self.name),
        }
    }

    /// The product of the bound sizes of `dims`.
    fn product(&self, dims: &[&str]) -> Result<usize> {
        dims.iter()
            .try_fold(1usize, |acc, d| Ok(acc * self.get(d)?))
    }

    /// `v` as an i32 argument.
    fn i32_of(&self, what: &str, v: usize) -> Result<i32> {
        match i32::try_from(v) {
            Ok(v) => Ok(v),
            Err(_) => bail!("{}: {what} = {v} does not fit an i32", self.name),
        }
    }

    /// Checks the kernel's [`Rule`]s on the bound dimensions.
    fn rules(&self, rules: &[Rule]) -> Result<()> {
        let name = &self.name;
        for rule in rules {
            match *rule {
                Rule::AtMost(d, max) => {
                    let v = self.get(d)?;
                    if v > max {
                        bail!("{name}: {d} = {v} exceeds {max}, the most this kernel covers (one tile)")
                    }
                }
                Rule::Cdiv(d, dims, div) => {
                    let (v, want) = (self.get(d)?, self.product(dims)?.div_ceil(div));
                    if v != want {
                        bail!(
                            "{name}: {d} must be {} = {want}, got {v}",
                            Extent::cdiv(dims, div).describe()
                        )
                    }
                }
                Rule::Product(d, dims, factor) => {
                    let (v, want) = (self.get(d)?, factor * self.product(dims)?);
                    if v != want {
                        bail!(
                            "{name}: {d} must be {factor} * {} = {want}, got {v}",
                            dims.join("*")
                        )
                    }
                }
                Rule::Divides(a, b) => {
                    let (va, vb) = (self.get(a)?, self.get(b)?);
                    if va == 0 || vb % va != 0 {
                        bail!("{name}: {a} = {va} must divide {b} = {vb}")
                    }
                }
                Rule::PowerOfTwo(d, lo, hi) => {
                    let v = self.get(d)?;
                    if !v.is_power_of_two() || v < lo || v > hi {
                        bail!("{name}: {d} = {v} must be a power of two in [{lo}, {hi}]")
                    }
                }
                Rule::MultipleOf(d, factor) => {
                    let v = self.get(d)?;
                    if v % factor != 0 {
                        bail!("{name}: {d} = {v} must be a multiple of {factor}")
                    }
                }
            }
        }
        Ok(())
    }

    /// The grid in programs: non-empty, within CUDA's limits.
    fn grid(&self, extents: &[Extent; 3]) -> Result<[u32; 3]> {
        let name = &self.name;
        let mut grid = [1u32; 3];
        for (axis, (g, e)) in grid.iter_mut().zip(extents).enumerate() {
            let programs = self.product(e.dims)?.div_ceil(e.div);
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
            *g = self.i32_of("grid", programs)? as u32;
        }
        Ok(grid)
    }

    /// The `.entry`'s argument list in order, the null scratch pointers last.
    fn arguments(&self, params: &[Param], scalars: &[Scalar]) -> Result<Vec<Arg>> {
        let name = &self.name;
        let mut scalars = scalars.iter();
        let mut args = Vec::with_capacity(params.len() + SCRATCH_PARAMS);
        let mut next_tensor = 0;
        for p in params {
            args.push(match *p {
                Param::Tensor(..) => {
                    next_tensor += 1;
                    Arg::Tensor(next_tensor - 1)
                }
                Param::Dim(pname, d) => Arg::I32(self.i32_of(pname, self.get(d)?)?),
                Param::Stride(pname, ..) => Arg::I32(self.i32_of(pname, self.get(pname)?)?),
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
        Ok(args)
    }
}

/// Checks that tensor argument `pname` of kernel `name` is row-major contiguous and starts on
/// a [`POINTER_ALIGNMENT`] boundary.
fn check_layout(name: &str, pname: &str, t: &TensorArg) -> Result<()> {
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
    check_aligned(name, pname, t)
}

/// Checks that tensor argument `pname` of kernel `name` starts on a [`POINTER_ALIGNMENT`]
/// boundary.
fn check_aligned(name: &str, pname: &str, t: &TensorArg) -> Result<()> {
    if !t.offset_bytes.is_multiple_of(POINTER_ALIGNMENT) {
        bail!(
            "{name}: {pname} starts at byte offset {} (mod 16 = {}); the kernel was compiled \
             for {POINTER_ALIGNMENT}-byte aligned pointers (tt.divisibility = 16): copy it to \
             a fresh buffer (.contiguous() of a new allocation) or use an unspecialised variant",
            t.offset_bytes,
            t.offset_bytes % POINTER_ALIGNMENT
        )
    }
    Ok(())
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
