//! Token-cost estimation: how many tokens a request's prompt holds (from its text, without a
//! tokenizer) and how many it will generate, combined into the reservation kvgate charges a pod.
//!
//! The static rule walks the text's characters (not bytes) once and mirrors how modern BPE
//! tokenizers (o200k, cl100k, Llama 3) pre-split text: one token per word, with camelCase humps,
//! long words and accented words costing more; digits in groups of three; a punctuation run costs
//! about one token, a lone mark between word characters (`a.b`, `snake_case`, `it's`) joins the
//! word after it, and repeated marks (`====`) merge; indentation runs and line breaks are a token
//! each; Han, kana and hangul just under one token per character. Measured against tiktoken in
//! `tests/estimator_accuracy.rs`. Learned corrections (see `calibration`) scale it per model once
//! responses' `usage` has been seen.

use crate::config::EstimatorConfig;
use crate::request::Request;

/// Letters of a word piece its first token covers; common long words are one token, rare ones
/// split, so each further letter adds `LONG_WORD_EXTRA_TOKENS`.
const LONG_WORD_LETTERS: usize = 8;
const LONG_WORD_EXTRA_TOKENS: f64 = 0.125;
/// A word with an accented Latin letter (é, ü, ñ…) splits more in English-heavy vocabularies.
const ACCENTED_WORD_TOKENS: f64 = 1.0;
/// Modern vocabularies group digits by three (o200k, cl100k, Llama 3).
const DIGITS_PER_TOKEN: usize = 3;
/// Numbers do not absorb the space before them, so that space is a token of its own.
const SPACE_BEFORE_DIGIT_TOKENS: f64 = 1.0;
/// A run of two or more spaces (indentation, alignment); its last space joins the next word.
const INDENT_TOKENS: f64 = 1.0;
/// A run of line breaks, unless punctuation just before it absorbs it (`;\n`, `.\n\n`).
const NEWLINE_TOKENS: f64 = 1.0;
/// The first mark of a punctuation run.
const PUNCT_TOKENS: f64 = 1.0;
/// A lone mark after a word character and before a letter (`.field`, `_name`, `'s`, `(arg`)
/// mostly merges into the word that follows.
const ATTACHED_PUNCT_TOKENS: f64 = 0.3;
/// Further marks of a run often merge (`");`, `"},{"`).
const PUNCT_MORE_TOKENS: f64 = 0.2;
/// A mark repeating the one before it (`---`, `====`, `**`) almost always merges.
const PUNCT_REPEAT_TOKENS: f64 = 0.05;
/// Han, kana, hangul and CJK punctuation, per character: common pairs merge, rare characters split.
const CJK_TOKENS: f64 = 0.78;
/// Other alphabets (Cyrillic, Greek, Arabic…).
const OTHER_LETTERS_PER_TOKEN: usize = 4;
const SYMBOL_TOKENS: f64 = 1.0;
/// Emoji and other pictographs outside the BMP are often two byte-level tokens.
const PICTOGRAPH_TOKENS: f64 = 1.5;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    /// Latin letters, accented ones included.
    Lower,
    Upper,
    Digit,
    Space,
    Newline,
    Punct,
    CjkPunct,
    Cjk,
    OtherLetter,
    Pictograph,
    Symbol,
}

impl Class {
    fn is_letter(self) -> bool {
        matches!(self, Class::Lower | Class::Upper)
    }
}

/// Classes of the ASCII characters, looked up rather than matched: most prompts are mostly ASCII
/// and this loop runs over every character of every prompt.
const ASCII_CLASS: [Class; 128] = {
    let mut table = [Class::Punct; 128];
    let mut i = 0;
    while i < 128 {
        let b = i as u8;
        table[i] = match b {
            b'a'..=b'z' => Class::Lower,
            b'A'..=b'Z' => Class::Upper,
            b'0'..=b'9' => Class::Digit,
            b'\n' | b'\r' => Class::Newline,
            b' ' | b'\t' | 0x0b | 0x0c => Class::Space,
            _ => Class::Punct,
        };
        i += 1;
    }
    table
};

fn class(c: char) -> Class {
    if let Some(k) = ASCII_CLASS.get(c as usize) {
        return *k;
    }
    match c {
        'a'..='z' => Class::Lower,
        'A'..='Z' => Class::Upper,
        '0'..='9' => Class::Digit,
        '\n' | '\r' => Class::Newline,
        c if c.is_whitespace() => Class::Space,
        c if c.is_ascii() => Class::Punct,
        // General punctuation: curly quotes, dashes, ellipsis.
        '\u{2000}'..='\u{206f}' => Class::Punct,
        '\u{3000}'..='\u{303f}' | '\u{ff00}'..='\u{ffef}' => Class::CjkPunct,
        '\u{2e80}'..='\u{9fff}' | '\u{ac00}'..='\u{d7af}' | '\u{f900}'..='\u{faff}' => Class::Cjk,
        '\u{20000}'..='\u{2fa1f}' => Class::Cjk,
        // Combining accents continue the Latin word they decorate.
        '\u{300}'..='\u{36f}' => Class::Lower,
        '\u{c0}'..='\u{24f}' | '\u{1e00}'..='\u{1eff}' if c.is_alphabetic() => {
            if c.is_uppercase() {
                Class::Upper
            } else {
                Class::Lower
            }
        }
        c if c.is_alphabetic() => Class::OtherLetter,
        '\u{1f000}'..='\u{1faff}' => Class::Pictograph,
        _ => Class::Symbol,
    }
}

/// Prompt tokens by the static rule, before any learned correction.
pub fn static_prompt_tokens(text: &str) -> f64 {
    let mut tokens = 0.0;
    // The start of the text behaves like the start of a line.
    let (mut prev, mut prev_char) = (Class::Newline, '\n');
    // Characters so far in the current word piece, digit run or other-alphabet run.
    let mut run = 0usize;
    let mut accented = false;
    let mut chars = text.chars();
    let mut current = chars.next().map(|c| (c, class(c)));
    while let Some((c, k)) = current {
        let following = chars.next().map(|n| (n, class(n)));
        let next = following.map_or(Class::Newline, |(_, n)| n);
        tokens += match k {
            Class::Lower | Class::Upper => {
                let mut t = 0.0;
                // A piece starts after a non-letter and at a camelCase hump.
                if !prev.is_letter() || (prev == Class::Lower && k == Class::Upper) {
                    t += 1.0;
                    run = 0;
                    accented = false;
                }
                run += 1;
                if run > LONG_WORD_LETTERS {
                    t += LONG_WORD_EXTRA_TOKENS;
                }
                if !accented && !c.is_ascii() {
                    accented = true;
                    t += ACCENTED_WORD_TOKENS;
                }
                t
            }
            Class::Digit | Class::OtherLetter => {
                if prev != k {
                    run = 0;
                }
                run += 1;
                let per_token = if k == Class::Digit {
                    DIGITS_PER_TOKEN
                } else {
                    OTHER_LETTERS_PER_TOKEN
                };
                if (run - 1).is_multiple_of(per_token) {
                    1.0
                } else {
                    0.0
                }
            }
            // Spaces are charged at the end of their run; a single space joins the next word.
            Class::Space if next != Class::Space => {
                let mut t = 0.0;
                if prev == Class::Space && next != Class::Newline {
                    t += INDENT_TOKENS;
                }
                if next == Class::Digit {
                    t += SPACE_BEFORE_DIGIT_TOKENS;
                }
                t
            }
            Class::Space => 0.0,
            Class::Newline => match prev {
                Class::Newline | Class::Punct | Class::CjkPunct => 0.0,
                _ => NEWLINE_TOKENS,
            },
            Class::Punct if prev == Class::Punct => {
                if prev_char == c {
                    PUNCT_REPEAT_TOKENS
                } else {
                    PUNCT_MORE_TOKENS
                }
            }
            Class::Punct if next.is_letter() && prev != Class::Space => ATTACHED_PUNCT_TOKENS,
            Class::Punct => PUNCT_TOKENS,
            Class::CjkPunct | Class::Cjk => CJK_TOKENS,
            Class::Pictograph => PICTOGRAPH_TOKENS,
            Class::Symbol => SYMBOL_TOKENS,
        };
        prev = k;
        prev_char = c;
        current = following;
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
    estimate_from(req, static_prompt_tokens(&req.text), learned, cfg)
}

/// `estimate` for a caller that already ran the static rule over the request's text (it is the
/// costliest step for long prompts, and calibration needs its result too).
pub fn estimate_from(
    req: &Request,
    static_text_tokens: f64,
    learned: Option<Learned>,
    cfg: &EstimatorConfig,
) -> Estimate {
    let scale = learned.map_or(1.0, |l| l.prompt_scale);
    let text_tokens = (static_text_tokens * scale).round() as u64;
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
        // Six CJK characters are 18 bytes but three to six tokens (o200k: 你好 世界 你好).
        let cjk = static_prompt_tokens("你好世界你好");
        assert!((4.0..=6.0).contains(&cjk), "{cjk}");
        let latin = static_prompt_tokens("the quick brown fox jumps over the lazy dog");
        assert!((8.0..=11.0).contains(&latin), "{latin}");
        assert_eq!(static_prompt_tokens("1234567"), 3.0);
        assert_eq!(static_prompt_tokens(""), 0.0);
    }

    /// Expected values are o200k's counts (tiktoken), exact or within the rule's fractions.
    #[test]
    fn follows_how_bpe_splits_words_numbers_and_punctuation() {
        let close = |text: &str, o200k: f64, slack: f64| {
            let t = static_prompt_tokens(text);
            assert!((t - o200k).abs() <= slack, "{text:?}: {t} vs {o200k}");
        };
        // camelCase humps split; a lone mark joins the word after it.
        close("HashMap", 2.0, 0.0);
        close("self.options", 2.0, 0.5);
        close("don’t", 2.0, 0.5);
        // Indentation is one token, `;` absorbs the line break: "   ", " let", " x", " =", " ",
        // "1", ";\n".
        close("    let x = 1;\n", 7.0, 0.0);
        // A space before a number stands alone; digits go by three.
        close("in 2024, about 1,234 people", 11.0, 0.0);
        close("{\"role\":\"user\",\"content\":\"hi\"}", 9.0, 2.0);
        // Repeated marks merge into long tokens (79 '=' are two).
        close(&"=".repeat(79), 2.0, 3.0);
        // Accented words and other alphabets split more than English words.
        close("naïve café", 4.0, 0.0);
        close("Привет, мир", 4.0, 0.0);
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
