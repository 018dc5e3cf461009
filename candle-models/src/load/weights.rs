//! A model's weights on disk: one `model.safetensors`, or the shards a
//! `model.safetensors.index.json` names, memory-mapped and checked against the model's config
//! before any tensor's data is read.
//!
//! Every problem is an error naming the file and the tensor: a shard the index names but the
//! directory lacks, a tensor the index maps to a shard that lacks it, a tensor in a shard that
//! the index does not map there, a dtype that is not floating point, a shape other than the
//! config's, a tensor missing or unexpected, a non-finite value, a tied copy that differs.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Component, Path, PathBuf};

use candle_core::safetensors::Load;
use candle_core::{DType, Device, Tensor, Var};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use super::finite;
use super::{Source, INDEX_FILE, MODEL_FILE};
use crate::model::{CheckpointTensor, ModelConfig, Params};
use crate::{Error, Result};

/// Where a model directory keeps its weights.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WeightFiles {
    /// One safetensors file (`model.safetensors`).
    Single(PathBuf),
    /// Shards named by an index.
    Sharded(ShardIndex),
}

/// A `model.safetensors.index.json`, read (its shards are checked when the weights are).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardIndex {
    /// The index file.
    pub path: PathBuf,
    /// Tensor name to shard file name (relative to the index's directory).
    pub weight_map: BTreeMap<String, String>,
    /// `metadata.total_size`: the bytes of all tensors (headers excluded), if recorded.
    pub total_size: Option<u64>,
}

/// One tensor as a safetensors header describes it (no data read).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorHeader {
    /// Its name in the file.
    pub name: String,
    /// Its stored dtype, as safetensors names it (`F32`, `BF16`, `I64`, ...).
    pub dtype: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// The file that holds it.
    pub file: PathBuf,
}

impl WeightFiles {
    /// Whether `dir` holds weights this module reads (`model.safetensors` or the index).
    pub fn present_in(dir: &Path) -> bool {
        dir.join(MODEL_FILE).is_file() || dir.join(INDEX_FILE).is_file()
    }

    /// The weights of model directory `dir`: `model.safetensors` when present (as
    /// `transformers` prefers it), else the shards of `model.safetensors.index.json`.
    pub fn locate(dir: &Path) -> Result<Self> {
        let single = dir.join(MODEL_FILE);
        if single.is_file() {
            return Ok(WeightFiles::Single(single));
        }
        let index = dir.join(INDEX_FILE);
        if index.is_file() {
            return Ok(WeightFiles::Sharded(ShardIndex::read(&index)?));
        }
        Err(Error::checkpoint(
            dir,
            format!("holds no weights (neither {MODEL_FILE} nor {INDEX_FILE})"),
        ))
    }

    /// The file errors about the weights as a whole name: the single file or the index.
    pub fn path(&self) -> &Path {
        match self {
            WeightFiles::Single(p) => p,
            WeightFiles::Sharded(i) => &i.path,
        }
    }

    /// The files holding tensors: the single file, or each shard once, sorted.
    pub fn files(&self) -> Vec<PathBuf> {
        match self {
            WeightFiles::Single(p) => vec![p.clone()],
            WeightFiles::Sharded(i) => i.shard_paths(),
        }
    }

    /// Every tensor's name, dtype and shape from the headers, sorted by name within each
    /// file (the index is checked against the shards first).
    pub fn headers(&self) -> Result<Vec<TensorHeader>> {
        let mapped = self.map()?;
        let mut out = Vec::new();
        for m in &mapped {
            let st = m.parse()?;
            let mut names = st.names();
            names.sort();
            for name in names {
                let view = m.tensor(&st, name)?;
                out.push(TensorHeader {
                    name: name.to_string(),
                    dtype: format!("{:?}", view.dtype()),
                    shape: view.shape().to_vec(),
                    file: m.path.clone(),
                });
            }
        }
        Ok(out)
    }

    /// Reads the weights as f32 parameters of a model of `config` on `device`, checking them
    /// as [`Source`] says (a trainer checkpoint holds f32 parameters only; a pretrained model
    /// may hold other float dtypes, cast with one notice, buffers, skipped, and tied copies,
    /// which must equal their parameter). Names, dtypes and shapes are checked from the
    /// headers before any tensor's data is read.
    pub fn read(
        &self,
        config: &dyn ModelConfig,
        device: &Device,
        source: Source,
    ) -> Result<Params> {
        let weights = self.open(config, source)?;
        let mut vars = Vec::with_capacity(weights.params.len());
        for name in weights.names() {
            vars.push((
                name.clone(),
                Var::from_tensor(&weights.tensor(name, device)?)?,
            ));
        }
        let params = Params::from_vars(vars);
        weights.check_copies(device, |of| params.tensor(of))?;
        params.check(config).map_err(|e| {
            Error::checkpoint(
                self.path(),
                e.to_string().replace("checkpoint <params>: ", ""),
            )
        })?;
        Ok(params)
    }

    /// The weights of a model of `config`, checked from the headers as [`WeightFiles::read`]
    /// checks them, to be read one tensor at a time ([`Streamed::tensor`]): the files stay
    /// mapped, so a reader holds one tensor in memory, not the model.
    pub fn open(&self, config: &dyn ModelConfig, source: Source) -> Result<Streamed> {
        let mapped = self.map()?;
        let mut plan = Plan::new(config, source);
        for m in &mapped {
            let st = m.parse()?;
            let mut names = st.names();
            names.sort();
            for name in names {
                plan.add(&m.path, name, &m.tensor(&st, name)?)?;
            }
        }
        plan.check_complete(self.path())?;
        if !plan.cast.is_empty() {
            let from: Vec<&str> = plan.cast.iter().map(String::as_str).collect();
            tracing::warn!(
                "{}: {} weights loaded as f32",
                self.path().display(),
                from.join(", ")
            );
        }
        let index: BTreeMap<PathBuf, usize> = mapped
            .iter()
            .enumerate()
            .map(|(i, m)| (m.path.clone(), i))
            .collect();
        let mut params = BTreeMap::new();
        let mut copies = Vec::new();
        for ((file, name), target) in plan.targets {
            let at = (index[&file], name);
            match target {
                Target::Param(p) => {
                    params.insert(p, at);
                }
                Target::Copy(of) => copies.push((at, of)),
            }
        }
        Ok(Streamed {
            mapped,
            params,
            copies,
        })
    }

    /// Maps every file, after checking (for shards) that the index and the shards agree.
    fn map(&self) -> Result<Vec<Mapped>> {
        match self {
            WeightFiles::Single(p) => Ok(vec![Mapped::open(p)?]),
            WeightFiles::Sharded(index) => index.map_checked(),
        }
    }
}

impl ShardIndex {
    /// Reads `model.safetensors.index.json` at `path`.
    pub fn read(path: &Path) -> Result<Self> {
        let json: Value = candle_data::io::read_json(path)?;
        let err = |msg: String| Error::checkpoint(path, msg);
        let Some(map) = json.get("weight_map").and_then(Value::as_object) else {
            return Err(err("has no `weight_map` object".into()));
        };
        let mut weight_map = BTreeMap::new();
        for (name, shard) in map {
            let Some(shard) = shard.as_str() else {
                return Err(err(format!(
                    "`weight_map` maps `{name}` to {shard}, not to a file name"
                )));
            };
            let plain = Path::new(shard)
                .components()
                .all(|c| matches!(c, Component::Normal(_)));
            if !plain || shard.is_empty() {
                return Err(err(format!(
                    "`weight_map` maps `{name}` to `{shard}`, which is not a file in the \
                     index's directory"
                )));
            }
            weight_map.insert(name.clone(), shard.to_string());
        }
        let total_size = json
            .get("metadata")
            .and_then(|m| m.get("total_size"))
            .and_then(Value::as_u64);
        Ok(ShardIndex {
            path: path.to_path_buf(),
            weight_map,
            total_size,
        })
    }

    fn dir(&self) -> &Path {
        self.path.parent().unwrap_or(Path::new("."))
    }

    /// Each shard's path once, sorted.
    pub fn shard_paths(&self) -> Vec<PathBuf> {
        let names: BTreeSet<&String> = self.weight_map.values().collect();
        names.into_iter().map(|n| self.dir().join(n)).collect()
    }

    /// Maps every shard, checking that each exists and holds exactly the tensors the index
    /// maps to it.
    fn map_checked(&self) -> Result<Vec<Mapped>> {
        let mut by_shard: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (name, shard) in &self.weight_map {
            by_shard.entry(shard).or_default().push(name);
        }
        for (shard, names) in &by_shard {
            let path = self.dir().join(shard);
            if !path.is_file() {
                let more = match names.len() {
                    1 => String::new(),
                    n => format!(" and {} more", n - 1),
                };
                return Err(Error::checkpoint(
                    &self.path,
                    format!(
                        "maps `{}`{more} to the shard `{shard}`, which is missing ({} does not \
                         exist)",
                        names[0],
                        path.display()
                    ),
                ));
            }
        }
        let mut mapped = Vec::with_capacity(by_shard.len());
        for (shard, names) in &by_shard {
            let m = Mapped::open(&self.dir().join(shard))?;
            let st = m.parse()?;
            let held: BTreeSet<&str> = st.names().into_iter().collect();
            if let Some(absent) = names.iter().find(|n| !held.contains(**n)) {
                return Err(Error::checkpoint(
                    &m.path,
                    format!(
                        "lacks the tensor `{absent}`, which {} maps to this shard",
                        self.path.display()
                    ),
                ));
            }
            for name in held {
                match self.weight_map.get(name) {
                    Some(s) if s == shard => {}
                    Some(s) => {
                        return Err(Error::checkpoint(
                            &m.path,
                            format!(
                                "holds the tensor `{name}`, which {} maps to the shard `{s}`",
                                self.path.display()
                            ),
                        ))
                    }
                    None => {
                        return Err(Error::checkpoint(
                            &m.path,
                            format!(
                                "holds the tensor `{name}`, which is not in the index {}",
                                self.path.display()
                            ),
                        ))
                    }
                }
            }
            drop(st);
            mapped.push(m);
        }
        Ok(mapped)
    }
}

/// A model's weights, checked from their headers and mapped, read one tensor at a time
/// ([`WeightFiles::open`]).
pub struct Streamed {
    mapped: Vec<Mapped>,
    /// Each parameter's file (an index into `mapped`) and stored name, by parameter name.
    params: BTreeMap<String, (usize, String)>,
    /// Tied copies: where each is stored, and the parameter it must equal.
    copies: Vec<((usize, String), String)>,
}

impl Streamed {
    /// The parameters' names, in order.
    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.params.keys()
    }

    /// The parameter `name` on `device`, in f32 (cast from its stored dtype), checked finite.
    pub fn tensor(&self, name: &str, device: &Device) -> Result<Tensor> {
        let at = self
            .params
            .get(name)
            .ok_or_else(|| Error::Config(format!("the weights have no parameter `{name}`")))?;
        self.load(at, device)
    }

    /// Errors, naming the file and the tensor, unless every tied copy equals its parameter
    /// (`param` gives a parameter by name).
    pub fn check_copies(
        &self,
        device: &Device,
        param: impl Fn(&str) -> Result<Tensor>,
    ) -> Result<()> {
        for (at, of) in &self.copies {
            let copy = self.load(at, device)?;
            // `ne` is true for NaN, which `abs().max_all()` would miss.
            if copy.ne(&param(of)?)?.max_all()?.to_scalar::<u8>()? != 0 {
                return Err(Error::checkpoint(
                    &self.mapped[at.0].path,
                    format!(
                        "`{}` differs from `{of}`: untied heads are not supported",
                        at.1
                    ),
                ));
            }
        }
        Ok(())
    }

    fn load(&self, (file, name): &(usize, String), device: &Device) -> Result<Tensor> {
        let m = &self.mapped[*file];
        let st = m.parse()?;
        let t = m
            .tensor(&st, name)?
            .load(device)
            .map_err(|e| Error::checkpoint(&m.path, format!("tensor `{name}`: {e}")))?
            .to_dtype(DType::F32)?;
        finite::check_tensors(&m.path, "weight", [(name.as_str(), &t)])?;
        Ok(t)
    }
}

/// A safetensors file mapped into memory (read-only).
struct Mapped {
    path: PathBuf,
    map: Option<memmap2::Mmap>,
}

impl Mapped {
    fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        let map = match len {
            0 => None, // an empty file cannot be mapped; it is reported as not safetensors
            // SAFETY: the map is only read. A file changed by another process while it is
            // mapped could change what is read (as for candle's own mmap loader); the
            // checkpoint manifest catches a changed trainer checkpoint.
            _ => Some(unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?),
        };
        Ok(Mapped {
            path: path.to_path_buf(),
            map,
        })
    }

    fn parse(&self) -> Result<SafeTensors<'_>> {
        SafeTensors::deserialize(self.map.as_deref().unwrap_or(&[])).map_err(|e| {
            Error::checkpoint(
                &self.path,
                format!("not a valid safetensors file (truncated or corrupt?): {e}"),
            )
        })
    }

    fn tensor<'a>(
        &self,
        st: &SafeTensors<'a>,
        name: &str,
    ) -> Result<safetensors::tensor::TensorView<'a>> {
        st.tensor(name)
            .map_err(|e| Error::checkpoint(&self.path, format!("tensor `{name}`: {e}")))
    }
}

/// What a stored tensor becomes.
enum Target {
    /// The parameter of this name.
    Param(String),
    /// A copy of this tied parameter, to compare.
    Copy(String),
}

/// The header pass: every tensor's role, dtype and shape checked before data is read.
struct Plan<'a> {
    config: &'a dyn ModelConfig,
    source: Source,
    shapes: BTreeMap<String, Vec<usize>>,
    /// (file, stored name) → what it becomes; buffers are absent.
    targets: BTreeMap<(PathBuf, String), Target>,
    /// Parameter names found, with the file holding each.
    params: BTreeMap<String, PathBuf>,
    /// Stored dtypes other than f32 (cast).
    cast: BTreeSet<String>,
}

impl<'a> Plan<'a> {
    fn new(config: &'a dyn ModelConfig, source: Source) -> Self {
        Plan {
            config,
            source,
            shapes: config.shapes(),
            targets: BTreeMap::new(),
            params: BTreeMap::new(),
            cast: BTreeSet::new(),
        }
    }

    fn add(
        &mut self,
        file: &Path,
        name: &str,
        view: &safetensors::tensor::TensorView,
    ) -> Result<()> {
        let err = |msg: String| Err(Error::checkpoint(file, msg));
        let kind = self.config.checkpoint_tensor(name);
        if self.source == Source::Checkpoint && kind != CheckpointTensor::Param(name.to_string()) {
            return err(format!(
                "unexpected `{name}` (the trainer writes parameters only)"
            ));
        }
        let (target, of) = match kind {
            CheckpointTensor::Buffer => {
                tracing::info!("{}: skipping the buffer `{name}`", file.display());
                return Ok(());
            }
            CheckpointTensor::TiedCopy(of) => (Target::Copy(of.clone()), of),
            CheckpointTensor::Param(p) => (Target::Param(p.clone()), p),
        };
        let dtype = view.dtype();
        if !matches!(dtype, Dtype::F16 | Dtype::BF16 | Dtype::F32 | Dtype::F64) {
            return err(format!(
                "tensor `{name}` has dtype {dtype:?}; weights must be floating point (f32, \
                 f16, bf16 or f64)"
            ));
        }
        if dtype != Dtype::F32 {
            if self.source == Source::Checkpoint {
                return err(format!("`{name}` is {dtype:?}; the trainer writes f32"));
            }
            self.cast.insert(format!("{dtype:?}"));
        }
        if let Some(want) = self.shapes.get(&of) {
            if view.shape() != want.as_slice() {
                let what = match &target {
                    Target::Param(_) => String::new(),
                    Target::Copy(_) => format!(" (a copy of `{of}`)"),
                };
                return err(format!(
                    "tensor `{name}`{what} has shape {:?} but config.json needs {want:?}",
                    view.shape()
                ));
            }
        }
        if let Target::Param(p) = &target {
            if let Some(first) = self.params.insert(p.clone(), file.to_path_buf()) {
                return err(format!(
                    "holds `{name}`, which is parameter `{p}` again (also in {})",
                    first.display()
                ));
            }
        }
        self.targets
            .insert((file.to_path_buf(), name.to_string()), target);
        Ok(())
    }

    /// Every parameter of the config present, none other (from the headers).
    fn check_complete(&self, what: &Path) -> Result<()> {
        let mut problems: Vec<String> = self
            .shapes
            .keys()
            .filter(|n| !self.params.contains_key(*n))
            .map(|n| format!("missing `{n}`"))
            .collect();
        problems.extend(
            self.params
                .iter()
                .filter(|(n, _)| !self.shapes.contains_key(*n))
                .map(|(n, f)| match f.as_path() == what {
                    true => format!("unexpected `{n}`"),
                    false => format!("unexpected `{n}` (in {})", f.display()),
                }),
        );
        if problems.is_empty() {
            return Ok(());
        }
        let n = problems.len();
        problems.truncate(5);
        let more = match n > 5 {
            true => format!(" (and {} more)", n - 5),
            false => String::new(),
        };
        Err(Error::checkpoint(
            what,
            format!(
                "the tensors do not match config.json: {}{more}",
                problems.join("; ")
            ),
        ))
    }
}
