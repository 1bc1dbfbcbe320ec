//! Safetensors weights: one file or many (`model.safetensors.index.json`), memory-mapped and
//! handed to the backend in their checkpoint dtype straight from the map (f32, bf16 and f16;
//! f64 is narrowed to f32 on the host first). The backend decides what it keeps. A store can
//! also hold tensors made in memory (the embedded model; a GGUF file's dequantized tensors,
//! which it frees one by one as the backend takes them).
//!
//! Every failure names the file and, where there is one, the tensor: a missing tensor, a wrong
//! shape, a non-float dtype, a truncated file or a shard the index points to that is absent.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors, tensor::TensorInfo};

use std::borrow::Cow;

use super::ModelError;
use super::quant::Quantization;
use crate::backend::fp8::{Fp8Scales, Fp8Weight};
use crate::backend::{DType, HostTensor, LayerOps, f32_bytes};

/// A tensor's bytes as stored (or narrowed to f32 for f64 checkpoints), with its dtype.
pub struct RawTensor<'a> {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub bytes: Cow<'a, [u8]>,
}

impl RawTensor<'_> {
    pub fn host(&self) -> HostTensor<'_> {
        HostTensor {
            dtype: self.dtype,
            shape: &self.shape,
            bytes: &self.bytes,
        }
    }
}

/// Host tensors by name: values and shape.
type HostTensors = HashMap<String, (Vec<f32>, Vec<usize>)>;

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
    memory: HostTensors,
    /// Tensors made in memory that are handed over once (a GGUF file's dequantized tensors):
    /// [`WeightStore::load`] removes one, uploads it and frees the host copy, so the host and
    /// backend copies of the whole model never coexist.
    once: RefCell<HostTensors>,
    /// The shapes of `once`'s tensors, kept after they are handed over.
    once_shapes: HashMap<String, Vec<usize>>,
    by_name: HashMap<String, usize>,
    total_bytes: usize,
    loaded_bytes: Cell<usize>,
    next_report: Cell<usize>,
    /// `model.load_format = "dummy"`: no files; every tensor is seeded random values of the
    /// shape the architecture asks for (norm weights are ones), so full-size configs run
    /// without their weights. The value is the seed.
    dummy: Option<u64>,
    /// Which projections are FP8 (the checkpoint's scheme, online quantization).
    quant: Quantization,
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
            once: RefCell::default(),
            once_shapes: HashMap::new(),
            by_name,
            total_bytes,
            loaded_bytes: Cell::new(0),
            next_report: Cell::new(0),
            dummy: None,
            quant: Quantization::default(),
        })
    }

    /// A store of tensors held in memory (name → (values, shape)).
    pub fn from_memory(tensors: HashMap<String, (Vec<f32>, Vec<usize>)>) -> Self {
        Self {
            shards: Vec::new(),
            memory: tensors,
            once: RefCell::default(),
            once_shapes: HashMap::new(),
            by_name: HashMap::new(),
            total_bytes: 0,
            loaded_bytes: Cell::new(0),
            next_report: Cell::new(0),
            dummy: None,
            quant: Quantization::default(),
        }
    }

    /// A store of tensors held in memory that [`WeightStore::load`] hands to the backend once,
    /// freeing each host copy as it goes (a second load of the same tensor is an error; other
    /// reads copy and keep it).
    pub fn from_memory_once(tensors: HostTensors) -> Self {
        Self {
            once_shapes: tensors
                .iter()
                .map(|(name, (_, shape))| (name.clone(), shape.clone()))
                .collect(),
            once: RefCell::new(tensors),
            ..Self::from_memory(HashMap::new())
        }
    }

    /// A store with no files that makes up every tensor it is asked for (see `dummy`).
    /// Optional tensors (biases, untied heads present only in some checkpoints) are absent.
    pub fn dummy(seed: u64) -> Self {
        Self {
            dummy: Some(seed),
            ..Self::from_memory(HashMap::new())
        }
    }

    /// Sets which projections are FP8 ([`WeightStore::load_linear`]).
    pub fn set_quantization(&mut self, quant: Quantization) {
        self.quant = quant;
    }

    /// Which projections are FP8.
    pub fn quantization(&self) -> &Quantization {
        &self.quant
    }

    /// Whether this store makes up its tensors (`model.load_format = "dummy"`).
    pub fn is_dummy(&self) -> bool {
        self.dummy.is_some()
    }

    pub fn has(&self, name: &str) -> bool {
        self.dummy.is_none()
            && (self.memory.contains_key(name) || self.once_shapes.contains_key(name))
            || self.by_name.contains_key(name)
    }

    /// The stored shape of a tensor, if present.
    pub fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
        if let Some((_, shape)) = self.memory.get(name) {
            return Some(shape.clone());
        }
        if let Some(shape) = self.once_shapes.get(name) {
            return Some(shape.clone());
        }
        let shard = &self.shards[*self.by_name.get(name)?];
        shard.tensors.get(name).map(|i| i.shape.clone())
    }

    /// Uploads `name`, which must have exactly `shape`, in its checkpoint dtype.
    pub fn load<B: LayerOps>(
        &self,
        backend: &B,
        name: &str,
        shape: &[usize],
    ) -> Result<B::Tensor, ModelError> {
        if let Some(seed) = self.dummy {
            return dummy_tensor(backend, name, shape, seed);
        }
        if self.once_shapes.contains_key(name) {
            return self.load_once(backend, name, shape);
        }
        let raw = self.raw(name)?;
        if raw.shape != shape {
            return Err(ModelError::TensorShape {
                path: self.path_of(name),
                tensor: name.to_string(),
                got: raw.shape,
                expected: shape.to_vec(),
            });
        }
        backend
            .upload(raw.host())
            .map_err(|e| ModelError::Backend(e.to_string()))
    }

    /// The weight of the projection `module` (`{module}.weight`, exactly `shape`): FP8 codes
    /// and scales where the checkpoint stores it so, quantized at load where online
    /// quantization asks for it (dummy weights: where either scheme would make it FP8), else
    /// as [`WeightStore::load`].
    pub fn load_linear<B: LayerOps>(
        &self,
        backend: &B,
        module: &str,
        shape: &[usize],
    ) -> Result<B::Tensor, ModelError> {
        let name = format!("{module}.weight");
        let backend_err = |e: crate::backend::BackendError| ModelError::Backend(e.to_string());
        if self.dummy.is_some() {
            let t = self.load(backend, &name, shape)?;
            return if self.quant.dummy_fp8(module) {
                backend.quantize_fp8(&t).map_err(backend_err)
            } else {
                Ok(t)
            };
        }
        if let Some(w) = self.fp8(&name)? {
            if w.shape != shape {
                return Err(ModelError::TensorShape {
                    path: self.path_of(&name),
                    tensor: name,
                    got: w.shape,
                    expected: shape.to_vec(),
                });
            }
            return backend.upload_fp8(w).map_err(backend_err);
        }
        let t = self.load(backend, &name, shape)?;
        if self.quant.quantize_online(module) {
            backend.quantize_fp8(&t).map_err(backend_err)
        } else {
            Ok(t)
        }
    }

    /// A tensor the checkpoint stores as FP8 e4m3, with its scales (`{name}_scale_inv` or
    /// `{name}_scale`: one value, one per output row, or one per block); `None` for a tensor of
    /// another dtype.
    pub fn fp8(&self, name: &str) -> Result<Option<Fp8Weight<'_>>, ModelError> {
        let Some(&idx) = self.by_name.get(name) else {
            return Ok(None);
        };
        if self.memory.contains_key(name) || self.once_shapes.contains_key(name) {
            return Ok(None);
        }
        let shard = &self.shards[idx];
        let info = &shard.tensors[name];
        if info.dtype != Dtype::F8_E4M3 {
            return Ok(None);
        }
        let bad = |message: String| ModelError::Weights {
            path: shard.path.clone(),
            message,
        };
        let (start, end) = info.data_offsets;
        let codes = &shard.mmap[shard.data_start + start..shard.data_start + end];
        let scale_name = [format!("{name}_scale_inv"), format!("{name}_scale")]
            .into_iter()
            .find(|n| self.by_name.contains_key(n))
            .ok_or_else(|| {
                bad(format!(
                    "FP8 tensor `{name}` has no scale (`{name}_scale_inv` or `{name}_scale`)"
                ))
            })?;
        let (scales, scale_shape) = self.read_f32(&scale_name)?;
        let shape = info.shape.clone();
        let (e, r, c) = match shape[..] {
            [r, c] => (1, r, c),
            [e, r, c] => (e, r, c),
            _ => {
                return Err(bad(format!(
                    "FP8 tensor `{name}` of shape {shape:?} is not a matrix"
                )));
            }
        };
        let scales = match scales.len() {
            1 => Fp8Scales::Rows(Cow::Owned(vec![scales[0]; e * r])),
            n if n == e * r => Fp8Scales::Rows(Cow::Owned(scales)),
            n if e > 1 && n == e => Fp8Scales::Rows(Cow::Owned(
                scales
                    .iter()
                    .flat_map(|&s| std::iter::repeat_n(s, r))
                    .collect(),
            )),
            n => {
                let block = self
                    .quant
                    .checkpoint
                    .as_ref()
                    .and_then(|c| c.block)
                    .unwrap_or([128, 128]);
                if n != e * r.div_ceil(block[0]) * c.div_ceil(block[1]) {
                    return Err(bad(format!(
                        "the scale `{scale_name}` of shape {scale_shape:?} fits no layout of \
                         `{name}` {shape:?} (one value, one per row, or one per {block:?} block)"
                    )));
                }
                Fp8Scales::Blocks {
                    block,
                    scales: Cow::Owned(scales),
                }
            }
        };
        self.report_progress(end - start);
        let w = Fp8Weight {
            shape,
            codes: Cow::Borrowed(codes),
            scales,
        };
        w.check()
            .map_err(|e| bad(format!("FP8 tensor `{name}`: {e}")))?;
        Ok(Some(w))
    }

    /// [`WeightStore::load`] of a tensor handed over once: uploaded, then its host copy freed.
    fn load_once<B: LayerOps>(
        &self,
        backend: &B,
        name: &str,
        shape: &[usize],
    ) -> Result<B::Tensor, ModelError> {
        let (data, got) = self.once.borrow_mut().remove(name).ok_or_else(|| {
            ModelError::Backend(format!(
                "tensor `{name}` was loaded twice from a store that hands each tensor over once"
            ))
        })?;
        if got != shape {
            return Err(ModelError::TensorShape {
                path: self.path_of(name),
                tensor: name.to_string(),
                got,
                expected: shape.to_vec(),
            });
        }
        let host = HostTensor {
            dtype: DType::F32,
            shape,
            bytes: f32_bytes(&data),
        };
        backend
            .upload(host)
            .map_err(|e| ModelError::Backend(e.to_string()))
    }

    /// The file a tensor comes from (for error messages).
    pub fn path_of(&self, name: &str) -> PathBuf {
        match self.by_name.get(name) {
            Some(&i) => self.shards[i].path.clone(),
            None => PathBuf::from("<embedded>"),
        }
    }

    /// Loads `name` as f32 with its on-disk shape (small host-side tensors only).
    pub fn read_f32(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>), ModelError> {
        let raw = self.raw(name)?;
        Ok((raw.host().to_f32(), raw.shape))
    }

    /// The stored bytes of `name`, which must be a `[rows, cols]` matrix (for weights whose rows
    /// are regrouped or stacked at load).
    pub fn raw_rows(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<RawTensor<'_>, ModelError> {
        let raw = self.raw(name)?;
        if raw.shape != [rows, cols] {
            return Err(ModelError::TensorShape {
                path: self.path_of(name),
                tensor: name.to_string(),
                got: raw.shape,
                expected: vec![rows, cols],
            });
        }
        Ok(raw)
    }

    /// The stored bytes of `name`, borrowed from the memory map.
    pub fn raw(&self, name: &str) -> Result<RawTensor<'_>, ModelError> {
        if let Some((data, shape)) = self.memory.get(name) {
            return Ok(RawTensor {
                dtype: DType::F32,
                shape: shape.clone(),
                bytes: Cow::Borrowed(f32_bytes(data)),
            });
        }
        if self.once_shapes.contains_key(name) {
            let once = self.once.borrow();
            let (data, shape) = once.get(name).ok_or_else(|| {
                ModelError::Backend(format!(
                    "tensor `{name}` was read after the backend took it (a store that hands \
                     each tensor over once)"
                ))
            })?;
            return Ok(RawTensor {
                dtype: DType::F32,
                shape: shape.clone(),
                bytes: Cow::Owned(f32_bytes(data).to_vec()),
            });
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
        let unsupported = || ModelError::TensorDtype {
            path: shard.path.clone(),
            tensor: name.to_string(),
            dtype: format!("{:?}", info.dtype),
        };
        let (dtype, bytes) = match info.dtype {
            // Read where a loader rewrites a weight (regrouped rows, stacked experts): exact
            // values, so it works everywhere; projections load codes through `load_linear`.
            Dtype::F8_E4M3 => {
                let w = self.fp8(name)?.ok_or_else(unsupported)?;
                let values = w.dequantize();
                return Ok(RawTensor {
                    dtype: DType::F32,
                    shape: info.shape.clone(),
                    bytes: Cow::Owned(f32_bytes(&values).to_vec()),
                });
            }
            Dtype::F32 => (DType::F32, Cow::Borrowed(bytes)),
            Dtype::BF16 => (DType::BF16, Cow::Borrowed(bytes)),
            Dtype::F16 => (DType::F16, Cow::Borrowed(bytes)),
            Dtype::F64 => {
                let narrowed: Vec<u8> = bytes
                    .chunks_exact(8)
                    .flat_map(|b| {
                        let v =
                            f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
                        (v as f32).to_le_bytes()
                    })
                    .collect();
                (DType::F32, Cow::Owned(narrowed))
            }
            _ => return Err(unsupported()),
        };
        let expected: usize = info.shape.iter().product::<usize>() * dtype.size();
        if bytes.len() != expected {
            return Err(unsupported());
        }
        self.report_progress(end - start);
        Ok(RawTensor {
            dtype,
            shape: info.shape.clone(),
            bytes,
        })
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

/// A made-up weight: ones for norm weights, else uniform values of standard deviation 0.02
/// seeded by the tensor's name (the same on every backend and every run).
fn dummy_tensor<B: LayerOps>(
    backend: &B,
    name: &str,
    shape: &[usize],
    seed: u64,
) -> Result<B::Tensor, ModelError> {
    let backend_err = |e: crate::backend::BackendError| ModelError::Backend(e.to_string());
    let mut t = backend
        .zeros(shape, backend.act_dtype())
        .map_err(backend_err)?;
    let is_norm = shape.len() == 1 && name.contains("norm");
    let (std, mean) = if is_norm { (0.0, 1.0) } else { (0.02, 0.0) };
    // FNV-1a over the name, mixed with the store's seed.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed;
    for b in name.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    backend
        .fill_dummy(&mut t, h, std, mean)
        .map_err(backend_err)?;
    Ok(t)
}

/// This process's resident set now and at its peak (`VmRSS`, `VmHWM`), in bytes; `None` where
/// `/proc/self/status` cannot be read (not Linux).
pub fn process_memory() -> Option<(u64, u64)> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |key: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(key))?;
        let kib: u64 = line[key.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(kib * 1024)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// Hands the allocator's free memory back to the system (glibc keeps freed chunks in its
/// heaps, including those of the threads that dequantized a GGUF file's tensors, and counts
/// them in RSS). A no-op elsewhere.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        unsafe extern "C" {
            fn malloc_trim(pad: usize) -> std::ffi::c_int;
        }
        // SAFETY: glibc's malloc_trim takes no pointers and may be called at any time; it only
        // returns free pages of the allocator's heaps to the system.
        unsafe {
            malloc_trim(0);
        }
    }
}
