//! `check_launch` cases of the embedding backward: grid (one program per table row and column
//! block), block and the full argument list, and the errors of invalid launches.

use super::{args_of, refuses, t};
use crate::cuda_kernels::{check_launch, find, Arg, TensorArg};
use anyhow::Result;
use candle_core::DType;

#[test]
fn embedding_launches() -> Result<()> {
    use Arg::I32;
    use DType::U32;
    let (n, v, c) = (123usize, 50257usize, 768usize);
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let bwd = find("embedding_bwd", dt).unwrap();
        let ins = [t(&[n, c], dt), t(&[n], U32), t(&[v], U32), t(&[v, c], dt)];
        let l = check_launch(bwd, &ins, &[])?;
        assert_eq!((l.grid, l.block), ([50257, 3, 1], [64, 1, 1]));
        let dims = [n, v, c].map(|d| I32(d as i32));
        assert_eq!(l.args, args_of(4, &dims));
    }
    let bwd = find("embedding_bwd", DType::BF16).unwrap();
    let b = DType::BF16;
    let ok = [t(&[n, c], b), t(&[n], U32), t(&[v], U32), t(&[v, c], b)];
    let with = |i: usize, arg: TensorArg| {
        let mut args = ok.clone();
        args[i] = arg;
        args
    };
    // the order must hold one position per id
    refuses(bwd, &with(1, t(&[n + 1], U32)), &[], "ORDER has N = 124");
    // segment starts as i32 (or of another table) are refused
    refuses(bwd, &with(2, t(&[v], DType::I32)), &[], "START");
    // dW's columns differ from dy's
    assert!(check_launch(bwd, &with(3, t(&[v, c + 1], b)), &[]).is_err());
    Ok(())
}
