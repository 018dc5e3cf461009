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
