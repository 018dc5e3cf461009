//! [`Policy`] as text: `none`, `all`, `every:K`, `sqrt`, `budget:BYTES` (`budget:256MiB`), the
//! form command lines and config files use.

use std::fmt;
use std::str::FromStr;

use crate::policy::Policy;

/// Parses a byte count: `1048576`, `512KiB`, `64MiB`, `2GiB` (also `K`, `M`, `G`, `KB`, ...,
/// all powers of 1024).
///
/// ```
/// assert_eq!(candle_remat::parse_bytes("64MiB"), Ok(64 << 20));
/// assert!(candle_remat::parse_bytes("12 parsecs").is_err());
/// ```
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a byte count"))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        other => return Err(format!("unknown byte unit `{other}` in `{s}`")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("byte count `{s}` is too large"))
}

impl FromStr for Policy {
    type Err = String;

    /// ```
    /// use candle_remat::Policy;
    /// assert_eq!("every:2".parse(), Ok(Policy::EveryK(2)));
    /// assert_eq!("budget:1KiB".parse(), Ok(Policy::Budget(1024)));
    /// assert!("every:0".parse::<Policy>().is_err());
    /// ```
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("remat must be none, all, every:K, sqrt or budget:BYTES, not `{s}`");
        Ok(match s {
            "none" => Policy::None,
            "all" => Policy::EveryK(1),
            "sqrt" => Policy::SqrtN,
            _ => match s.split_once(':') {
                Some(("every", k)) => match k.parse::<usize>() {
                    Ok(k) if k >= 1 => Policy::EveryK(k),
                    _ => return Err(bad()),
                },
                Some(("budget", b)) => Policy::Budget(parse_bytes(b)?),
                _ => return Err(bad()),
            },
        })
    }
}

impl fmt::Display for Policy {
    /// The text [`Policy::from_str`] reads back: `every:1` is written `all`, budgets in bytes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Policy::None => f.write_str("none"),
            Policy::EveryK(1) => f.write_str("all"),
            Policy::EveryK(k) => write!(f, "every:{k}"),
            Policy::SqrtN => f.write_str("sqrt"),
            Policy::Budget(b) => write!(f, "budget:{b}"),
        }
    }
}

#[cfg(feature = "serde")]
impl serde::Serialize for Policy {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for Policy {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = <String as serde::Deserialize>::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        for p in [
            Policy::None,
            Policy::EveryK(1),
            Policy::EveryK(3),
            Policy::SqrtN,
            Policy::Budget(1 << 20),
        ] {
            assert_eq!(p.to_string().parse::<Policy>(), Ok(p));
        }
        assert!("some".parse::<Policy>().is_err());
        assert!("budget:12 parsecs".parse::<Policy>().is_err());
    }
}
