//! f32 values written as the shortest decimal that reads back to them (`0.1`, not the
//! `0.10000000149011612` of widening to f64, which TOML writers do).

use serde::ser::SerializeStruct;
use serde::Serialize;

/// `x` as the f64 of its shortest round-trip decimal (Rust's `Display` of f32 is that
/// decimal): `0.1f32` gives `0.1f64`, which reads back as `0.1f32`.
pub(crate) fn f32_as_f64(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}

/// A config field on its way to a serializer (picks `PutF32` for `f32`, `PutAny`
/// otherwise, by method resolution: the f32 impl is on the value, the generic one on a
/// reference, which is tried later).
pub(crate) struct Field<'a, T>(pub &'a T);

/// Writes an `f32` field as [`f32_as_f64`].
pub(crate) trait PutF32 {
    /// Serializes the field as `key`.
    fn put<S: SerializeStruct>(&self, s: &mut S, key: &'static str) -> Result<(), S::Error>;
}

impl PutF32 for Field<'_, f32> {
    fn put<S: SerializeStruct>(&self, s: &mut S, key: &'static str) -> Result<(), S::Error> {
        s.serialize_field(key, &f32_as_f64(*self.0))
    }
}

impl PutF32 for Field<'_, Option<f32>> {
    fn put<S: SerializeStruct>(&self, s: &mut S, key: &'static str) -> Result<(), S::Error> {
        s.serialize_field(key, &self.0.map(f32_as_f64))
    }
}

/// Writes any other field as it serializes.
pub(crate) trait PutAny {
    /// Serializes the field as `key`.
    fn put<S: SerializeStruct>(&self, s: &mut S, key: &'static str) -> Result<(), S::Error>;
}

impl<T: Serialize> PutAny for &Field<'_, T> {
    fn put<S: SerializeStruct>(&self, s: &mut S, key: &'static str) -> Result<(), S::Error> {
        s.serialize_field(key, self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::f32_as_f64;

    #[test]
    fn f32_reads_as_its_shortest_decimal() {
        assert_eq!(f32_as_f64(0.1), 0.1f64);
        assert_eq!(f32_as_f64(0.1) as f32, 0.1f32);
    }
}
