//! Every kernel compiles for the H200 (`sm_90a`) with NVRTC, spills no registers, and each
//! PTX `.entry` parameter list matches the Rust table the host launches through.
//!
//! Needs `libnvrtc.so.13` on the library path (CI installs NVRTC from PyPI; no GPU and no
//! toolkit are needed). Without it the test says so and passes, unless
//! `CHIMERA_REQUIRE_NVRTC=1`, which CI sets.

use chimera_kernels::{Param, compile, nvrtc_version, sources};

/// `(entry name, parameter types)` of every `.entry` in a PTX module.
fn ptx_entries(ptx: &str) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    let mut rest = ptx;
    while let Some(at) = rest.find(".entry ") {
        rest = &rest[at + ".entry ".len()..];
        let name_end = rest.find('(').expect("entry without parameter list");
        let name = rest[..name_end].trim().to_string();
        let close = rest.find(')').expect("unclosed parameter list");
        let params = rest[name_end + 1..close]
            .split(',')
            .filter_map(|p| {
                let p = p.trim();
                let ty = p.strip_prefix(".param .")?;
                Some(ty.split_whitespace().next()?.to_string())
            })
            .collect();
        out.push((name, params));
        rest = &rest[close..];
    }
    out
}

/// The PTX text of entry `name`, from its header to the next entry (empty if absent).
fn entry_body<'a>(ptx: &'a str, name: &str) -> &'a str {
    let header = format!(".entry {name}(");
    let Some(at) = ptx.find(&header) else {
        return "";
    };
    let rest = &ptx[at + header.len()..];
    match rest.find(".entry ") {
        Some(end) => &rest[..end],
        None => rest,
    }
}

/// Says a test was skipped straight on the process's stderr: the harness hides `eprintln!` of
/// a passing test, and a skip must show in a plain `cargo test`.
fn skipped(why: &str) {
    use std::io::Write;
    let name = std::thread::current()
        .name()
        .unwrap_or("this test")
        .to_string();
    let _ = writeln!(std::io::stderr(), "skipped: {name}: {why}");
}

#[test]
fn every_kernel_compiles_for_sm90a_without_spills_and_matches_its_abi_table() {
    let version = match nvrtc_version() {
        Ok(v) => v,
        Err(e) => {
            assert!(
                std::env::var("CHIMERA_REQUIRE_NVRTC").as_deref() != Ok("1"),
                "CHIMERA_REQUIRE_NVRTC=1 but NVRTC is unusable: {e}"
            );
            skipped(&e.to_string());
            return;
        }
    };
    eprintln!("NVRTC {}.{}", version.0, version.1);
    let mut failures = Vec::new();
    for source in sources() {
        let started = std::time::Instant::now();
        let compiled = match compile(source, "sm_90a", true, true) {
            Ok(c) => c,
            Err(e) => {
                failures.push(format!("{e}"));
                continue;
            }
        };
        eprintln!(
            "{}: {} bytes of CUBIN in {:.0?}",
            source.name,
            compiled.cubin.len(),
            started.elapsed()
        );
        // CHIMERA_PTXAS_LOG=1 prints ptxas' per-kernel registers, shared memory and spills.
        if std::env::var_os("CHIMERA_PTXAS_LOG").is_some() {
            eprintln!("{}", compiled.log);
        }
        for line in compiled.log.lines() {
            if line.contains("spill")
                && !line.contains(" 0 bytes spill stores, 0 bytes spill loads")
            {
                failures.push(format!("{}: {line}", source.name));
            }
            // ptxas serialises wgmma (waits after every instruction) when it cannot prove the
            // accumulators untouched while in flight: correct but far slower.
            if line.contains("wgmma") && line.contains("serialized") {
                failures.push(format!("{}: {line}", source.name));
            }
        }
        if source.sm90a_only {
            // The Hopper kernels' ptxas report (registers, warnings), for the record.
            for line in compiled.log.lines().filter(|l| !l.trim().is_empty()) {
                eprintln!("{}: {}", source.name, line.trim());
            }
        }
        let ptx = compiled.ptx.as_deref().unwrap_or_default();
        let found = ptx_entries(ptx);
        for entry in source.entries {
            let want: Vec<&str> = entry.params.iter().map(|p| Param::ptx(*p)).collect();
            match found.iter().find(|(n, _)| n == entry.name) {
                None => failures.push(format!(
                    "{}: entry {} missing from the PTX",
                    source.name, entry.name
                )),
                Some((_, got)) if *got != want => failures.push(format!(
                    "{}: entry {} takes {got:?} in PTX but the table says {want:?}",
                    source.name, entry.name
                )),
                Some(_) => {}
            }
            // The host launches every kernel with programmatic stream serialization: each one
            // must wait for its predecessor before touching memory (CHIMERA_PDL_ENTRY).
            if !entry_body(ptx, entry.name).contains("griddepcontrol.wait") {
                failures.push(format!(
                    "{}: entry {} does not start with CHIMERA_PDL_ENTRY()",
                    source.name, entry.name
                ));
            }
        }
        for (name, _) in &found {
            if !source.entries.iter().any(|e| e.name == name) {
                failures.push(format!(
                    "{}: PTX entry {name} is not in the table",
                    source.name
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_ptx_entry_parser_reads_parameter_types() {
    let ptx = ".visible .entry foo_f32(\n\t.param .u64 foo_param_0,\n\t.param .u32 foo_param_1,\n\t.param .f32 foo_param_2\n)\n{ ret; }\n.visible .entry bar()\n{}";
    let e = ptx_entries(ptx);
    assert_eq!(e[0].0, "foo_f32");
    assert_eq!(e[0].1, vec!["u64", "u32", "f32"]);
    assert_eq!(e[1], ("bar".to_string(), vec![]));
}

/// Ampere (sm_80) builds every source that is not Hopper-only: the programmatic-launch entry
/// and everything else the common headers use must exist there too.
#[test]
fn every_portable_source_compiles_for_sm80() {
    if let Err(e) = nvrtc_version() {
        assert!(
            std::env::var("CHIMERA_REQUIRE_NVRTC").as_deref() != Ok("1"),
            "CHIMERA_REQUIRE_NVRTC=1 but NVRTC is unusable: {e}"
        );
        skipped(&e.to_string());
        return;
    }
    let mut failures = Vec::new();
    for source in sources().iter().filter(|s| s.builds_for("sm_80")) {
        match compile(source, "sm_80", false, true) {
            Ok(c) => {
                let ptx = c.ptx.as_deref().unwrap_or_default();
                if ptx.contains("griddepcontrol") {
                    failures.push(format!("{}: griddepcontrol in sm_80 PTX", source.name));
                }
            }
            Err(e) => failures.push(format!("{}: {e}", source.name)),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
