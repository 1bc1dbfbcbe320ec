//! Run-time compilation with NVRTC (loaded dynamically through cudarc) and the on-disk CUBIN
//! cache.
//!
//! NVRTC is thread-safe across programs, so [`compile_all`] compiles every source on its own
//! thread. The cache key is a SHA-256 over the inlined source text, the options, the NVRTC
//! version, the architecture and [`crate::ABI_VERSION`]; a cached CUBIN is written to a
//! temporary file and renamed, so concurrent processes never read half a file.

use std::ffi::{CStr, CString, c_char, c_int};
use std::path::{Path, PathBuf};

use cudarc::nvrtc::sys;
use sha2::{Digest, Sha256};

use crate::{ABI_VERSION, Source, sources};

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error(
        "NVRTC (libnvrtc.so.13) was not found: install the CUDA 13 runtime compiler \
         (e.g. `pip install nvidia-cuda-nvrtc==13.0.88`) and put its lib/ directory on LD_LIBRARY_PATH"
    )]
    NoNvrtc,
    #[error("kernel source: {0}")]
    Source(String),
    #[error("NVRTC failed to compile {source_name} for {arch}:\n{log}")]
    Compile {
        source_name: String,
        arch: String,
        log: String,
    },
    #[error("NVRTC call {call} failed with code {code}")]
    Nvrtc { call: &'static str, code: i32 },
    #[error("kernel cache {path}: {err}")]
    Cache { path: PathBuf, err: std::io::Error },
}

/// One compiled source.
#[derive(Debug, Clone)]
pub struct Compiled {
    pub source: &'static str,
    pub cubin: Vec<u8>,
    /// The PTX (only when asked for: the ABI check reads its `.entry` lists).
    pub ptx: Option<String>,
    /// NVRTC's log (ptxas's resource report when compiled with `--ptxas-options=-v`).
    pub log: String,
    pub from_cache: bool,
}

fn check(call: &'static str, r: sys::nvrtcResult) -> Result<(), KernelError> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(KernelError::Nvrtc {
            call,
            code: r as i32,
        })
    }
}

fn ensure_loaded() -> Result<(), KernelError> {
    // SAFETY: probing for the shared library has no preconditions.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(KernelError::NoNvrtc)
    }
}

/// NVRTC's `(major, minor)` version.
pub fn nvrtc_version() -> Result<(i32, i32), KernelError> {
    ensure_loaded()?;
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: the library is present; both out-pointers are valid.
    check("nvrtcVersion", unsafe {
        sys::nvrtcVersion(&mut major, &mut minor)
    })?;
    Ok((major, minor))
}

/// The options every kernel is compiled with for `arch` (e.g. `sm_90a`).
pub fn options(arch: &str, verbose: bool) -> Vec<String> {
    let mut o = vec![
        format!("-arch={arch}"),
        "-std=c++17".to_string(),
        "-lineinfo".to_string(),
        "-default-device".to_string(),
    ];
    if verbose {
        o.push("--ptxas-options=-v".to_string());
    }
    o
}

struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by nvrtcCreateProgram and is destroyed once.
        unsafe {
            sys::nvrtcDestroyProgram(&mut self.0);
        }
    }
}

/// Compiles one source for `arch` (no cache). `verbose` adds ptxas's resource report to the
/// log; `want_ptx` also returns the PTX.
pub fn compile(
    source: &'static Source,
    arch: &str,
    verbose: bool,
    want_ptx: bool,
) -> Result<Compiled, KernelError> {
    ensure_loaded()?;
    let text = CString::new(source.text()?)
        .map_err(|_| KernelError::Source(format!("{}: NUL byte in source", source.name)))?;
    let name = CString::new(source.name).map_err(|_| KernelError::Source("name".into()))?;
    let opts: Vec<CString> = options(arch, verbose)
        .into_iter()
        .map(|o| CString::new(o).map_err(|_| KernelError::Source("option".into())))
        .collect::<Result<_, _>>()?;
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    let mut prog = Program(std::ptr::null_mut());
    // SAFETY: all strings are NUL-terminated and outlive the calls; no headers are passed.
    unsafe {
        check(
            "nvrtcCreateProgram",
            sys::nvrtcCreateProgram(
                &mut prog.0,
                text.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            ),
        )?;
        let rc = sys::nvrtcCompileProgram(prog.0, opt_ptrs.len() as c_int, opt_ptrs.as_ptr());
        let log = program_log(&prog)?;
        if rc != sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(KernelError::Compile {
                source_name: source.name.to_string(),
                arch: arch.to_string(),
                log,
            });
        }
        let mut n = 0usize;
        check("nvrtcGetCUBINSize", sys::nvrtcGetCUBINSize(prog.0, &mut n))?;
        let mut cubin = vec![0u8; n];
        check(
            "nvrtcGetCUBIN",
            sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast()),
        )?;
        let ptx = if want_ptx {
            let mut n = 0usize;
            check("nvrtcGetPTXSize", sys::nvrtcGetPTXSize(prog.0, &mut n))?;
            let mut buf = vec![0u8; n];
            check(
                "nvrtcGetPTX",
                sys::nvrtcGetPTX(prog.0, buf.as_mut_ptr().cast()),
            )?;
            Some(cstr_lossy(&buf))
        } else {
            None
        };
        Ok(Compiled {
            source: source.name,
            cubin,
            ptx,
            log,
            from_cache: false,
        })
    }
}

fn cstr_lossy(buf: &[u8]) -> String {
    CStr::from_bytes_until_nul(buf)
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_else(|_| String::from_utf8_lossy(buf).into_owned())
}

/// # Safety
/// `prog` must be a live program.
unsafe fn program_log(prog: &Program) -> Result<String, KernelError> {
    let mut n = 0usize;
    // SAFETY: guaranteed by the caller; the buffer is sized as NVRTC reports.
    unsafe {
        check(
            "nvrtcGetProgramLogSize",
            sys::nvrtcGetProgramLogSize(prog.0, &mut n),
        )?;
        let mut buf = vec![0u8; n.max(1)];
        check(
            "nvrtcGetProgramLog",
            sys::nvrtcGetProgramLog(prog.0, buf.as_mut_ptr().cast()),
        )?;
        Ok(cstr_lossy(&buf))
    }
}

/// CUBINs on disk: `$CHIMERA_KERNEL_CACHE`, else `$XDG_CACHE_HOME/chimera/kernels`, else
/// `~/.cache/chimera/kernels`.
#[derive(Debug, Clone)]
pub struct KernelCache {
    pub dir: PathBuf,
}

impl KernelCache {
    pub fn from_env() -> Self {
        let dir = std::env::var_os("CHIMERA_KERNEL_CACHE")
            .map(PathBuf::from)
            .or_else(|| {
                std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("chimera/kernels"))
            })
            .or_else(|| {
                std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/chimera/kernels"))
            })
            .unwrap_or_else(|| std::env::temp_dir().join("chimera-kernels"));
        Self { dir }
    }

    /// The cache key of `source` compiled for `arch` by NVRTC `version`.
    pub fn key(source: &Source, arch: &str, version: (i32, i32)) -> Result<String, KernelError> {
        let mut h = Sha256::new();
        h.update(source.text()?.as_bytes());
        for o in options(arch, false) {
            h.update(o.as_bytes());
            h.update([0]);
        }
        h.update(format!("nvrtc {}.{}", version.0, version.1).as_bytes());
        h.update(format!("abi {ABI_VERSION}").as_bytes());
        let digest = h.finalize();
        let hex: String = digest.iter().take(16).map(|b| format!("{b:02x}")).collect();
        // A source in a unit's folder (`ssm/conv.cu`) is cached as `ssm-conv-…`: one folder.
        Ok(format!(
            "{}-{arch}-{hex}.cubin",
            source.name.trim_end_matches(".cu").replace('/', "-")
        ))
    }

    fn path(&self, key: &str) -> PathBuf {
        self.dir.join(key)
    }

    fn read(&self, key: &str) -> Option<Vec<u8>> {
        std::fs::read(self.path(key)).ok().filter(|b| !b.is_empty())
    }

    fn write(&self, key: &str, cubin: &[u8]) -> Result<(), KernelError> {
        let err = |path: &Path, err| KernelError::Cache {
            path: path.to_path_buf(),
            err,
        };
        std::fs::create_dir_all(&self.dir).map_err(|e| err(&self.dir, e))?;
        let tmp = self.dir.join(format!(".{key}.{}.tmp", std::process::id()));
        std::fs::write(&tmp, cubin).map_err(|e| err(&tmp, e))?;
        let dst = self.path(key);
        std::fs::rename(&tmp, &dst).map_err(|e| err(&dst, e))
    }

    /// The CUBIN of `source` for `arch`: from the cache, or compiled and stored.
    pub fn get(&self, source: &'static Source, arch: &str) -> Result<Compiled, KernelError> {
        let key = Self::key(source, arch, nvrtc_version()?)?;
        if let Some(cubin) = self.read(&key) {
            return Ok(Compiled {
                source: source.name,
                cubin,
                ptx: None,
                log: String::new(),
                from_cache: true,
            });
        }
        let compiled = compile(source, arch, false, false)?;
        // A read-only cache directory costs a recompile next time, not a failure now.
        if let Err(e) = self.write(&key, &compiled.cubin) {
            eprintln!("warning: not caching kernels: {e}");
        }
        Ok(compiled)
    }
}

/// Every source that builds for `arch` ([`Source::builds_for`]), compiled in parallel (or
/// read from `cache`), in [`sources`] order.
pub fn compile_all(cache: Option<&KernelCache>, arch: &str) -> Result<Vec<Compiled>, KernelError> {
    ensure_loaded()?;
    std::thread::scope(|s| {
        let handles: Vec<_> = sources()
            .iter()
            .filter(|src| src.builds_for(arch))
            .map(|src| {
                s.spawn(move || match cache {
                    Some(c) => c.get(src, arch),
                    None => compile(src, arch, false, false),
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(KernelError::Source("compiler thread panicked".into())))
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_source_caches_under_its_own_plain_file_name() {
        let mut keys = std::collections::HashSet::new();
        for s in sources() {
            let key = KernelCache::key(s, "sm_90a", (13, 0)).expect("key");
            assert!(!key.contains('/') && !key.starts_with('.'), "{key}");
            assert!(keys.insert(key.clone()), "{key} twice");
        }
        let conv = sources().iter().find(|s| s.name == "ssm/conv.cu");
        let key = KernelCache::key(conv.expect("conv"), "sm_90a", (13, 0)).expect("key");
        assert!(key.starts_with("ssm-conv-sm_90a-"), "{key}");
    }
}
