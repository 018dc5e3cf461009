//! Config values written as names: one table per enum gives both directions.

/// `FromStr` and `Display` for an enum of unit variants from one table of
/// `Variant => "name"`; a name outside the table is an error that says `$expected`.
/// Exported for the trainer's own config enums, not part of the API.
#[doc(hidden)]
#[macro_export]
macro_rules! named_enum {
    ($ty:ident, $expected:literal, { $($variant:ident => $name:literal),+ $(,)? }) => {
        impl std::str::FromStr for $ty {
            type Err = String;
            fn from_str(s: &str) -> std::result::Result<Self, String> {
                match s {
                    $($name => Ok($ty::$variant),)+
                    other => Err(format!(concat!($expected, ", not `{}`"), other)),
                }
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(match self {
                    $($ty::$variant => $name,)+
                })
            }
        }
    };
}

/// Serde through `Display` / `FromStr`: the type is written as its text and read back by
/// parsing it (a parse error is the deserializer's error), so a config field reads and writes
/// as the same text as its flag. The caller needs `serde` among its dependencies.
/// Exported for the workspace's config types, not part of the API.
#[doc(hidden)]
#[macro_export]
macro_rules! serde_as_text {
    ($t:ty) => {
        impl serde::Serialize for $t {
            fn serialize<S: serde::Serializer>(
                &self,
                s: S,
            ) -> std::result::Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }
        impl<'de> serde::Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(
                d: D,
            ) -> std::result::Result<Self, D::Error> {
                let text = <String as serde::Deserialize>::deserialize(d)?;
                text.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}
