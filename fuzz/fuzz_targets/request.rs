//! Request bodies: `Request::parse` for every API on the same bytes, then the estimator and the
//! prompt-block hashing on whatever parsed, under several valid configurations.
//!
//! Invariants: nothing panics; a parsed body was a JSON object whose model, when it names one, is
//! the JSON string at the request's model span (an absent, null or empty model is the engine's own);
//! `estimate.cost` lies in [minReservationTokens, maxReservationTokens]; output never exceeds
//! outputCapTokens; the static rule is finite and >= 0; `block_hashes` returns exactly
//! min(full blocks, max) hashes, is deterministic, and a longer text keeps the shorter one's
//! hashes as a prefix. A body read for its model alone (`Request::model_only`, paths kvgate does
//! not read) names a non-empty model at its span, and its rename is read back as the new name.
#![no_main]

use kvgate::config::{Config, EstimatorConfig};
use kvgate::estimate::calibration::PromptFit;
use kvgate::estimate::output_dist::{OutputDist, BUCKETS};
use kvgate::estimate::reservation::{estimate, Learned};
use kvgate::estimate::text::static_prompt_tokens;
use kvgate::openai::request::{Api, Request};
use kvgate::routing::prefix::block_hashes;
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

const APIS: [Api; 9] = [
    Api::Completions,
    Api::ChatCompletions,
    Api::Responses,
    Api::Embeddings,
    Api::Pooling,
    Api::Messages,
    Api::Generate,
    Api::Tokens,
    Api::Score,
];

/// Estimator configurations, each accepted by `Config::parse` (so each is one an operator can
/// write): the defaults, a narrow clamp, and the widest the validation allows.
fn estimators() -> &'static [EstimatorConfig] {
    static CFGS: OnceLock<Vec<EstimatorConfig>> = OnceLock::new();
    CFGS.get_or_init(|| {
        [
            "{}",
            r#"{"estimator":{"minReservationTokens":100,"maxReservationTokens":100,
                "outputFloorTokens":0,"outputCapTokens":0,"safetyFactor":1.0}}"#,
            r#"{"estimator":{"minReservationTokens":0,"maxReservationTokens":18446744073709551615,
                "nonTextPartTokens":18446744073709551615,"defaultOutputTokens":18446744073709551615,
                "outputFloorTokens":18446744073709551615,"outputCapTokens":18446744073709551615,
                "safetyFactor":10.0}}"#,
        ]
        .iter()
        .map(|json| match Config::parse(json.as_bytes()) {
            Ok(c) => c.estimator,
            Err(e) => panic!("fuzz target's own config is invalid: {e}"),
        })
        .collect()
    })
}

/// Learned values as calibration can produce them: scale clamped to [0.1, 10], the fixed part in
/// [0, 65,536], spread in [0, 1];
/// output lengths
/// all of one token, all past 2^16, or spread over every bucket with half of them cut off.
fn learned() -> [Option<Learned>; 4] {
    let none = [0.0; BUCKETS];
    let mut shortest = none;
    shortest[0] = 1_000.0;
    let mut longest = none;
    longest[BUCKETS - 1] = 1_000.0;
    [
        None,
        Some(Learned {
            templated: PromptFit {
                scale: 0.1,
                offset: 0.0,
            },
            raw: PromptFit {
                scale: 0.1,
                offset: 0.0,
            },
            part_tokens: Some(0.0),
            prompt_spread: 0.0,
            output: OutputDist::learned(&shortest, &none, 256, 0),
            tokens_per_piece: 1.0,
        }),
        Some(Learned {
            templated: PromptFit {
                scale: 10.0,
                offset: 65_536.0,
            },
            raw: PromptFit {
                scale: 10.0,
                offset: 65_536.0,
            },
            part_tokens: Some(65_536.0),
            prompt_spread: 1.0,
            output: OutputDist::learned(&longest, &none, 1, 0),
            tokens_per_piece: 16.0,
        }),
        Some(Learned {
            templated: PromptFit {
                scale: 1.0,
                offset: 30.0,
            },
            raw: PromptFit {
                scale: 1.0,
                offset: 0.0,
            },
            part_tokens: None,
            prompt_spread: 0.05,
            output: OutputDist::learned(&[1.0; BUCKETS], &[1.0; BUCKETS], 65_536, 65_536),
            tokens_per_piece: 4.0,
        }),
    ]
}

/// (block chars, max blocks) pairs: one-character blocks, the default 64, and small caps.
const BLOCKS: [(usize, usize); 4] = [(1, 1), (1, 8192), (3, 5), (64, 8192)];

fn check_blocks(req: &Request) {
    let chars = req.text.chars().count();
    for (block_chars, max) in BLOCKS {
        let h = block_hashes(
            &req.model,
            req.cache_salt.as_deref(),
            &req.text,
            block_chars,
            max,
        );
        assert_eq!(h.len(), (chars / block_chars).min(max), "block count");
        assert_eq!(
            h,
            block_hashes(
                &req.model,
                req.cache_salt.as_deref(),
                &req.text,
                block_chars,
                max
            ),
            "deterministic"
        );
        // A conversation's next turn extends its text: its blocks extend the earlier ones.
        let longer = format!("{}<user>\nmore\n", req.text);
        let hl = block_hashes(
            &req.model,
            req.cache_salt.as_deref(),
            &longer,
            block_chars,
            max,
        );
        assert!(
            hl.starts_with(&h),
            "a longer prompt must keep the shorter one's blocks"
        );
    }
}

fn check_estimates(req: &Request) {
    let rule = static_prompt_tokens(&req.text);
    assert!(rule.is_finite() && rule >= 0.0, "static rule gave {rule}");
    // At most about two tokens per character (a pictograph is 1.5).
    assert!(
        rule <= 2.0 * req.text.chars().count() as f64 + 1.0,
        "static rule gave {rule}"
    );
    for cfg in estimators() {
        for learned in learned() {
            let e = estimate(req, learned, cfg);
            assert!(
                (cfg.min_reservation_tokens..=cfg.max_reservation_tokens).contains(&e.cost),
                "cost {} outside [{}, {}]: {e:?} {req:?}",
                e.cost,
                cfg.min_reservation_tokens,
                cfg.max_reservation_tokens
            );
            // Each of its choices runs at most to the cap.
            let cap = cfg.output_cap_tokens.saturating_mul(req.choices.max(1));
            assert_eq!(e.choices, req.choices.max(1), "{e:?}");
            assert!(e.output_tokens <= cap, "{e:?}");
            assert!(e.output_tokens <= e.max_output_tokens, "{e:?}");
            assert!(e.max_output_tokens <= cap, "{e:?}");
            let outlook = e.outlook(e.choices, 0);
            assert!(outlook.windows(2).all(|w| w[0] >= w[1]), "{outlook:?}");
            if req.max_output_tokens == Some(0) {
                assert_eq!(e.output_tokens, 0, "{e:?}");
            }
            assert!(e.prompt_tokens >= req.token_ids, "{e:?} {req:?}");
            // Only what was estimated by rule is uncertain, by at most its whole (spread ≤ 1).
            let by_rule = (e.prompt_tokens - req.token_ids) as f64 * cfg.safety_factor;
            assert!(e.prompt_sigma as f64 <= by_rule + 1.0, "{e:?} {req:?}");
        }
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = Api::from_path(s);
    }
    for api in APIS {
        let Ok(req) = Request::parse(api, data) else {
            continue;
        };
        assert_eq!(
            data.iter().find(|b| !b.is_ascii_whitespace()),
            Some(&b'{'),
            "only JSON objects parse"
        );
        let (start, end) = req.model_span;
        if end > start {
            let named: String =
                serde_json::from_slice(&data[start..end]).expect("the span is the model's string");
            assert_eq!(named, req.model, "a rename writes where the model is");
        } else {
            assert!(req.model.is_empty(), "no span, no model");
        }
        if matches!(api, Api::Embeddings | Api::Pooling | Api::Score) {
            assert_eq!(req.max_output_tokens, Some(0));
        }
        if let Some((len, _)) = req.repeated {
            assert!(req.text.is_char_boundary(len) && req.prefix_text().len() >= len);
        }
        check_estimates(&req);
        check_blocks(&req);
    }
    if let Some(req) = Request::model_only(data) {
        let (start, end) = req.model_span;
        let named: String =
            serde_json::from_slice(&data[start..end]).expect("the span is the model's string");
        assert!(!req.model.is_empty() && named == req.model, "{req:?}");
        let renamed = Request::model_only(&req.with_model(data, "target\"\u{1}"));
        assert_eq!(
            renamed.map(|r| r.model).as_deref(),
            Some("target\"\u{1}"),
            "a rename is read back"
        );
    }
});
