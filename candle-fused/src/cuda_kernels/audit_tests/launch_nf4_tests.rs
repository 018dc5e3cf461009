//! `check_launch` cases of the NF4 dequantization: grid (one program per `BLOCK` values),
//! block and the full argument list of the plain and the double-quantized entries, and the
//! errors of invalid launches.

use super::{refuses, t};
use crate::cuda_kernels::{check_launch, find, Arg, Scalar};
use anyhow::Result;
use candle_core::DType;

#[test]
fn nf4_launches() -> Result<()> {
    use Arg::{Null, Tensor as T, F32, I32};
    // a tile of rows 3..10 of a [131, 129] weight: 16899 values, 265 blocks of 64, 2 nested
    let (n, start, e): (usize, usize, usize) = (131 * 129, 3 * 129, 7 * 129);
    let (b, a, u8) = (n.div_ceil(2), n.div_ceil(64), DType::U8);
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let plain = find("nf4_dequant", dt).unwrap();
        let ins = [t(&[b], u8), t(&[a], DType::F32), t(&[e], dt)];
        let l = check_launch(plain, &ins, &[Scalar::I32(start as i32), Scalar::I32(64)])?;
        assert_eq!((l.grid, l.block), ([1, 1, 1], [128, 1, 1]));
        let args = [T(0), T(1), T(2), I32(start as i32), I32(e as i32), I32(64)];
        assert_eq!(l.args, [&args[..], &[Null, Null]].concat());
        let nested = find("nf4_dequant_nested", dt).unwrap();
        let ins = [
            t(&[b], u8),
            t(&[a], u8),
            t(&[2], DType::F32),
            t(&[256], DType::F32),
            t(&[e], dt),
        ];
        let scalars = [
            Scalar::F32(0.25),
            Scalar::I32(start as i32),
            Scalar::I32(64),
            Scalar::I32(256),
        ];
        let l = check_launch(nested, &ins, &scalars)?;
        assert_eq!(l.grid, [1, 1, 1]);
        let args = [T(0), T(1), T(2), T(3), T(4), F32(0.25)];
        let ints = [I32(start as i32), I32(e as i32), I32(64), I32(256)];
        assert_eq!(l.args, [&args[..], &ints, &[Null, Null]].concat());
    }
    let (plain, f) = (find("nf4_dequant", DType::BF16).unwrap(), DType::F32);
    let bf = DType::BF16;
    let s = [Scalar::I32(0), Scalar::I32(64)];
    let err = |ins: &[_], s: &[Scalar]| check_launch(plain, ins, s).unwrap_err().to_string();
    // the codes must be bytes
    let e1 = err(&[t(&[b], DType::U32), t(&[a], f), t(&[e], bf)], &s);
    assert!(e1.contains("PACKED must be U8"), "{e1}");
    // the absmaxes f32 whatever the output
    let e1 = err(&[t(&[b], u8), t(&[a], bf), t(&[e], bf)], &s);
    assert!(e1.contains("ABSMAX must be F32"), "{e1}");
    // START and BS are the caller's
    let e1 = err(&[t(&[b], u8), t(&[a], f), t(&[e], bf)], &s[..1]);
    assert!(e1.contains("BS"), "{e1}");
    // the nested map has 256 entries
    let nested = find("nf4_dequant_nested", bf).unwrap();
    let ins = [
        t(&[b], u8),
        t(&[a], u8),
        t(&[2], f),
        t(&[255], f),
        t(&[e], bf),
    ];
    let s = [
        Scalar::F32(0.0),
        Scalar::I32(0),
        Scalar::I32(64),
        Scalar::I32(256),
    ];
    refuses(nested, &ins, &s, "M must be 256");
    Ok(())
}
