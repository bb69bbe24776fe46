#![cfg(not(target_arch = "wasm32"))]
//! How close the static token rule (`kvgate::estimate::text::static_prompt_tokens`) comes to real
//! tokenizers, before and after the per-model calibration kvgate learns from responses' `usage`.
//!
//! The corpus is checked in under `tests/fixtures/estimator/<category>/` (sources in its
//! README). Each file is cut into samples of a few hundred to a few thousand bytes; the ground
//! truth is tiktoken's o200k_base and cl100k_base. Three views are reported per category:
//!
//! * the static rule alone, over every sample (and over the held-out half, for comparison);
//! * after "mixed" calibration: one scale learned by kvgate's own calibration (`Calibration`, on
//!   the in-memory host) from the training half of all samples in a shuffled order, then applied
//!   to the held-out half;
//! * after per-category calibration: a model whose traffic is all of one kind (code, Chinese…)
//!   learns that kind's scale from its training half; evaluated on the held-out half.
//!
//! Run `cargo test -p kvgate --test estimator_accuracy -- --nocapture` to see the tables. Set
//! `ESTIMATOR_ACCURACY_DUMP=<file>` to also write every sample with its true counts as JSON lines
//! (for tuning the rule offline).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use kvgate::config::EstimatorConfig;
use kvgate::estimate::calibration::{self, Calibration};
use kvgate::estimate::templates::Keys;
use kvgate::estimate::text::static_prompt_tokens;
use kvgate::store::fake_host::FakeHost;
use tiktoken_rs::CoreBPE;

/// Sample sizes cycle through these UTF-8 byte targets; bytes rather than characters keep
/// samples' token counts comparable across scripts (a CJK character is three bytes and about
/// one token, an English word about five bytes and one token).
const TARGET_BYTES: [usize; 6] = [200, 350, 600, 1000, 1600, 2800];
/// A sample is cut at the first line or sentence end after its target, or here at the latest.
const MAX_BYTES: usize = 4000;

struct Sample {
    category: String,
    file: String,
    text: String,
    o200k: usize,
    cl100k: usize,
    estimate: f64,
}

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/estimator")
}

/// Whether a sample may end just after `text[..end]`: after a newline or a sentence end.
fn is_cut(text: &str, end: usize) -> bool {
    let before = &text[..end];
    before.ends_with('\n')
        || before.ends_with('。')
        || before.ends_with('！')
        || before.ends_with('？')
        || ((before.ends_with(". ") || before.ends_with("? ")) && !text[end..].starts_with(' '))
}

/// Cuts a file into samples with byte targets cycling through `TARGET_BYTES`.
fn split(text: &str, cycle: &mut usize) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut start = 0;
    while start < text.len() {
        let target = TARGET_BYTES[*cycle % TARGET_BYTES.len()];
        let mut end = None;
        let mut last_boundary = start;
        for (i, c) in text[start..].char_indices() {
            let pos = start + i + c.len_utf8();
            if pos - start > MAX_BYTES {
                break;
            }
            last_boundary = pos;
            if pos - start >= target && is_cut(text, pos) {
                end = Some(pos);
                break;
            }
        }
        let end = end.unwrap_or(if text.len() - start <= MAX_BYTES {
            text.len()
        } else {
            last_boundary
        });
        let piece = text[start..end].trim_matches(|c| c == '\n' || c == '\r');
        start = end;
        if piece.is_empty() {
            continue;
        }
        // A short tail belongs with the sample before it.
        match out.last_mut() {
            Some(prev) if piece.len() < 100 => {
                prev.push('\n');
                prev.push_str(piece);
            }
            _ => {
                out.push(piece.to_string());
                *cycle += 1;
            }
        }
    }
    out
}

fn sorted_entries(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let mut paths = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .map(|entry| entry.map(|e| e.path()).map_err(|e| e.to_string()))
        .collect::<Result<Vec<_>, _>>()?;
    paths.sort();
    Ok(paths)
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
}

fn load_corpus() -> Result<Vec<Sample>, String> {
    let o200k = tiktoken_rs::o200k_base().map_err(|e| e.to_string())?;
    let cl100k = tiktoken_rs::cl100k_base().map_err(|e| e.to_string())?;
    let count = |bpe: &CoreBPE, t: &str| bpe.encode_ordinary(t).len();
    let mut samples = Vec::new();
    for dir in sorted_entries(&fixtures_dir())?
        .into_iter()
        .filter(|p| p.is_dir())
    {
        let category = file_name(&dir);
        let mut cycle = 0;
        for file in sorted_entries(&dir)? {
            let text =
                std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
            for piece in split(&text, &mut cycle) {
                samples.push(Sample {
                    category: category.clone(),
                    file: file_name(&file),
                    o200k: count(&o200k, &piece),
                    cl100k: count(&cl100k, &piece),
                    estimate: static_prompt_tokens(&piece),
                    text: piece,
                });
            }
        }
    }
    Ok(samples)
}

/// The prompt scale kvgate's calibration learns from these (static estimate, true tokens) pairs,
/// fed in order to `Calibration::record` on a fresh in-memory host and read back as `learned`
/// does (default weights; every sample counts, whatever `minSamples` says).
// A test helper: a failing record must stop the test, as in a #[test] function.
#[allow(clippy::expect_used)]
fn learn_scale(pairs: impl Iterator<Item = (f64, usize)>) -> f64 {
    const MODEL: &str = "accuracy";
    let cfg = EstimatorConfig {
        min_samples: 1,
        ..EstimatorConfig::default()
    };
    let vm = FakeHost::new().vm();
    for (estimate, truth) in pairs {
        let sample = calibration::Sample {
            static_text_tokens: estimate,
            // Plain text, counted by the tokenizer alone: no template.
            templated: false,
            known_tokens: 0,
            parts: 0,
            prompts: 1,
            prompt_tokens: truth as u64,
            completion_tokens: 0,
            choices: 1,
            length: calibration::Length::Ended,
            bounded: false,
            pieces: 0,
            template: Keys::default(),
        };
        Calibration::record(&vm, MODEL, &[sample], &cfg).expect("the in-memory host never fails");
    }
    Calibration::default()
        .learned(&vm, MODEL, None, &cfg)
        .map_or(1.0, |learned| learned.raw.scale)
}

/// Nearest-rank quantile of unsorted values.
fn quantile(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

fn rel_err(estimate: f64, truth: usize) -> f64 {
    let truth = truth as f64;
    (estimate.round() - truth).abs() / truth
}

#[derive(Default, Clone, Copy)]
struct Stats {
    n: usize,
    median: f64,
    p90: f64,
}

fn stats(errors: &[f64]) -> Stats {
    Stats {
        n: errors.len(),
        median: quantile(errors, 0.5),
        p90: quantile(errors, 0.9),
    }
}

#[derive(Default, Clone, Copy)]
struct Row {
    /// The static rule over every sample of the row.
    static_all: Stats,
    /// Median of true/static over every sample: the rule's bias (1.0 = unbiased).
    bias: f64,
    /// The static rule over the held-out half, to compare with the calibrated columns.
    static_held_out: Stats,
    mixed: Stats,
    per_category: Stats,
    /// The scale the category's own training half taught (per-category rows only).
    category_scale: Option<f64>,
}

struct Report {
    rows: BTreeMap<String, Row>,
    all: Row,
    mixed_scale: f64,
}

/// Deterministic shuffle (xorshift), so the mixed calibration sees categories interleaved.
fn shuffled(n: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for i in (1..n).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        order.swap(i, (state % (i as u64 + 1)) as usize);
    }
    order
}

fn evaluate(samples: &[Sample], truth: impl Fn(&Sample) -> usize) -> Report {
    // Alternate samples within each category go to training and to evaluation.
    let mut train = vec![false; samples.len()];
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, s) in samples.iter().enumerate() {
        let k = seen.entry(&s.category).or_default();
        train[i] = k.is_multiple_of(2);
        *k += 1;
    }
    let order = shuffled(samples.len());
    let mixed_scale = learn_scale(
        order
            .iter()
            .filter(|&&i| train[i])
            .map(|&i| (samples[i].estimate, truth(&samples[i]))),
    );
    let category_scale: BTreeMap<&str, f64> = seen
        .keys()
        .map(|cat| {
            let pairs = samples
                .iter()
                .zip(&train)
                .filter(|(s, &t)| t && s.category == *cat)
                .map(|(s, _)| (s.estimate, truth(s)));
            (*cat, learn_scale(pairs))
        })
        .collect();
    let row = |filter: &dyn Fn(&Sample) -> bool| -> Row {
        let errors = |scale: &dyn Fn(&Sample) -> f64, held_out_only: bool| -> Vec<f64> {
            samples
                .iter()
                .zip(&train)
                .filter(|(s, &t)| filter(s) && !(held_out_only && t))
                .map(|(s, _)| rel_err(s.estimate * scale(s), truth(s)))
                .collect()
        };
        let ratios: Vec<f64> = samples
            .iter()
            .filter(|s| filter(s))
            .map(|s| truth(s) as f64 / s.estimate)
            .collect();
        Row {
            static_all: stats(&errors(&|_| 1.0, false)),
            bias: quantile(&ratios, 0.5),
            static_held_out: stats(&errors(&|_| 1.0, true)),
            mixed: stats(&errors(&|_| mixed_scale, true)),
            per_category: stats(&errors(
                &|s| {
                    category_scale
                        .get(s.category.as_str())
                        .copied()
                        .unwrap_or(1.0)
                },
                true,
            )),
            category_scale: None,
        }
    };
    let rows = category_scale
        .iter()
        .map(|(cat, scale)| {
            let r = Row {
                category_scale: Some(*scale),
                ..row(&|s: &Sample| s.category == *cat)
            };
            (cat.to_string(), r)
        })
        .collect();
    Report {
        rows,
        all: row(&|_| true),
        mixed_scale,
    }
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

fn render(name: &str, r: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n{name}: relative error |est - true| / true, median and p90.\n\
         Left: the static rule over all samples (true/static = its median bias). Right: the \
         held-out half,\nstatic and after calibration (mixed traffic learned scale {:.3}; \
         per-category scale in the last column).",
        r.mixed_scale
    );
    let _ = writeln!(
        out,
        "{:<9} {:>4} {:>6} {:>6} {:>6} | {:>4} {:>6} {:>6} | {:>9} {:>6} | {:>9} {:>6} {:>6}",
        "", "", "static", "", "true/", "", "static", "", "mixed cal", "", "per-cat", "", "",
    );
    let _ = writeln!(
        out,
        "{:<9} {:>4} {:>6} {:>6} {:>6} | {:>4} {:>6} {:>6} | {:>9} {:>6} | {:>9} {:>6} {:>6}",
        "category",
        "n",
        "median",
        "p90",
        "static",
        "n",
        "median",
        "p90",
        "median",
        "p90",
        "median",
        "p90",
        "scale",
    );
    let rule = "-".repeat(104);
    let _ = writeln!(out, "{rule}");
    let line = |out: &mut String, cat: &str, row: &Row| {
        let scale = row
            .category_scale
            .map_or_else(|| String::from("-"), |s| format!("{s:.3}"));
        let _ = writeln!(
            out,
            "{:<9} {:>4} {:>6} {:>6} {:>6.3} | {:>4} {:>6} {:>6} | {:>9} {:>6} | {:>9} {:>6} {:>6}",
            cat,
            row.static_all.n,
            pct(row.static_all.median),
            pct(row.static_all.p90),
            row.bias,
            row.static_held_out.n,
            pct(row.static_held_out.median),
            pct(row.static_held_out.p90),
            pct(row.mixed.median),
            pct(row.mixed.p90),
            pct(row.per_category.median),
            pct(row.per_category.p90),
            scale
        );
    };
    for (cat, row) in &r.rows {
        line(&mut out, cat, row);
    }
    let _ = writeln!(out, "{rule}");
    line(&mut out, "all", &r.all);
    out
}

fn dump(samples: &[Sample], path: &str) {
    let mut out = String::new();
    for s in samples {
        let line = serde_json::json!({
            "category": s.category,
            "file": s.file,
            "o200k": s.o200k,
            "cl100k": s.cl100k,
            "estimate": s.estimate,
            "text": s.text,
        });
        let _ = writeln!(out, "{line}");
    }
    if let Err(e) = std::fs::write(path, out) {
        eprintln!("cannot write {path}: {e}");
    }
}

#[test]
fn static_rule_tracks_real_tokenizers() {
    let samples = load_corpus().expect("estimator fixtures");
    if let Ok(path) = std::env::var("ESTIMATOR_ACCURACY_DUMP") {
        dump(&samples, &path);
    }
    let o200k = evaluate(&samples, |s| s.o200k);
    let cl100k = evaluate(&samples, |s| s.cl100k);
    println!(
        "{} samples, {} characters, {} o200k tokens, {} cl100k tokens",
        samples.len(),
        samples
            .iter()
            .map(|s| s.text.chars().count())
            .sum::<usize>(),
        samples.iter().map(|s| s.o200k).sum::<usize>(),
        samples.iter().map(|s| s.cl100k).sum::<usize>()
    );
    println!("{}", render("o200k_base", &o200k));
    println!("{}", render("cl100k_base", &cl100k));

    // The corpus itself: varied and large enough for the bounds below to mean something.
    assert!(samples.len() >= 150, "{} samples", samples.len());
    for (cat, row) in &o200k.rows {
        assert!(row.static_all.n >= 8, "{cat}: {} samples", row.static_all.n);
    }

    // Bounds sit well above what the rule measures (see the tables), so they catch a broken rule
    // rather than noise. o200k, the static rule alone:
    let all = &o200k.all;
    assert!(
        all.static_all.median < 0.04,
        "o200k median {}",
        pct(all.static_all.median)
    );
    assert!(
        all.static_all.p90 < 0.12,
        "o200k p90 {}",
        pct(all.static_all.p90)
    );
    assert!(
        (0.95..=1.05).contains(&all.bias),
        "o200k bias {:.3}",
        all.bias
    );
    for (cat, row) in &o200k.rows {
        let s = row.static_all;
        // Other European languages split into more tokens per word than English (and Russian
        // fewer than the rule's four letters a token): a language's bias is the per-model
        // calibration's job, so only a loose bound here.
        let (median, p90) = if cat == "european" {
            (0.20, 0.40)
        } else {
            (0.10, 0.30)
        };
        assert!(s.median < median, "o200k {cat}: median {}", pct(s.median));
        assert!(s.p90 < p90, "o200k {cat}: p90 {}", pct(s.p90));
    }
    // ... after calibration, on held-out samples.
    assert!(
        all.mixed.median < 0.05,
        "o200k mixed-cal median {}",
        pct(all.mixed.median)
    );
    assert!(
        all.mixed.p90 < 0.15,
        "o200k mixed-cal p90 {}",
        pct(all.mixed.p90)
    );
    assert!(
        all.per_category.median < 0.05,
        "o200k per-cat median {}",
        pct(all.per_category.median)
    );
    assert!(
        all.per_category.p90 < 0.15,
        "o200k per-cat p90 {}",
        pct(all.per_category.p90)
    );

    // cl100k spends about 1.5 tokens per CJK character where o200k spends 0.8, so the static rule
    // is off there, and calibration (per model, so per tokenizer) is what closes the gap.
    let all = &cl100k.all;
    assert!(
        all.static_all.median < 0.05,
        "cl100k median {}",
        pct(all.static_all.median)
    );
    assert!(
        all.per_category.median < 0.05,
        "cl100k per-cat median {}",
        pct(all.per_category.median)
    );
    assert!(
        all.per_category.p90 < 0.15,
        "cl100k per-cat p90 {}",
        pct(all.per_category.p90)
    );
    for (cat, row) in &cl100k.rows {
        let s = row.per_category;
        assert!(
            s.median < 0.12,
            "cl100k {cat}: per-cat median {}",
            pct(s.median)
        );
    }
}
