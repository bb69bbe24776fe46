//! Per-request records and their summary (percentiles, throughput, goodput, errors, pod share).

use std::collections::BTreeMap;

use serde::Serialize;

use crate::client::Outcome;

/// One request's outcome, written as one JSON line.
#[derive(Debug, Clone, Serialize, Default)]
pub struct Record {
    pub job: usize,
    pub turn: usize,
    /// Seconds from the start of the run to sending the request.
    pub sent: f64,
    /// The request's `max_tokens` (none: the server decided when to stop), so that what an
    /// answer's length could have been known from is in the record beside it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    #[serde(flatten)]
    pub outcome: Outcome,
    pub tags: BTreeMap<String, String>,
}

/// Percentile of sorted values, linear interpolation between closest ranks (numpy's default).
pub fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let q = q.clamp(0.0, 100.0);
    let pos = q / 100.0 * (sorted.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    let frac = pos - lo as f64;
    Some(sorted[lo] + (sorted[hi] - sorted[lo]) * frac)
}

pub fn mean(v: &[f64]) -> Option<f64> {
    if v.is_empty() {
        None
    } else {
        Some(v.iter().sum::<f64>() / v.len() as f64)
    }
}

#[derive(Debug, Clone, Serialize, Default, PartialEq)]
pub struct Dist {
    pub n: usize,
    pub mean: Option<f64>,
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
    pub max: Option<f64>,
}

impl Dist {
    pub fn of(mut v: Vec<f64>) -> Dist {
        v.retain(|x| x.is_finite());
        v.sort_by(f64::total_cmp);
        Dist {
            n: v.len(),
            mean: mean(&v),
            p50: percentile(&v, 50.0),
            p90: percentile(&v, 90.0),
            p99: percentile(&v, 99.0),
            max: v.last().copied(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct Summary {
    pub requests: usize,
    pub ok: usize,
    /// Responses other than 200, by status ("0" = no response).
    pub errors: BTreeMap<String, usize>,
    /// From the first send to the last response end, seconds.
    pub duration_s: f64,
    pub ttft_ms: Dist,
    pub itl_ms: Dist,
    pub e2e_ms: Dist,
    pub output_tokens: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub output_tok_per_s: f64,
    pub ok_per_s: f64,
    pub ttft_slo_ms: f64,
    /// Successful requests whose TTFT met the objective.
    pub goodput: usize,
    pub goodput_fraction: f64,
    pub goodput_per_s: f64,
    /// Requests served per pod (`x-sim-pod`).
    pub pod_share: BTreeMap<String, usize>,
}

impl Summary {
    pub fn of(records: &[&Record], ttft_slo_ms: f64) -> Summary {
        let mut s = Summary {
            requests: records.len(),
            ttft_slo_ms,
            ..Summary::default()
        };
        let mut start = f64::INFINITY;
        let mut end: f64 = 0.0;
        let mut ttft = Vec::new();
        let mut itl = Vec::new();
        let mut e2e = Vec::new();
        for r in records {
            start = start.min(r.sent);
            end = end.max(r.sent + r.outcome.e2e);
            if r.outcome.status != 200 || r.outcome.error.is_some() {
                let key = if r.outcome.status == 200 {
                    "200-broken".to_string()
                } else {
                    r.outcome.status.to_string()
                };
                *s.errors.entry(key).or_default() += 1;
                continue;
            }
            s.ok += 1;
            if let Some(p) = &r.outcome.pod {
                *s.pod_share.entry(p.clone()).or_default() += 1;
            }
            s.output_tokens += r.outcome.completion_tokens.unwrap_or(r.outcome.chunks);
            s.prompt_tokens += r.outcome.prompt_tokens.unwrap_or(0);
            s.cached_tokens += r.outcome.cached_tokens.unwrap_or(0);
            e2e.push(r.outcome.e2e * 1000.0);
            if let Some(t) = r.outcome.ttft {
                ttft.push(t * 1000.0);
                if t * 1000.0 <= ttft_slo_ms {
                    s.goodput += 1;
                }
            }
            itl.extend_from_slice(&r.outcome.itl);
        }
        s.duration_s = if end > start { end - start } else { 0.0 };
        if s.duration_s > 0.0 {
            s.output_tok_per_s = s.output_tokens as f64 / s.duration_s;
            s.ok_per_s = s.ok as f64 / s.duration_s;
            s.goodput_per_s = s.goodput as f64 / s.duration_s;
        }
        if s.requests > 0 {
            s.goodput_fraction = s.goodput as f64 / s.requests as f64;
        }
        s.ttft_ms = Dist::of(ttft);
        s.itl_ms = Dist::of(itl);
        s.e2e_ms = Dist::of(e2e);
        s
    }
}

/// Tags broken down in the report.
pub const BREAKDOWN: [&str; 3] = ["class", "tenant", "cost"];

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub overall: Summary,
    /// tag → value → summary, for the tags in `BREAKDOWN` that the workload sets.
    pub by: BTreeMap<String, BTreeMap<String, Summary>>,
}

pub fn report(records: &[Record], ttft_slo_ms: f64) -> Report {
    let all: Vec<&Record> = records.iter().collect();
    let mut by = BTreeMap::new();
    for tag in BREAKDOWN {
        let mut groups: BTreeMap<String, Vec<&Record>> = BTreeMap::new();
        for r in records {
            if let Some(v) = r.tags.get(tag) {
                groups.entry(v.clone()).or_default().push(r);
            }
        }
        if !groups.is_empty() {
            let m: BTreeMap<String, Summary> = groups
                .into_iter()
                .map(|(k, v)| (k, Summary::of(&v, ttft_slo_ms)))
                .collect();
            by.insert(tag.to_string(), m);
        }
    }
    Report {
        overall: Summary::of(&all, ttft_slo_ms),
        by,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_match_numpy_linear() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(5.5));
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&v, 100.0), Some(10.0));
        // numpy.percentile(range(1, 11), 90) == 9.1, 99 -> 9.91
        assert!((percentile(&v, 90.0).unwrap_or(0.0) - 9.1).abs() < 1e-9);
        assert!((percentile(&v, 99.0).unwrap_or(0.0) - 9.91).abs() < 1e-9);
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&[3.0], 99.0), Some(3.0));
    }

    #[test]
    fn dist_sorts_and_ignores_non_finite() {
        let d = Dist::of(vec![3.0, f64::NAN, 1.0, 2.0]);
        assert_eq!(d.n, 3);
        assert_eq!(d.p50, Some(2.0));
        assert_eq!(d.mean, Some(2.0));
        assert_eq!(d.max, Some(3.0));
        assert_eq!(Dist::of(vec![]).mean, None);
    }

    fn rec(sent: f64, status: u16, ttft: Option<f64>, tokens: u64, pod: &str) -> Record {
        Record {
            sent,
            outcome: Outcome {
                status,
                ttft,
                e2e: 1.0,
                itl: vec![10.0, 20.0],
                completion_tokens: Some(tokens),
                pod: Some(pod.into()),
                ..Outcome::default()
            },
            ..Record::default()
        }
    }

    #[test]
    fn summary_counts_goodput_errors_throughput_and_share() {
        let mut rs = vec![
            rec(0.0, 200, Some(0.1), 10, "0"),
            rec(0.5, 200, Some(0.3), 10, "1"),
            rec(1.0, 200, Some(0.05), 10, "1"),
            rec(1.0, 503, None, 0, "1"),
            rec(0.0, 0, None, 0, ""),
        ];
        rs[3].outcome.e2e = 0.01;
        rs[4].outcome.error = Some("timeout".into());
        let r = report(&rs, 200.0);
        let s = &r.overall;
        assert_eq!((s.requests, s.ok, s.goodput), (5, 3, 2));
        assert_eq!(s.errors.get("503"), Some(&1));
        assert_eq!(s.errors.get("0"), Some(&1));
        assert_eq!(s.duration_s, 2.0);
        assert_eq!(s.output_tokens, 30);
        assert_eq!(s.output_tok_per_s, 15.0);
        assert_eq!(s.pod_share.get("1"), Some(&2));
        assert_eq!(s.itl_ms.n, 6);
        assert!((s.goodput_fraction - 0.4).abs() < 1e-12);
        assert!(r.by.is_empty());
    }

    #[test]
    fn report_breaks_down_by_tags() {
        let mut a = rec(0.0, 200, Some(0.1), 5, "0");
        a.tags.insert("class".into(), "critical".into());
        let mut b = rec(0.0, 200, Some(0.9), 5, "0");
        b.tags.insert("class".into(), "batch".into());
        let r = report(&[a, b], 500.0);
        let by = &r.by["class"];
        assert_eq!(by["critical"].goodput, 1);
        assert_eq!(by["batch"].goodput, 0);
    }
}
