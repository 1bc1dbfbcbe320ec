//! The benchmark's outputs: the JSON report, the terminal tables and the sweep plot.
//!
//! Owns [`BenchReport`] — the stable JSON document described in `docs/bench-schema.md`
//! (schema id [`SCHEMA`]; fields are only ever added, and a removal or change of meaning gets
//! a new id) — and its renderings: a per-point latency/throughput table, a one-line-per-point
//! sweep table, and an SVG plot of latency percentiles and throughput against offered load.
//!
//! Invariants: rendering never changes the numbers; an infinite request rate has no x value and
//! is left out of the plot (it stays in the tables and JSON). Must not measure or send.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use plotters::prelude::*;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::BenchError;
use super::stats::{Distribution, Latencies, PointSummary, RequestRecord};
use super::workload::LenRange;

/// Identifier of the JSON layout written by this version.
pub const SCHEMA: &str = "chimera-bench/1";

/// Which server was driven.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServerInfo {
    pub url: String,
    pub endpoint: String,
    pub path: String,
    pub model: String,
}

/// What was sent. Fields that do not apply to the workload kind are null.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkloadInfo {
    pub kind: String,
    pub seed: u64,
    /// `"fresh"` (each sweep point has its own prompts) or `"same"`.
    pub sweep_prompts: String,
    /// Tokenizer path, or `"words"`.
    pub tokenizer: String,
    pub prompt_format: String,
    pub groups: Option<usize>,
    pub prompts_per_group: Option<usize>,
    pub prefix_len: Option<LenRange>,
    pub question_len: Option<LenRange>,
    pub input_len: Option<LenRange>,
    pub output_len: Option<LenRange>,
    pub conversations: Option<usize>,
    pub turns: Option<usize>,
    pub prompts_file: Option<PathBuf>,
    pub shuffle: Option<bool>,
    /// Sessions and requests in one pass over the generated workload.
    pub sessions_per_pass: usize,
    pub requests_per_pass: usize,
}

/// How each point was bounded and what every request carried.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunInfo {
    pub max_requests: Option<usize>,
    pub duration_s: Option<f64>,
    pub timeout_s: f64,
    pub temperature: f32,
    pub ignore_eos: bool,
    pub extra_body: Value,
    /// Warm-up requests sent before the first point, and how many of them failed.
    pub warmup_requests: usize,
    pub warmup_failed: usize,
    /// The run was stopped with Ctrl-C: the last point is partial and later ones are missing.
    pub interrupted: bool,
}

/// Speculative decoding during one point, from the server's `/metrics` before and after it
/// (`chimera:` or `vllm:` `spec_decode_*` counters, summed over replicas).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SpecDecode {
    /// Verify steps that carried drafts.
    pub drafts: f64,
    pub draft_tokens: f64,
    pub accepted_tokens: f64,
}

impl SpecDecode {
    /// The counters in a Prometheus text page (zeros where the server has none).
    pub fn parse(metrics: &str) -> Self {
        let mut s = Self::default();
        for line in metrics.lines().filter(|l| !l.starts_with('#')) {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let name = series.split('{').next().unwrap_or(series);
            let name = name
                .strip_prefix("chimera:")
                .or_else(|| name.strip_prefix("vllm:"))
                .unwrap_or("");
            let name = name.strip_suffix("_total").unwrap_or(name);
            let Ok(v) = value.trim().parse::<f64>() else {
                continue;
            };
            match name {
                "spec_decode_num_drafts" => s.drafts += v,
                "spec_decode_num_draft_tokens" => s.draft_tokens += v,
                "spec_decode_num_accepted_tokens" => s.accepted_tokens += v,
                _ => {}
            }
        }
        s
    }

    /// What happened between `before` and `self` (`None` when no draft was verified).
    pub fn since(self, before: Self) -> Option<Self> {
        let d = Self {
            drafts: self.drafts - before.drafts,
            draft_tokens: self.draft_tokens - before.draft_tokens,
            accepted_tokens: self.accepted_tokens - before.accepted_tokens,
        };
        (d.drafts > 0.0).then_some(d)
    }

    /// Accepted drafts over drafts verified.
    pub fn acceptance_rate(&self) -> f64 {
        self.accepted_tokens / self.draft_tokens.max(1.0)
    }

    /// Tokens per verify step: the accepted drafts plus the one every step yields.
    pub fn mean_acceptance_length(&self) -> f64 {
        1.0 + self.accepted_tokens / self.drafts.max(1.0)
    }

    /// One line for the point's table.
    pub fn line(&self) -> String {
        format!(
            "speculative {} verify steps  {} / {} drafts accepted ({:.1} %)  mean acceptance length {:.2}\n",
            self.drafts,
            self.accepted_tokens,
            self.draft_tokens,
            100.0 * self.acceptance_rate(),
            self.mean_acceptance_length()
        )
    }
}

/// One load point: its summary, and the per-request records when `--save-requests` is given.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PointReport {
    #[serde(flatten)]
    pub summary: PointSummary,
    /// Speculative decoding during the point, when the server verified drafts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec_decode: Option<SpecDecode>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub records: Option<Vec<RequestRecord>>,
}

/// The whole run, as written to `--output`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchReport {
    pub schema: String,
    pub label: Option<String>,
    pub metadata: BTreeMap<String, String>,
    pub started_at_unix_s: f64,
    pub server: ServerInfo,
    pub workload: WorkloadInfo,
    pub run: RunInfo,
    pub points: Vec<PointReport>,
}

impl BenchReport {
    pub fn write_json(&self, path: &Path) -> Result<(), BenchError> {
        let text = serde_json::to_string_pretty(self)
            .map_err(|e| BenchError::Report(format!("serialize report: {e}")))?;
        std::fs::write(path, text + "\n").map_err(|e| BenchError::Io {
            path: path.to_path_buf(),
            source: e,
        })
    }

    pub fn read_json(path: &Path) -> Result<Self, BenchError> {
        let text = std::fs::read_to_string(path).map_err(|e| BenchError::Io {
            path: path.to_path_buf(),
            source: e,
        })?;
        serde_json::from_str(&text)
            .map_err(|e| BenchError::Report(format!("{}: {e}", path.display())))
    }

    /// Title line: label, workload, endpoint, model.
    pub fn header(&self) -> String {
        let mut s = String::from("chimera bench");
        if let Some(l) = &self.label {
            let _ = write!(s, " [{l}]");
        }
        let _ = write!(
            s,
            ": {} workload, {} {}{}, model {}",
            self.workload.kind,
            self.server.endpoint,
            self.server.url,
            self.server.path,
            self.server.model
        );
        s
    }

    /// Sweep table: one line per point.
    pub fn sweep_table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{:>12} {:>8} {:>10} {:>9} {:>9} {:>8} {:>8} {:>9} {:>6} {:>6}",
            "load",
            "req/s",
            "out tok/s",
            "TTFT p50",
            "TTFT p99",
            "ITL p50",
            "ITL p99",
            "E2E p50",
            "hit%",
            "failed"
        );
        for p in &self.points {
            let p = &p.summary;
            let l = &p.latency_ms;
            let _ = writeln!(
                s,
                "{:>12} {:>8.2} {:>10.1} {:>9} {:>9} {:>8} {:>8} {:>9} {:>6} {:>6}",
                load_label(p),
                p.throughput.requests_per_s,
                p.throughput.output_tokens_per_s,
                pct(&l.ttft, |d| d.p50),
                pct(&l.ttft, |d| d.p99),
                pct(&l.itl, |d| d.p50),
                pct(&l.itl, |d| d.p99),
                pct(&l.e2e, |d| d.p50),
                p.cache_hit_ratio
                    .map_or("-".into(), |r| format!("{:.1}", r * 100.0)),
                p.requests.failed,
            );
        }
        s
    }
}

/// Ratios of `new` to `base` for each point pair (matched by position): throughputs and
/// latency percentiles as `new / base`, cache-hit ratio as `base -> new` percentages.
pub fn comparison_table(base: &BenchReport, new: &BenchReport) -> String {
    let mut s = String::new();
    let name = |r: &BenchReport| r.label.clone().unwrap_or_else(|| "unlabelled".into());
    let _ = writeln!(s, "ratios {} / {} (new / baseline)", name(new), name(base));
    let _ = writeln!(
        s,
        "{:>12} {:>8} {:>10} {:>9} {:>9} {:>8} {:>9} {:>15}",
        "load",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "E2E p50",
        "hit% base->new"
    );
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(n), Some(d)) if d > 0.0 => format!("{:.3}x", n / d),
        _ => "-".into(),
    };
    let mut mismatched = false;
    for (b, n) in base.points.iter().zip(&new.points) {
        let (b, n) = (&b.summary, &n.summary);
        let mut load = load_label(n);
        if b.load != n.load {
            load.push('*');
            mismatched = true;
        }
        let q = |p: &PointSummary, f: fn(&Latencies) -> Option<f64>| f(&p.latency_ms);
        let hit = |p: &PointSummary| {
            p.cache_hit_ratio
                .map_or("-".into(), |r| format!("{:.1}", r * 100.0))
        };
        let _ = writeln!(
            s,
            "{:>12} {:>8} {:>10} {:>9} {:>9} {:>8} {:>9} {:>15}",
            load,
            ratio(
                Some(n.throughput.requests_per_s),
                Some(b.throughput.requests_per_s)
            ),
            ratio(
                Some(n.throughput.output_tokens_per_s),
                Some(b.throughput.output_tokens_per_s)
            ),
            ratio(
                q(n, |l| l.ttft.as_ref().map(|d| d.p50)),
                q(b, |l| l.ttft.as_ref().map(|d| d.p50))
            ),
            ratio(
                q(n, |l| l.ttft.as_ref().map(|d| d.p99)),
                q(b, |l| l.ttft.as_ref().map(|d| d.p99))
            ),
            ratio(
                q(n, |l| l.itl.as_ref().map(|d| d.p50)),
                q(b, |l| l.itl.as_ref().map(|d| d.p50))
            ),
            ratio(
                q(n, |l| l.e2e.as_ref().map(|d| d.p50)),
                q(b, |l| l.e2e.as_ref().map(|d| d.p50))
            ),
            format!("{} -> {}", hit(b), hit(n)),
        );
    }
    if base.points.len() != new.points.len() {
        let _ = writeln!(
            s,
            "(baseline has {} points, this run {}; compared the first {})",
            base.points.len(),
            new.points.len(),
            base.points.len().min(new.points.len())
        );
    }
    if mismatched {
        let _ = writeln!(s, "* the baseline point had a different offered load");
    }
    s
}

fn load_label(p: &PointSummary) -> String {
    match (p.load.mode.as_str(), p.load.value) {
        ("concurrency", Some(v)) => format!("c={v}"),
        (_, Some(v)) => format!("{v} req/s"),
        (_, None) => "inf req/s".into(),
    }
}

fn pct(d: &Option<Distribution>, f: impl Fn(&Distribution) -> f64) -> String {
    d.as_ref().map_or("-".into(), |d| format!("{:.1}", f(d)))
}

/// The detailed table of one point.
pub fn point_table(p: &PointSummary) -> String {
    let mut s = String::new();
    let r = &p.requests;
    let _ = write!(
        s,
        "-- {} --\nrequests    sent {}  completed {}  failed {}",
        load_label(p),
        r.sent,
        r.completed,
        r.failed
    );
    if !p.errors.is_empty() {
        let kinds: Vec<String> = p.errors.iter().map(|(k, n)| format!("{k}: {n}")).collect();
        let _ = write!(s, " ({})", kinds.join(", "));
    }
    if r.skipped_turns > 0 {
        let _ = write!(s, "  skipped turns {}", r.skipped_turns);
    }
    if r.without_usage > 0 {
        let _ = write!(s, "  without usage {}", r.without_usage);
    }
    let t = &p.throughput;
    let _ = writeln!(
        s,
        "\nduration    {:.3} s  mean in flight {:.2}\nthroughput  {:.2} req/s  input {:.1} tok/s  output {:.1} tok/s  total {:.1} tok/s",
        p.duration_s,
        p.mean_in_flight,
        t.requests_per_s,
        t.input_tokens_per_s,
        t.output_tokens_per_s,
        t.total_tokens_per_s
    );
    let _ = writeln!(
        s,
        "tokens      prompt {}  completion {}  cached {}  cache hit {}",
        p.tokens.prompt,
        p.tokens.completion,
        p.tokens.cached,
        p.cache_hit_ratio
            .map_or("n/a (server sent no cached_tokens)".into(), |x| format!(
                "{:.1}%",
                x * 100.0
            ))
    );
    let _ = writeln!(
        s,
        "{:<13}{:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "latency (ms)", "mean", "p50", "p90", "p99", "max", "n"
    );
    let l = &p.latency_ms;
    for (name, d) in [
        ("TTFT", &l.ttft),
        ("TPOT", &l.tpot),
        ("ITL", &l.itl),
        ("E2E", &l.e2e),
    ] {
        match d {
            Some(d) => {
                let _ = writeln!(
                    s,
                    "  {:<11}{:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9}",
                    name, d.mean, d.p50, d.p90, d.p99, d.max, d.count
                );
            }
            None => {
                let _ = writeln!(s, "  {name:<11}{:>9}", "-");
            }
        }
    }
    s
}

/// Plot panels: title, y unit, series names.
const PANELS: [(&str, &str, &[&str]); 4] = [
    ("time to first token", "ms", &["p50", "p90", "p99"]),
    ("inter-token latency", "ms", &["p50", "p90", "p99"]),
    ("end-to-end latency", "ms", &["p50", "p90", "p99"]),
    ("throughput", "tokens/s", &["output", "total"]),
];

fn panel_value(p: &PointSummary, panel: usize, series: &str) -> Option<f64> {
    let dist = match panel {
        0 => &p.latency_ms.ttft,
        1 => &p.latency_ms.itl,
        2 => &p.latency_ms.e2e,
        _ => {
            return Some(match series {
                "output" => p.throughput.output_tokens_per_s,
                _ => p.throughput.total_tokens_per_s,
            });
        }
    };
    let d = dist.as_ref()?;
    Some(match series {
        "p50" => d.p50,
        "p90" => d.p90,
        _ => d.p99,
    })
}

/// Writes an SVG with four panels against offered load: TTFT, ITL and E2E percentiles
/// (p50/p90/p99, ms) and token throughput (output and total, tokens/s).
pub fn write_plot(report: &BenchReport, path: &Path) -> Result<(), BenchError> {
    let err = |e: String| BenchError::Report(format!("plot {}: {e}", path.display()));
    let mut pts: Vec<&PointSummary> = report
        .points
        .iter()
        .map(|p| &p.summary)
        .filter(|p| p.load.value.is_some())
        .collect();
    if pts.is_empty() {
        return Err(err("no point has a finite offered load".into()));
    }
    pts.sort_by(|a, b| {
        a.load
            .value
            .unwrap_or(0.0)
            .total_cmp(&b.load.value.unwrap_or(0.0))
    });
    let x_desc = if pts[0].load.mode == "concurrency" {
        "concurrency (clients)"
    } else {
        "request rate (req/s)"
    };
    let root = SVGBackend::new(path, (1200, 900)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let title = report.header();
    let root = root
        .titled(&title, ("sans-serif", 20))
        .map_err(|e| err(e.to_string()))?;
    let areas = root.split_evenly((2, 2));
    let xs: Vec<f64> = pts.iter().filter_map(|p| p.load.value).collect();
    let (xmin, xmax) = (xs[0], xs[xs.len() - 1]);
    let pad = if xmax > xmin {
        (xmax - xmin) * 0.05
    } else {
        xmin.abs().max(1.0) * 0.5
    };
    let colors = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(214, 39, 40),
    ];
    for (panel, (area, (name, unit, series))) in areas.iter().zip(PANELS).enumerate() {
        let ymax = pts
            .iter()
            .flat_map(|p| series.iter().filter_map(move |s| panel_value(p, panel, s)))
            .fold(0.0f64, f64::max);
        let ymax = if ymax > 0.0 { ymax * 1.1 } else { 1.0 };
        let mut chart = ChartBuilder::on(area)
            .caption(name, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d((xmin - pad)..(xmax + pad), 0.0..ymax)
            .map_err(|e| err(e.to_string()))?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc(unit)
            .draw()
            .map_err(|e| err(e.to_string()))?;
        for (label, color) in series.iter().zip(colors) {
            let line: Vec<(f64, f64)> = pts
                .iter()
                .filter_map(|p| Some((p.load.value?, panel_value(p, panel, label)?)))
                .collect();
            chart
                .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))
                .map_err(|e| err(e.to_string()))?
                .label(*label)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
            chart
                .draw_series(PointSeries::of_element(line, 4, color, &|c, s, st| {
                    Circle::new(c, s, st.filled())
                }))
                .map_err(|e| err(e.to_string()))?;
        }
        chart
            .configure_series_labels()
            // Latencies usually rise to the right; throughput starts low on the left.
            .position(if panel < 3 {
                SeriesLabelPosition::LowerRight
            } else {
                SeriesLabelPosition::UpperLeft
            })
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(e.to_string()))?;
    }
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::arrivals::LoadPoint;

    fn point(load: LoadPoint, ttft: f64, n: usize) -> PointReport {
        let records: Vec<RequestRecord> = (0..n)
            .map(|_| RequestRecord {
                ttft_s: Some(ttft),
                e2e_s: ttft + 0.1,
                itl_s: vec![0.01; 10],
                prompt_tokens: Some(100),
                completion_tokens: Some(11),
                cached_tokens: Some(50),
                ..Default::default()
            })
            .collect();
        PointReport {
            summary: PointSummary::compute(&load, &records, 1.0, 0),
            spec_decode: None,
            records: None,
        }
    }

    fn report(points: Vec<PointReport>) -> BenchReport {
        BenchReport {
            schema: SCHEMA.into(),
            label: Some("x".into()),
            metadata: BTreeMap::new(),
            started_at_unix_s: 0.0,
            server: ServerInfo {
                url: "http://h".into(),
                endpoint: "completions".into(),
                path: "/v1/completions".into(),
                model: "m".into(),
            },
            workload: WorkloadInfo {
                kind: "random".into(),
                seed: 0,
                sweep_prompts: "fresh".into(),
                tokenizer: "words".into(),
                prompt_format: "text".into(),
                groups: None,
                prompts_per_group: None,
                prefix_len: None,
                question_len: None,
                input_len: Some(LenRange::fixed(100)),
                output_len: Some(LenRange::fixed(11)),
                conversations: None,
                turns: None,
                prompts_file: None,
                shuffle: None,
                sessions_per_pass: 1,
                requests_per_pass: 1,
            },
            run: RunInfo {
                max_requests: None,
                duration_s: None,
                timeout_s: 1.0,
                temperature: 0.0,
                ignore_eos: false,
                extra_body: Value::Null,
                warmup_requests: 0,
                warmup_failed: 0,
                interrupted: false,
            },
            points,
        }
    }

    #[test]
    fn tables_show_the_numbers() {
        let r = report(vec![
            point(LoadPoint::Concurrency(1), 0.05, 4),
            point(LoadPoint::Concurrency(4), 0.2, 8),
        ]);
        let t = point_table(&r.points[0].summary);
        assert!(t.contains("sent 4  completed 4  failed 0"), "{t}");
        assert!(t.contains("cache hit 50.0%"), "{t}");
        assert!(t.contains("4.00 req/s"), "{t}");
        let sweep = r.sweep_table();
        assert_eq!(sweep.lines().count(), 3);
        assert!(sweep.contains("c=4") && sweep.contains("200.0"), "{sweep}");
    }

    #[test]
    fn comparison_gives_new_over_base() {
        let base = report(vec![point(LoadPoint::Concurrency(2), 0.2, 4)]);
        let new = report(vec![point(LoadPoint::Concurrency(2), 0.05, 8)]);
        let t = comparison_table(&base, &new);
        // req/s 8 / 4, TTFT 50 / 200 ms.
        assert!(t.contains("2.000x"), "{t}");
        assert!(t.contains("0.250x"), "{t}");
        assert!(t.contains("50.0 -> 50.0"), "{t}");
        assert!(!t.contains('*'));
        let other = report(vec![point(LoadPoint::Concurrency(3), 0.05, 8)]);
        assert!(comparison_table(&base, &other).contains("c=3*"));
    }

    #[test]
    fn plot_skips_infinite_rate_and_needs_one_finite_point() {
        let dir = std::env::temp_dir().join(format!("chimera-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let inf = LoadPoint::Rate {
            rate: f64::INFINITY,
            burstiness: 1.0,
            max_concurrency: None,
        };
        let only_inf = report(vec![point(inf, 0.1, 2)]);
        assert!(write_plot(&only_inf, &dir.join("a.svg")).is_err());
        let rate = |r| LoadPoint::Rate {
            rate: r,
            burstiness: 1.0,
            max_concurrency: None,
        };
        let r = report(vec![
            point(rate(2.0), 0.1, 2),
            point(rate(4.0), 0.3, 2),
            point(inf, 0.5, 2),
        ]);
        let path = dir.join("b.svg");
        write_plot(&r, &path).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.contains("request rate (req/s)") && svg.contains("throughput"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod spec_tests {
    use super::SpecDecode;

    #[test]
    fn spec_decode_counters_are_read_from_either_prefix() {
        let page = "# HELP x\n\
chimera:spec_decode_num_drafts_total{model_name=\"m\",engine=\"0\"} 10\n\
chimera:spec_decode_num_drafts_total{model_name=\"m\",engine=\"1\"} 6\n\
chimera:spec_decode_num_draft_tokens_total{engine=\"0\"} 48\n\
chimera:spec_decode_num_accepted_tokens_total{engine=\"0\"} 24\n\
chimera:spec_decode_num_accepted_tokens_per_pos_total{engine=\"0\",position=\"0\"} 14\n";
        let s = SpecDecode::parse(page);
        assert_eq!(
            (s.drafts, s.draft_tokens, s.accepted_tokens),
            (16.0, 48.0, 24.0)
        );
        let v = SpecDecode::parse(
            "vllm:spec_decode_num_drafts_total 4\nvllm:spec_decode_num_draft_tokens_total 12\nvllm:spec_decode_num_accepted_tokens_total 6\n",
        );
        let d = v.since(SpecDecode::default()).unwrap();
        assert_eq!(d.mean_acceptance_length(), 2.5);
        assert_eq!(d.acceptance_rate(), 0.5);
        assert!(v.since(v).is_none(), "no verify step in between");
        assert!(
            d.line().contains("mean acceptance length 2.50"),
            "{}",
            d.line()
        );
    }
}
