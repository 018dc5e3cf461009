//! Checks that keep poisoned state out of checkpoints: weights and optimiser state must be
//! floating point and finite, when saved and when loaded.

use std::path::Path;

use candle_core::{CpuStorage, DType, Storage, Tensor};

use crate::{Error, Result};

/// The first non-finite element of `t`: its flat index and value, or `None` if every element is
/// finite. Integer tensors are finite by definition.
pub(crate) fn first_non_finite(t: &Tensor) -> Result<Option<(usize, f64)>> {
    if !t.dtype().is_float() {
        return Ok(None);
    }
    if let Some(found) = scan_in_place(t) {
        return Ok(found);
    }
    let values = t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    Ok(values
        .iter()
        .position(|v| !v.is_finite())
        .map(|i| (i, values[i])))
}

/// [`first_non_finite`] of a contiguous CPU tensor, read where it lies (no copy, so that a
/// reader of the largest tensor holds it once, not three times); `None` for other tensors.
fn scan_in_place(t: &Tensor) -> Option<Option<(usize, f64)>> {
    fn first<T: Copy>(
        v: &[T],
        finite: impl Fn(T) -> bool,
        wide: impl Fn(T) -> f64,
    ) -> Option<(usize, f64)> {
        v.iter().position(|x| !finite(*x)).map(|i| (i, wide(v[i])))
    }
    let (storage, layout) = t.storage_and_layout();
    let (Storage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets()) else {
        return None;
    };
    Some(match cpu {
        CpuStorage::F32(v) => first(&v[start..end], f32::is_finite, f64::from),
        CpuStorage::F64(v) => first(&v[start..end], f64::is_finite, |x| x),
        CpuStorage::BF16(v) => first(&v[start..end], |x| x.is_finite(), |x| x.to_f64()),
        CpuStorage::F16(v) => first(&v[start..end], |x| x.is_finite(), |x| x.to_f64()),
        _ => return None,
    })
}

/// Errors, naming `file` and the tensor, unless every tensor is floating point and finite.
///
/// `what` says what the tensors are ("weights", "optimiser state") for the message.
pub fn check_tensors<'a>(
    file: &Path,
    what: &str,
    tensors: impl IntoIterator<Item = (&'a str, &'a Tensor)>,
) -> Result<()> {
    for (name, t) in tensors {
        check_float(file, name, t)?;
        if let Some((i, v)) = first_non_finite(t)? {
            return Err(Error::checkpoint(
                file,
                format!(
                    "{what} tensor `{name}` holds {v} at flat index {i} (shape {:?})",
                    t.dims()
                ),
            ));
        }
    }
    Ok(())
}

/// Errors, naming `file` and the tensor, unless `t` has a floating-point dtype (a `u8` or `i64`
/// tensor where weights are expected is a corrupt or foreign file, not something to convert).
pub(crate) fn check_float(file: &Path, name: &str, t: &Tensor) -> Result<()> {
    if t.dtype().is_float() {
        return Ok(());
    }
    Err(Error::checkpoint(
        file,
        format!(
            "tensor `{name}` has dtype {:?}; weights and optimiser state must be f32, f16, bf16 \
             or f64",
            t.dtype()
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn finds_non_finite_values_anywhere() {
        let dev = Device::Cpu;
        let mut v = vec![0.5f32; 1000];
        assert_eq!(
            first_non_finite(&Tensor::new(v.as_slice(), &dev).unwrap()).unwrap(),
            None
        );
        // Poisoned one after another: the first non-finite index is 737, 737, then 1.
        for (i, bad, first) in [
            (737, f32::NAN, 737),
            (999, f32::INFINITY, 737),
            (1, f32::NEG_INFINITY, 1),
        ] {
            v[i] = bad;
            let t = Tensor::new(v.as_slice(), &dev)
                .unwrap()
                .reshape((10, 100))
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap();
            let (at, _) = first_non_finite(&t).unwrap().unwrap();
            assert_eq!(at, first);
            let err = check_tensors(Path::new("m.safetensors"), "weights", [("w", &t)])
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("m.safetensors") && err.contains("`w`"),
                "{err}"
            );
        }
        // Every float dtype read in place, a narrowed view (offset) and a transposed one (the
        // copying path): the index is the flat index in the tensor's own order.
        let mut w = vec![1.0f32; 12];
        w[7] = f32::NAN; // row 1, column 3 of a [3, 4]
        let t = Tensor::new(w.as_slice(), &dev)
            .unwrap()
            .reshape((3, 4))
            .unwrap();
        for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
            let t = t.to_dtype(dtype).unwrap();
            assert_eq!(
                first_non_finite(&t).unwrap().map(|f| f.0),
                Some(7),
                "{dtype:?}"
            );
            let rows = t.narrow(0, 1, 2).unwrap();
            assert_eq!(
                first_non_finite(&rows).unwrap().map(|f| f.0),
                Some(3),
                "{dtype:?}"
            );
            let tr = t.t().unwrap(); // [4, 3]: the NaN at row 3, column 1
            assert_eq!(
                first_non_finite(&tr).unwrap().map(|f| f.0),
                Some(10),
                "{dtype:?}"
            );
            let head = t.narrow(0, 0, 1).unwrap();
            assert_eq!(first_non_finite(&head).unwrap(), None, "{dtype:?}");
        }
        let ints = Tensor::new(&[1u8, 2, 3], &dev).unwrap();
        let err = check_tensors(Path::new("m.safetensors"), "weights", [("u", &ints)])
            .unwrap_err()
            .to_string();
        assert!(err.contains("U8") && err.contains("`u`"), "{err}");
    }
}
