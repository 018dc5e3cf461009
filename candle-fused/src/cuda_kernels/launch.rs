//! Launching the embedded Triton kernels ([`super::cubins`]) on Candle's CUDA stream
//! (`cuda` feature only).
//!
//! [`launch`] finds the kernel's [`KernelSpec`], runs [`super::check_launch`] on the tensors (dims,
//! strides, dtypes and the real device addresses, so the 16-byte alignment is checked on the
//! pointers passed), loads the module for the device once (a process-wide cache keyed by CUDA
//! context and kernel; the sm_80 cubin on compute capability 8.x, sm_90 on 9.0, otherwise a
//! clear error), and pushes the `.entry` arguments in `Launch::args` order on the stream of the
//! tensors' Candle device, with cudarc's event tracking (reads wait for earlier writes, writes
//! for earlier reads and writes) as Candle's own kernels do.
//!
//! # Wiring a family's kernels into its op (RMSNorm: `src/norm.rs` + `src/norm/cuda.rs`)
//!
//! The cubins are embedded by `build.rs` (every kernel of `kernels/*.json`, `cubins.rs`).
//!
//! 1. The op's public function, before the CPU/composite paths:
//!    ```ignore
//!    if cuda_kernels::triton_for(x) && c <= my_family::BLOCK_C {   // + the family's limits
//!        let (x, w) = (cuda_kernels::triton_input(x)?, cuda_kernels::triton_input(w)?);
//!        return op::apply(MyOp { triton: true, .. }, &[&x, &w], None, None); // nothing precomputed
//!    }
//!    ```
//! 2. `impl Kernel for MyOp`: the forward on CUDA, in `src/<family>/cuda.rs` (`cfg(feature = "cuda")`):
//!    ```ignore
//!    #[cfg(feature = "cuda")]
//!    fn cuda_fwd(&self, ins: &[op::CudaIn<'_>]) -> op::CudaOut {
//!        let ((sx, lx), (sw, lw)) = (ins[0], ins[1]);
//!        let mut y = Output::new(sx.device(), lx.shape().clone(), sx.dtype())?;
//!        let mut stat = Output::new(sx.device(), n, DType::F32)?;
//!        launch("my_fwd", sx.dtype(), vec![
//!            Buf::read(sx, lx).view(&[n, c])?, Buf::read(sw, lw),
//!            Buf::write(&mut y).view(&[n, c])?, Buf::write(&mut stat),
//!        ], &[Scalar::F32(self.eps as f32)])?;
//!        self.stat.set(stat.into_tensor());     // `Saved`, read by `bwd`
//!        Ok(y.into_parts())
//!    }
//!    ```
//! 3. Its `bwd`: `op::triton_path!(self.triton, self.name(), cuda::bwd(..))`, where the tensors' storages come
//!    from `t.storage_and_layout()` + [`cuda_of`], the gradients from `Output`s launched into
//!    and turned into tensors with [`Output::into_tensor`] (`Tensor::from_storage`; no graph:
//!    gradients are leaves), so the backward kernels need no second custom op.
//! 4. The family in `tests/families/` (its cases and `TOL`; its line in `FAMILIES` there): the
//!    committed vectors, run by `tests/cuda_triton/` on the GPU.
//!
//! A kernel that overwrites one of its inputs (`ce_fwd_bwd` turning a chunk's logits into
//! their gradient, `src/linear_cross_entropy/cuda.rs`) gets the tensor's storage mutably from
//! a Candle `InplaceOp1` and passes it as [`Buf::update`], its output parameter as
//! [`Buf::same_as`] that argument.

use super::switch::cubin_arch;
use super::{check_variants, cubins, find, KernelSpec, Launch, Scalar, TensorArg};
use crate::cuda_kernels::{may_launch, Arg};
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cuda_backend::cudarc;
use candle_core::op::BackpropOp;
use candle_core::{
    bail, CudaDevice, CudaStorage, DType, Error, Layout, Result, Shape, Storage, Tensor,
};
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{
    CudaFunction, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg, SyncOnDrop,
};
use half::{bf16, f16};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// `(rows, columns)` of a tensor of `dims` seen as `[N, C]`: the last dimension, and the
/// product of the others (the row kernels' view).
pub(crate) fn rows_cols(dims: &[usize]) -> (usize, usize) {
    let c = dims.last().copied().unwrap_or(1);
    (dims.iter().product::<usize>() / c.max(1), c)
}

/// A kernel's forward inputs as `Fused::cuda_fwd` hands them over.
pub(crate) type CudaIn<'a> = (&'a CudaStorage, &'a Layout);

/// The CUDA storage behind a tensor's storage guard.
pub(crate) fn cuda_of(s: &Storage) -> Result<&CudaStorage> {
    match s {
        Storage::Cuda(c) => Ok(c),
        _ => bail!("candle-fused: expected a CUDA tensor"),
    }
}

/// A fresh contiguous buffer a kernel writes (uninitialised: the kernel writes every element).
pub(crate) struct Output {
    storage: CudaStorage,
    shape: Shape,
}

impl Output {
    /// `shape` elements of `dtype` on `dev`.
    pub(crate) fn new(dev: &CudaDevice, shape: impl Into<Shape>, dtype: DType) -> Result<Self> {
        let shape = shape.into();
        // SAFETY: every kernel launched into an `Output` writes all of its elements before
        // anything reads them (each family's kernels are checked for it under the interpreter).
        let storage = unsafe { dev.alloc_uninit(&shape, dtype)? };
        Ok(Self { storage, shape })
    }

    /// The storage and shape, as a `cuda_fwd` returns them.
    pub(crate) fn into_parts(self) -> (CudaStorage, Shape) {
        (self.storage, self.shape)
    }

    /// The ordered sum of the rows of this `[P, C]` buffer of partial sums (f32) into a fresh
    /// `[C]` tensor of `dtype`, by the reduction kernel `entry` (no atomics: the same bits on
    /// every run).
    pub(crate) fn reduce_rows(&self, entry: &str, dtype: DType) -> Result<Tensor> {
        let (_, c) = self.shape.dims2()?;
        let mut out = Self::new(self.storage.device(), c, dtype)?;
        let tensors = vec![Buf::read_output(self), Buf::write(&mut out)];
        launch(entry, dtype, tensors, &[])?;
        Ok(out.into_tensor())
    }

    /// As a tensor outside any graph (a saved statistic, a gradient).
    pub(crate) fn into_tensor(self) -> Tensor {
        Tensor::from_storage(
            Storage::Cuda(self.storage),
            self.shape,
            BackpropOp::none(),
            false,
        )
    }
}

enum Access<'a> {
    Read(&'a CudaStorage),
    Write(&'a mut CudaStorage),
    /// The memory of the earlier tensor argument with this index, again.
    Same(usize),
    /// The storage of the earlier tensor argument with this index, through the own layout (its
    /// offset from the storage's start): another part of one output.
    Alias(usize),
}

/// One tensor argument of a launch: a storage read or written, and the layout the kernel sees.
pub(crate) struct Buf<'a> {
    access: Access<'a>,
    layout: Layout,
    /// The dtype the kernel is told (`None`: the storage's); see [`Buf::bits_as`].
    bits_as: Option<DType>,
}

impl<'a> Buf<'a> {
    /// An input: `s` as `l` describes it (contiguous and aligned: see `triton_input`).
    pub(crate) fn read(s: &'a CudaStorage, l: &Layout) -> Self {
        Self {
            access: Access::Read(s),
            layout: l.clone(),
            bits_as: None,
        }
    }

    /// An earlier kernel's output, read (e.g. partial sums).
    pub(crate) fn read_output(o: &'a Output) -> Self {
        Self {
            access: Access::Read(&o.storage),
            layout: Layout::contiguous(o.shape.clone()),
            bits_as: None,
        }
    }

    /// An output buffer.
    pub(crate) fn write(o: &'a mut Output) -> Self {
        let layout = Layout::contiguous(o.shape.clone());
        Self {
            access: Access::Write(&mut o.storage),
            layout,
            bits_as: None,
        }
    }

    /// An output buffer written through the strided view `l` of its elements (e.g. the heads
    /// of a packed `[B, T, 3C]` gradient as `[B, H, T, D]`).
    pub(crate) fn write_as(o: &'a mut Output, l: Layout) -> Self {
        Self {
            access: Access::Write(&mut o.storage),
            layout: l,
            bits_as: None,
        }
    }

    /// The storage of the tensor argument `index` (an earlier [`Buf::write_as`]) seen through
    /// `l`, whose start offset counts from the storage's start: a second part of one output
    /// (dK and dV in one packed gradient).
    pub(crate) fn alias(index: usize, l: Layout) -> Self {
        Self {
            access: Access::Alias(index),
            layout: l,
            bits_as: None,
        }
    }

    /// A storage the kernel reads and overwrites in place (logits turned into their gradient;
    /// the optimizer state an in-place op hands over as `&mut`), as `l` describes it; pass it
    /// again with [`Buf::same_as`] where the kernel takes the output as a separate parameter.
    pub(crate) fn update(s: &'a mut CudaStorage, l: &Layout) -> Self {
        Self {
            access: Access::Write(s),
            layout: l.clone(),
            bits_as: None,
        }
    }

    /// The tensor argument `index` (an earlier one) again: its pointer, dims and dtype, for a
    /// kernel writing an output over one of its inputs. No [`Buf::view`] of it: view the first.
    pub(crate) fn same_as(index: usize) -> Self {
        Self {
            access: Access::Same(index),
            layout: Layout::contiguous(()),
            bits_as: None,
        }
    }

    /// The same contiguous elements seen with the dims the kernel's table names (e.g. `[N, C]`
    /// for a `[B, T, C]` tensor).
    pub(crate) fn view(mut self, dims: &[usize]) -> Result<Self> {
        let shape = Shape::from(dims);
        if matches!(self.access, Access::Same(_) | Access::Alias(_))
            || !self.layout.is_contiguous()
            || shape.elem_count() != self.layout.shape().elem_count()
        {
            bail!(
                "candle-fused: cannot view {:?} (strides {:?}) as {dims:?}",
                self.layout.dims(),
                self.layout.stride()
            )
        }
        self.layout = Layout::contiguous_with_offset(shape, self.layout.start_offset());
        Ok(self)
    }

    /// A u32 buffer passed where the kernel takes i32 (or the reverse): the same 32-bit
    /// patterns, for kernels that only compare them for equality (attention's document ids).
    pub(crate) fn bits_as(mut self, dtype: DType) -> Result<Self> {
        let ints = [DType::U32, DType::I32];
        let own = self.storage().map(|s| s.dtype());
        if !(ints.contains(&dtype) && own.is_some_and(|d| ints.contains(&d))) {
            bail!("candle-fused: {own:?} tensors cannot be passed as {dtype:?}")
        }
        self.bits_as = Some(dtype);
        Ok(self)
    }

    /// The dtype the kernel is told (none for [`Buf::same_as`]: the one it repeats).
    fn dtype(&self) -> Option<DType> {
        self.bits_as.or_else(|| self.storage().map(|s| s.dtype()))
    }

    /// The storage (none for [`Buf::same_as`]: the one it repeats).
    fn storage(&self) -> Option<&CudaStorage> {
        match &self.access {
            Access::Read(s) => Some(s),
            Access::Write(s) => Some(s),
            Access::Same(_) | Access::Alias(_) => None,
        }
    }
}

/// The device pointer of `buf`'s first element and the guard that records the access on
/// `stream` once dropped (after the launch is queued).
pub(crate) fn pointer<'b>(
    buf: &'b mut Buf<'_>,
    stream: &'b CudaStream,
) -> Result<(u64, SyncOnDrop<'b>)> {
    fn read<'b, T: candle_core::cuda::CudaDType + 'static>(
        s: &'b CudaStorage,
        stream: &'b CudaStream,
    ) -> Result<(u64, SyncOnDrop<'b>)> {
        Ok(s.as_cuda_slice::<T>()?.device_ptr(stream))
    }
    fn write<'b, T: candle_core::cuda::CudaDType + 'static>(
        s: &'b mut CudaStorage,
        stream: &'b CudaStream,
    ) -> Result<(u64, SyncOnDrop<'b>)> {
        Ok(s.as_cuda_slice_mut::<T>()?.device_ptr_mut(stream))
    }
    let Some(dtype) = buf.storage().map(|s| s.dtype()) else {
        bail!("candle-fused: Buf::same_as has no pointer of its own")
    };
    let start = (buf.layout.start_offset() * dtype.size_in_bytes()) as u64;
    let (base, guard) = match (&mut buf.access, dtype) {
        (Access::Read(s), DType::F32) => read::<f32>(s, stream)?,
        (Access::Read(s), DType::BF16) => read::<bf16>(s, stream)?,
        (Access::Read(s), DType::F16) => read::<f16>(s, stream)?,
        (Access::Read(s), DType::I32) => read::<i32>(s, stream)?,
        (Access::Read(s), DType::U32) => read::<u32>(s, stream)?,
        (Access::Read(s), DType::U8) => read::<u8>(s, stream)?,
        (Access::Read(s), DType::F64) => read::<f64>(s, stream)?,
        (Access::Read(s), DType::I64) => read::<i64>(s, stream)?,
        (Access::Write(s), DType::F32) => write::<f32>(s, stream)?,
        (Access::Write(s), DType::BF16) => write::<bf16>(s, stream)?,
        (Access::Write(s), DType::F16) => write::<f16>(s, stream)?,
        (Access::Write(s), DType::I32) => write::<i32>(s, stream)?,
        (Access::Write(s), DType::U32) => write::<u32>(s, stream)?,
        (Access::Write(s), DType::F64) => write::<f64>(s, stream)?,
        (_, dt) => bail!("candle-fused: no Triton kernel takes {dt:?} tensors"),
    };
    Ok((base + start, guard))
}

/// Launches the kernel `entry` for `dtype` on `tensors` (its `Param::Tensor` arguments in
/// order) and `scalars` (its `Param::Int` / `Param::Float` arguments in order), after
/// [`super::check_launch`]; returns the checked launch. Asynchronous, as every Candle op: the outputs
/// are ready for whatever is queued next on the device's stream.
pub(crate) fn launch(
    entry: &str,
    dtype: DType,
    tensors: Vec<Buf<'_>>,
    scalars: &[Scalar],
) -> Result<Launch> {
    launch_first(&[entry], dtype, tensors, scalars)
}

/// [`launch`] of the first of `entries` (the builds of one kernel, most specialised first)
/// that [`check_variants`] accepts for these tensors and scalars, e.g. a head-size build of
/// attention before the generic one.
pub(crate) fn launch_first(
    entries: &[&str],
    dtype: DType,
    mut tensors: Vec<Buf<'_>>,
    scalars: &[Scalar],
) -> Result<Launch> {
    // builds never launched on a GPU only when allowed (`UNPROVEN_ENV`)
    let entries: Vec<&str> = entries.iter().copied().filter(|e| may_launch(e)).collect();
    let entries = entries.as_slice();
    let Some(spec) = entries.iter().find_map(|e| find(e, dtype)) else {
        bail!("candle-fused: no Triton kernel among {entries:?} for {dtype:?}")
    };
    let dev = device_of(spec, &tensors)?;
    let stream = dev.cuda_stream();
    let mut ptrs = Vec::with_capacity(tensors.len());
    let mut guards = Vec::with_capacity(tensors.len());
    let mut checked = Vec::with_capacity(tensors.len());
    // each argument's storage start (its pointer less its layout's offset)
    let mut bases = Vec::with_capacity(tensors.len());
    for (i, buf) in tensors.iter_mut().enumerate() {
        if let Access::Alias(j) = buf.access {
            let (Some(&base), Some(dtype)) =
                (bases.get(j), checked.get(j).map(|a: &TensorArg| a.dtype))
            else {
                bail!(
                    "{}: tensor argument {i} aliases {j}, which is not an earlier one",
                    spec.name()
                )
            };
            let ptr = base + (buf.layout.start_offset() * dtype.size_in_bytes()) as u64;
            checked.push(TensorArg {
                dims: buf.layout.dims().to_vec(),
                strides: buf.layout.stride().to_vec(),
                dtype,
                offset_bytes: ptr as usize,
            });
            ptrs.push(ptr);
            bases.push(base);
            continue;
        }
        if let Access::Same(j) = buf.access {
            // the same memory: the earlier argument's pointer and its recorded access
            let (Some(&ptr), Some(arg)) = (ptrs.get(j), checked.get(j).cloned()) else {
                bail!(
                    "{}: tensor argument {i} repeats {j}, which is not an earlier one",
                    spec.name()
                )
            };
            ptrs.push(ptr);
            checked.push(arg);
            bases.push(bases[j]);
            continue;
        }
        let (dims, strides) = (buf.layout.dims().to_vec(), buf.layout.stride().to_vec());
        let Some(dtype) = buf.dtype() else {
            bail!("{}: tensor argument {i} has no storage", spec.name())
        };
        let start =
            buf.layout.start_offset() * buf.storage().map_or(0, |s| s.dtype().size_in_bytes());
        let (ptr, guard) = pointer(buf, &stream)?;
        bases.push(ptr - start as u64);
        checked.push(TensorArg {
            dims,
            strides,
            dtype,
            // the address itself: its remainder mod 16 is what the kernels assume is 0
            offset_bytes: ptr as usize,
        });
        ptrs.push(ptr);
        guards.push(guard);
    }
    let (spec, launch) = check_variants(entries, dtype, &checked, scalars)?;
    let (func, shared_bytes) = function(&dev, spec)?;
    // SAFETY: `launch` is the checked launch of `spec` (the function's kernel) on these
    // pointers, whose tensors live (and whose guards stay) until the launch is queued.
    unsafe { queue(&stream, &func, &launch, &ptrs, shared_bytes, spec) }?;
    drop(guards);
    super::switch::count_launch();
    Ok(launch)
}

/// The one CUDA device of the tensor arguments (an error naming the kernel when there are
/// none or they are on several).
fn device_of(spec: &KernelSpec, tensors: &[Buf<'_>]) -> Result<CudaDevice> {
    let Some(dev) = tensors
        .iter()
        .find_map(|b| b.storage())
        .map(|s| s.device().clone())
    else {
        bail!("{}: no tensor arguments", spec.name())
    };
    if let Some(s) = tensors
        .iter()
        .filter_map(|b| b.storage())
        .find(|s| !s.device().same_device(&dev))
    {
        bail!(
            "{}: tensors on different CUDA devices ({:?} and {:?})",
            spec.name(),
            dev,
            s.device()
        )
    }
    Ok(dev)
}

/// Queues `func` (the kernel of `spec`) on `stream` with `launch`'s grid, block and
/// arguments (`ptrs`: the device pointers of the tensor arguments, in order) and
/// `shared_bytes` of dynamic shared memory.
///
/// # Safety
/// `launch` is what `check_launch` returned for `spec` and the tensors behind `ptrs`, and
/// those tensors live until the launch is queued.
unsafe fn queue(
    stream: &CudaStream,
    func: &CudaFunction,
    launch: &Launch,
    ptrs: &[u64],
    shared_bytes: u32,
    spec: &KernelSpec,
) -> Result<()> {
    // The argument values live here until the launch is queued (cudarc keeps pointers to them).
    let (mut ints, mut floats) = (Vec::<i32>::new(), Vec::<f32>::new());
    for a in &launch.args {
        match a {
            Arg::I32(v) => ints.push(*v),
            Arg::F32(v) => floats.push(*v),
            Arg::Tensor(_) | Arg::Null => {}
        }
    }
    let null = 0u64;
    let mut builder = stream.launch_builder(func);
    let (mut ni, mut nf) = (0, 0);
    for a in &launch.args {
        match a {
            Arg::Tensor(i) => builder.arg(&ptrs[*i]),
            Arg::I32(_) => {
                ni += 1;
                builder.arg(&ints[ni - 1])
            }
            Arg::F32(_) => {
                nf += 1;
                builder.arg(&floats[nf - 1])
            }
            Arg::Null => builder.arg(&null),
        };
    }
    let cfg = LaunchConfig {
        grid_dim: launch.grid.into(),
        block_dim: launch.block.into(),
        shared_mem_bytes: shared_bytes,
    };
    // SAFETY: the arguments are exactly the `.entry`'s parameters in order and types (the
    // table is checked against the compiled metadata by the unit tests of `audit_tests.rs`), every
    // tensor passed `check_launch` (shape, dtype, contiguity, alignment) and lives until the
    // launch is queued (the caller's contract); the caller's guards, dropped after this
    // returns, record the accesses.
    unsafe { builder.launch(cfg) }
        .map_err(|e| Error::Msg(format!("{}: launch: {e}", spec.name())))?;
    Ok(())
}

type Cache = Mutex<HashMap<(usize, &'static str, DType), (CudaFunction, u32)>>;

/// The kernel's function in the device's context, its module loaded on first use, and the
/// dynamic shared memory of the cubin chosen for the device's architecture.
fn function(dev: &CudaDevice, spec: &'static KernelSpec) -> Result<(CudaFunction, u32)> {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let ctx = dev.cuda_stream().context().clone();
    // the context pointer identifies it while alive, and the cached function keeps it alive
    let key = (ctx.cu_ctx() as usize, spec.entry, spec.dtype);
    let mut cache = CACHE
        .get_or_init(Default::default)
        .lock()
        .map_err(|_| Error::Msg("candle-fused: poisoned kernel cache".into()))?;
    if let Some(f) = cache.get(&key) {
        return Ok(f.clone());
    }
    let name = spec.name();
    let err =
        |what: &str, e: cudarc::driver::DriverError| Error::Msg(format!("{name}: {what}: {e}"));
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|e| err("compute capability", e))?;
    let Some(cubin) = cubins::find(spec.entry, spec.dtype) else {
        bail!("{name}: not embedded (build.rs embeds every kernel of kernels/*.json)")
    };
    let (image, arch) = match cubin_arch(major, minor) {
        Some(80) => (cubin.sm80, 80),
        Some(_) => (cubin.sm90, 90),
        None => bail!(
            "{name}: no cubin for compute capability {major}.{minor} (compiled for sm_80: \
             8.x, and sm_90a: 9.0); switch the Triton kernels off (cuda_kernels::set_triton(false), \
             CANDLE_FUSED_TRITON=0) or compile them for this GPU"
        ),
    };
    let Some(shared_bytes) = spec.shared_bytes_for(arch) else {
        bail!("{name}: no shared memory size for sm_{arch} in the launch table")
    };
    let module = ctx
        .load_module(cudarc::nvrtc::Ptx::from_binary(image.to_vec()))
        .map_err(|e| err("loading the cubin", e))?;
    let func = module
        .load_function(spec.entry)
        .map_err(|e| err("no such .entry in the cubin", e))?;
    // A block needs the function's static shared memory (`.nv.shared.<entry>`, e.g. 1 KiB for
    // a reduction on sm_90) plus the dynamic bytes: opt in when the sum is over 48 KiB.
    let static_bytes = func
        .get_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
        .map_err(|e| err("static shared memory size", e))?;
    let most = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        .map_err(|e| err("shared memory limit", e))?;
    let (Ok(static_bytes), Ok(most)) = (u32::try_from(static_bytes), u32::try_from(most)) else {
        bail!("{name}: the driver reports {static_bytes} static shared bytes and a limit of {most}")
    };
    let opt_in = super::shared_memory_opt_in(static_bytes, shared_bytes, most)
        .map_err(|e| Error::Msg(format!("{name}: {e} (compute capability {major}.{minor})")))?;
    if let Some(dynamic) = opt_in {
        let Ok(dynamic) = i32::try_from(dynamic) else {
            bail!("{name}: {dynamic} bytes of dynamic shared memory")
        };
        func.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            dynamic,
        )
        .map_err(|e| err("setting the shared memory size", e))?;
    }
    cache.insert(key, (func.clone(), shared_bytes));
    Ok((func, shared_bytes))
}
