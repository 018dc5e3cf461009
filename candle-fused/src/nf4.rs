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

/// Values per 4-bit block.
pub const BLOCK: usize = 64;
/// Absmaxes per block of the double quantization.
pub const NESTED_BLOCK: usize = 256;
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

/// bitsandbytes' signed 8-bit dynamic map (`create_dynamic_map()`, f32 bits), sorted: the
/// codebook of double quantization.
#[rustfmt::skip]
const DYNAMIC_MAP_BITS: [u32; 256] = [
    0xbf7e3333, 0xbf7a999a, 0xbf770000, 0xbf736666, 0xbf6fcccd, 0xbf6c3333, 0xbf68999a, 0xbf650000,
    0xbf616666, 0xbf5dcccd, 0xbf5a3333, 0xbf56999a, 0xbf530000, 0xbf4f6666, 0xbf4bcccd, 0xbf483333,
    0xbf44999a, 0xbf410000, 0xbf3d6666, 0xbf39cccd, 0xbf363334, 0xbf32999a, 0xbf2f0000, 0xbf2b6666,
    0xbf27cccd, 0xbf243334, 0xbf20999a, 0xbf1d0000, 0xbf196666, 0xbf15cccd, 0xbf123334, 0xbf0e999a,
    0xbf0b0000, 0xbf076666, 0xbf03cccc, 0xbf003333, 0xbef93332, 0xbef20000, 0xbeeacccc, 0xbee3999a,
    0xbedc6666, 0xbed53333, 0xbece0000, 0xbec6cccc, 0xbebf999a, 0xbeb86666, 0xbeb13333, 0xbeaa0000,
    0xbea2cccc, 0xbe9b999a, 0xbe946666, 0xbe8d3334, 0xbe860000, 0xbe7d9999, 0xbe6f3333, 0xbe60cccd,
    0xbe526666, 0xbe440000, 0xbe35999a, 0xbe273333, 0xbe18cccd, 0xbe0a6666, 0xbdf80000, 0xbddb3334,
    0xbdc9eb85, 0xbdc428f7, 0xbdbe6667, 0xbdb8a3d7, 0xbdb2e148, 0xbdad1eb8, 0xbda75c2a, 0xbda1999a,
    0xbd9bd70a, 0xbd96147b, 0xbd9051eb, 0xbd8a8f5d, 0xbd84cccd, 0xbd7e147b, 0xbd728f5d, 0xbd670a3d,
    0xbd5b851f, 0xbd500000, 0xbd447ae1, 0xbd38f5c3, 0xbd2d70a3, 0xbd21eb85, 0xbd166667, 0xbd0ae148,
    0xbcfeb852, 0xbce7ae15, 0xbcd0a3d7, 0xbcb9999a, 0xbca28f5d, 0xbc8b851f, 0xbc68f5c3, 0xbc3ae148,
    0xbc1f3b64, 0xbc160418, 0xbc0ccccd, 0xbc039581, 0xbbf4bc6a, 0xbbe24dd3, 0xbbcfdf3b, 0xbbbd70a4,
    0xbbab020d, 0xbb989374, 0xbb8624dd, 0xbb676c8a, 0xbb428f5c, 0xbb1db22d, 0xbaf1a9fc, 0xbaa7ef9d,
    0xba7765ff, 0xba59e83e, 0xba3c6a80, 0xba1eecc1, 0xba016f01, 0xb9c7e283, 0xb98ce705, 0xb923d70b,
    0xb8ba1f4b, 0xb88aefb3, 0xb8378034, 0xb7b24206, 0xb70205ff, 0xb65a1a94, 0xb513a3b7, 0x00000000,
    0x3513a3b7, 0x365a1a94, 0x370205ff, 0x37b24206, 0x38378034, 0x388aefb3, 0x38ba1f4b, 0x3923d70b,
    0x398ce705, 0x39c7e283, 0x3a016f01, 0x3a1eecc1, 0x3a3c6a80, 0x3a59e83e, 0x3a7765ff, 0x3aa7ef9d,
    0x3af1a9fc, 0x3b1db22d, 0x3b428f5c, 0x3b676c8a, 0x3b8624dd, 0x3b989374, 0x3bab020d, 0x3bbd70a4,
    0x3bcfdf3b, 0x3be24dd3, 0x3bf4bc6a, 0x3c039581, 0x3c0ccccd, 0x3c160418, 0x3c1f3b64, 0x3c3ae148,
    0x3c68f5c3, 0x3c8b851f, 0x3ca28f5d, 0x3cb9999a, 0x3cd0a3d7, 0x3ce7ae15, 0x3cfeb852, 0x3d0ae148,
    0x3d166667, 0x3d21eb85, 0x3d2d70a3, 0x3d38f5c3, 0x3d447ae1, 0x3d500000, 0x3d5b851f, 0x3d670a3d,
    0x3d728f5d, 0x3d7e147b, 0x3d84cccd, 0x3d8a8f5d, 0x3d9051eb, 0x3d96147b, 0x3d9bd70a, 0x3da1999a,
    0x3da75c2a, 0x3dad1eb8, 0x3db2e148, 0x3db8a3d7, 0x3dbe6667, 0x3dc428f7, 0x3dc9eb85, 0x3ddb3334,
    0x3df80000, 0x3e0a6666, 0x3e18cccd, 0x3e273333, 0x3e35999a, 0x3e440000, 0x3e526666, 0x3e60cccd,
    0x3e6f3333, 0x3e7d9999, 0x3e860000, 0x3e8d3334, 0x3e946666, 0x3e9b999a, 0x3ea2cccc, 0x3eaa0000,
    0x3eb13333, 0x3eb86666, 0x3ebf999a, 0x3ec6cccc, 0x3ece0000, 0x3ed53333, 0x3edc6666, 0x3ee3999a,
    0x3eeacccc, 0x3ef20000, 0x3ef93332, 0x3f003333, 0x3f03cccc, 0x3f076666, 0x3f0b0000, 0x3f0e999a,
    0x3f123334, 0x3f15cccd, 0x3f196666, 0x3f1d0000, 0x3f20999a, 0x3f243334, 0x3f27cccd, 0x3f2b6666,
    0x3f2f0000, 0x3f32999a, 0x3f363334, 0x3f39cccd, 0x3f3d6666, 0x3f410000, 0x3f44999a, 0x3f483333,
    0x3f4bcccd, 0x3f4f6666, 0x3f530000, 0x3f56999a, 0x3f5a3333, 0x3f5dcccd, 0x3f616666, 0x3f650000,
    0x3f68999a, 0x3f6c3333, 0x3f6fcccd, 0x3f736666, 0x3f770000, 0x3f7a999a, 0x3f7e3333, 0x3f800000,
];

/// bitsandbytes' signed 8-bit dynamic map, 256 sorted f32 values from about -0.993 to 1.
pub fn dynamic_map() -> [f32; 256] {
    DYNAMIC_MAP_BITS.map(f32::from_bits)
}

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

/// Entries of bitsandbytes' CPU quantization lookup table over `[-1, 1]`.
const LUT_SIZE: usize = 65536;

/// bitsandbytes' CPU lookup table of the 8-bit codes (`build_quantize_lut`): entry `i` is the
/// code nearest to `-1 + 2i / 65535` (the first midpoint of `map` at or above it), in f32.
fn dynamic_lut() -> &'static [u8; LUT_SIZE] {
    static LUT: std::sync::OnceLock<Box<[u8; LUT_SIZE]>> = std::sync::OnceLock::new();
    LUT.get_or_init(|| {
        let map = dynamic_map();
        let mid: Vec<f32> = map.windows(2).map(|w| 0.5 * (w[0] + w[1])).collect();
        let mut lut = Box::new([0u8; LUT_SIZE]);
        let mut code = 0;
        for (i, e) in lut.iter_mut().enumerate() {
            let v = -1.0 + (2.0 * i as f32) / (LUT_SIZE - 1) as f32;
            while code < mid.len() && mid[code] < v {
                code += 1;
            }
            *e = code as u8;
        }
        lut
    })
}

/// The 8-bit codes of one nested block `x` and its absmax, as bitsandbytes' CPU
/// `quantize_blockwise` computes them: each value times `1 / absmax`, clamped to `[-1, 1]`,
/// looked up in [`dynamic_lut`] at the nearest of its 65536 points (so a value within half a
/// table step of a midpoint may take the farther code, as there); an all-zero block codes 0.
fn quantize_dynamic_block(x: &[f32], codes: &mut [u8]) -> f32 {
    let m = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if m == 0.0 {
        codes.fill(0);
        return m;
    }
    let (lut, inv) = (dynamic_lut(), 1.0 / m);
    for (c, v) in codes.iter_mut().zip(x) {
        let v = (v * inv).clamp(-1.0, 1.0);
        *c = lut[((v + 1.0) * 0.5 * (LUT_SIZE - 1) as f32 + 0.5) as usize];
    }
    m
}

/// `ceil(log2(x))` as torch's `CeilLog2` (1 for `x <= 2`).
fn ceil_log2(x: usize) -> usize {
    match x {
        0..=2 => 1,
        _ => (usize::BITS - (x - 1).leading_zeros()) as usize,
    }
}

/// torch's `multi_row_sum`: `N` running sums over `size` rows of `N` values (`rows` row-major),
/// cascaded over 4 levels so that long sums stay accurate, in torch's order.
fn multi_row_sum<const N: usize>(rows: &[f32], size: usize) -> [f32; N] {
    const LEVELS: usize = 4;
    let power = (ceil_log2(size) / LEVELS).max(4);
    let (step, mask) = (1usize << power, (1usize << power) - 1);
    let mut acc = [[0f32; N]; LEVELS];
    let mut i = 0;
    while i + step <= size {
        for _ in 0..step {
            for k in 0..N {
                acc[0][k] += rows[i * N + k];
            }
            i += 1;
        }
        for j in 1..LEVELS {
            let (lower, upper) = acc.split_at_mut(j);
            for (hi, lo) in upper[0].iter_mut().zip(lower[j - 1].iter_mut()) {
                *hi += *lo;
                *lo = 0.0;
            }
            if i & (mask << (j * power)) != 0 {
                break;
            }
        }
    }
    while i < size {
        for k in 0..N {
            acc[0][k] += rows[i * N + k];
        }
        i += 1;
    }
    let (first, rest) = acc.split_at_mut(1);
    for level in rest.iter() {
        for (a, b) in first[0].iter_mut().zip(level) {
            *a += b;
        }
    }
    first[0]
}

/// The f32 sum of `x` in the order torch's CPU `sum` adds a contiguous f32 vector on one
/// thread (`cascade_sum`: 4 interleaved accumulators of 8-lane vectors, the last vectors, the
/// tail, then the lanes; 4 scalar accumulators below 8 values), so that the mean bitsandbytes
/// subtracts before double quantization (`absmax.mean()`) is the same f32. (torch splits sums
/// longer than 32768 over its threads: a multi-threaded torch may then differ in the last bit.)
fn torch_sum(x: &[f32]) -> f32 {
    const LANES: usize = 8;
    const ILP: usize = 4;
    if x.len() < LANES {
        let rows = x.len() / ILP;
        let mut p = multi_row_sum::<ILP>(&x[..rows * ILP], rows);
        for v in &x[rows * ILP..] {
            p[0] += v;
        }
        return p[1..].iter().fold(p[0], |a, b| a + b);
    }
    let vecs = x.len() / LANES;
    let rows = vecs / ILP;
    let mut p = multi_row_sum::<{ ILP * LANES }>(&x[..rows * ILP * LANES], rows);
    for i in rows * ILP..vecs {
        for l in 0..LANES {
            p[l] += x[i * LANES + l];
        }
    }
    for k in 1..ILP {
        for l in 0..LANES {
            p[l] += p[k * LANES + l];
        }
    }
    let tail = x[vecs * LANES..].iter().fold(0f32, |a, b| a + b);
    p[..LANES].iter().fold(tail, |a, b| a + b)
}

/// Double quantization of `absmax`: `(codes, nested absmaxes, offset)`.
fn quantize_nested(absmax: &[f32]) -> (Vec<u8>, Vec<f32>, f32) {
    let offset = torch_sum(absmax) / absmax.len().max(1) as f32;
    let shifted: Vec<f32> = absmax.iter().map(|a| a - offset).collect();
    let mut codes = vec![0u8; shifted.len()];
    let nested: Vec<f32> = shifted
        .chunks(NESTED_BLOCK)
        .zip(codes.chunks_mut(NESTED_BLOCK))
        .map(|(x, c)| quantize_dynamic_block(x, c))
        .collect();
    (codes, nested, offset)
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
    /// on the host for a CPU weight, else (and under
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
        let vals = match host {
            true => self.dequantize_range_cpu(absmax, start, end)?,
            false => self.dequantize_range_composite(absmax, start, end)?,
        };
        vals.to_dtype(self.dtype)?.to_dtype(dtype)
    }

    /// [`Nf4Weight::dequantize_range`] in f32 on the host.
    fn dequantize_range_cpu(&self, absmax: &Tensor, start: usize, end: usize) -> Result<Tensor> {
        let b0 = start / 2;
        let bytes = self
            .packed
            .narrow(0, b0, blocks(end, 2) - b0)?
            .to_vec1::<u8>()?;
        let (a0, a1) = (start / self.blocksize, blocks(end, self.blocksize));
        let am = absmax.narrow(0, a0, a1 - a0)?.to_vec1::<f32>()?;
        let bs = self.blocksize;
        let out: Vec<f32> = (start..end)
            .map(|i| {
                let byte = bytes[i / 2 - b0];
                let code = if i % 2 == 0 { byte >> 4 } else { byte & 0x0f };
                NF4_VALUES[code as usize] * am[i / bs - a0]
            })
            .collect();
        Tensor::from_vec(out, end - start, &Device::Cpu)
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

/// The torch name of a dtype, as bitsandbytes writes it (`str(dtype).strip("torch.")`).
fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        DType::F64 => "float64",
        _ => "unknown",
    }
}

/// The settings of a saved quant state.
struct QuantState {
    blocksize: usize,
    dtype: DType,
    shape: Vec<usize>,
    /// `(nested_blocksize, nested_offset)` with double quantization.
    nested: Option<(usize, f32)>,
}

impl QuantState {
    /// Parses the JSON bytes of `tensor` (named `name`).
    fn parse(name: &str, tensor: &Tensor) -> Result<Self> {
        use serde_json::Value;
        let bytes = tensor.flatten_all()?.to_dtype(DType::U8)?.to_vec1::<u8>()?;
        let v: Value = serde_json::from_slice(&bytes)
            .map_err(|e| candle_core::Error::Msg(format!("`{name}`: not JSON: {e}")))?;
        let field = |k: &str| -> Result<&Value> {
            v.get(k)
                .ok_or_else(|| candle_core::Error::Msg(format!("`{name}`: no `{k}` key")))
        };
        match field("quant_type")?.as_str() {
            Some("nf4") => {}
            other => bail!("`{name}`: quant_type {other:?}: only nf4 is supported"),
        }
        let size = |k: &str| -> Result<usize> {
            match field(k)?.as_u64() {
                Some(x) => Ok(x as usize),
                None => bail!("`{name}`: `{k}` must be a size, got {}", field(k)?),
            }
        };
        let dtype = match field("dtype")?.as_str() {
            Some("float32") => DType::F32,
            Some("bfloat16") => DType::BF16,
            Some("float16") => DType::F16,
            _ => bail!(
                "`{name}`: dtype {} is not float32, bfloat16 or float16",
                field("dtype")?
            ),
        };
        let shape = match field("shape")?.as_array() {
            Some(a) => a
                .iter()
                .map(|d| match d.as_u64() {
                    Some(x) => Ok(x as usize),
                    None => bail!("`{name}`: shape entry {d} is not a size"),
                })
                .collect::<Result<Vec<_>>>()?,
            None => bail!("`{name}`: shape must be a list, got {}", field("shape")?),
        };
        let nested = match v.get("nested_blocksize") {
            None => None,
            Some(_) => {
                let offset = match field("nested_offset")?.as_f64() {
                    Some(x) => x as f32,
                    None => bail!("`{name}`: nested_offset must be a number"),
                };
                if field("nested_dtype")?.as_str() != Some("float32") {
                    bail!(
                        "`{name}`: nested_dtype {} is not float32",
                        field("nested_dtype")?
                    );
                }
                Some((size("nested_blocksize")?, offset))
            }
        };
        Ok(QuantState {
            blocksize: size("blocksize")?,
            dtype,
            shape,
            nested,
        })
    }
}
