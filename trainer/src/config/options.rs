//! What the parts a run names (its optimiser, its objective) read of the run's config: its
//! keys by name ([`RunKeys`], [`OptionReader`]), and their own options, the tables
//! `optimizer_options` and `objective_options` ([`Options`]). Each part reads and checks
//! what it takes, so that adding one, with options, touches no config code.
//!
//! An options table is written in a TOML file as a table (`[optimizer_options]`, then
//! `momentum = 0.9`), on the command line as `--optimizer-options momentum=0.9,nesterov=true`.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::TrainConfig;

use crate::{Error, Result};

/// Options by name, for the part a run names (its optimiser, its objective): a TOML table
/// (`[optimizer_options]`, then `momentum = 0.9`) or `--optimizer-options momentum=0.9,nesterov=true`;
/// empty by default.
///
/// ```
/// use trainer::config::Options;
/// let o: Options = "momentum=0.9,nesterov=true".parse()?;
/// assert_eq!(o.to_string(), "momentum=0.9,nesterov=true");
/// assert!("momentum".parse::<Options>().is_err());
/// # Ok::<(), String>(())
/// ```
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Options(pub BTreeMap<String, toml::Value>);

impl Options {
    /// Whether no option is given.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl FromStr for Options {
    type Err = String;

    /// `key=value` pairs separated by commas (values as in TOML: `0.9`, `true`, `"text"`; a
    /// bare word is text); empty: no option.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let mut out = BTreeMap::new();
        for pair in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((key, value)) = pair.split_once('=') else {
                return Err(format!("`{pair}` is not key=value"));
            };
            let (key, value) = (key.trim(), value.trim());
            let parsed = toml::from_str::<toml::Table>(&format!("v = {value}"))
                .ok()
                .and_then(|mut t| t.remove("v"))
                .unwrap_or_else(|| toml::Value::String(value.to_string()));
            out.insert(key.to_string(), parsed);
        }
        Ok(Options(out))
    }
}

impl fmt::Display for Options {
    /// As [`FromStr`] reads it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let pairs: Vec<String> = self.0.iter().map(|(k, v)| format!("{k}={v}")).collect();
        f.write_str(&pairs.join(","))
    }
}

/// A run's config as its keys and values (as its TOML file writes them): what
/// `optim::build` and `objective::build` hand the part the run names.
#[derive(Clone, Debug, PartialEq)]
pub struct RunKeys(toml::Table);

impl From<&TrainConfig> for RunKeys {
    fn from(config: &TrainConfig) -> Self {
        RunKeys(toml::Table::try_from(config).unwrap_or_default())
    }
}

impl RunKeys {
    /// The run's key `key` (`optimizer`, `lr`, `kernels`), as its type reads it.
    pub fn get<T: DeserializeOwned>(&self, key: &str) -> Result<T> {
        let value = self.0.get(key).cloned();
        let value = value.ok_or_else(|| Error::Config(format!("the run has no key `{key}`")))?;
        T::deserialize(value).map_err(|e| Error::Config(format!("{key}: {e}")))
    }

    /// A reader for the part called `part` whose options are the table `table`
    /// (`optimizer_options`, `objective_options`).
    pub fn part<'a>(&'a self, table: &'static str, part: &'a str) -> OptionReader<'a> {
        OptionReader {
            run: self,
            table,
            part,
            asked: Vec::new(),
            keys: Vec::new(),
        }
    }
}

/// What one part reads of a run's config ([`RunKeys::part`]): run keys by name
/// ([`key`](Self::key)), and its options, each asked once with its default
/// ([`f64`](Self::f64), [`bool`](Self::bool)); [`finish`](Self::finish) refuses the options
/// no one asked for, naming them and what the part reads.
///
/// ```
/// use trainer::config::{RunKeys, TrainConfig};
/// let mut config = TrainConfig::default();
/// config.optimizer_options = "momentum=0.9".parse()?;
/// let keys = RunKeys::from(&config);
/// let mut r = keys.part("optimizer_options", "sgd");
/// assert_eq!(r.key::<f64>("lr")?, config.lr);
/// assert_eq!(r.f64("momentum", 0.0)?, 0.9);
/// assert!(!r.bool("nesterov", false)?);
/// r.finish()?;
/// config.optimizer_options = "momentun=0.9".parse()?;
/// let keys = RunKeys::from(&config);
/// let mut r = keys.part("optimizer_options", "sgd");
/// r.f64("momentum", 0.0)?;
/// let e = r.finish().unwrap_err().to_string();
/// assert!(e.contains("optimizer_options.momentun") && e.contains("momentum"), "{e}");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct OptionReader<'a> {
    run: &'a RunKeys,
    table: &'static str,
    part: &'a str,
    asked: Vec<&'static str>,
    keys: Vec<&'static str>,
}

impl OptionReader<'_> {
    /// The run's key `key` (`lr`, `beta1`, `kernels`), as its type reads it.
    pub fn key<T: DeserializeOwned>(&mut self, key: &'static str) -> Result<T> {
        self.keys.push(key);
        self.run.get(key)
    }

    /// The option `key` as a finite number (an integer reads as one), or `default`.
    pub fn f64(&mut self, key: &'static str, default: f64) -> Result<f64> {
        self.asked.push(key);
        let v = match self.option(key) {
            None => return Ok(default),
            Some(toml::Value::Float(x)) => *x,
            Some(toml::Value::Integer(i)) => *i as f64,
            Some(other) => return Err(self.bad(key, "a number", other)),
        };
        if !v.is_finite() {
            return Err(Error::Config(format!(
                "{}.{key} must be a finite number, got {v}",
                self.table
            )));
        }
        Ok(v)
    }

    /// The option `key` as `true` or `false`, or `default`.
    pub fn bool(&mut self, key: &'static str, default: bool) -> Result<bool> {
        self.asked.push(key);
        match self.option(key) {
            None => Ok(default),
            Some(toml::Value::Boolean(b)) => Ok(*b),
            Some(other) => Err(self.bad(key, "true or false", other)),
        }
    }

    /// Errors unless every option given was asked for.
    pub fn finish(self) -> Result<()> {
        let given = self.run.0.get(self.table).and_then(toml::Value::as_table);
        let Some(key) = given
            .into_iter()
            .flat_map(|t| t.keys())
            .find(|k| !self.asked.contains(&k.as_str()))
        else {
            return Ok(());
        };
        let list = |v: &[&str]| match v.is_empty() {
            true => "none".to_string(),
            false => v.join(", "),
        };
        Err(Error::Config(format!(
            "{}.{key} is not an option of `{}` (its options: {}; the run keys it reads: {})",
            self.table,
            self.part,
            list(&self.asked),
            list(&self.keys)
        )))
    }

    fn option(&self, key: &str) -> Option<&toml::Value> {
        let table = self.run.0.get(self.table)?.as_table()?;
        table.get(key)
    }

    fn bad(&self, key: &str, want: &str, got: &toml::Value) -> Error {
        Error::Config(format!("{}.{key} must be {want}, got {got}", self.table))
    }
}
