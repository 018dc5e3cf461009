//! `check_launch` cases of the embedding backward: grid (one program per table row and column
//! block), block and the full argument list, and the errors of invalid launches.

use super::t;
use crate::cuda_kernels::{check_launch, find, Arg};
use anyhow::Result;
use candle_core::DType;

#[test]
fn embedding_launches() -> Result<()> {
    use Arg::{Null, Tensor as T, I32};
    let (n, v, c) = (123usize, 50257usize, 768usize);
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let bwd = find("embedding_bwd", dt).unwrap();
        let ins = [
            t(&[n, c], dt),
            t(&[n], DType::U32),
            t(&[v], DType::U32),
            t(&[v, c], dt),
        ];
        let l = check_launch(bwd, &ins, &[])?;
        assert_eq!((l.grid, l.block), ([50257, 3, 1], [64, 1, 1]));
        assert_eq!(
            l.args,
            [
                T(0),
                T(1),
                T(2),
                T(3),
                I32(n as i32),
                I32(v as i32),
                I32(c as i32),
                Null,
                Null
            ]
        );
    }
    let bwd = find("embedding_bwd", DType::BF16).unwrap();
    let b = DType::BF16;
    // the order must hold one position per id
    let err = check_launch(
        bwd,
        &[
            t(&[n, c], b),
            t(&[n + 1], DType::U32),
            t(&[v], DType::U32),
            t(&[v, c], b),
        ],
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("ORDER has N = 124"), "{err}");
    // segment starts as i32 (or of another table) are refused
    let err = check_launch(
        bwd,
        &[
            t(&[n, c], b),
            t(&[n], DType::U32),
            t(&[v], DType::I32),
            t(&[v, c], b),
        ],
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("START"), "{err}");
    // dW's columns differ from dy's
    assert!(check_launch(
        bwd,
        &[
            t(&[n, c], b),
            t(&[n], DType::U32),
            t(&[v], DType::U32),
            t(&[v, c + 1], b)
        ],
        &[],
    )
    .is_err());
    Ok(())
}
