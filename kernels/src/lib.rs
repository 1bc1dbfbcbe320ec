//! chimera's CUDA kernels.
//!
//! The kernels are CUDA C++ written here (`src/*.cu`, `src/*.cuh`, and a unit's folder such
//! as `src/ssm/`), embedded in the binary with `include_str!` and compiled at run time by
//! NVRTC for the device's architecture (`sm_90a` on an H200). No CUDA toolkit is needed to
//! build the project, and NVRTC needs no toolkit headers: the sources include only project
//! headers, named relative to the including file as a C preprocessor resolves them, which
//! are inlined textually before compilation ([`Source::text`]).
//!
//! Every kernel entry point is declared in a Rust table ([`Entry`]: name and parameter
//! kinds) next to its source. The host launches kernels only through that table, and a test
//! compiles every source with NVRTC and checks the PTX `.entry` parameter lists against it,
//! so an argument-ABI mistake is caught on a machine without a GPU.
//!
//! Compiled CUBINs are cached on disk ([`KernelCache`]), keyed by the inlined source, the
//! options, the NVRTC version and the architecture; sources compile in parallel.

pub mod attention;
pub mod moe;
pub mod nvrtc;
pub mod sample;
pub mod ssm;

use std::path::Path;

pub use nvrtc::{Compiled, KernelCache, KernelError, compile, compile_all, nvrtc_version};

/// One kernel launch as a planner describes it: the entry, the geometry and the arguments
/// in parameter order. `A` is the planner's own enum of symbolic arguments (a tensor, a step
/// column, a scalar), which the backend maps to device pointers and values.
#[derive(Debug, Clone, PartialEq)]
pub struct Launch<A> {
    pub entry: &'static str,
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    /// Dynamic shared memory in bytes.
    pub smem: u32,
    pub args: Vec<A>,
}

/// A kernel parameter as the launch code passes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Param {
    /// A device pointer (`.u64` in PTX).
    Ptr,
    U32,
    I32,
    U64,
    F32,
}

impl Param {
    /// The PTX parameter type NVRTC emits for this kind.
    pub fn ptx(self) -> &'static str {
        match self {
            Param::Ptr | Param::U64 => "u64",
            Param::U32 | Param::I32 => "u32",
            Param::F32 => "f32",
        }
    }
}

/// One `extern "C" __global__` entry point.
#[derive(Debug, Clone, Copy)]
pub struct Entry {
    pub name: &'static str,
    pub params: &'static [Param],
}

/// One compilation unit: a `.cu` file and its entry points.
#[derive(Debug, Clone, Copy)]
pub struct Source {
    /// The file's path under `src/` (`gemv.cu`, `ssm/conv.cu`).
    pub name: &'static str,
    pub code: &'static str,
    pub entries: &'static [Entry],
    /// Built only for Hopper's `sm_90a` target (it uses `wgmma`); other architectures go
    /// without its entries ([`Source::builds_for`]).
    pub sm90a_only: bool,
}

/// Project headers that sources may `#include`, by their path under `src/`.
pub const HEADERS: &[(&str, &str)] = &[
    ("common.cuh", include_str!("common.cuh")),
    ("mma.cuh", include_str!("mma.cuh")),
    ("attention.cuh", include_str!("attention.cuh")),
    ("ssm/ssm.cuh", include_str!("ssm/ssm.cuh")),
    ("ssm/ssd.cuh", include_str!("ssm/ssd.cuh")),
];

/// Bumped whenever a kernel's parameters change meaning without changing its source text.
pub const ABI_VERSION: u32 = 1;

/// Every compilation unit.
pub fn sources() -> &'static [Source] {
    const SOURCES: &[Source] = &[
        Source {
            name: "dense.cu",
            code: include_str!("dense.cu"),
            entries: dense::ENTRIES,
            sm90a_only: false,
        },
        Source {
            name: "attention.cu",
            code: include_str!("attention.cu"),
            entries: attention::ENTRIES,
            sm90a_only: false,
        },
        Source {
            name: "attention_sm90.cu",
            code: include_str!("attention_sm90.cu"),
            entries: attention::SM90_ENTRIES,
            sm90a_only: true,
        },
        Source {
            name: "sample.cu",
            code: include_str!("sample.cu"),
            entries: sample::ENTRIES,
            sm90a_only: false,
        },
        Source {
            name: "ssm/slot_ops.cu",
            code: include_str!("ssm/slot_ops.cu"),
            entries: ssm::slot_ops::ENTRIES,
            sm90a_only: false,
        },
        Source {
            name: "ssm/conv.cu",
            code: include_str!("ssm/conv.cu"),
            entries: ssm::conv::ENTRIES,
            sm90a_only: false,
        },
        Source {
            name: "ssm/state_update.cu",
            code: include_str!("ssm/state_update.cu"),
            entries: ssm::state_update::ENTRIES,
            sm90a_only: false,
        },
        Source {
            name: "ssm/ssd_state.cu",
            code: include_str!("ssm/ssd_state.cu"),
            entries: ssm::ssd::STATE_ENTRIES,
            sm90a_only: false,
        },
        Source {
            name: "ssm/ssd_scan.cu",
            code: include_str!("ssm/ssd_scan.cu"),
            entries: ssm::ssd::SCAN_ENTRIES,
            sm90a_only: false,
        },
        Source {
            name: "ssm/gdn.cu",
            code: include_str!("ssm/gdn.cu"),
            entries: ssm::gdn::ENTRIES,
            sm90a_only: false,
        },
        Source {
            name: "moe.cu",
            code: include_str!("moe.cu"),
            entries: moe::ENTRIES,
            sm90a_only: false,
        },
        Source {
            name: "gemv.cu",
            code: include_str!("gemv.cu"),
            entries: gemv::ENTRIES,
            sm90a_only: false,
        },
        Source {
            name: "fp8.cu",
            code: include_str!("fp8.cu"),
            entries: fp8::ENTRIES,
            sm90a_only: false,
        },
    ];
    SOURCES
}

/// The entry named `name`, in whichever source declares it.
pub fn entry(name: &str) -> Option<(&'static Source, &'static Entry)> {
    sources()
        .iter()
        .find_map(|s| s.entries.iter().find(|e| e.name == name).map(|e| (s, e)))
}

impl Source {
    /// Whether this source is compiled for `arch` (an NVRTC target such as `sm_90a`).
    pub fn builds_for(&self, arch: &str) -> bool {
        !self.sm90a_only || arch == "sm_90a"
    }

    /// The source with project headers inlined (each once), as NVRTC compiles it. A file of
    /// the same name in [`SOURCES_ENV`]'s folder replaces the embedded one.
    pub fn text(&self) -> Result<String, KernelError> {
        self.text_with(std::env::var_os(SOURCES_ENV).as_deref().map(Path::new))
    }

    /// [`Self::text`] with the files of `dir`, if any, replacing the embedded ones.
    fn text_with(&self, dir: Option<&Path>) -> Result<String, KernelError> {
        let code = replacement(dir, self.name)?;
        let code = code.as_deref().unwrap_or(self.code);
        let mut out = String::with_capacity(code.len() + 4096);
        let mut seen = Vec::new();
        inline_into(self.name, code, dir, &mut out, &mut seen)?;
        Ok(out)
    }
}

/// A folder whose `.cu` / `.cuh` files replace the embedded ones of the same path under `src/`
/// (the folder mirrors `src/`: its `ssm/conv.cu` replaces that source), for kernel work on a
/// machine that runs the binary but cannot build it: variants of a kernel are timed by
/// running the same binary with different folders. Entry points and their parameters stay
/// those of the Rust tables (the ABI test does not see replacements). Replaced files change
/// the cache key, so cached CUBINs of other variants are not reused.
pub const SOURCES_ENV: &str = "CHIMERA_KERNEL_SOURCES";

/// The files [`SOURCES_ENV`] replaces, for the host to report at start.
pub fn replaced_files() -> Vec<String> {
    let Some(dir) = std::env::var_os(SOURCES_ENV) else {
        return Vec::new();
    };
    let names = sources()
        .iter()
        .map(|s| s.name)
        .chain(HEADERS.iter().map(|(n, _)| *n));
    names
        .filter(|n| Path::new(&dir).join(n).is_file())
        .map(str::to_owned)
        .collect()
}

/// The replacement text of source or header `name`, when `dir` holds one.
fn replacement(dir: Option<&Path>, name: &str) -> Result<Option<String>, KernelError> {
    let Some(dir) = dir else {
        return Ok(None);
    };
    let path = dir.join(name);
    if !path.is_file() {
        return Ok(None);
    }
    std::fs::read_to_string(&path)
        .map(Some)
        .map_err(|e| KernelError::Source(format!("{}: {e}", path.display())))
}

fn inline_into(
    file: &str,
    code: &str,
    dir: Option<&Path>,
    out: &mut String,
    seen: &mut Vec<&'static str>,
) -> Result<(), KernelError> {
    for line in code.lines() {
        let t = line.trim();
        if t == "#pragma once" {
            continue;
        }
        if let Some(rest) = t.strip_prefix("#include") {
            let name = rest.trim().trim_matches('"');
            let path = include_path(file, name);
            let found = HEADERS.iter().find(|(n, _)| Some(*n) == path.as_deref());
            let Some(&(hname, hcode)) = found else {
                return Err(KernelError::Source(format!(
                    "{file}: #include {name}: not a project header (NVRTC has no toolkit headers)"
                )));
            };
            if !seen.contains(&hname) {
                seen.push(hname);
                let replaced = replacement(dir, hname)?;
                inline_into(hname, replaced.as_deref().unwrap_or(hcode), dir, out, seen)?;
            }
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    Ok(())
}

/// The path under `src/` that `#include "name"` in `file` (a path under `src/`) names:
/// relative to `file`'s folder, as a C preprocessor resolves it; `None` outside `src/`.
fn include_path(file: &str, name: &str) -> Option<String> {
    let mut parts: Vec<&str> = file.split('/').collect();
    parts.pop();
    for part in name.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop()?;
            }
            _ => parts.push(part),
        }
    }
    Some(parts.join("/"))
}

/// Dense-path kernels (`dense.cu`): row gathers, norms, rotary, activations, casts,
/// KV writes, dummy weights. Most come in an `_f32` and a `_bf16` instantiation with the same
/// parameters.
pub mod dense {
    use super::Entry;
    use super::Param::{self, F32, Ptr, U32, U64};

    const fn e(name: &'static str, params: &'static [Param]) -> Entry {
        Entry { name, params }
    }

    const RMS: &[Param] = &[Ptr, Ptr, Ptr, U32, F32];
    const ADD_RMS: &[Param] = &[Ptr, Ptr, Ptr, Ptr, U32, F32];
    const GATED_RMS: &[Param] = &[Ptr, Ptr, Ptr, Ptr, U32, U32, F32, U32, U32, U32];
    const ROPE: &[Param] = &[Ptr, U32, U32, U32, U32, Ptr, Ptr, F32, U32];
    const ACT: &[Param] = &[Ptr, U64, U32];
    const ACT_MUL: &[Param] = &[Ptr, Ptr, Ptr, U64, U32];
    const BINARY: &[Param] = &[Ptr, Ptr, U64];
    const SIGMOID_GATE: &[Param] = &[Ptr, Ptr, U64, U32, U32];
    const MOE_ROUTE_SOFTMAX: &[Param] = &[Ptr, Ptr, Ptr, U32, U32, U32, U32, F32];
    const SCALE: &[Param] = &[Ptr, U64, F32];
    const GATHER: &[Param] = &[Ptr, Ptr, Ptr, U32, U32, U32];
    const KV_WRITE: &[Param] = &[Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U64];
    const ROPE_KV_WRITE: &[Param] = &[
        Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32, Ptr, Ptr, F32, U64, Ptr, U32,
    ];
    // The FP8 cache's writes: the same, then the K and V scales.
    const KV_WRITE_FP8: &[Param] = &[Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U64, F32, F32];
    const ROPE_KV_WRITE_FP8: &[Param] = &[
        Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32, Ptr, Ptr, F32, U64, Ptr, U32, F32, F32,
    ];
    const BIAS: &[Param] = &[Ptr, Ptr, U32, U32];
    const MOE_ROUTE: &[Param] = &[Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32, U32, U32, F32];
    const MOE_SCATTER: &[Param] = &[Ptr, Ptr, Ptr, Ptr, U32, U32];
    const COPY_COLS: &[Param] = &[Ptr, Ptr, U32, U32, U32, U32];
    const CAST: &[Param] = &[Ptr, Ptr, U64];
    const FILL_RANDOM: &[Param] = &[Ptr, U64, U64, F32];
    const FILL: &[Param] = &[Ptr, U64, F32];

    pub const ENTRIES: &[Entry] = &[
        e("rms_norm_f32", RMS),
        e("rms_norm_bf16", RMS),
        e("add_rms_norm_f32", ADD_RMS),
        e("add_rms_norm_bf16", ADD_RMS),
        e("gated_rms_norm_f32", GATED_RMS),
        e("gated_rms_norm_bf16", GATED_RMS),
        e("rope_f32", ROPE),
        e("rope_bf16", ROPE),
        e("activate_f32", ACT),
        e("activate_bf16", ACT),
        e("act_mul_f32", ACT_MUL),
        e("act_mul_bf16", ACT_MUL),
        e("sigmoid_gate_f32", SIGMOID_GATE),
        e("sigmoid_gate_bf16", SIGMOID_GATE),
        e("moe_route_softmax_f32", MOE_ROUTE_SOFTMAX),
        e("moe_route_softmax_bf16", MOE_ROUTE_SOFTMAX),
        e("add_assign_f32", BINARY),
        e("add_assign_bf16", BINARY),
        e("scale_assign_f32", SCALE),
        e("scale_assign_bf16", SCALE),
        e("gather_rows_f32", GATHER),
        e("gather_rows_bf16", GATHER),
        e("kv_write_f32", KV_WRITE),
        e("kv_write_bf16", KV_WRITE),
        e("rope_kv_write_f32", ROPE_KV_WRITE),
        e("rope_kv_write_bf16", ROPE_KV_WRITE),
        e("kv_write_fp8_f32", KV_WRITE_FP8),
        e("kv_write_fp8_bf16", KV_WRITE_FP8),
        e("rope_kv_write_fp8_f32", ROPE_KV_WRITE_FP8),
        e("rope_kv_write_fp8_bf16", ROPE_KV_WRITE_FP8),
        e("moe_route_f32", MOE_ROUTE),
        e("moe_route_bf16", MOE_ROUTE),
        e("moe_scatter_add_f32", MOE_SCATTER),
        e("moe_scatter_add_bf16", MOE_SCATTER),
        e("add_bias_f32", BIAS),
        e("add_bias_bf16", BIAS),
        e("copy_cols_f32", COPY_COLS),
        e("copy_cols_bf16", COPY_COLS),
        e("cast_f32_to_bf16", CAST),
        e("cast_bf16_to_f32", CAST),
        e("cast_f16_to_bf16", CAST),
        e("cast_f16_to_f32", CAST),
        e("fill_random_f32", FILL_RANDOM),
        e("fill_random_bf16", FILL_RANDOM),
        e("fill_f32", FILL),
        e("fill_bf16", FILL),
    ];
}

/// Small-batch bf16 linear layers (`gemv.cu`): `y = x · wᵀ (+ b)` for one to eight input rows,
/// over up to three weights that share the input in one launch.
pub mod gemv {
    use super::Entry;
    use super::Param::{Ptr, U32};

    /// Warps per block; they split `k` between them.
    pub const WARPS: u32 = 8;

    const PARAMS: &[super::Param] = &[
        Ptr, U32, U32, Ptr, Ptr, Ptr, U32, Ptr, Ptr, Ptr, U32, Ptr, Ptr, Ptr, U32, U32, U32,
    ];

    /// The epilogue (`mode` parameter, `gemv.cu`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Mode {
        /// `y_s = x · w_sᵀ (+ b_s)`.
        Plain = 0,
        /// `y_s = act(x · w_sᵀ (+ b_s))`.
        Activated = 1,
        /// Segment 0 a gate, segment 1 an up projection of the same shape: `y_0 = act(gate) * up`.
        Gated = 2,
    }

    pub const ENTRIES: &[Entry] = &[
        Entry {
            name: "gemv_bf16_n1",
            params: PARAMS,
        },
        Entry {
            name: "gemv_bf16_n2",
            params: PARAMS,
        },
        Entry {
            name: "gemv_bf16_mma",
            params: PARAMS,
        },
    ];

    /// The most input rows the GEMV takes (more go to cuBLASLt).
    pub const MAX_ROWS: usize = 8;

    /// The longest rows (`k`) the tensor-core entry takes: each of its warps waits for one
    /// trip of loads at a time, so long rows over few output groups leave the memory idle.
    /// Measured on an H100 at 3, 5 and 8 rows against cuBLASLt (`gpu-check --suite
    /// bench-kernels`): faster on every 8B decode shape up to k = 8192 (q|k|v 18.7–19.2 against
    /// 30.4–30.7 µs, o_proj 12.3–12.7 / 15.4, gate|up 77–78 / 80–82, in_proj 51–52 / 58–59,
    /// out_proj k = 8192 24.4–25.5 / 26.1–26.4, lm_head 335–340 / 363), slower past it (down_proj
    /// k = 14336 43.9–45.0 / 42.2–42.4, NemotronH's MLP down k = 21504 67–69 / 61–62).
    pub const MMA_MAX_K: usize = 8192;

    /// The entry for `n` input rows (1 to [`MAX_ROWS`]) of length `k` and the output features
    /// each block computes (every segment's `m` must be a multiple of it); `None`: cuBLASLt.
    pub fn variant(n: usize, k: usize) -> Option<(&'static str, u32)> {
        match n {
            1 => Some(("gemv_bf16_n1", 2)),
            2 => Some(("gemv_bf16_n2", 4)),
            3..=MAX_ROWS if k <= MMA_MAX_K => Some(("gemv_bf16_mma", 16)),
            _ => None,
        }
    }
}

/// FP8 e4m3 weights (`fp8.cu`): per-row quantization (weights at load, activations per token
/// before an FP8 GEMM), dequantization, and the small-batch GEMV over the codes.
pub mod fp8 {
    use super::Entry;
    use super::Param::{self, Ptr, U32};

    const fn e(name: &'static str, params: &'static [Param]) -> Entry {
        Entry { name, params }
    }

    /// Warps per GEMV block.
    pub const WARPS: u32 = 8;
    /// Output features per block of the default GEMV entries (every `m` must be a multiple of
    /// the entry's).
    pub const GEMV_ROWS: usize = 4;
    /// The most input rows the GEMV takes.
    pub const GEMV_MAX_N: usize = 2;

    const QUANTIZE: &[Param] = &[Ptr, Ptr, Ptr, U32];
    const DEQUANTIZE: &[Param] = &[Ptr, Ptr, Ptr, U32, U32, U32, U32];
    const GEMV: &[Param] = &[
        Ptr, U32, U32, Ptr, Ptr, U32, U32, Ptr, Ptr, U32, Ptr, Ptr, Ptr, U32,
    ];

    pub const ENTRIES: &[Entry] = &[
        e("fp8_quantize_rows_f32", QUANTIZE),
        e("fp8_quantize_rows_bf16", QUANTIZE),
        e("fp8_dequantize_f32", DEQUANTIZE),
        e("fp8_dequantize_bf16", DEQUANTIZE),
        e("fp8_gemv_f32_n1", GEMV),
        e("fp8_gemv_f32_n2", GEMV),
        e("fp8_gemv_bf16_n1", GEMV),
        e("fp8_gemv_bf16_n2", GEMV),
        e("fp8_gemv_bf16_n1_r8u1", GEMV),
        e("fp8_gemv_bf16_n1_r8u2", GEMV),
        e("fp8_gemv_bf16_n1_r16u1", GEMV),
        e("fp8_gemv_bf16_n1_r2u4", GEMV),
        e("fp8_gemv_bf16_n1_w2u4", GEMV),
        e("fp8_gemv_bf16_n1_w4u2", GEMV),
        e("fp8_gemv_bf16_n1_w2u2", GEMV),
    ];

    /// The one-row bf16 GEMV's variants, (entry, output features a block): the first is the
    /// default; the bench times the others against it.
    pub const GEMV_N1_BF16: &[(&str, usize)] = &[
        ("fp8_gemv_bf16_n1", 4),
        ("fp8_gemv_bf16_n1_r8u1", 8),
        ("fp8_gemv_bf16_n1_r8u2", 8),
        ("fp8_gemv_bf16_n1_r16u1", 16),
        ("fp8_gemv_bf16_n1_r2u4", 2),
        // A warp per group of features: WARPS warps × R features a block.
        ("fp8_gemv_bf16_n1_w2u4", WARPS as usize * 2),
        ("fp8_gemv_bf16_n1_w4u2", WARPS as usize * 4),
        ("fp8_gemv_bf16_n1_w2u2", WARPS as usize * 2),
    ];

    /// The variant of [`GEMV_N1_BF16`] for an `m × k` weight on `sms` multiprocessors, from
    /// `bench-fp8` on an H100 (2026-12-07): the warp-per-features kernel with two chunks in
    /// flight (`w2u2`) wherever its blocks fill every multiprocessor and the reduction is at
    /// most twice the output (64–92 % of the copy bandwidth on the 8B shapes, against 58–81 % for
    /// the four-feature block kernel); the two-feature block kernel with four chunks in flight
    /// (`r2u4`) for long reductions of large weights (down projections: 88–89 % against 82–86 %);
    /// the four-feature block kernel for small outputs (k_proj's 1024: more, smaller blocks).
    pub fn gemv_n1_bf16_pick(m: usize, k: usize, sms: usize) -> usize {
        let index = |name: &str| {
            GEMV_N1_BF16
                .iter()
                .position(|(n, _)| *n == name)
                .expect("a listed variant")
        };
        let large = m * k >= 32 << 20;
        if k > 2 * m && large {
            index("fp8_gemv_bf16_n1_r2u4")
        } else if k <= 2 * m && m / (WARPS as usize * 2) >= sms {
            index("fp8_gemv_bf16_n1_w2u2")
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fp8_gemv_pick_follows_the_measured_shapes() {
        let name = |m: usize, k: usize| fp8::GEMV_N1_BF16[fp8::gemv_n1_bf16_pick(m, k, 132)].0;
        // Wide outputs: the warp-per-features kernel; long reductions of large weights: two
        // features a block with four chunks in flight; few outputs: the default.
        for (m, k) in [(4096, 4096), (14336, 4096), (18560, 4096), (4096, 8192)] {
            assert_eq!(name(m, k), "fp8_gemv_bf16_n1_w2u2", "{m}×{k}");
        }
        for (m, k) in [(4096, 14336), (4096, 21504)] {
            assert_eq!(name(m, k), "fp8_gemv_bf16_n1_r2u4", "{m}×{k}");
        }
        assert_eq!(name(1024, 4096), fp8::GEMV_N1_BF16[0].0);
        // A GPU with more multiprocessors than blocks keeps the default.
        assert_eq!(fp8::gemv_n1_bf16_pick(4096, 4096, 1024), 0);
    }

    #[test]
    fn every_source_inlines_and_names_unique_entries() {
        let mut names = std::collections::HashSet::new();
        for s in sources() {
            let text = s.text().unwrap_or_else(|e| panic!("{e}"));
            assert!(!text.contains("#include"), "{}: include left", s.name);
            for e in s.entries {
                assert!(names.insert(e.name), "entry {} declared twice", e.name);
            }
        }
    }

    #[test]
    fn the_hopper_source_builds_only_for_sm90a() {
        let (src, _) = entry("attn_prefill_wgmma_d128_bf16").expect("declared");
        assert!(src.sm90a_only);
        assert!(src.builds_for("sm_90a"));
        for arch in ["sm_80", "sm_86", "sm_89", "sm_90", "sm_100a"] {
            assert!(!src.builds_for(arch), "{arch}");
        }
        let (portable, _) = entry("attn_prefill_d128_bf16").expect("declared");
        assert!(portable.builds_for("sm_80") && portable.builds_for("sm_90a"));
    }

    #[test]
    fn files_of_the_sources_folder_replace_sources_and_headers() {
        let dir =
            std::env::temp_dir().join(format!("chimera-kernel-sources-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        std::fs::write(
            dir.join("gemv.cu"),
            "#include \"common.cuh\"\n// variant B\n",
        )
        .expect("write");
        std::fs::write(dir.join("common.cuh"), "// replaced common\n").expect("write");
        let gemv = sources()
            .iter()
            .find(|s| s.name == "gemv.cu")
            .expect("gemv");
        let text = gemv.text_with(Some(&dir)).expect("text");
        assert_eq!(text, "// replaced common\n// variant B\n");
        // A source without a file of its name keeps its own text, headers still replaced.
        let dense = sources()
            .iter()
            .find(|s| s.name == "dense.cu")
            .expect("dense");
        let text = dense.text_with(Some(&dir)).expect("text");
        assert!(text.contains("// replaced common\n"));
        assert!(
            !text.contains("typedef unsigned int u32;"),
            "the embedded header is gone"
        );
        assert!(
            text.contains("extern \"C\" __global__"),
            "dense.cu's own text is kept"
        );
        assert_eq!(
            dense.text_with(None).expect("text"),
            dense.text().expect("text")
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn includes_resolve_from_the_including_file() {
        assert_eq!(
            include_path("gemv.cu", "common.cuh").as_deref(),
            Some("common.cuh")
        );
        assert_eq!(
            include_path("ssm/conv.cu", "ssm.cuh").as_deref(),
            Some("ssm/ssm.cuh")
        );
        assert_eq!(
            include_path("ssm/ssm.cuh", "../common.cuh").as_deref(),
            Some("common.cuh")
        );
        assert_eq!(
            include_path("ssm/ssd.cuh", "./ssm.cuh").as_deref(),
            Some("ssm/ssm.cuh")
        );
        assert_eq!(include_path("gemv.cu", "../common.cuh"), None);
        // A header of another folder is not found by its bare name.
        let bad = Source {
            name: "ssm/bad.cu",
            code: "#include \"common.cuh\"\n",
            entries: &[],
            sm90a_only: false,
        };
        let err = bad.text().expect_err("ssm/common.cuh is no header");
        assert!(err.to_string().contains("not a project header"), "{err}");
    }

    #[test]
    fn a_header_of_a_units_folder_is_replaced_by_its_path() {
        let dir = std::env::temp_dir().join(format!("chimera-kernel-unit-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("ssm")).expect("temp dir");
        std::fs::write(dir.join("ssm/ssm.cuh"), "// replaced ssm header\n").expect("write");
        let conv = sources()
            .iter()
            .find(|s| s.name == "ssm/conv.cu")
            .expect("conv");
        let text = conv.text_with(Some(&dir)).expect("text");
        assert!(
            text.contains("\n// replaced ssm header\n"),
            "the replacement inlined"
        );
        assert!(
            !text.contains("layer_state(S* pool"),
            "the embedded header is gone"
        );
        assert!(
            !text.contains("typedef unsigned int u32;"),
            "its includes went with it"
        );
        assert!(
            text.contains("ssm_conv_chunks_f32"),
            "conv.cu's own text is kept"
        );
        std::fs::write(dir.join("ssm/conv.cu"), "// variant\n").expect("write");
        assert_eq!(conv.text_with(Some(&dir)).expect("text"), "// variant\n");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_toolkit_header_is_refused() {
        let bad = Source {
            name: "bad.cu",
            code: "#include \"cuda_bf16.h\"\n",
            entries: &[],
            sm90a_only: false,
        };
        let err = bad.text().expect_err("toolkit header must be refused");
        assert!(err.to_string().contains("not a project header"), "{err}");
    }
}
