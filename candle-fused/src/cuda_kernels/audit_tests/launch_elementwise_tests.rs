//! `check_launch` cases of the elementwise families (SwiGLU, GeGLU, GELU, dropout, AdamW): grid,
//! block and the full argument list of valid launches, and the errors of invalid ones.

use super::{refuses, t};
use crate::cuda_kernels::{check_launch, find, Arg, Scalar};
use anyhow::Result;
use candle_core::DType;

#[test]
fn gated_launches() -> Result<()> {
    // SwiGLU's and GeGLU's entries: one contract
    for (f, b) in [("swiglu_fwd", "swiglu_bwd"), ("geglu_fwd", "geglu_bwd")] {
        gated_launch(f, b)?;
    }
    Ok(())
}

fn gated_launch(fwd_entry: &str, bwd_entry: &str) -> Result<()> {
    use Arg::{Null, Tensor as T, I32};
    let e = 37 * 129;
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let fwd = find(fwd_entry, dt).unwrap();
        let l = check_launch(fwd, &[t(&[e], dt), t(&[e], dt), t(&[e], dt)], &[])?;
        assert_eq!((l.grid, l.block), ([5, 1, 1], [128, 1, 1]));
        assert_eq!(l.args, [T(0), T(1), T(2), I32(e as i32), Null, Null]);
        let bwd = find(bwd_entry, dt).unwrap();
        let l = check_launch(
            bwd,
            &[
                t(&[e], dt),
                t(&[e], dt),
                t(&[e], dt),
                t(&[e], dt),
                t(&[e], dt),
            ],
            &[],
        )?;
        assert_eq!(l.grid, [5, 1, 1]);
        assert_eq!(
            l.args,
            [T(0), T(1), T(2), T(3), T(4), I32(e as i32), Null, Null]
        );
    }
    let fwd = find(fwd_entry, DType::BF16).unwrap();
    // gate and up of different lengths
    refuses(
        fwd,
        &[
            t(&[e], DType::BF16),
            t(&[e + 1], DType::BF16),
            t(&[e], DType::BF16),
        ],
        &[],
        "UP has E = 4774",
    );
    // the packed [gate | up] halves are not contiguous: copy them first
    let mut half = t(&[37, 129], DType::BF16);
    half.strides = vec![258, 1];
    let fwd2 = [half.clone(), half, t(&[37, 129], DType::BF16)];
    assert!(check_launch(fwd, &fwd2, &[]).is_err());
    // the second half of a packed buffer of odd width is misaligned (129 bf16 = 258 bytes)
    let mut up = t(&[e], DType::BF16);
    up.offset_bytes = 258;
    refuses(
        fwd,
        &[t(&[e], DType::BF16), up, t(&[e], DType::BF16)],
        &[],
        "16-byte aligned",
    );
    // an empty tensor: skip the launch
    let z = t(&[0], DType::BF16);
    assert!(check_launch(fwd, &[z.clone(), z.clone(), z], &[]).is_err());
    Ok(())
}

#[test]
fn gelu_launches() -> Result<()> {
    use crate::cuda_kernels::gelu::ROWS_PER_PROGRAM;
    use Arg::{Null, Tensor as T, I32};
    let (n, c) = (37usize, 300usize);
    let e = n * c;
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let l = check_launch(
            find("gelu_fwd", dt).unwrap(),
            &[t(&[e], dt), t(&[e], dt)],
            &[],
        )?;
        assert_eq!((l.grid, l.block), ([11, 1, 1], [128, 1, 1]));
        assert_eq!(l.args, [T(0), T(1), I32(e as i32), Null, Null]);
        let l = check_launch(
            find("gelu_bwd", dt).unwrap(),
            &[t(&[e], dt), t(&[e], dt), t(&[e], dt)],
            &[],
        )?;
        assert_eq!(l.args, [T(0), T(1), T(2), I32(e as i32), Null, Null]);

        let fwd = find("bias_gelu_fwd", dt).unwrap();
        let l = check_launch(fwd, &[t(&[n, c], dt), t(&[c], dt), t(&[n, c], dt)], &[])?;
        assert_eq!((l.grid, l.block), ([5, 2, 1], [128, 1, 1]));
        assert_eq!(l.args, [T(0), T(1), T(2), I32(37), I32(300), Null, Null]);

        let p = n.div_ceil(ROWS_PER_PROGRAM);
        let dx = find("bias_gelu_bwd_dx", dt).unwrap();
        let args = [
            t(&[n, c], dt),
            t(&[c], dt),
            t(&[n, c], dt),
            t(&[n, c], dt),
            t(&[p, c], DType::F32),
        ];
        let l = check_launch(dx, &args, &[])?;
        assert_eq!((l.grid, l.block), ([3, 2, 1], [64, 1, 1]));
        assert_eq!(
            l.args,
            [T(0), T(1), T(2), T(3), T(4), I32(37), I32(300), Null, Null]
        );
        let mut wrong = args.clone();
        wrong[4] = t(&[p, c], dt);
        if dt != DType::F32 {
            refuses(dx, &wrong, &[], "DB_PARTIAL must be F32");
        }
        wrong[4] = t(&[p + 1, c], DType::F32);
        refuses(dx, &wrong, &[], "cdiv(N, 16)");

        let db = find("bias_gelu_bwd_db", dt).unwrap();
        let l = check_launch(db, &[t(&[p, c], DType::F32), t(&[c], dt)], &[])?;
        assert_eq!((l.grid, l.block), ([2, 1, 1], [64, 1, 1]));
        assert_eq!(l.args, [T(0), T(1), I32(3), I32(300), Null, Null]);
    }
    // a bias of another length than the rows
    let dt = DType::BF16;
    let fwd = find("bias_gelu_fwd", dt).unwrap();
    refuses(
        fwd,
        &[t(&[n, c], dt), t(&[c + 1], dt), t(&[n, c], dt)],
        &[],
        "B has C = 301",
    );
    // no scalars are taken
    refuses(
        fwd,
        &[t(&[n, c], dt), t(&[c], dt), t(&[n, c], dt)],
        &[Scalar::F32(1.0)],
        "left over",
    );
    Ok(())
}

#[test]
fn dropout_launches() -> Result<()> {
    use crate::cuda_kernels::dropout::{scalars, words};
    use crate::RngKey;
    use Arg::{Null, Tensor as T, F32, I32};
    let e = 4773;
    let key = RngKey::new(0xDEAD_BEEF_1234_5678, 0x1_0000_0003).with_offset((5 << 32) + 7);
    assert_eq!(
        words(0xDEAD_BEEF_1234_5678),
        [0x1234_5678, 0xDEAD_BEEFu32 as i32]
    );
    for (dt, scale) in [
        (DType::F32, 1.0 / 0.7f32),
        (DType::BF16, 1.4296875),
        (DType::F16, 1.4287109),
    ] {
        let s = scalars(0.3, key, dt)?;
        assert_eq!(s[7], Scalar::F32(scale), "{dt:?}");
        let spec = find("dropout", dt).unwrap();
        let l = check_launch(spec, &[t(&[e], dt), t(&[e], dt)], &s)?;
        assert_eq!((l.grid, l.block), ([5, 1, 1], [128, 1, 1]));
        assert_eq!(
            l.args,
            [
                T(0),
                T(1),
                I32(e as i32),
                I32(0x1234_5678),
                I32(0xDEAD_BEEFu32 as i32),
                I32(3),
                I32(1),
                I32(7),
                I32(5),
                F32(0.3),
                F32(scale),
                Null,
                Null
            ]
        );
    }
    // p outside [0, 1), a dtype without a variant
    assert!(scalars(1.0, key, DType::F32).is_err());
    assert!(scalars(-0.1, key, DType::F32).is_err());
    assert!(scalars(0.1, key, DType::F64).is_err());
    // the scalars in the wrong order (p first)
    let spec = find("dropout", DType::F32).unwrap();
    let mut s = scalars(0.3, key, DType::F32)?.to_vec();
    s.rotate_right(2);
    refuses(
        spec,
        &[t(&[e], DType::F32), t(&[e], DType::F32)],
        &s,
        "seed_lo needs a Scalar::I32",
    );
    // x and y of different lengths
    refuses(
        spec,
        &[t(&[e], DType::F32), t(&[e - 1], DType::F32)],
        &scalars(0.3, key, DType::F32)?,
        "Y has E = 4772",
    );
    Ok(())
}

#[test]
fn adamw_launches() -> Result<()> {
    use crate::adamw::AdamWStep;
    use crate::cuda_kernels::adamw::{scalars, SUMSQ_BLOCK};
    use Arg::{Null, Tensor as T, F32, I32};
    let e = 3001usize;
    let step = AdamWStep {
        step: 7,
        grad_scale: 0.5,
        ..Default::default()
    };
    let s = scalars(&step)?;
    let f = DType::F32;
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let up = find("adamw_update", dt).unwrap();
        let args = [t(&[e], f), t(&[e], dt), t(&[e], f), t(&[e], f)];
        let l = check_launch(up, &args, &s)?;
        assert_eq!((l.grid, l.block), ([3, 1, 1], [128, 1, 1]));
        assert_eq!(l.args[..5], [T(0), T(1), T(2), T(3), I32(3001)]);
        assert_eq!(l.args[5], F32(0.5));
        assert_eq!(
            l.args[6..14],
            s.map(|v| match v {
                Scalar::F32(x) => F32(x),
                Scalar::I32(x) => I32(x),
            })[1..]
        );
        assert_eq!(l.args[14..], [Null, Null]);
        // the moments and the parameter are f32 whatever the gradient's dtype
        if dt != f {
            let mut wrong = args.clone();
            wrong[2] = t(&[e], dt);
            refuses(up, &wrong, &s, "EXP_AVG must be F32");
        }
        // eight scalars instead of nine
        refuses(up, &args, &s[..8], "eps needs a Scalar::F32");

        let p = e.div_ceil(SUMSQ_BLOCK);
        let part = find("sumsq_partial", dt).unwrap();
        let l = check_launch(part, &[t(&[e], dt), t(&[p], DType::F64)], &[])?;
        assert_eq!(l.grid, [3, 1, 1]);
        assert_eq!(l.args, [T(0), T(1), I32(3001), Null, Null]);
        refuses(part, &[t(&[e], dt), t(&[p], f)], &[], "PARTIAL must be F64");
        refuses(
            part,
            &[t(&[e], dt), t(&[p + 1], DType::F64)],
            &[],
            "cdiv(E, 1024)",
        );
    }
    let total = find("sumsq_total", f).unwrap();
    let l = check_launch(total, &[t(&[3], DType::F64), t(&[1], f)], &[])?;
    assert_eq!((l.grid, l.block), ([1, 1, 1], [128, 1, 1]));
    assert_eq!(l.args, [T(0), T(1), I32(3), Null, Null]);
    assert!(check_launch(total, &[t(&[3], DType::F64), t(&[2], f)], &[]).is_err());
    assert!(find("sumsq_total", DType::BF16).is_none());
    // a step the CPU rejects
    assert!(scalars(&AdamWStep {
        beta1: 1.0,
        ..Default::default()
    })
    .is_err());
    Ok(())
}

#[test]
fn adamw_multi_launches() -> Result<()> {
    use crate::adamw::AdamWStep;
    use crate::cuda_kernels::adamw::scalars;
    use Arg::{Null, Tensor as T, F32, I32};
    let s = scalars(&AdamWStep {
        step: 3,
        ..Default::default()
    })?;
    let (i64_, f) = (DType::I64, DType::F32);
    // three tensors of 3001, 5 and 1024 elements: 3 + 1 + 1 blocks of 1024
    let nb = 5;
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let up = find("adamw_update_multi", dt).unwrap();
        let mut scalars_nb = vec![Scalar::I32(nb)];
        scalars_nb.extend_from_slice(&s);
        let l = check_launch(up, &[t(&[3, 8], i64_), t(&[3001], dt)], &scalars_nb)?;
        // the grid is the caller's block count, not a tensor's size
        assert_eq!((l.grid, l.block), ([5, 1, 1], [128, 1, 1]));
        assert_eq!(l.args[..4], [T(0), T(1), I32(3), I32(nb)]);
        assert_eq!(l.args[4..13].len(), 9);
        assert!(matches!(l.args[4], F32(_)));
        assert_eq!(l.args[13..], [Null, Null]);
        // a table of 4 columns, an i32 table, a negative block count: refused
        refuses(
            up,
            &[t(&[3, 4], i64_), t(&[3001], dt)],
            &scalars_nb,
            "W must be 8",
        );
        assert!(check_launch(up, &[t(&[3, 8], DType::I32), t(&[3001], dt)], &scalars_nb).is_err());
        scalars_nb[0] = Scalar::I32(-1);
        assert!(check_launch(up, &[t(&[3, 8], i64_), t(&[3001], dt)], &scalars_nb).is_err());

        let part = find("sumsq_partial_multi", dt).unwrap();
        let args = [
            t(&[3, 4], i64_),
            t(&[nb as usize], DType::F64),
            t(&[3001], dt),
        ];
        let l = check_launch(part, &args, &[Scalar::I32(nb)])?;
        assert_eq!(l.grid, [5, 1, 1]);
        assert_eq!(l.args, [T(0), T(1), T(2), I32(3), I32(nb), Null, Null]);
    }
    let total = find("sumsq_total_multi", f).unwrap();
    let args = [t(&[4], i64_), t(&[nb as usize], DType::F64), t(&[1], f)];
    let l = check_launch(total, &args, &[Scalar::I32(3)])?;
    assert_eq!(l.grid, [1, 1, 1]);
    assert_eq!(l.args, [T(0), T(1), T(2), I32(3), Null, Null]);
    assert!(find("sumsq_total_multi", DType::BF16).is_none());
    Ok(())
}
