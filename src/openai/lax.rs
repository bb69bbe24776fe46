//! A request's numbers and flags as the engines read them. vLLM's and SGLang's request models
//! are pydantic models in its default lax mode, which takes `"max_tokens": 100.0`, `"n": "2"` and
//! `"stream": "true"` as well as the JSON types the OpenAI API names; clients that compute a
//! limit in floating point, or build a body from form fields or environment variables, send
//! such values, and the engine serves them. A gateway that refused them would break requests
//! that work without it, so kvgate reads each field it decides on by the same rules (pydantic's
//! conversion table, checked against pydantic 2.14), and refuses only what the engine refuses.
//!
//! Source of truth: none; these are read from the request body and die with the parse.

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::value::RawValue;
use std::fmt;

/// A count (`max_tokens`, `n`): a whole number, from an integer, a float with no fraction, a
/// string holding one (`" 1_000 "`, `"2.0"`) or a bool (0 or 1). Negative counts, which the
/// engine refuses after reading them, are refused here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Count(pub u64);

/// A flag (`stream`, `store`, `ignore_eos`): a bool, 0 or 1 (as an integer or a float), or one
/// of pydantic's words for either, in any case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Flag(pub bool);

/// pydantic's words for a flag, lower-cased; the string is not trimmed.
const TRUE_WORDS: [&str; 6] = ["1", "on", "t", "true", "y", "yes"];
const FALSE_WORDS: [&str; 6] = ["0", "off", "f", "false", "n", "no"];

/// Floats from here up are past the engine's integers (pydantic: "exceeded maximum size").
const FLOAT_LIMIT: f64 = 9_223_372_036_854_775_808.0;

/// A string's count, as Python's `int()` reads it after pydantic strips whitespace and a
/// fraction of zeros: digits with single underscores between them, after an optional sign.
fn parse_count(s: &str) -> Option<i128> {
    let s = s.trim();
    let s = match s.split_once('.') {
        Some((whole, zeros)) if !zeros.is_empty() && zeros.bytes().all(|b| b == b'0') => whole,
        Some(_) => return None,
        None => s,
    };
    let (negative, digits) = match (s.strip_prefix('-'), s.strip_prefix('+')) {
        (Some(digits), _) => (true, digits),
        (None, Some(digits)) => (false, digits),
        (None, None) => (false, s),
    };
    let bytes = digits.as_bytes();
    let well_placed = bytes.iter().enumerate().all(|(i, &b)| {
        b.is_ascii_digit()
            || (b == b'_'
                && bytes.get(i.wrapping_sub(1)).is_some_and(u8::is_ascii_digit)
                && bytes.get(i + 1).is_some_and(u8::is_ascii_digit))
    });
    if bytes.is_empty() || !well_placed {
        return None;
    }
    let value: i128 = digits.replace('_', "").parse().ok()?;
    Some(if negative { -value } else { value })
}

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Count;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a non-negative integer")
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Count, E> {
                Ok(Count(v))
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Count, E> {
                u64::try_from(v)
                    .map(Count)
                    .map_err(|_| E::invalid_value(de::Unexpected::Signed(v), &self))
            }

            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Count, E> {
                if (0.0..FLOAT_LIMIT).contains(&v) && v.fract() == 0.0 {
                    // Whole and in range, so the cast is exact.
                    Ok(Count(v as u64))
                } else {
                    Err(E::invalid_value(de::Unexpected::Float(v), &self))
                }
            }

            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Count, E> {
                Ok(Count(u64::from(v)))
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Count, E> {
                parse_count(v)
                    .and_then(|n| u64::try_from(n).ok())
                    .map(Count)
                    .ok_or_else(|| E::invalid_value(de::Unexpected::Str(v), &self))
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Flag {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Flag;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a boolean")
            }

            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Flag, E> {
                Ok(Flag(v))
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Flag, E> {
                match v {
                    0 | 1 => Ok(Flag(v == 1)),
                    _ => Err(E::invalid_value(de::Unexpected::Unsigned(v), &self)),
                }
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Flag, E> {
                Err(E::invalid_value(de::Unexpected::Signed(v), &self))
            }

            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Flag, E> {
                match v {
                    0.0 => Ok(Flag(false)),
                    1.0 => Ok(Flag(true)),
                    _ => Err(E::invalid_value(de::Unexpected::Float(v), &self)),
                }
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Flag, E> {
                let said = |words: &[&str]| words.iter().any(|w| w.eq_ignore_ascii_case(v));
                if said(&TRUE_WORDS) {
                    Ok(Flag(true))
                } else if said(&FALSE_WORDS) {
                    Ok(Flag(false))
                } else {
                    Err(E::invalid_value(de::Unexpected::Str(v), &self))
                }
            }
        }
        d.deserialize_any(V)
    }
}

impl Flag {
    /// A field kept as it was written, left to the engine to refuse: on only if it says so.
    pub(super) fn on(value: &RawValue) -> bool {
        serde_json::from_str::<Flag>(value.get()).is_ok_and(|f| f.0)
    }
}

impl Count {
    /// A field kept as it was written, left to the engine to refuse: its count, if it is one.
    pub(super) fn of(value: &RawValue) -> Option<u64> {
        serde_json::from_str::<Count>(value.get()).ok().map(|c| c.0)
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    fn count(json: &str) -> Option<u64> {
        serde_json::from_str::<Count>(json).ok().map(|c| c.0)
    }

    fn flag(json: &str) -> Option<bool> {
        serde_json::from_str::<Flag>(json).ok().map(|f| f.0)
    }

    /// Each case as pydantic 2.14 reads an `int` field in JSON (negative ones, which it reads
    /// and the engine then refuses, refused here).
    #[test]
    fn counts_are_read_as_the_engines_read_them() {
        for (json, want) in [
            ("100", Some(100)),
            ("100.0", Some(100)),
            ("1e2", Some(100)),
            ("-0.0", Some(0)),
            ("true", Some(1)),
            ("false", Some(0)),
            (r#""100""#, Some(100)),
            (r#"" 100 ""#, Some(100)),
            (r#""\t3\n""#, Some(3)),
            (r#""100.0""#, Some(100)),
            (r#""2.00""#, Some(2)),
            (r#""+2.0""#, Some(2)),
            (r#""1_000""#, Some(1000)),
            (r#""1_000.0""#, Some(1000)),
            (r#""00012""#, Some(12)),
            (r#""-0""#, Some(0)),
            ("100.5", None),
            ("-1", None),
            ("1e19", None),
            (r#""-2.0""#, None),
            (r#""2.""#, None),
            (r#"".0""#, None),
            (r#""2.01""#, None),
            (r#""2.0.0""#, None),
            (r#""1e2""#, None),
            (r#""0x10""#, None),
            (r#""1__0""#, None),
            (r#""_1""#, None),
            (r#""1_""#, None),
            (r#""+_1""#, None),
            (r#""""#, None),
            (r#"" ""#, None),
            (r#""99999999999999999999""#, None),
            ("[1]", None),
            ("{}", None),
        ] {
            assert_eq!(count(json), want, "{json}");
        }
    }

    /// Each case as pydantic 2.14 reads a `bool` field in JSON.
    #[test]
    fn flags_are_read_as_the_engines_read_them() {
        for (json, want) in [
            ("true", Some(true)),
            ("false", Some(false)),
            ("1", Some(true)),
            ("0", Some(false)),
            ("1.0", Some(true)),
            ("0.0", Some(false)),
            (r#""true""#, Some(true)),
            (r#""TRUE""#, Some(true)),
            (r#""Yes""#, Some(true)),
            (r#""on""#, Some(true)),
            (r#""t""#, Some(true)),
            (r#""y""#, Some(true)),
            (r#""1""#, Some(true)),
            (r#""false""#, Some(false)),
            (r#""N""#, Some(false)),
            (r#""F""#, Some(false)),
            (r#""off""#, Some(false)),
            (r#""0""#, Some(false)),
            ("2", None),
            ("-1", None),
            ("1.5", None),
            (r#"" true""#, None),
            (r#""true ""#, None),
            (r#""abc""#, None),
            ("[]", None),
        ] {
            assert_eq!(flag(json), want, "{json}");
        }
        let raw = |json: &'static str| serde_json::from_str::<&RawValue>(json).unwrap();
        assert!(Flag::on(raw(r#""yes""#)));
        assert!(!Flag::on(raw("{}")));
        assert!(!Flag::on(raw("[true]")));
        assert_eq!(Count::of(raw(r#""20""#)), Some(20));
        assert_eq!(Count::of(raw(r#""x""#)), None);
        assert_eq!(Count::of(raw("[20]")), None);
    }
}
