//! A pod's token budget and whether a request fits it. By default the budget is the engine's
//! own KV capacity (`num_gpu_blocks × block_size`, from its metrics) times a utilisation target;
//! a configured value overrides it. Either is corrected by what the engine's own numbers say
//! (`feedback`: backed off after preemptions, less the KV kvgate cannot account for). A request
//! fits when the pod's KV forecast with it added (`forecast`) stays within the budget. Until a pod's first scrape says how large it is, it takes one
//! request at a time (kvgate will not guess, and will not flood a pod it knows nothing of); a pod
//! whose metrics carry no capacity, one whose metrics could not be read at all
//! (`pods::scrape::UNREADABLE_SCRAPES` in a row), or any pod when nothing is scraped, is not
//! limited.

use crate::admission::forecast::Load;
use crate::config::Config;
use crate::estimate::reservation::Estimate;
use crate::pods::record::{At, PodRecord, Snapshot};

pub fn budget_tokens(cfg: &Config, snapshot: Option<&Snapshot>) -> Option<u64> {
    let a = &cfg.admission;
    if !a.enabled {
        return None;
    }
    let nominal = if a.budget_tokens > 0 {
        a.budget_tokens
    } else {
        match snapshot {
            Some(s) if s.capacity_tokens > 0 => (s.capacity_tokens as f64 * a.utilization) as u64,
            Some(s) if s.healthy => return None,
            _ if cfg.metrics.cluster.is_empty() => return None,
            // Not scraped yet (or down): room for one request, which `fits` always allows alone.
            _ => return Some(0),
        }
    };
    Some(snapshot.map_or(nominal, |s| {
        ((nominal as f64 * (1.0 - s.backoff.clamp(0.0, 1.0))) as u64)
            .saturating_sub(s.unexplained_tokens)
    }))
}

/// A request fits when the pod's forecast with it at `now_ms` stays within the budget, or when
/// the pod has nothing in flight: a request larger than any budget still runs, alone, rather
/// than waiting forever. Not with several gateway replicas (`etcd`): this record holds only this replica's
/// requests, so "alone" says nothing of the others' on the pod. And its engine has a seat for it
/// (`pods::seats`): with several replicas, each fills the share of the seats its grant is of the
/// budget.
pub fn fits(
    rec: &PodRecord,
    request: Load,
    budget: Option<u64>,
    cfg: &Config,
    block_tokens: u64,
    now_ms: u64,
) -> bool {
    if !cfg.admission.enabled {
        return true;
    }
    let share = match budget {
        Some(b) if cfg.etcd.enabled() => budget_tokens(cfg, rec.snapshot.as_ref())
            .filter(|&whole| whole > 0)
            .map_or(1.0, |whole| b as f64 / whole as f64),
        _ => 1.0,
    };
    if !crate::pods::seats::room(rec, &request, share, cfg) {
        return false;
    }
    budget.is_none_or(|b| {
        let at = At::of(cfg, now_ms);
        (rec.entries.is_empty() && !cfg.etcd.enabled())
            || rec.forecast(Some(request), cfg.admission.headroom(), block_tokens, at) <= b
    })
}

/// What the request takes of a pod holding nothing else, as admission forecasts it (`fits`): its
/// prompt with the estimate's margin (`routing::router` charges no less where nothing of it is
/// cached), and its answers as far ahead as the forecast looks. With several gateway replicas,
/// the credit a replica asks for in one step for the request heading its line (`replicas::split`:
/// asked for at its cost, what it is expected to take when done, a request with a `max_tokens`
/// of 800 was handed 1,150 tokens of a pod where admission needed about 1,400, and never fitted).
pub fn need(est: &Estimate, cfg: &Config, block_tokens: u64, now_ms: u64) -> u64 {
    let held = est.held_prompt_tokens(block_tokens, true)
        * cfg.estimator.safety_factor
        * est.prompt_margin;
    let alone = Load::fresh(est, held.round() as u64, est.prompt_sigma);
    PodRecord::default().forecast(
        Some(alone),
        cfg.admission.headroom(),
        block_tokens,
        At::of(cfg, now_ms),
    )
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use crate::admission::forecast::Headroom;
    use crate::estimate::output_dist::{Outlook, OutputDist, HORIZON_STEPS};
    use crate::pods::record::RequestEntry;

    /// A configuration whose pods are scraped for their metrics.
    fn scraping() -> Config {
        let mut cfg = Config::default();
        cfg.metrics.cluster = "kvgate_metrics".into();
        cfg
    }

    /// A healthy pod's scrape, with its KV capacity.
    fn scraped(capacity_tokens: u64) -> Snapshot {
        Snapshot {
            healthy: true,
            capacity_tokens,
            ..Snapshot::default()
        }
    }

    /// Running through the whole of the forecast's horizon.
    const RUNNING: Outlook = [255; HORIZON_STEPS.len()];

    #[test]
    fn derived_configured_unknown_or_unlimited() {
        let mut cfg = scraping();
        let snap = scraped(1000);
        assert_eq!(budget_tokens(&cfg, Some(&snap)), Some(1000), "the whole KV");
        cfg.admission.utilization = 0.95;
        assert_eq!(budget_tokens(&cfg, Some(&snap)), Some(950));
        assert_eq!(
            budget_tokens(&cfg, None),
            Some(0),
            "not scraped yet: one at a time"
        );
        let no_capacity = scraped(0);
        assert_eq!(budget_tokens(&cfg, Some(&no_capacity)), None);
        cfg.admission.budget_tokens = 50;
        assert_eq!(budget_tokens(&cfg, Some(&snap)), Some(50));
        cfg.admission.enabled = false;
        assert_eq!(budget_tokens(&cfg, Some(&snap)), None);
        let unscraped = Config::default();
        assert_eq!(budget_tokens(&unscraped, None), None);
    }

    #[test]
    fn the_engines_feedback_corrects_the_budget() {
        let mut cfg = scraping();
        let snap = Snapshot {
            backoff: 0.2,
            unexplained_tokens: 100,
            ..scraped(1000)
        };
        assert_eq!(budget_tokens(&cfg, Some(&snap)), Some(1000 * 8 / 10 - 100));
        cfg.admission.budget_tokens = 500;
        assert_eq!(
            budget_tokens(&cfg, Some(&snap)),
            Some(300),
            "a fixed budget too"
        );
    }

    #[test]
    fn a_request_needs_what_fits_checks_on_an_empty_pod_not_its_expected_cost() {
        // 552 prompt tokens, answers of 400 expected and `max_tokens` 800.
        let est = Estimate {
            output_tokens: 400,
            max_output_tokens: 800,
            output: OutputDist::prior(400),
            cost: 952,
            ..Estimate::exact(552, 800)
        };
        let mut cfg = Config::default();
        cfg.etcd.cluster = "etcd".into();
        let need = need(&est, &cfg, 16, 0);
        // Its bound is kept for: far more than it is expected to take, at most all of it with
        // the partial blocks and the stream's lag the forecast allows for (`forecast::slack`).
        assert!(need > est.cost + 200, "{need}");
        let prompt = (552.0 * cfg.estimator.safety_factor).round() as u64;
        assert!(need <= prompt + 800 + 3 * 16, "{need}");
        // Exactly what admission asks of a pod holding nothing else (with etcd on, a request
        // alone is checked too).
        let load = Load::fresh(&est, prompt, est.prompt_sigma);
        let empty = PodRecord::default();
        assert!(fits(&empty, load, Some(need), &cfg, 16, 0));
        assert!(!fits(&empty, load, Some(need - 1), &cfg, 16, 0));
    }

    #[test]
    fn fits_within_the_forecast_or_alone() {
        let cfg = Config::default();
        let load = |held| Load {
            held,
            sigma: 0,
            left: 1,
            rate: 1,
            bounded: false,
            guessed: false,
            streamed: 0,
            ahead: None,
            outlook: RUNNING,
        };
        let holding = |held| PodRecord {
            entries: vec![RequestEntry {
                held_tokens: held,
                left: 1,
                outlook: RUNNING,
                ..RequestEntry::default()
            }],
            ..PodRecord::default()
        };
        let empty = PodRecord::default();
        assert!(
            fits(&empty, load(10), Some(5), &cfg, 0, 0),
            "alone it always fits"
        );
        // Each holds what it holds, plus the one token it has left to generate.
        assert!(fits(&holding(4), load(4), Some(10), &cfg, 0, 0));
        assert!(!fits(&holding(5), load(4), Some(10), &cfg, 0, 0));
        assert!(
            !fits(&holding(3), load(4), Some(10), &cfg, 1, 0),
            "a partial block each"
        );
        assert!(fits(&holding(u64::MAX / 4), load(5), None, &cfg, 16, 0));
    }

    #[test]
    fn headroom_the_engine_gave_up_admits_on_expectation() {
        let cfg = Config::default();
        let outlook = OutputDist::prior(256).outlook(0, 8192);
        let unbounded = |held| Load {
            held,
            sigma: 0,
            left: 8192,
            rate: 1,
            bounded: false,
            guessed: false,
            streamed: 0,
            ahead: None,
            outlook,
        };
        let mut rec = PodRecord {
            entries: (0..8)
                .map(|id| RequestEntry {
                    id,
                    held_tokens: 1000,
                    left: 8192,
                    outlook,
                    ..RequestEntry::default()
                })
                .collect(),
            snapshot: Some(Snapshot::default()),
            ..PodRecord::default()
        };
        let with_headroom = rec.forecast(
            Some(unbounded(1000)),
            cfg.admission.headroom(),
            16,
            At::UNTIMED,
        );
        let expected = rec.forecast(
            Some(unbounded(1000)),
            Headroom::uniform(0.0),
            16,
            At::UNTIMED,
        );
        assert!(expected < with_headroom);
        let budget = Some((expected + with_headroom) / 2);
        assert!(!fits(&rec, unbounded(1000), budget, &cfg, 16, 0));
        if let Some(s) = rec.snapshot.as_mut() {
            s.relief = 1.0;
        }
        assert!(
            fits(&rec, unbounded(1000), budget, &cfg, 16, 0),
            "all the headroom given up: the expectation alone"
        );
        for e in rec.entries.iter_mut() {
            e.bounded = true;
        }
        assert!(
            !fits(&rec, unbounded(1000), budget, &cfg, 16, 0),
            "requests with max_tokens keep their whole headroom"
        );
    }
}
