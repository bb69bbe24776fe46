//! Token-cost estimation: how many tokens a request's prompt holds (from its text, without a
//! tokenizer) and how many it will generate, combined into the reservation kvgate charges a pod.
//!
//! The static rule counts characters, not bytes, by script: a run of Latin letters is about one
//! token per word plus one per long-word split, CJK about one token per character, digits in groups
//! of three, punctuation and symbols in between. Learned corrections (see `calibration`) scale it
//! per model once responses' `usage` has been seen.

use crate::config::EstimatorConfig;
use crate::request::Request;

/// Letters a BPE vocabulary typically keeps in one token before splitting a long word.
const LETTERS_PER_TOKEN: f64 = 7.0;
/// Modern vocabularies group digits by three (o200k, cl100k, Llama 3).
const DIGITS_PER_TOKEN: f64 = 3.0;
const PUNCT_TOKENS: f64 = 0.55;
const CJK_TOKENS: f64 = 0.8;
const OTHER_LETTERS_PER_TOKEN: f64 = 3.0;
const SYMBOL_TOKENS: f64 = 1.5;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    Letter,
    Digit,
    Space,
    Newline,
    Punct,
    Cjk,
    OtherLetter,
    Symbol,
}

fn class(c: char) -> Class {
    match c {
        'a'..='z' | 'A'..='Z' => Class::Letter,
        '0'..='9' => Class::Digit,
        ' ' | '\t' => Class::Space,
        '\n' | '\r' => Class::Newline,
        c if c.is_ascii() => Class::Punct,
        '\u{3000}'..='\u{303f}' | '\u{ff00}'..='\u{ffef}' => Class::Punct,
        '\u{2e80}'..='\u{9fff}' | '\u{ac00}'..='\u{d7af}' | '\u{f900}'..='\u{faff}' => Class::Cjk,
        '\u{20000}'..='\u{2fa1f}' => Class::Cjk,
        c if c.is_alphabetic() => Class::OtherLetter,
        c if c.is_whitespace() => Class::Space,
        _ => Class::Symbol,
    }
}

/// Prompt tokens by the static rule, before any learned correction.
pub fn static_prompt_tokens(text: &str) -> f64 {
    let mut tokens = 0.0;
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        let k = class(c);
        let mut run = 1usize;
        // Runs of the same class are tokenized together; punctuation, CJK and symbols are
        // charged per character so they need no run.
        if matches!(
            k,
            Class::Letter | Class::Digit | Class::Space | Class::Newline | Class::OtherLetter
        ) {
            while chars.peek().is_some_and(|&n| class(n) == k) {
                chars.next();
                run += 1;
            }
        }
        let run = run as f64;
        tokens += match k {
            Class::Letter => 1.0 + ((run - 1.0) / LETTERS_PER_TOKEN).floor(),
            Class::Digit => (run / DIGITS_PER_TOKEN).ceil(),
            // A single space joins the next word; longer runs (indentation) are a token or so.
            Class::Space => {
                if run > 1.0 {
                    1.0
                } else {
                    0.0
                }
            }
            Class::Newline => 1.0,
            Class::Punct => PUNCT_TOKENS,
            Class::Cjk => CJK_TOKENS,
            Class::OtherLetter => (run / OTHER_LETTERS_PER_TOKEN).ceil(),
            Class::Symbol => SYMBOL_TOKENS,
        };
    }
    tokens
}

/// What was learned for a model from responses, if enough has been seen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Learned {
    /// Real prompt tokens per static-rule token.
    pub prompt_scale: f64,
    /// The configured quantile of observed output lengths.
    pub output_quantile: f64,
}

/// The estimate for one request, in tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Estimate {
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    /// What to reserve: (prompt + output) × safety factor, clamped.
    pub cost: u64,
}

pub fn estimate(req: &Request, learned: Option<Learned>, cfg: &EstimatorConfig) -> Estimate {
    let scale = learned.map_or(1.0, |l| l.prompt_scale);
    let text_tokens = (static_prompt_tokens(&req.text) * scale).round() as u64;
    let prompt_tokens = text_tokens
        .saturating_add(req.token_ids)
        .saturating_add(req.non_text_parts.saturating_mul(cfg.non_text_part_tokens));
    let typical = learned.map_or(cfg.default_output_tokens, |l| {
        l.output_quantile.ceil() as u64
    });
    let output_tokens = match req.max_output_tokens {
        Some(0) => 0,
        Some(max) => max.min(typical.max(cfg.output_floor_tokens)),
        None => typical.max(cfg.output_floor_tokens),
    }
    .min(cfg.output_cap_tokens);
    let raw = prompt_tokens.saturating_add(output_tokens) as f64 * cfg.safety_factor;
    let cost = (raw.ceil() as u64).clamp(cfg.min_reservation_tokens, cfg.max_reservation_tokens);
    Estimate {
        prompt_tokens,
        output_tokens,
        cost,
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    fn req(text: &str, max: Option<u64>) -> Request {
        Request {
            model: "m".into(),
            text: text.into(),
            max_output_tokens: max,
            ..Request::default()
        }
    }

    #[test]
    fn counts_characters_not_bytes() {
        // Six CJK characters are 18 bytes but about five tokens.
        let cjk = static_prompt_tokens("你好世界你好");
        assert!((4.0..=6.0).contains(&cjk), "{cjk}");
        let latin = static_prompt_tokens("the quick brown fox jumps over the lazy dog");
        assert!((8.0..=11.0).contains(&latin), "{latin}");
        assert_eq!(static_prompt_tokens("1234567"), 3.0);
        assert_eq!(static_prompt_tokens(""), 0.0);
    }

    #[test]
    fn output_is_the_smaller_of_limit_and_typical() {
        let cfg = EstimatorConfig::default();
        assert_eq!(estimate(&req("x", Some(10)), None, &cfg).output_tokens, 10);
        assert_eq!(
            estimate(&req("x", Some(100_000)), None, &cfg).output_tokens,
            256
        );
        assert_eq!(estimate(&req("x", None), None, &cfg).output_tokens, 256);
        let learned = Learned {
            prompt_scale: 1.0,
            output_quantile: 900.0,
        };
        assert_eq!(
            estimate(&req("x", None), Some(learned), &cfg).output_tokens,
            900
        );
        assert_eq!(estimate(&req("x", Some(0)), None, &cfg).output_tokens, 0);
        let small = Learned {
            prompt_scale: 1.0,
            output_quantile: 3.0,
        };
        assert_eq!(
            estimate(&req("x", None), Some(small), &cfg).output_tokens,
            16
        );
    }

    #[test]
    fn cost_applies_safety_and_clamps() {
        let cfg = EstimatorConfig::default();
        let e = estimate(&req(&"word ".repeat(1000), Some(1000)), None, &cfg);
        assert_eq!(e.prompt_tokens, 1000);
        assert_eq!(e.output_tokens, 256);
        assert_eq!(e.cost, 1382); // (1000 + 256) × 1.1, rounded up
        assert_eq!(estimate(&req("", Some(1)), None, &cfg).cost, 64);
        let huge = Request {
            token_ids: 10_000_000,
            ..req("", Some(1))
        };
        assert_eq!(estimate(&huge, None, &cfg).cost, 131_072);
    }

    #[test]
    fn token_ids_are_exact_and_parts_charged() {
        let cfg = EstimatorConfig::default();
        let r = Request {
            token_ids: 123,
            non_text_parts: 2,
            ..req("", Some(0))
        };
        assert_eq!(estimate(&r, None, &cfg).prompt_tokens, 123 + 1024);
    }
}
