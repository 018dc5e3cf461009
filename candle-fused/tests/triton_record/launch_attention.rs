//! `check_launch` on the flash attention launch table.

use super::*;

/// The attention scalars: scale, causal, window, p_drop, keep, seed lo/hi, site lo/hi,
/// offset lo/hi.
fn attn_cfg() -> Vec<Scalar> {
    use Scalar::{F32, I32};
    vec![
        F32(0.125),
        I32(1),
        I32(20),
        F32(0.2),
        F32(1.25),
        I32(0x9abc_def0_u32 as i32),
        I32(0x1234_5678),
        I32(3),
        I32(5),
        I32(1_000_003),
        I32(0),
    ]
}

#[test]
fn attention_launches() -> Result<()> {
    use candle_fused::cuda_kernels::attention::{BLOCK_16, BLOCK_F32};
    use Arg::{Null, Tensor as T, F32, I32};
    let (b, h, kv, n, d) = (2usize, 6usize, 2usize, 70usize, 64usize);
    let cfg = attn_cfg();
    let cfg_args = [
        F32(0.125),
        I32(1),
        I32(20),
        F32(0.2),
        F32(1.25),
        I32(0x9abc_def0_u32 as i32),
        I32(0x1234_5678),
        I32(3),
        I32(5),
        I32(1_000_003),
        I32(0),
        Null,
        Null,
    ];
    let dims = [I32(6), I32(2), I32(70), I32(64)];
    for (dt, block) in [
        (DType::F32, BLOCK_F32),
        (DType::BF16, BLOCK_16),
        (DType::F16, BLOCK_16),
    ] {
        let (qo, kvt) = (t(&[b, h, n, d], dt), t(&[b, kv, n, d], dt));
        let (doc, stat) = (t(&[b, n], DType::I32), t(&[b, h, n], DType::F32));
        let programs = n.div_ceil(block) as u32;

        let fwd = find("attn_fwd", dt).unwrap();
        let args = [
            qo.clone(),
            kvt.clone(),
            kvt.clone(),
            doc.clone(),
            qo.clone(),
            stat.clone(),
        ];
        let l = check_launch(fwd, &args, &cfg)?;
        assert_eq!((l.grid, l.block), ([programs, 12, 1], [128, 1, 1]));
        let want: Vec<Arg> = (0..6)
            .map(T)
            .chain(dims)
            .chain(cfg_args.iter().copied())
            .collect();
        assert_eq!(l.args, want);
        assert_eq!(l.shared_bytes, fwd.shared_bytes);

        let delta = find("attn_bwd_delta", dt).unwrap();
        let l = check_launch(delta, &[qo.clone(), qo.clone(), stat.clone()], &[])?;
        assert_eq!((l.grid, l.block), ([2, 12, 1], [128, 1, 1]));
        assert_eq!(l.args, [T(0), T(1), T(2), I32(70), I32(64), Null, Null]);

        let dkdv = find("attn_bwd_dkdv", dt).unwrap();
        let bwd_in = [
            qo.clone(),
            kvt.clone(),
            kvt.clone(),
            doc.clone(),
            qo.clone(),
            stat.clone(),
            stat.clone(),
        ];
        let mut args = bwd_in.to_vec();
        args.extend([kvt.clone(), kvt.clone()]);
        let l = check_launch(dkdv, &args, &cfg)?;
        assert_eq!((l.grid, l.block), ([programs, 4, 1], [256, 1, 1]));
        assert_eq!(l.args.len(), 9 + 4 + 11 + 2);
        assert_eq!(&l.args[9..13], &dims);

        let dq = find("attn_bwd_dq", dt).unwrap();
        let mut args = bwd_in.to_vec();
        args.push(qo.clone());
        let l = check_launch(dq, &args, &cfg)?;
        assert_eq!((l.grid, l.block), ([programs, 12, 1], [256, 1, 1]));
        assert_eq!(l.args[8..12], dims);
    }
    // what the kernels do not cover, or a wrong layout
    let dt = DType::BF16;
    let fwd = find("attn_fwd", dt).unwrap();
    let args = |h: usize, kv: usize, tk: usize, d: usize, doc: DType| {
        [
            t(&[b, h, n, d], dt),
            t(&[b, kv, tk, d], dt),
            t(&[b, kv, tk, d], dt),
            t(&[b, n], doc),
            t(&[b, h, n, d], dt),
            t(&[b, h, n], DType::F32),
        ]
    };
    check_launch(fwd, &args(6, 2, n, 128, DType::I32), &cfg)?;
    let e = check_launch(fwd, &args(6, 2, n, 129, DType::I32), &cfg)
        .unwrap_err()
        .to_string();
    assert!(e.contains("D = 129 exceeds 128"), "{e}");
    let e = check_launch(fwd, &args(6, 4, n, d, DType::I32), &cfg)
        .unwrap_err()
        .to_string();
    assert!(e.contains("KV = 4 must divide H = 6"), "{e}");
    let e = check_launch(fwd, &args(6, 2, n + 1, d, DType::I32), &cfg)
        .unwrap_err()
        .to_string();
    assert!(e.contains("K has T = 71, an earlier argument 70"), "{e}");
    let e = check_launch(fwd, &args(6, 2, n, d, DType::U32), &cfg)
        .unwrap_err()
        .to_string();
    assert!(e.contains("DOC must be I32"), "{e}");
    let e = check_launch(fwd, &args(6, 2, n, d, DType::I32), &cfg[..10])
        .unwrap_err()
        .to_string();
    assert!(e.contains("off_hi needs a Scalar::I32"), "{e}");
    // B*H programs along y: at most CUDA's 65535 (B = 2, H = 32770: 65540)
    check_launch(fwd, &args(32766, 2, n, d, DType::I32), &cfg)?;
    let e = check_launch(fwd, &args(32770, 2, n, d, DType::I32), &cfg)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("grid B*H = 65540 exceeds CUDA's 65535 along y"),
        "{e}"
    );
    Ok(())
}
