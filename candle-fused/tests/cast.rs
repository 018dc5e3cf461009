//! `candle_fused::cast` against Candle's `to_dtype`, bit for bit: special values (NaN payloads,
//! infinities, signed zeros, subnormals, ties to even, overflow), a vector long enough to run
//! in parallel (odd length), a strided input (Candle's path), and `cast_var` as a leaf.

use candle_core::{DType, Device, Tensor, D};
use candle_fused::cast::{cast, cast_var};

/// f32 bit patterns that exercise rounding and the special cases.
fn specials() -> Vec<f32> {
    let bits = [
        0x7FC0_0000u32, // quiet NaN
        0x7F80_0001,    // signalling NaN
        0xFFC1_2345,    // negative NaN with a payload
        0x7F80_0000,    // inf
        0xFF80_0000,    // -inf
        0x0000_0000,    // 0
        0x8000_0000,    // -0
        0x0000_0001,    // smallest subnormal
        0x807F_FFFF,    // largest negative subnormal
        0x3F80_8000,    // 1 + 2^-8: a tie, rounds to even (down)
        0x3F81_8000,    // a tie that rounds up
        0x3F80_8001,    // just above a tie
        0x7F7F_FFFF,    // f32::MAX: rounds to inf in bf16
        0x4780_0000,    // 65536: overflows f16
        0x3380_0000,    // 2^-24: f16's smallest subnormal
    ];
    bits.iter().map(|&b| f32::from_bits(b)).collect()
}

/// `a` and `b` as f32 bit patterns (after an exact widening of 16-bit types).
fn bits(t: &Tensor) -> Vec<u32> {
    let wide = match t.dtype() {
        DType::F32 => t.clone(),
        _ => t.to_dtype(DType::F32).unwrap(),
    };
    let v = wide.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    v.iter().map(|x| x.to_bits()).collect()
}

fn inputs() -> Vec<Tensor> {
    let dev = Device::Cpu;
    let n = 7 * 42_859; // above the parallel threshold, odd
    let long: Vec<f32> = (0..n)
        .map(|i| ((i as f32) * 0.618_034).sin() * 10f32.powi((i % 13) as i32 - 6))
        .collect();
    vec![
        Tensor::new(specials(), &dev).unwrap(),
        Tensor::from_vec(long, (7, n / 7), &dev).unwrap(),
    ]
}

#[test]
fn casts_match_to_dtype_bit_for_bit() {
    for x in inputs() {
        for to in [DType::BF16, DType::F16] {
            let want = x.to_dtype(to).unwrap();
            let got = cast(&x, to).unwrap();
            assert_eq!((got.dtype(), got.dims()), (to, x.dims()));
            assert_eq!(bits(&got), bits(&want), "f32 -> {to:?}");
            // and back: 16-bit to f32
            let back = cast(&want, DType::F32).unwrap();
            assert_eq!(bits(&back), bits(&want.to_dtype(DType::F32).unwrap()));
            let leaf = cast_var(&x, to).unwrap();
            assert_eq!(
                bits(leaf.as_tensor()),
                bits(&want),
                "cast_var f32 -> {to:?}"
            );
        }
    }
}

#[test]
fn strided_and_other_dtypes_take_candles_path() {
    let x = inputs().remove(1);
    let t = x.transpose(0, 1).unwrap(); // strided
    let got = cast(&t, DType::BF16).unwrap();
    assert_eq!(bits(&got), bits(&t.to_dtype(DType::BF16).unwrap()));
    let f64s = cast(&x, DType::F64).unwrap();
    assert_eq!(f64s.dtype(), DType::F64);
    assert_eq!(f64s.sum(D::Minus1).unwrap().dims(), &[7]);
}

#[test]
fn results_are_detached_and_cast_var_is_a_leaf() {
    let w = candle_core::Var::new(&[1.5f32, -2.25], &Device::Cpu).unwrap();
    let loss = |t: &Tensor| t.sqr().unwrap().sum_all().unwrap();
    let c = cast(w.as_tensor(), DType::BF16).unwrap();
    assert!(!c.is_variable());
    let grads = loss(&c).backward().unwrap();
    assert!(
        grads.get(w.as_tensor()).is_none(),
        "cast: no graph to the input"
    );
    let leaf = cast_var(w.as_tensor(), DType::BF16).unwrap();
    let grads = loss(leaf.as_tensor()).backward().unwrap();
    assert!(grads.get(leaf.as_tensor()).is_some());
    assert!(
        grads.get(w.as_tensor()).is_none(),
        "cast_var: the input is not reached"
    );
}
