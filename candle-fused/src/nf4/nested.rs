//! Double quantization of NF4 absmaxes as bitsandbytes' CPU backend computes it: the mean
//! subtracted (summed in torch's order) and the rest quantized to 8 bits with the dynamic map
//! through bitsandbytes' lookup table.

/// Absmaxes per block of the double quantization.
pub const NESTED_BLOCK: usize = 256;

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
pub(super) fn quantize_nested(absmax: &[f32]) -> (Vec<u8>, Vec<f32>, f32) {
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
