//! The GGUF container (llama.cpp's single-file checkpoints, versions 2 and 3): a header of
//! typed metadata, a table of tensors (name, ggml dims, ggml type, offset), and the aligned
//! data section, memory-mapped.
//!
//! ggml lists a tensor's dims fastest-first (`ne[0]` is the row length); [`TensorInfo::shape`]
//! gives them in the row-major order the rest of chimera uses. Every read is bounds-checked:
//! a truncated or corrupt file is an error naming the file, never a panic.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::quant::GgmlType;
use crate::model::ModelError;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// Any integer type that fits, as u64.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One tensor of the table.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the fastest-varying (the row length).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute byte offset in the file.
    pub start: usize,
    pub len: usize,
}

impl TensorInfo {
    /// Row-major shape (the reverse of ggml's dims).
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    pub fn elements(&self) -> usize {
        self.dims.iter().product::<u64>() as usize
    }
}

/// An open GGUF file.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: HashMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    mmap: Mmap,
}

/// A bounds-checked little-endian reader over the file's bytes.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| {
                format!(
                    "truncated: wanted {n} bytes at offset {} of {}",
                    self.pos,
                    self.bytes.len()
                )
            })?;
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A count or length, checked against what the rest of the file could hold.
    fn len(&mut self, unit: usize) -> Result<usize, String> {
        let n = self.u64()?;
        let left = (self.bytes.len() - self.pos) as u64;
        if n.saturating_mul(unit.max(1) as u64) > left {
            return Err(format!(
                "a length of {n} at offset {} exceeds the file",
                self.pos - 8
            ));
        }
        Ok(n as usize)
    }

    fn string(&mut self) -> Result<String, String> {
        let n = self.len(1)?;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec())
            .map_err(|_| format!("a string at offset {} is not UTF-8", self.pos - n))
    }

    fn value(&mut self, ty: u32, depth: usize) -> Result<Value, String> {
        Ok(match ty {
            0 => Value::U8(self.array::<1>()?[0]),
            1 => Value::I8(self.array::<1>()?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array()?)),
            3 => Value::I16(i16::from_le_bytes(self.array()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.array()?)),
            6 => Value::F32(f32::from_le_bytes(self.array()?)),
            7 => match self.array::<1>()?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(format!("bool value {b} at offset {}", self.pos - 1)),
            },
            8 => Value::Str(self.string()?),
            9 => {
                if depth > 4 {
                    return Err("arrays nested too deeply".into());
                }
                let elem = self.u32()?;
                let n = self.len(1)?;
                let mut out = Vec::with_capacity(n);
                for _ in 0..n {
                    out.push(self.value(elem, depth + 1)?);
                }
                Value::Array(out)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.array()?)),
            12 => Value::F64(f64::from_le_bytes(self.array()?)),
            t => {
                return Err(format!(
                    "unknown metadata value type {t} at offset {}",
                    self.pos - 4
                ));
            }
        })
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let file = File::open(path).map_err(|e| ModelError::Io {
            path: path.to_path_buf(),
            source: e,
        })?;
        // SAFETY: the file is opened read-only and the map is only read; a checkpoint that is
        // modified while being loaded is outside what any loader can defend against.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::Io {
            path: path.to_path_buf(),
            source: e,
        })?;
        let (version, metadata, tensors) = parse(&mmap).map_err(|message| ModelError::Weights {
            path: path.to_path_buf(),
            message: format!("not a valid GGUF file: {message}"),
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            version,
            metadata,
            tensors,
            mmap,
        })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The stored bytes of a tensor.
    pub fn data(&self, t: &TensorInfo) -> &[u8] {
        &self.mmap[t.start..t.start + t.len]
    }

    /// Bytes of all tensors' data as stored (quantized).
    pub fn data_bytes(&self) -> usize {
        self.tensors.iter().map(|t| t.len).sum()
    }
}

type Parsed = (u32, HashMap<String, Value>, Vec<TensorInfo>);

fn parse(bytes: &[u8]) -> Result<Parsed, String> {
    let mut r = Reader { bytes, pos: 0 };
    if r.take(4).ok() != Some(MAGIC.as_slice()) {
        return Err("the file does not start with `GGUF`".into());
    }
    let version = r.u32()?;
    if !(2..=3).contains(&version) {
        return Err(format!("version {version} (versions 2 and 3 load)"));
    }
    let n_tensors = r.len(8)?;
    let n_kv = r.len(8)?;
    let mut metadata = HashMap::with_capacity(n_kv);
    for _ in 0..n_kv {
        let key = r.string()?;
        let ty = r.u32()?;
        let value = r
            .value(ty, 0)
            .map_err(|e| format!("metadata `{key}`: {e}"))?;
        metadata.insert(key, value);
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => v
            .as_u64()
            .filter(|a| *a > 0 && a.is_power_of_two())
            .ok_or("`general.alignment` must be a power of two")?,
    };
    let mut raw = Vec::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        let name = r.string()?;
        let n_dims = r.u32()? as usize;
        if n_dims == 0 || n_dims > 4 {
            return Err(format!(
                "tensor `{name}` has {n_dims} dims (1 to 4 allowed)"
            ));
        }
        let dims = (0..n_dims)
            .map(|_| r.u64())
            .collect::<Result<Vec<_>, _>>()?;
        let ty_id = r.u32()?;
        let offset = r.u64()?;
        let ty = GgmlType::from_id(ty_id)
            .ok_or_else(|| format!("tensor `{name}` has unknown ggml type {ty_id}"))?;
        raw.push((name, dims, ty, offset));
    }
    let data_start = (r.pos as u64).div_ceil(alignment) * alignment;
    let mut tensors = Vec::with_capacity(raw.len());
    for (name, dims, ty, offset) in raw {
        let elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| format!("tensor `{name}`: dims {dims:?} overflow"))?;
        let (block, block_bytes) = ty.block();
        if dims[0] % block as u64 != 0 {
            return Err(format!(
                "tensor `{name}`: rows of {} elements are not whole {} blocks of {block}",
                dims[0],
                ty.name()
            ));
        }
        let len = elements / block as u64 * block_bytes as u64;
        let start = data_start + offset;
        if offset % alignment != 0 || start + len > bytes.len() as u64 {
            return Err(format!(
                "tensor `{name}` ({len} bytes at data offset {offset}) lies outside the file \
                 or is misaligned (truncated?)"
            ));
        }
        tensors.push(TensorInfo {
            name,
            dims,
            ty,
            start: start as usize,
            len: len as usize,
        });
    }
    Ok((version, metadata, tensors))
}

/// Writes a GGUF file (version 3): the inverse of the parser, for tests and fixtures.
/// `tensors` are (name, row-major shape, type, stored bytes).
pub fn write(
    path: &Path,
    metadata: &[(&str, Value)],
    tensors: &[(String, Vec<usize>, GgmlType, Vec<u8>)],
) -> std::io::Result<()> {
    fn put_str(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }
    fn type_id(v: &Value) -> u32 {
        match v {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::Str(_) => 8,
            Value::Array(_) => 9,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }
    fn put_value(out: &mut Vec<u8>, v: &Value) {
        match v {
            Value::U8(x) => out.push(*x),
            Value::I8(x) => out.push(*x as u8),
            Value::U16(x) => out.extend(x.to_le_bytes()),
            Value::I16(x) => out.extend(x.to_le_bytes()),
            Value::U32(x) => out.extend(x.to_le_bytes()),
            Value::I32(x) => out.extend(x.to_le_bytes()),
            Value::F32(x) => out.extend(x.to_le_bytes()),
            Value::Bool(x) => out.push(u8::from(*x)),
            Value::Str(s) => put_str(out, s),
            Value::Array(a) => {
                out.extend(a.first().map_or(4, type_id).to_le_bytes());
                out.extend((a.len() as u64).to_le_bytes());
                for x in a {
                    put_value(out, x);
                }
            }
            Value::U64(x) => out.extend(x.to_le_bytes()),
            Value::I64(x) => out.extend(x.to_le_bytes()),
            Value::F64(x) => out.extend(x.to_le_bytes()),
        }
    }
    let align = DEFAULT_ALIGNMENT as usize;
    let mut out = Vec::new();
    out.extend(MAGIC);
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        put_str(&mut out, k);
        out.extend(type_id(v).to_le_bytes());
        put_value(&mut out, v);
    }
    let mut offset = 0usize;
    for (name, shape, ty, bytes) in tensors {
        put_str(&mut out, name);
        out.extend((shape.len() as u32).to_le_bytes());
        for d in shape.iter().rev() {
            out.extend((*d as u64).to_le_bytes());
        }
        out.extend(ty.id().to_le_bytes());
        out.extend((offset as u64).to_le_bytes());
        offset += bytes.len().div_ceil(align) * align;
    }
    out.resize(out.len().div_ceil(align) * align, 0);
    for (_, _, _, bytes) in tensors {
        out.extend(bytes);
        out.resize(out.len().div_ceil(align) * align, 0);
    }
    std::fs::write(path, out)
}
