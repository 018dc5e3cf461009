//! `check_launch` on the cross-entropy launch table.

use super::*;

/// `ignore_index` (none: -1) and `scale` of the cross-entropy kernels.
const CE_SCALARS: &[Scalar] = &[Scalar::I32(-1), Scalar::F32(0.25)];

/// The `.entry` arguments of a cross-entropy kernel on `tensors` tensors: the tensors in order,
/// R = 37, V = 50257, `ignore_index` -1, `scale` where the kernel takes one, the two scratch
/// pointers.
fn ce_args(tensors: usize, scale: Option<f32>) -> Vec<Arg> {
    let mut rest = vec![Arg::I32(37), Arg::I32(50257), Arg::I32(-1)];
    rest.extend(scale.map(Arg::F32));
    args_of(tensors, &rest)
}

#[test]
fn check_launch_cross_entropy() -> Result<()> {
    // a GPT-2 vocabulary: 13 blocks of BLOCK_V, the last partial; R odd
    let (r, v) = (37usize, 50257usize);
    assert_eq!(v.div_ceil(cross_entropy::BLOCK_V), 13);
    let row = |dt| t(&[r], dt);
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let logits = t(&[r, v], dt);
        let fwd = find("ce_fwd", dt).unwrap();
        let (targets, f32_row) = (row(DType::U32), row(DType::F32));
        let fwd_args = [&logits, &targets, &f32_row, &f32_row, &f32_row].map(Clone::clone);
        let l = check_launch(fwd, &fwd_args, &CE_SCALARS[..1])?;
        assert_eq!((l.grid, l.block), ([37, 1, 1], [256, 1, 1]));
        assert_eq!(l.shared_bytes, [32; 2]);
        assert_eq!(l.args, ce_args(5, None));
        // ce_fwd takes no scale
        refuses(fwd, &fwd_args, CE_SCALARS, "left over");

        let bwd = find("ce_bwd", dt).unwrap();
        let bwd_args = [&logits, &targets, &f32_row, &f32_row, &logits].map(Clone::clone);
        let l = check_launch(bwd, &bwd_args, CE_SCALARS)?;
        assert_eq!((l.grid, l.shared_bytes), ([37, 1, 1], [0; 2]));
        assert_eq!(l.args, ce_args(5, Some(0.25)));

        let fb = find("ce_fwd_bwd", dt).unwrap();
        let mut fb_args = fwd_args.to_vec();
        fb_args.push(logits.clone()); // DLOGITS: the logits themselves, in place
        let l = check_launch(fb, &fb_args, CE_SCALARS)?;
        assert_eq!(l.grid, [37, 1, 1]);
        assert_eq!(l.args, ce_args(6, Some(0.25)));
        // the gradient has the logits' dtype, the statistics are f32
        let mut a = fb_args.clone();
        a[5] = t(&[r, v], DType::F32);
        if dt != DType::F32 {
            refuses(fb, &a, CE_SCALARS, "DLOGITS must be");
        }
        let mut a = fb_args.clone();
        a[4] = row(dt);
        if dt != DType::F32 {
            refuses(fb, &a, CE_SCALARS, "LSE must be F32");
        }
    }
    let dt = DType::BF16;
    let fb = find("ce_fwd_bwd", dt).unwrap();
    let ok = [
        t(&[r, v], dt),
        row(DType::U32),
        row(DType::F32),
        row(DType::F32),
        row(DType::F32),
        t(&[r, v], dt),
    ];
    check_launch(fb, &ok, CE_SCALARS)?;
    // targets are u32, as the CPU ops take them
    let mut a = ok.clone();
    a[1] = row(DType::I32);
    refuses(fb, &a, CE_SCALARS, "TARGETS must be U32");
    // a chunk's targets sliced out of a longer buffer at row 3: 12 bytes, not 16-byte aligned
    let mut a = ok.clone();
    a[1].offset_bytes = 12;
    refuses(fb, &a, CE_SCALARS, "TARGETS starts at byte offset 12");
    // at row 4 of a u32 buffer it is aligned
    a[1].offset_bytes = 16;
    check_launch(fb, &a, CE_SCALARS)?;
    // rows and classes must agree
    let mut a = ok.clone();
    a[5] = t(&[r, v - 1], dt);
    refuses(fb, &a, CE_SCALARS, "DLOGITS has V = 50256");
    let mut a = ok.clone();
    a[2] = row(DType::F32);
    a[2].dims = vec![r + 1];
    refuses(fb, &a, CE_SCALARS, "WEIGHT has R = 38");
    // a strided view of the logits (a column slice of a wider matrix)
    let mut a = ok.clone();
    a[0].strides = vec![v + 7, 1];
    refuses(fb, &a, CE_SCALARS, "LOGITS must be contiguous");
    // scalars in order: ignore_index (i32), then scale (f32)
    refuses(
        fb,
        &ok,
        &[Scalar::F32(0.25), Scalar::I32(-1)],
        "ignore_index needs a Scalar::I32",
    );
    refuses(fb, &ok, &CE_SCALARS[..1], "scale needs a Scalar::F32");
    // no counted row in a chunk: no launch
    let empty = [
        t(&[0, v], dt),
        t(&[0], DType::U32),
        t(&[0], DType::F32),
        t(&[0], DType::F32),
        t(&[0], DType::F32),
        t(&[0, v], dt),
    ];
    refuses(fb, &empty, CE_SCALARS, "empty grid");
    // any vocabulary (no tile limit), and R x V past i32 (the kernels' offsets are 64-bit)
    let (r, v) = (65536usize, 50257usize);
    let big = [
        t(&[r, v], dt),
        t(&[r], DType::U32),
        t(&[r], DType::F32),
        t(&[r], DType::F32),
        t(&[r], DType::F32),
        t(&[r, v], dt),
    ];
    assert!(r * v > i32::MAX as usize);
    assert_eq!(check_launch(fb, &big, CE_SCALARS)?.grid, [65536, 1, 1]);
    Ok(())
}
