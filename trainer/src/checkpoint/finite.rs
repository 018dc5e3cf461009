//! Checks that keep poisoned state out of checkpoints: weights and optimiser state must be
//! floating point and finite, when saved and when loaded.

use std::path::Path;

use candle_core::{DType, Tensor};

use crate::{Error, Result};

/// The first non-finite element of `t`: its flat index and value, or `None` if every element is
/// finite. Integer tensors are finite by definition.
pub fn first_non_finite(t: &Tensor) -> Result<Option<(usize, f64)>> {
    if !t.dtype().is_float() {
        return Ok(None);
    }
    let values = t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    Ok(values
        .iter()
        .position(|v| !v.is_finite())
        .map(|i| (i, values[i])))
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
pub fn check_float(file: &Path, name: &str, t: &Tensor) -> Result<()> {
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
        let ints = Tensor::new(&[1u8, 2, 3], &dev).unwrap();
        let err = check_tensors(Path::new("m.safetensors"), "weights", [("u", &ints)])
            .unwrap_err()
            .to_string();
        assert!(err.contains("U8") && err.contains("`u`"), "{err}");
    }
}
