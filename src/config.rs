//! The plugin configuration: the JSON an operator writes (camelCase, unknown keys rejected), its
//! defaults, and its validation. Parsed once in `on_configure`; the request path only reads the
//! resulting structs. Every key and default is listed in docs/configuration.md, and a test keeps
//! that page in step with the `Default` impls below.

use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Config {
    /// Requests that are not JSON or not on a known OpenAI path go upstream untouched; when false
    /// they are refused with 404.
    pub passthrough_unknown: bool,
    /// The largest request body kvgate reads; above it the answer is 413.
    pub max_body_bytes: u64,
    /// Adds `x-kvgate-*` response headers that explain each decision.
    pub debug_headers: bool,
    pub estimator: EstimatorConfig,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            passthrough_unknown: true,
            max_body_bytes: 1024 * 1024,
            debug_headers: false,
            estimator: EstimatorConfig::default(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct EstimatorConfig {
    /// Tokens charged for each non-text content part (image, audio, file).
    pub non_text_part_tokens: u64,
    /// Expected output when the request sets no max-tokens field and nothing has been learned.
    pub default_output_tokens: u64,
    /// Expected output is never below this.
    pub output_floor_tokens: u64,
    /// Expected output is never above this, whatever max_tokens says.
    pub output_cap_tokens: u64,
    /// Multiplies the estimated cost, so small underestimates do not overfill a pod.
    pub safety_factor: f64,
    /// A reservation is never smaller than this.
    pub min_reservation_tokens: u64,
    /// A reservation is never larger than this.
    pub max_reservation_tokens: u64,
    /// Learn characters-per-token and output lengths per model from responses' `usage`.
    pub calibrate: bool,
    /// Weight of each new sample in the learned averages (exponential moving average).
    pub calibration_weight: f64,
    /// Quantile of learned output lengths used as the expected output.
    pub output_quantile: f64,
    /// Samples needed before learned values replace the static rule.
    pub min_samples: u32,
}

impl Default for EstimatorConfig {
    fn default() -> Self {
        Self {
            non_text_part_tokens: 512,
            default_output_tokens: 256,
            output_floor_tokens: 16,
            output_cap_tokens: 8192,
            safety_factor: 1.1,
            min_reservation_tokens: 64,
            max_reservation_tokens: 131_072,
            calibrate: true,
            calibration_weight: 0.05,
            output_quantile: 0.9,
            min_samples: 20,
        }
    }
}

/// A configuration that cannot be used: which field, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid kvgate config: field `{}`: {}",
            self.field, self.reason
        )
    }
}

fn invalid(field: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.to_string(),
        reason: reason.into(),
    }
}

impl Config {
    /// Parses the plugin configuration; empty input means all defaults.
    pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Config::default());
        }
        let de = &mut serde_json::Deserializer::from_slice(bytes);
        let config: Config = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
            let path = e.path().to_string();
            let field = if path == "." {
                "(top level)".to_string()
            } else {
                path
            };
            let inner = e.into_inner();
            // serde_json appends " at line L column C"; the field path says more.
            let text = inner.to_string();
            let reason = match text.rfind(" at line ") {
                Some(i) if inner.line() > 0 => text[..i].to_string(),
                _ => text,
            };
            invalid(&field, reason)
        })?;
        de.end()
            .map_err(|e| invalid("(top level)", format!("trailing characters: {e}")))?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if self.max_body_bytes == 0 {
            return Err(invalid("maxBodyBytes", "must be greater than 0"));
        }
        self.estimator.validate()
    }
}

impl EstimatorConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let e = |field: &str, reason: &str| Err(invalid(&format!("estimator.{field}"), reason));
        if !(self.safety_factor >= 1.0 && self.safety_factor <= 10.0) {
            return e("safetyFactor", "must be between 1.0 and 10.0");
        }
        if self.output_floor_tokens > self.output_cap_tokens {
            return e("outputFloorTokens", "must not exceed outputCapTokens");
        }
        if self.min_reservation_tokens > self.max_reservation_tokens {
            return e(
                "minReservationTokens",
                "must not exceed maxReservationTokens",
            );
        }
        if !(self.calibration_weight > 0.0 && self.calibration_weight <= 1.0) {
            return e("calibrationWeight", "must be in (0, 1]");
        }
        if !(self.output_quantile > 0.0 && self.output_quantile < 1.0) {
            return e("outputQuantile", "must be in (0, 1)");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    #[test]
    fn empty_config_means_defaults() {
        assert_eq!(Config::parse(b"").unwrap(), Config::default());
        assert_eq!(Config::parse(b"  \n").unwrap(), Config::default());
        assert_eq!(Config::parse(b"{}").unwrap(), Config::default());
    }

    #[test]
    fn keys_are_camel_case_and_partial_sections_keep_defaults() {
        let c =
            Config::parse(br#"{"debugHeaders":true,"estimator":{"safetyFactor":1.5}}"#).unwrap();
        assert!(c.debug_headers);
        assert_eq!(c.estimator.safety_factor, 1.5);
        assert_eq!(c.estimator.default_output_tokens, 256);
    }

    #[test]
    fn unknown_key_is_named() {
        let err = Config::parse(br#"{"estimator":{"safetyFactr":1.5}}"#).unwrap_err();
        assert_eq!(err.field, "estimator.safetyFactr");
        assert!(err.reason.contains("unknown field"), "{err}");
    }

    #[test]
    fn wrong_type_is_named() {
        let err = Config::parse(br#"{"maxBodyBytes":"big"}"#).unwrap_err();
        assert_eq!(err.field, "maxBodyBytes");
        assert!(err.reason.contains("invalid type"), "{err}");
    }

    #[test]
    fn bad_values_are_named() {
        let err = Config::parse(br#"{"estimator":{"safetyFactor":0.5}}"#).unwrap_err();
        assert_eq!(err.field, "estimator.safetyFactor");
        let err =
            Config::parse(br#"{"estimator":{"minReservationTokens":10,"maxReservationTokens":5}}"#)
                .unwrap_err();
        assert_eq!(err.field, "estimator.minReservationTokens");
        let err = Config::parse(b"{not json").unwrap_err();
        assert!(err.to_string().contains("invalid kvgate config"));
    }

    /// Every key of the default config, with its default, appears in docs/configuration.md.
    #[test]
    fn every_key_is_documented() {
        fn walk(prefix: &str, v: &serde_json::Value, out: &mut Vec<(String, String)>) {
            match v {
                serde_json::Value::Object(map) => {
                    for (k, v) in map {
                        let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                        walk(&key, v, out);
                    }
                }
                other => out.push((prefix.to_string(), other.to_string())),
            }
        }
        let doc = include_str!("../docs/configuration.md");
        let mut keys = Vec::new();
        walk("", &serde_json::to_value(Config::default()).unwrap(), &mut keys);
        for (key, default) in keys {
            let row = doc
                .lines()
                .find(|l| l.starts_with(&format!("| `{key}` |")))
                .unwrap_or_else(|| panic!("docs/configuration.md has no row for `{key}`"));
            assert!(
                row.contains(&format!("| `{default}` |")),
                "docs/configuration.md: `{key}` should show default `{default}`: {row}"
            );
        }
    }
}

