//! Safetensors weights: one file or many (`model.safetensors.index.json`), memory-mapped,
//! converted to f32 on load (f32, bf16, f16 and f64 on disk).
//!
//! Every failure names the file and, where there is one, the tensor: a missing tensor, a wrong
//! shape, a non-float dtype, a truncated file or a shard the index points to that is absent.

use std::cell::Cell;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors, tensor::TensorInfo};

use super::ModelError;
use crate::backend::Backend;

struct Shard {
    path: PathBuf,
    mmap: Mmap,
    /// Byte offset of the data section (8 + header length).
    data_start: usize,
    tensors: HashMap<String, TensorInfo>,
}

/// All tensors of a model folder, by name.
pub struct WeightStore {
    shards: Vec<Shard>,
    /// Tensors generated in memory (the embedded model), looked up before the shards.
    memory: HashMap<String, (Vec<f32>, Vec<usize>)>,
    by_name: HashMap<String, usize>,
    total_bytes: usize,
    loaded_bytes: Cell<usize>,
    next_report: Cell<usize>,
}

impl WeightStore {
    /// Opens every shard of the model in `dir`.
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| ModelError::Io {
                path: index.clone(),
                source: e,
            })?;
            let json: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| ModelError::Weights {
                    path: index.clone(),
                    message: format!("not valid JSON: {e}"),
                })?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| ModelError::Weights {
                    path: index.clone(),
                    message: "missing `weight_map`".into(),
                })?;
            let mut names: Vec<String> = map
                .values()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect();
            names.sort();
            names.dedup();
            names.into_iter().map(|n| dir.join(n)).collect()
        } else {
            let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(|e| ModelError::Io {
                    path: dir.to_path_buf(),
                    source: e,
                })?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            found.sort();
            found
        };
        if files.is_empty() {
            return Err(ModelError::Weights {
                path: dir.to_path_buf(),
                message: "no *.safetensors file in the model folder".into(),
            });
        }
        let mut shards = Vec::with_capacity(files.len());
        let mut by_name = HashMap::new();
        let mut total_bytes = 0;
        for path in files {
            let shard = open_shard(&path)?;
            for (name, info) in &shard.tensors {
                by_name.insert(name.clone(), shards.len());
                total_bytes += info.data_offsets.1 - info.data_offsets.0;
            }
            shards.push(shard);
        }
        Ok(Self {
            shards,
            memory: HashMap::new(),
            by_name,
            total_bytes,
            loaded_bytes: Cell::new(0),
            next_report: Cell::new(0),
        })
    }

    /// A store of tensors held in memory (name → (values, shape)).
    pub fn from_memory(tensors: HashMap<String, (Vec<f32>, Vec<usize>)>) -> Self {
        Self {
            shards: Vec::new(),
            memory: tensors,
            by_name: HashMap::new(),
            total_bytes: 0,
            loaded_bytes: Cell::new(0),
            next_report: Cell::new(0),
        }
    }

    pub fn has(&self, name: &str) -> bool {
        self.memory.contains_key(name) || self.by_name.contains_key(name)
    }

    /// The stored shape of a tensor, if present.
    pub fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
        if let Some((_, shape)) = self.memory.get(name) {
            return Some(shape.clone());
        }
        let shard = &self.shards[*self.by_name.get(name)?];
        shard.tensors.get(name).map(|i| i.shape.clone())
    }

    /// Loads `name` as f32 with exactly `shape`.
    pub fn load<B: Backend>(
        &self,
        backend: &B,
        name: &str,
        shape: &[usize],
    ) -> Result<B::Tensor, ModelError> {
        let (data, got) = self.read_f32(name)?;
        if got != shape {
            let path = match self.by_name.get(name) {
                Some(&i) => self.shards[i].path.clone(),
                None => PathBuf::from("<embedded>"),
            };
            return Err(ModelError::TensorShape {
                path,
                tensor: name.to_string(),
                got,
                expected: shape.to_vec(),
            });
        }
        backend
            .from_host(data, shape)
            .map_err(|e| ModelError::Backend(e.to_string()))
    }

    /// Loads `name` as f32 with its on-disk shape.
    pub fn read_f32(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>), ModelError> {
        if let Some((data, shape)) = self.memory.get(name) {
            return Ok((data.clone(), shape.clone()));
        }
        let idx = *self
            .by_name
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                tensor: name.to_string(),
                files: self
                    .shards
                    .iter()
                    .map(|s| s.path.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
            })?;
        let shard = &self.shards[idx];
        let info = &shard.tensors[name];
        let (start, end) = info.data_offsets;
        let bytes = &shard.mmap[shard.data_start + start..shard.data_start + end];
        let data = convert(bytes, info.dtype).ok_or_else(|| ModelError::TensorDtype {
            path: shard.path.clone(),
            tensor: name.to_string(),
            dtype: format!("{:?}", info.dtype),
        })?;
        self.report_progress(end - start);
        Ok((data, info.shape.clone()))
    }

    fn report_progress(&self, bytes: usize) {
        const LARGE: usize = 256 << 20;
        let loaded = self.loaded_bytes.get() + bytes;
        self.loaded_bytes.set(loaded);
        if self.total_bytes < LARGE || loaded < self.next_report.get() {
            return;
        }
        let pct = loaded * 100 / self.total_bytes.max(1);
        tracing::info!(
            "loading weights: {pct}% ({:.2} of {:.2} GiB)",
            loaded as f64 / (1u64 << 30) as f64,
            self.total_bytes as f64 / (1u64 << 30) as f64
        );
        self.next_report.set(loaded + self.total_bytes / 10);
    }
}

fn open_shard(path: &Path) -> Result<Shard, ModelError> {
    let file = File::open(path).map_err(|e| ModelError::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    // SAFETY: the file is opened read-only and the map is only read; a model folder that is
    // modified while being served is outside what any loader can defend against.
    let mmap = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    let bad = |message: String| ModelError::Weights {
        path: path.to_path_buf(),
        message,
    };
    let (header_len, metadata) = SafeTensors::read_metadata(&mmap[..]).map_err(|e| {
        bad(format!(
            "not a valid safetensors file (truncated or corrupt?): {e}"
        ))
    })?;
    let data_start = 8 + header_len;
    let mut tensors = HashMap::new();
    for (name, info) in metadata.tensors() {
        let (start, end) = info.data_offsets;
        if data_start + end > mmap.len() || start > end {
            return Err(bad(format!(
                "tensor `{name}` extends past the end of the file (truncated?)"
            )));
        }
        tensors.insert(name, info.clone());
    }
    Ok(Shard {
        path: path.to_path_buf(),
        mmap,
        data_start,
        tensors,
    })
}

fn convert(bytes: &[u8], dtype: Dtype) -> Option<Vec<f32>> {
    match dtype {
        Dtype::F32 => Some(
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        ),
        Dtype::BF16 => Some(
            bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        ),
        Dtype::F16 => Some(
            bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        ),
        Dtype::F64 => Some(
            bytes
                .chunks_exact(8)
                .map(|b| {
                    f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f32
                })
                .collect(),
        ),
        _ => None,
    }
}
