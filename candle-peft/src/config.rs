//! The LoRA configuration, as PEFT's `LoraConfig` writes it to `adapter_config.json`, and
//! which modules it adapts ([`TargetModules`], PEFT's `target_modules` semantics).

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use regex::Regex;
use serde_json::{json, Map, Value};

use crate::error::{PeftError, Result};

/// Which linear layers get an adapter, by module path (`model.layers.0.self_attn.q_proj`),
/// with PEFT's semantics.
///
/// ```
/// use candle_peft::TargetModules;
/// let t: TargetModules = "q_proj,v_proj".parse()?;
/// assert!(t.matches("model.layers.0.self_attn.q_proj", false));
/// assert!(!t.matches("model.layers.0.self_attn.k_proj", false));
/// let all: TargetModules = "all-linear".parse()?;
/// assert!(!all.matches("lm_head", true)); // never the output head
/// let re: TargetModules = r"re:.*\.(q|v)_proj".parse()?;
/// assert!(re.matches("model.layers.1.self_attn.v_proj", false));
/// # Ok::<(), candle_peft::PeftError>(())
/// ```
#[derive(Clone, Debug)]
pub enum TargetModules {
    /// A list: a path matches when it equals an entry or ends with `.entry`.
    Names(Vec<String>),
    /// A regular expression that must match the whole path (PEFT: a string that is not
    /// `all-linear`).
    Regex(Regex),
    /// Every linear layer but the output head (PEFT's `"all-linear"`).
    AllLinear,
}

impl TargetModules {
    /// Whether the linear layer at `path` is adapted; `is_output_head` says whether it is the
    /// model's output projection (excluded by [`TargetModules::AllLinear`] only).
    pub fn matches(&self, path: &str, is_output_head: bool) -> bool {
        match self {
            TargetModules::Names(names) => names.iter().any(|n| {
                path == n
                    || path
                        .strip_suffix(n.as_str())
                        .is_some_and(|p| p.ends_with('.'))
            }),
            TargetModules::Regex(re) => re.is_match(path),
            TargetModules::AllLinear => !is_output_head,
        }
    }

    /// A regex target, anchored to match the whole path.
    pub fn regex(pattern: &str) -> Result<Self> {
        Regex::new(&format!("^(?:{pattern})$"))
            .map(TargetModules::Regex)
            .map_err(|e| PeftError::config("target_modules", format!("bad regex: {e}")))
    }

    /// The value PEFT writes for it in `adapter_config.json` (a sorted list, the regex string
    /// or `"all-linear"`).
    pub fn to_peft_json(&self) -> Value {
        match self {
            TargetModules::Names(names) => {
                let mut names = names.clone();
                names.sort();
                names.dedup();
                json!(names)
            }
            TargetModules::Regex(re) => json!(strip_anchors(re.as_str())),
            TargetModules::AllLinear => json!("all-linear"),
        }
    }

    /// Reads PEFT's `target_modules` value (a list of names or a string).
    pub fn from_peft_json(v: &Value) -> Result<Self> {
        match v {
            Value::String(s) if s == "all-linear" => Ok(TargetModules::AllLinear),
            Value::String(s) => Self::regex(s),
            Value::Array(items) => items
                .iter()
                .map(|i| {
                    i.as_str().map(str::to_string).ok_or_else(|| {
                        PeftError::config("target_modules", format!("{i} is not a string"))
                    })
                })
                .collect::<Result<Vec<_>>>()
                .and_then(|names| match names.is_empty() {
                    true => Err(PeftError::config("target_modules", "the list is empty")),
                    false => Ok(TargetModules::Names(names)),
                }),
            other => Err(PeftError::config(
                "target_modules",
                format!("{other} is neither a list of names nor a string"),
            )),
        }
    }
}

fn strip_anchors(s: &str) -> &str {
    s.strip_prefix("^(?:")
        .and_then(|s| s.strip_suffix(")$"))
        .unwrap_or(s)
}

/// `all-linear`, a comma-separated list of names (`q_proj,v_proj`), or `re:` followed by a
/// regex that must match the whole module path.
impl FromStr for TargetModules {
    type Err = PeftError;

    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        if s == "all-linear" {
            return Ok(TargetModules::AllLinear);
        }
        if let Some(re) = s.strip_prefix("re:") {
            return Self::regex(re);
        }
        let names: Vec<String> = s
            .split(',')
            .map(|n| n.trim().to_string())
            .filter(|n| !n.is_empty())
            .collect();
        if names.is_empty() {
            return Err(PeftError::config(
                "target_modules",
                "give `all-linear`, module names separated by commas, or `re:<regex>`",
            ));
        }
        Ok(TargetModules::Names(names))
    }
}

impl fmt::Display for TargetModules {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TargetModules::Names(names) => f.write_str(&names.join(",")),
            TargetModules::Regex(re) => write!(f, "re:{}", strip_anchors(re.as_str())),
            TargetModules::AllLinear => f.write_str("all-linear"),
        }
    }
}

impl PartialEq for TargetModules {
    fn eq(&self, other: &Self) -> bool {
        self.to_peft_json() == other.to_peft_json()
    }
}

impl serde::Serialize for TargetModules {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for TargetModules {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A LoRA configuration: PEFT's `LoraConfig` restricted to what this crate implements.
///
/// ```
/// use candle_peft::LoraConfig;
/// let c = LoraConfig::new(16, 32.0).with_rslora(true);
/// assert_eq!(c.scaling(), 32.0 / 4.0); // alpha / sqrt(r)
/// # Ok::<(), candle_peft::PeftError>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    /// Rank of the adapters.
    pub r: usize,
    /// `lora_alpha`: the scaling's numerator.
    pub lora_alpha: f64,
    /// Dropout probability on the adapter's input (`base(x) + s B A dropout(x)`).
    pub lora_dropout: f32,
    /// Which linear layers get an adapter.
    pub target_modules: TargetModules,
    /// rsLoRA: scaling `alpha / sqrt(r)` instead of `alpha / r`.
    pub use_rslora: bool,
    /// Modules trained in full and saved beside the adapters (`lm_head`, `embed_tokens`),
    /// matched like a list of target modules.
    pub modules_to_save: Vec<String>,
    /// The base model as PEFT records it (informational).
    pub base_model_name_or_path: Option<String>,
    /// PEFT's `fan_in_fan_out`: the adapted layers store their weight `[in, out]` (GPT-2's
    /// `Conv1D`). As in PEFT, the layers decide ([`crate::inject::LinearLayer`]); the flag
    /// records what they were ([`crate::inject::Injected::config`]).
    pub fan_in_fan_out: bool,
    /// PEFT's `task_type` (`CAUSAL_LM`).
    pub task_type: Option<String>,
}

/// PEFT options and the value that means "off": a config that sets one of them to anything
/// else is refused by name, as a silently ignored option would train or load something else.
const UNSUPPORTED: &[(&str, &str)] = &[
    ("use_dora", "false"),
    ("rank_pattern", "{}"),
    ("alpha_pattern", "{}"),
    ("lora_bias", "false"),
    ("bias", "\"none\""),
    ("layers_to_transform", "null"),
    ("layers_pattern", "null"),
    ("exclude_modules", "null"),
    ("layer_replication", "null"),
    ("trainable_token_indices", "null"),
    ("target_parameters", "null"),
    ("megatron_config", "null"),
    ("megatron_core", "\"megatron.core\""),
    ("loftq_config", "{}"),
    ("eva_config", "null"),
    ("corda_config", "null"),
    ("lora_ga_config", "null"),
    ("use_qalora", "false"),
    ("alora_invocation_tokens", "null"),
    ("use_bdlora", "null"),
    ("arrow_config", "null"),
    ("velora_config", "null"),
    ("monteclora_config", "null"),
    ("kasa_config", "null"),
];

/// An error in the value of `key` of the adapter config at `path`.
fn key_error(path: &Path, key: &str, msg: String) -> PeftError {
    PeftError::file(path, format!("`{key}`: {msg}"))
}

/// Refuses by name what the adapter config `m` (at `path`) asks for that this crate does not
/// implement: a `peft_type` other than LoRA, a key of [`UNSUPPORTED`] not at its "off" value.
fn refuse_unsupported(m: &Map<String, Value>, path: &Path) -> Result<()> {
    match m.get("peft_type").and_then(Value::as_str) {
        Some("LORA") | None => {}
        Some(other) => {
            return Err(PeftError::Unsupported {
                path: path.into(),
                key: "peft_type".into(),
                value: format!("\"{other}\""),
            })
        }
    }
    for (key, off) in UNSUPPORTED {
        let off: Value = serde_json::from_str(off).unwrap_or(Value::Null);
        if let Some(v) = m.get(*key) {
            if !is_off(key, v, &off) {
                return Err(PeftError::Unsupported {
                    path: path.into(),
                    key: key.to_string(),
                    value: v.to_string(),
                });
            }
        }
    }
    Ok(())
}

/// The boolean `key` of the adapter config `m` (at `path`): `false` when absent or null.
fn flag(m: &Map<String, Value>, key: &str, path: &Path) -> Result<bool> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(v) => v
            .as_bool()
            .ok_or_else(|| key_error(path, key, format!("{v} is not true or false"))),
    }
}

/// Values that also mean "off" for some options (`[]` for an empty list, `false` for null).
fn is_off(key: &str, v: &Value, off: &Value) -> bool {
    v == off
        || v.is_null()
        || (matches!(
            key,
            "target_parameters" | "exclude_modules" | "layers_to_transform"
        ) && v.as_array().is_some_and(Vec::is_empty))
        || (key == "use_bdlora" && v == &Value::Bool(false))
        || (key == "rank_pattern" || key == "alpha_pattern" || key == "loftq_config")
            && v.as_object().is_some_and(Map::is_empty)
}

impl LoraConfig {
    /// Rank `r`, `lora_alpha`, every linear layer but the head, no dropout, no rsLoRA.
    pub fn new(r: usize, lora_alpha: f64) -> Self {
        LoraConfig {
            r,
            lora_alpha,
            lora_dropout: 0.0,
            target_modules: TargetModules::AllLinear,
            use_rslora: false,
            modules_to_save: Vec::new(),
            base_model_name_or_path: None,
            fan_in_fan_out: false,
            task_type: Some("CAUSAL_LM".into()),
        }
    }

    /// The same config with `target_modules`.
    pub fn with_targets(self, target_modules: TargetModules) -> Self {
        LoraConfig {
            target_modules,
            ..self
        }
    }

    /// The same config with rsLoRA's scaling on or off.
    pub fn with_rslora(self, use_rslora: bool) -> Self {
        LoraConfig { use_rslora, ..self }
    }

    /// The same config with dropout `p` on the adapters' input.
    pub fn with_dropout(self, lora_dropout: f32) -> Self {
        LoraConfig {
            lora_dropout,
            ..self
        }
    }

    /// The same config saving (training in full) `modules`.
    pub fn with_modules_to_save(self, modules: Vec<String>) -> Self {
        LoraConfig {
            modules_to_save: modules,
            ..self
        }
    }

    /// The same config recording the base model as `base` (PEFT's `base_model_name_or_path`).
    pub fn with_base(self, base: Option<String>) -> Self {
        LoraConfig {
            base_model_name_or_path: base,
            ..self
        }
    }

    /// The factor of the adapter's output: `alpha / r`, or `alpha / sqrt(r)` with rsLoRA.
    pub fn scaling(&self) -> f64 {
        let r = self.r as f64;
        match self.use_rslora {
            true => self.lora_alpha / r.sqrt(),
            false => self.lora_alpha / r,
        }
    }

    /// Checks the values: `r > 0`, a finite positive `lora_alpha`, dropout in `[0, 1)`.
    pub fn validate(&self) -> Result<()> {
        if self.r == 0 {
            return Err(PeftError::config("r", "the rank must be at least 1"));
        }
        if !(self.lora_alpha.is_finite() && self.lora_alpha > 0.0) {
            return Err(PeftError::config(
                "lora_alpha",
                format!("{} must be finite and positive", self.lora_alpha),
            ));
        }
        if !(0.0..1.0).contains(&self.lora_dropout) {
            return Err(PeftError::config(
                "lora_dropout",
                format!("{} must be in [0, 1)", self.lora_dropout),
            ));
        }
        Ok(())
    }

    /// Whether the module at `path` is trained in full and saved ([`LoraConfig::modules_to_save`],
    /// matched like a list of target modules).
    pub fn saves(&self, path: &str) -> bool {
        TargetModules::Names(self.modules_to_save.clone()).matches(path, false)
    }

    /// Reads `adapter_config.json` text (`path` names it in errors). Options this crate does
    /// not implement (`use_dora`, `rank_pattern`, `alpha_pattern`, `lora_bias`, `bias` other
    /// than `none`, ...) are refused by name; unknown keys are ignored, as PEFT does.
    pub fn from_peft_json(text: &str, path: &Path) -> Result<Self> {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| PeftError::file(path, format!("not valid JSON: {e}")))?;
        let Value::Object(m) = v else {
            return Err(PeftError::file(path, "not a JSON object"));
        };
        let key_err = |key: &str, msg: String| key_error(path, key, msg);
        refuse_unsupported(&m, path)?;
        let r = match m.get("r") {
            None => 8,
            Some(v) => v
                .as_u64()
                .map(|r| r as usize)
                .ok_or_else(|| key_err("r", format!("{v} is not a positive integer")))?,
        };
        let lora_alpha = match m.get("lora_alpha") {
            None => 8.0,
            Some(v) => v
                .as_f64()
                .ok_or_else(|| key_err("lora_alpha", format!("{v} is not a number")))?,
        };
        let lora_dropout = match m.get("lora_dropout") {
            None => 0.0,
            Some(v) => v
                .as_f64()
                .ok_or_else(|| key_err("lora_dropout", format!("{v} is not a number")))?
                as f32,
        };
        let target_modules = match m.get("target_modules") {
            None | Some(Value::Null) => {
                return Err(key_err(
                    "target_modules",
                    "missing (PEFT's per-architecture default is not guessed here: list the \
                     modules)"
                        .into(),
                ))
            }
            Some(v) => TargetModules::from_peft_json(v)
                .map_err(|e| key_err("target_modules", e.to_string()))?,
        };
        let use_rslora = flag(&m, "use_rslora", path)?;
        let fan_in_fan_out = flag(&m, "fan_in_fan_out", path)?;
        let modules_to_save = match m.get("modules_to_save") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|i| {
                    i.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| key_err("modules_to_save", format!("{i} is not a string")))
                })
                .collect::<Result<_>>()?,
            Some(v) => return Err(key_err("modules_to_save", format!("{v} is not a list"))),
        };
        let text_of = |key: &str| m.get(key).and_then(Value::as_str).map(str::to_string);
        let c = LoraConfig {
            r,
            lora_alpha,
            lora_dropout,
            target_modules,
            use_rslora,
            modules_to_save,
            base_model_name_or_path: text_of("base_model_name_or_path"),
            fan_in_fan_out,
            task_type: text_of("task_type"),
        };
        c.validate()
            .map_err(|e| PeftError::file(path, e.to_string()))?;
        Ok(c)
    }

    /// Reads an `adapter_config.json` file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| PeftError::file(path, format!("cannot read: {e}")))?;
        Self::from_peft_json(&text, path)
    }

    /// The `adapter_config.json` PEFT writes for this config (every option this crate
    /// implements, the others at their "off" values), which PEFT's `LoraConfig` loads.
    pub fn to_peft_json(&self) -> Value {
        let alpha = match self.lora_alpha.fract() == 0.0 && self.lora_alpha.abs() < 1e15 {
            true => json!(self.lora_alpha as i64),
            false => json!(self.lora_alpha),
        };
        let mut m = Map::new();
        m.insert("peft_type".into(), json!("LORA"));
        m.insert("task_type".into(), json!(self.task_type));
        m.insert(
            "base_model_name_or_path".into(),
            json!(self.base_model_name_or_path),
        );
        m.insert("r".into(), json!(self.r));
        m.insert("lora_alpha".into(), alpha);
        // The shortest decimal that reads back to the f32 (0.05, not 0.05000000074505806).
        let dropout: f64 = self
            .lora_dropout
            .to_string()
            .parse()
            .unwrap_or(f64::from(self.lora_dropout));
        m.insert("lora_dropout".into(), json!(dropout));
        m.insert("target_modules".into(), self.target_modules.to_peft_json());
        m.insert("use_rslora".into(), json!(self.use_rslora));
        m.insert("fan_in_fan_out".into(), json!(self.fan_in_fan_out));
        let saved = match self.modules_to_save.is_empty() {
            true => Value::Null,
            false => json!(self.modules_to_save),
        };
        m.insert("modules_to_save".into(), saved);
        m.insert("init_lora_weights".into(), json!(true));
        m.insert("inference_mode".into(), json!(true));
        for (key, off) in UNSUPPORTED {
            if !key.starts_with("megatron") {
                m.insert(
                    key.to_string(),
                    serde_json::from_str(off).unwrap_or(Value::Null),
                );
            }
        }
        Value::Object(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_matches_equal_or_dotted_suffix_only() {
        let t = TargetModules::Names(vec!["q_proj".into(), "mlp.up_proj".into()]);
        assert!(t.matches("q_proj", false));
        assert!(t.matches("model.layers.3.self_attn.q_proj", false));
        assert!(t.matches("model.layers.3.mlp.up_proj", false));
        assert!(!t.matches("model.layers.3.self_attn.xq_proj", false));
        assert!(!t.matches("model.layers.3.self_attn.q_proj.inner", false));
        assert!(!t.matches("model.layers.3.xmlp.up_proj", false));
    }

    #[test]
    fn regex_must_match_the_whole_path() {
        let t = TargetModules::regex(r"model\.layers\.\d+\.self_attn\.q_proj").unwrap();
        assert!(t.matches("model.layers.12.self_attn.q_proj", false));
        assert!(!t.matches("x.model.layers.12.self_attn.q_proj", false));
        assert!(!t.matches("model.layers.12.self_attn.q_proj2", false));
        assert_eq!(t.to_string(), r"re:model\.layers\.\d+\.self_attn\.q_proj");
        let back: TargetModules = t.to_string().parse().unwrap();
        assert_eq!(back, t);
        assert!(TargetModules::regex("(").is_err());
    }

    #[test]
    fn scaling_plain_and_rslora() {
        assert_eq!(LoraConfig::new(8, 16.0).scaling(), 2.0);
        assert_eq!(LoraConfig::new(16, 16.0).with_rslora(true).scaling(), 4.0);
    }

    #[test]
    fn peft_json_round_trip() {
        let c = LoraConfig::new(8, 16.0)
            .with_targets("v_proj,q_proj".parse().unwrap())
            .with_dropout(0.05)
            .with_modules_to_save(vec!["lm_head".into()]);
        let text = serde_json::to_string(&c.to_peft_json()).unwrap();
        let back = LoraConfig::from_peft_json(&text, Path::new("a.json")).unwrap();
        assert_eq!(back, c);
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["target_modules"], json!(["q_proj", "v_proj"]));
        assert_eq!(v["lora_alpha"], json!(16));
        assert_eq!(v["bias"], json!("none"));
    }

    #[test]
    fn unsupported_options_are_refused_by_name() {
        let base = r#""peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]"#;
        for (opt, ok) in [
            (r#""use_dora": true"#, false),
            (r#""use_dora": false"#, true),
            (r#""rank_pattern": {"q_proj": 8}"#, false),
            (r#""rank_pattern": {}"#, true),
            (r#""alpha_pattern": {"q": 2}"#, false),
            (r#""lora_bias": true"#, false),
            (r#""bias": "all""#, false),
            (r#""bias": "none""#, true),
            (r#""fan_in_fan_out": true"#, true),
            (r#""fan_in_fan_out": 3"#, false),
            (r#""layers_to_transform": [0]"#, false),
            (r#""exclude_modules": ["k_proj"]"#, false),
            (r#""megatron_core": "megatron.core""#, true),
            (r#""some_future_option": 3"#, true),
        ] {
            let text = format!("{{{base}, {opt}}}");
            let r = LoraConfig::from_peft_json(&text, Path::new("dir/adapter_config.json"));
            assert_eq!(r.is_ok(), ok, "{opt}: {r:?}");
            if let Err(e) = r {
                let key = opt.split('"').nth(1).unwrap();
                let msg = e.to_string();
                assert!(
                    msg.contains(key) && msg.contains("dir/adapter_config.json"),
                    "{msg}"
                );
            }
        }
        let e = LoraConfig::from_peft_json(
            r#"{"peft_type": "IA3", "target_modules": ["q"]}"#,
            Path::new("c.json"),
        )
        .unwrap_err();
        assert!(e.to_string().contains("peft_type"), "{e}");
        let e =
            LoraConfig::from_peft_json(r#"{"r": 0, "target_modules": ["q"]}"#, Path::new("c.json"))
                .unwrap_err();
        assert!(e.to_string().contains("`r`"), "{e}");
        let e = LoraConfig::from_peft_json(r#"{"r": 4}"#, Path::new("c.json")).unwrap_err();
        assert!(e.to_string().contains("target_modules"), "{e}");
    }
}
