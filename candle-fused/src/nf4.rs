//! 4-bit NormalFloat (NF4) weights as bitsandbytes computes and transformers saves them, bit
//! for bit: the frozen base of a QLoRA layer ([`qlora`](crate::qlora)).
//!
//! # The format
//!
//! A weight of `n` values (row-major) is cut into blocks of [`BLOCK`] (64) values. Per block:
//! the f32 absolute maximum `absmax`; each value times `1 / max(absmax, 1e-38)` (f32), clamped
//! to `[-1, 1]`, becomes the index of the nearest of the 16 [`NF4_VALUES`] (the lower index
//! when it lies exactly on a midpoint, the midpoints computed in f32); two codes a byte, the
//! first in the high nibble (a zero nibble pads an odd count). Dequantized, a value is
//! `NF4_VALUES[code] * absmax` in f32, rounded once to the dtype asked for.
//!
//! **Double quantization** (`bnb_4bit_use_double_quant`): the absmaxes minus their mean
//! (`offset`, f32, summed in torch's order) are quantized again, to 8 bits with bitsandbytes'
//! signed dynamic map ([`dynamic_map`]) in blocks of [`NESTED_BLOCK`] (256): per nested block
//! its own absmax, each value times its reciprocal mapped to a map entry through bitsandbytes'
//! CPU lookup table (the nearest entry but within half a step of the table's 65536 points). The
//! absmax of a 4-bit block is then `map[code] * nested_absmax + offset` (f32).
//!
//! transformers saves a 4-bit `weight` of a module as `weight` (the packed bytes, u8
//! `[ceil(n/2), 1]`), `weight.absmax`, `weight.quant_map` (the 16 values), with double
//! quantization `weight.nested_absmax` and `weight.nested_quant_map`, and
//! `weight.quant_state.bitsandbytes__nf4` (u8: the JSON of the block size, the dtype, the shape
//! and the nested settings); [`Nf4Weight::to_tensors`] and [`Nf4Weight::from_tensors`] write
//! and read these names. Checkpoints quantized by bitsandbytes' CUDA kernels are read as saved
//! (their codes are not re-derived).

use std::collections::BTreeMap;

use candle_core::{bail, DType, Device, Result, Tensor};
use rayon::prelude::*;

use crate::cpu::Real;

#[cfg(feature = "cuda")]
mod cuda;
mod host;
mod nested;
mod state;

use nested::quantize_nested;
pub use nested::{dynamic_map, NESTED_BLOCK};
use state::{dtype_name, QuantState};

/// Values per 4-bit block.
pub const BLOCK: usize = 64;
/// Block sizes bitsandbytes accepts.
const BLOCK_SIZES: [usize; 8] = [32, 64, 128, 256, 512, 1024, 2048, 4096];

/// The 16 NF4 values (bitsandbytes' `get_4bit_type("nf4")`, f32), in code order.
pub const NF4_VALUES: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

/// The quant-state entry name transformers saves beside an NF4 weight (its JSON settings).
pub const QUANT_STATE_SUFFIX: &str = "quant_state.bitsandbytes__nf4";

/// The absmaxes of an [`Nf4Weight`]: plain f32, or double-quantized.
#[derive(Clone, Debug)]
pub enum Absmax {
    /// One f32 per block.
    Plain(Tensor),
    /// The absmaxes minus `offset`, quantized to 8 bits.
    Nested(Nested),
}

/// Double-quantized absmaxes: block `i`'s absmax is
/// `map[codes[i]] * absmax[i / blocksize] + offset`, in f32.
#[derive(Clone, Debug)]
pub struct Nested {
    /// One u8 code per 4-bit block (`weight.absmax` in a transformers checkpoint).
    pub codes: Tensor,
    /// One f32 per nested block (`weight.nested_absmax`).
    pub absmax: Tensor,
    /// The 256-entry codebook (`weight.nested_quant_map`), f32.
    pub map: Tensor,
    /// The mean subtracted before quantizing (`nested_offset`).
    pub offset: f32,
    /// Absmaxes per nested block (`nested_blocksize`, 256).
    pub blocksize: usize,
}

/// A frozen weight in NF4: packed codes and absmaxes, with the shape and dtype it had.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_fused::nf4::Nf4Weight;
/// let w = Tensor::arange(0f32, 256.0, &Device::Cpu)?.affine(1.0 / 128.0, -1.0)?.reshape((4, 64))?;
/// let q = Nf4Weight::quantize(&w, true)?;
/// assert_eq!(q.shape(), &[4, 64]);
/// let back = q.dequantize(DType::F32)?;
/// let err = (back - &w)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(err < 0.15); // 4 bits: a coarse grid
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct Nf4Weight {
    shape: Vec<usize>,
    /// u8 `[ceil(n / 2)]`, two codes a byte, the first in the high nibble.
    packed: Tensor,
    absmax: Absmax,
    blocksize: usize,
    /// The dtype the weight had when quantized (dequantization rounds to it first).
    dtype: DType,
}

/// The f32 midpoints between neighbouring NF4 values, as bitsandbytes computes them.
fn midpoints() -> [f32; 15] {
    std::array::from_fn(|i| (NF4_VALUES[i] + NF4_VALUES[i + 1]) / 2.0)
}

/// The NF4 code of `s` in `[-1, 1]`: the first midpoint at or above it (a value on a midpoint
/// takes the lower code).
fn nf4_code(s: f32, mid: &[f32; 15]) -> u8 {
    mid.partition_point(|&m| m < s) as u8
}

/// Codes and absmax of one 4-bit block.
fn quantize_block(x: &[f32], mid: &[f32; 15], codes: &mut [u8]) -> f32 {
    let absmax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let inv = 1.0 / absmax.max(1e-38);
    for (c, v) in codes.iter_mut().zip(x) {
        *c = nf4_code((v * inv).clamp(-1.0, 1.0), mid);
    }
    absmax
}

/// `ceil(a / b)`.
fn blocks(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

/// Checks that the tensor `prefix` + `suffix` has `dtype` and `len` elements, naming it.
fn check_tensor(t: &Tensor, prefix: &str, suffix: &str, dtype: DType, len: usize) -> Result<()> {
    if t.dtype() != dtype {
        bail!("`{prefix}{suffix}` must be {dtype:?}, got {:?}", t.dtype());
    }
    if t.elem_count() != len {
        bail!(
            "`{prefix}{suffix}` holds {} values ({:?}), the quant state (shape, block sizes) \
             needs {len}",
            t.elem_count(),
            t.dims()
        );
    }
    Ok(())
}

impl Nf4Weight {
    /// Quantizes `w` (any float dtype and shape, read as f32) to NF4 in blocks of [`BLOCK`],
    /// with double quantization if `double`, as bitsandbytes' `quantize_4bit` does: the same
    /// codes and absmaxes bit for bit. Deterministic (blocks in parallel, each on its own).
    pub fn quantize(w: &Tensor, double: bool) -> Result<Self> {
        let dtype = w.dtype();
        let values = w.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        let n = values.len();
        let mid = midpoints();
        let mut codes = vec![0u8; n + n % 2];
        let absmax: Vec<f32> = values
            .par_chunks(BLOCK)
            .zip(codes.par_chunks_mut(BLOCK))
            .map(|(x, c)| quantize_block(x, &mid, &mut c[..x.len()]))
            .collect();
        let packed: Vec<u8> = codes.chunks(2).map(|p| (p[0] << 4) | p[1]).collect();
        let dev = w.device();
        let absmax = match double {
            false => Absmax::Plain(Tensor::from_vec(absmax, blocks(n, BLOCK), dev)?),
            true => {
                let (codes, nested, offset) = quantize_nested(&absmax);
                let (nb, nn) = (codes.len(), nested.len());
                Absmax::Nested(Nested {
                    codes: Tensor::from_vec(codes, nb, dev)?,
                    absmax: Tensor::from_vec(nested, nn, dev)?,
                    map: Tensor::new(&dynamic_map(), dev)?,
                    offset,
                    blocksize: NESTED_BLOCK,
                })
            }
        };
        let len = packed.len();
        Self::new(
            w.dims().to_vec(),
            Tensor::from_vec(packed, len, dev)?,
            absmax,
            BLOCK,
            dtype,
        )
    }

    /// A weight of `shape` from its parts (as read from a checkpoint), checked: `packed` u8
    /// of `ceil(n/2)` bytes, one absmax per block of `blocksize` (a bitsandbytes block size),
    /// the nested parts of matching lengths and a 256-entry map, `dtype` a float type.
    pub fn new(
        shape: Vec<usize>,
        packed: Tensor,
        absmax: Absmax,
        blocksize: usize,
        dtype: DType,
    ) -> Result<Self> {
        Self::named("weight", shape, packed, absmax, blocksize, dtype)
    }

    /// [`Nf4Weight::new`], errors naming the tensors after `prefix` (the weight's name).
    fn named(
        prefix: &str,
        shape: Vec<usize>,
        packed: Tensor,
        absmax: Absmax,
        blocksize: usize,
        dtype: DType,
    ) -> Result<Self> {
        let n: usize = shape.iter().product();
        if !BLOCK_SIZES.contains(&blocksize) {
            bail!("`{prefix}`: block size {blocksize} is not one of bitsandbytes' {BLOCK_SIZES:?}");
        }
        if !dtype.is_float() {
            bail!("`{prefix}`: the quantized weight's dtype must be a float type, got {dtype:?}");
        }
        let packed = packed.flatten_all()?;
        check_tensor(&packed, prefix, "", DType::U8, blocks(n, 2))?;
        let nb = blocks(n, blocksize);
        match &absmax {
            Absmax::Plain(a) => check_tensor(a, prefix, ".absmax", DType::F32, nb)?,
            Absmax::Nested(q) => {
                if !BLOCK_SIZES.contains(&q.blocksize) {
                    bail!(
                        "`{prefix}`: nested block size {} is not one of {BLOCK_SIZES:?}",
                        q.blocksize
                    );
                }
                check_tensor(&q.codes, prefix, ".absmax", DType::U8, nb)?;
                let nn = blocks(nb, q.blocksize);
                check_tensor(&q.absmax, prefix, ".nested_absmax", DType::F32, nn)?;
                check_tensor(&q.map, prefix, ".nested_quant_map", DType::F32, 256)?;
                if !q.offset.is_finite() {
                    bail!("`{prefix}`: nested_offset {} is not finite", q.offset);
                }
            }
        }
        Ok(Nf4Weight {
            shape,
            packed,
            absmax,
            blocksize,
            dtype,
        })
    }

    /// The weight's shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The dtype the weight had when quantized (the quant state's `dtype`).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The number of values per 4-bit block.
    pub fn blocksize(&self) -> usize {
        self.blocksize
    }

    /// The absmaxes as stored.
    pub fn absmax(&self) -> &Absmax {
        &self.absmax
    }

    /// The packed codes, u8 `[ceil(n/2)]`.
    pub fn packed(&self) -> &Tensor {
        &self.packed
    }

    /// The device the weight lives on.
    pub fn device(&self) -> &Device {
        self.packed.device()
    }

    /// The bytes the weight holds (codes, absmaxes and nested state).
    pub fn storage_bytes(&self) -> usize {
        let t = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        t(&self.packed)
            + match &self.absmax {
                Absmax::Plain(a) => t(a),
                Absmax::Nested(q) => t(&q.codes) + t(&q.absmax) + t(&q.map),
            }
    }

    /// The same weight on `device`.
    pub fn to_device(&self, device: &Device) -> Result<Self> {
        let absmax = match &self.absmax {
            Absmax::Plain(a) => Absmax::Plain(a.to_device(device)?),
            Absmax::Nested(q) => Absmax::Nested(Nested {
                codes: q.codes.to_device(device)?,
                absmax: q.absmax.to_device(device)?,
                map: q.map.to_device(device)?,
                ..q.clone()
            }),
        };
        Ok(Nf4Weight {
            packed: self.packed.to_device(device)?,
            absmax,
            ..self.clone()
        })
    }

    /// The f32 absmax of every block (double quantization undone: `map[code] * nested +
    /// offset`, as bitsandbytes' `dequantize_blockwise` computes it), on the weight's device.
    pub fn absmax_f32(&self) -> Result<Tensor> {
        match &self.absmax {
            Absmax::Plain(a) => Ok(a.clone()),
            Absmax::Nested(q) => {
                let nb = q.codes.elem_count();
                let codes = q.codes.to_dtype(DType::U32)?;
                let vals = q.map.index_select(&codes, 0)?;
                let per = q
                    .absmax
                    .unsqueeze(1)?
                    .broadcast_as((q.absmax.elem_count(), q.blocksize))?
                    .flatten_all()?
                    .narrow(0, 0, nb)?;
                (vals * per)?.affine(1.0, q.offset as f64)
            }
        }
    }

    /// Values `start..end` (flat, row-major) dequantized to `dtype`: `NF4_VALUES[code] *
    /// absmax` in f32, rounded to the quant state's dtype, then to `dtype` (as bitsandbytes'
    /// `dequantize_4bit(..).to(dtype)`; one rounding when the quant state is f32 or `dtype`).
    /// `absmax` is [`Nf4Weight::absmax_f32`]'s. A 1-D tensor on the weight's device: computed
    /// on the host for a CPU weight; on CUDA by the Triton kernel when the kernels are on (a
    /// nested weight's kernel reads its nested parts: the same f32 absmaxes); else (and under
    /// [`with_composite_fallback`](crate::with_composite_fallback)) by Candle ops on the device.
    pub fn dequantize_range(
        &self,
        absmax: &Tensor,
        start: usize,
        end: usize,
        dtype: DType,
    ) -> Result<Tensor> {
        let n = self.elem_count();
        if start > end || end > n {
            bail!("nf4: range {start}..{end} out of the weight's {n} values");
        }
        let host = self.device().is_cpu() && !crate::cpu::fallback_forced();
        #[cfg(feature = "cuda")]
        if let Some(out) = self.triton_dtype(dtype).filter(|_| !host && start < end) {
            return cuda::dequantize(self, absmax, start, end, out)?.to_dtype(dtype);
        }
        if host {
            let am = absmax.to_vec1::<f32>()?;
            return crate::cpu::dispatch!(dtype, T => {
                let mut out = vec![<T as crate::cpu::Elem>::from_acc(Real::ZERO); end - start];
                self.dequantize_into(&am, start, &mut out)?;
                Tensor::from_vec(out, end - start, &Device::Cpu)
            });
        }
        self.dequantize_range_composite(absmax, start, end)?
            .to_dtype(self.dtype)?
            .to_dtype(dtype)
    }

    /// The dtype the Triton kernel writes for `dtype` (the quant state's, whose rounding comes
    /// first; `dtype` itself for an f32 state), when the kernels take this weight.
    #[cfg(feature = "cuda")]
    fn triton_dtype(&self, dtype: DType) -> Option<DType> {
        let out = if self.dtype == DType::F32 {
            dtype
        } else {
            self.dtype
        };
        let entry = match self.absmax {
            Absmax::Plain(_) => "nf4_dequant",
            Absmax::Nested(_) => "nf4_dequant_nested",
        };
        // the kernel's indices are i32, up to `n + BLOCK`
        let top = self.elem_count() + crate::cuda_kernels::nf4::BLOCK;
        let on = crate::cuda_kernels::triton_flat(self.device(), out, top);
        (on && crate::cuda_kernels::may_launch(entry)).then_some(out)
    }

    /// [`Nf4Weight::dequantize_range`] in f32 from Candle ops (any device).
    fn dequantize_range_composite(
        &self,
        absmax: &Tensor,
        start: usize,
        end: usize,
    ) -> Result<Tensor> {
        let dev = self.device();
        let b0 = start / 2;
        let bytes = self
            .packed
            .narrow(0, b0, blocks(end, 2) - b0)?
            .to_dtype(DType::F32)?;
        let hi = (&bytes / 16.0)?.floor()?;
        let lo = (&bytes - (&hi * 16.0)?)?;
        let codes = Tensor::stack(&[hi, lo], 1)?
            .flatten_all()?
            .narrow(0, start % 2, end - start)?
            .to_dtype(DType::U32)?;
        let table = Tensor::new(&NF4_VALUES, dev)?;
        let vals = table.index_select(&codes, 0)?;
        let (a0, a1) = (start / self.blocksize, blocks(end, self.blocksize));
        let per = absmax
            .narrow(0, a0, a1 - a0)?
            .unsqueeze(1)?
            .broadcast_as((a1 - a0, self.blocksize))?
            .flatten_all()?
            .narrow(0, start - a0 * self.blocksize, end - start)?;
        vals * per
    }

    /// The number of values.
    pub fn elem_count(&self) -> usize {
        self.shape.iter().product()
    }

    /// The whole weight dequantized to `dtype`, in its shape (see
    /// [`Nf4Weight::dequantize_range`]): for export and tests; a layer dequantizes a tile at a
    /// time.
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        let absmax = self.absmax_f32()?;
        self.dequantize_range(&absmax, 0, self.elem_count(), dtype)?
            .reshape(self.shape.as_slice())
    }

    /// The quant state's JSON, as bitsandbytes packs it into
    /// `weight.quant_state.bitsandbytes__nf4`.
    pub fn quant_state_json(&self) -> String {
        // Python's `json.dumps` of bitsandbytes' dict: its key order and separators.
        let shape: Vec<String> = self.shape.iter().map(|d| d.to_string()).collect();
        let mut s = format!(
            "{{\"quant_type\": \"nf4\", \"blocksize\": {}, \"dtype\": \"{}\", \"shape\": [{}]",
            self.blocksize,
            dtype_name(self.dtype),
            shape.join(", ")
        );
        if let Absmax::Nested(q) = &self.absmax {
            let offset = serde_json::to_string(&(q.offset as f64)).unwrap_or_default();
            s += &format!(
                ", \"nested_blocksize\": {}, \"nested_dtype\": \"float32\", \"nested_offset\": {offset}",
                q.blocksize
            );
        }
        s + "}"
    }

    /// The tensors transformers saves for this weight under `prefix` (the module's
    /// `…weight`): `prefix` (u8 `[ceil(n/2), 1]`), `prefix.absmax`, `prefix.quant_map`, the
    /// nested ones with double quantization, and `prefix.quant_state.bitsandbytes__nf4`.
    pub fn to_tensors(&self, prefix: &str) -> Result<BTreeMap<String, Tensor>> {
        let dev = self.device();
        let mut out = BTreeMap::new();
        out.insert(prefix.to_string(), self.packed.unsqueeze(1)?);
        out.insert(
            format!("{prefix}.quant_map"),
            Tensor::new(&NF4_VALUES, dev)?,
        );
        match &self.absmax {
            Absmax::Plain(a) => {
                out.insert(format!("{prefix}.absmax"), a.clone());
            }
            Absmax::Nested(q) => {
                out.insert(format!("{prefix}.absmax"), q.codes.clone());
                out.insert(format!("{prefix}.nested_absmax"), q.absmax.clone());
                out.insert(format!("{prefix}.nested_quant_map"), q.map.clone());
            }
        }
        let json = self.quant_state_json().into_bytes();
        let len = json.len();
        out.insert(
            format!("{prefix}.{QUANT_STATE_SUFFIX}"),
            Tensor::from_vec(json, len, dev)?,
        );
        Ok(out)
    }

    /// Reads the weight transformers saved under `prefix` through `get` (a tensor by full
    /// name, `None` if absent), checking every part against the quant state: a missing
    /// tensor, another quantization type (`fp4`), a quant map that is not NF4's, lengths that
    /// do not fit the shape are errors naming the tensor.
    pub fn from_tensors(
        prefix: &str,
        get: &dyn Fn(&str) -> Result<Option<Tensor>>,
    ) -> Result<Self> {
        let need = |suffix: &str| -> Result<Tensor> {
            let name = format!("{prefix}{suffix}");
            get(&name)?.ok_or_else(|| {
                candle_core::Error::Msg(format!(
                    "nf4: `{name}` is missing (a 4-bit weight needs it)"
                ))
            })
        };
        let state_name = format!("{prefix}.{QUANT_STATE_SUFFIX}");
        let state = match get(&state_name)? {
            Some(s) => s,
            None => {
                let fp4 = format!("{prefix}.quant_state.bitsandbytes__fp4");
                if get(&fp4)?.is_some() {
                    bail!("`{fp4}`: the weight is quantized as fp4; only nf4 is supported");
                }
                bail!("nf4: `{state_name}` is missing (a 4-bit weight needs it)");
            }
        };
        let state = QuantState::parse(&state_name, &state)?;
        let ctx = |e: candle_core::Error| candle_core::Error::Msg(format!("`{prefix}`: {e}"));
        let quant_map = need(".quant_map")?;
        let nf4_map = quant_map
            .to_dtype(DType::F32)
            .and_then(|m| m.flatten_all()?.to_vec1::<f32>())
            .map_err(ctx)?;
        if nf4_map != NF4_VALUES {
            bail!("`{prefix}.quant_map` does not hold the 16 NF4 values: {nf4_map:?}");
        }
        let packed = need("")?;
        let absmax = need(".absmax")?;
        let absmax = match state.nested {
            None => Absmax::Plain(absmax),
            Some((blocksize, offset)) => Absmax::Nested(Nested {
                codes: absmax,
                absmax: need(".nested_absmax")?,
                map: need(".nested_quant_map")?,
                offset,
                blocksize,
            }),
        };
        Self::named(
            prefix,
            state.shape,
            packed,
            absmax,
            state.blocksize,
            state.dtype,
        )
    }
}
