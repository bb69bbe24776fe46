//! A request's counts and flags as vLLM reads them: its request models are pydantic models in
//! the default lax mode, which takes `"max_tokens": 100.0`, `"n": "2"` or `"stream": "true"` as
//! readily as the JSON types the OpenAI API names. The gateway in front must serve what vLLM
//! serves, so the simulator reads them the same way (its own reading of pydantic's conversion
//! table, apart from the gateway's, so that a test through both checks one against the other).

use serde_json::Value;

/// A count: an integer, a float with no fraction, a string holding one (whitespace around it,
/// `_` between digits, a fraction of zeros) or a bool. `Err` says why it is none; negative
/// counts are read (vLLM's own checks refuse them later) but are none of the simulator's, so
/// they are refused here with the message vLLM's check gives.
pub fn count(v: Option<&Value>, name: &str) -> Result<Option<usize>, String> {
    let whole = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Bool(b)) => Some(i128::from(*b)),
        Some(Value::Number(n)) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => Some(i128::from(i)),
            (None, Some(u), _) => Some(i128::from(u)),
            // Below 2^63 and whole, so the cast is exact.
            (None, None, Some(f)) if f.fract() == 0.0 && f.abs() < 9.223_372_036_854_776e18 => {
                Some(f as i128)
            }
            _ => None,
        },
        Some(Value::String(s)) => python_int(s),
        Some(_) => None,
    };
    match whole {
        None => Err(format!("{name} should be a valid integer")),
        Some(i) if i < 0 => Err(format!("{name} must be at least 0, got {i}.")),
        Some(i) => Ok(Some(usize::try_from(i).unwrap_or(usize::MAX))),
    }
}

/// Python's `int()` of a string after pydantic trims it and drops a fraction of zeros.
fn python_int(s: &str) -> Option<i128> {
    let mut s = s.trim();
    if let Some((whole, zeros)) = s.split_once('.') {
        if zeros.is_empty() || zeros.chars().any(|c| c != '0') {
            return None;
        }
        s = whole;
    }
    let unsigned = s.trim_start_matches(['+', '-']);
    if s.len() - unsigned.len() > 1
        || unsigned.is_empty()
        || unsigned.starts_with('_')
        || unsigned.ends_with('_')
        || unsigned.contains("__")
        || !unsigned.chars().all(|c| c.is_ascii_digit() || c == '_')
    {
        return None;
    }
    s.replace('_', "").parse().ok()
}

/// A flag: a bool, 0 or 1 (integer or float), or one of pydantic's words, in any case.
pub fn flag(v: Option<&Value>, name: &str) -> Result<Option<bool>, String> {
    let on = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Bool(b)) => Some(*b),
        Some(Value::Number(n)) => match n.as_f64() {
            Some(x) if x == 0.0 || x == 1.0 => Some(x == 1.0),
            _ => None,
        },
        Some(Value::String(s)) => match s.to_lowercase().as_str() {
            "1" | "on" | "t" | "true" | "y" | "yes" => Some(true),
            "0" | "off" | "f" | "false" | "n" | "no" => Some(false),
            _ => None,
        },
        Some(_) => None,
    };
    on.map(Some)
        .ok_or_else(|| format!("{name} should be a valid boolean"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn counts_as_pydantic_reads_them() {
        let c = |v: Value| count(Some(&v), "n");
        assert_eq!(c(json!(100)), Ok(Some(100)));
        assert_eq!(c(json!(100.0)), Ok(Some(100)));
        assert_eq!(c(json!(true)), Ok(Some(1)));
        assert_eq!(c(json!(" 1_000.00 ")), Ok(Some(1000)));
        assert_eq!(c(json!("+7")), Ok(Some(7)));
        assert_eq!(c(Value::Null), Ok(None));
        for bad in [
            json!(1.5),
            json!("1.5"),
            json!("2."),
            json!("1e2"),
            json!("_1"),
            json!("1__0"),
            json!("+-1"),
            json!(""),
            json!([]),
        ] {
            assert!(c(bad.clone()).is_err(), "{bad}");
        }
        assert_eq!(c(json!(-1)), Err("n must be at least 0, got -1.".into()));
    }

    #[test]
    fn flags_as_pydantic_reads_them() {
        let f = |v: Value| flag(Some(&v), "stream");
        for (v, want) in [
            (json!(true), true),
            (json!("True"), true),
            (json!("yes"), true),
            (json!(1), true),
            (json!(1.0), true),
            (json!("off"), false),
            (json!(0), false),
        ] {
            assert_eq!(f(v.clone()), Ok(Some(want)), "{v}");
        }
        for bad in [json!(2), json!(" true"), json!("maybe"), json!({})] {
            assert!(f(bad.clone()).is_err(), "{bad}");
        }
    }
}
