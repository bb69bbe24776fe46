//! Answers kvgate gives itself instead of forwarding: status, headers and an OpenAI-style JSON
//! error body (an Anthropic-style one to a Messages API client), so clients' SDKs surface the
//! reason.

use serde_json::json;

/// The header that names why kvgate answered itself (the error's `type`), which clients and the
/// access log read.
pub const REASON_HEADER: &str = "x-kvgate-reason";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalReply {
    pub status: u32,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl LocalReply {
    /// An OpenAI-shaped error: `{"error":{"message","type","param","code"}}`.
    pub fn error(status: u32, kind: &str, message: &str, param: Option<&str>) -> LocalReply {
        let body = json!({
            "error": {"message": message, "type": kind, "param": param, "code": status}
        });
        LocalReply {
            status,
            headers: vec![
                ("content-type".into(), "application/json".into()),
                (REASON_HEADER.into(), kind.into()),
            ],
            body: body.to_string().into_bytes(),
        }
    }

    /// The same error in the Anthropic Messages API's shape,
    /// `{"type":"error","error":{"type","message"}}`, which its SDKs read (and vLLM's
    /// `/v1/messages` answers in): the type named from the status as Anthropic names it; the
    /// status, the message and the headers kept (`x-kvgate-reason` still says kvgate's own
    /// reason). A reply that is not an error is kept as it is.
    pub fn anthropic(mut self) -> LocalReply {
        let error = serde_json::from_slice::<serde_json::Value>(&self.body).ok();
        let message = error
            .as_ref()
            .and_then(|e| e.get("error")?.get("message")?.as_str());
        let Some(message) = message else {
            return self;
        };
        let kind = match self.status {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 | 529 => "overloaded_error",
            // 400, and Anthropic's type for "other 4XX status codes not listed" (415: an
            // encoded body).
            400..=499 => "invalid_request_error",
            _ => "api_error",
        };
        let body = json!({"type": "error", "error": {"type": kind, "message": message}});
        self.body = body.to_string().into_bytes();
        self
    }

    pub fn with_header(mut self, name: &str, value: String) -> Self {
        self.headers.push((name.to_string(), value));
        self
    }

    /// When to try again: `retry-after` in whole seconds (RFC 9110's delay-seconds), and
    /// `retry-after-ms` to the millisecond, which OpenAI's and Anthropic's SDKs read first.
    pub fn retry_after(self, ms: u64) -> Self {
        self.with_header("retry-after", ms.div_ceil(1_000).to_string())
            .with_header("retry-after-ms", ms.to_string())
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    #[test]
    fn error_body_is_openai_shaped() {
        let r = LocalReply::error(400, "invalid_request_error", "bad \"x\"", Some("model"));
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(v["error"]["message"], "bad \"x\"");
        assert_eq!(v["error"]["param"], "model");
        assert_eq!(v["error"]["code"], 400);
        assert_eq!(r.status, 400);
    }

    /// A Messages API client gets each of kvgate's errors in Anthropic's shape, with the
    /// status and kvgate's reason kept.
    #[test]
    fn an_anthropic_client_gets_anthropic_shaped_errors() {
        for (status, kind, anthropic) in [
            (400, "invalid_request_error", "invalid_request_error"),
            (404, "model_not_found", "not_found_error"),
            (413, "request_too_large", "request_too_large"),
            (415, "invalid_request_error", "invalid_request_error"),
            (429, "queue_full", "rate_limit_error"),
            (503, "service_unavailable", "overloaded_error"),
            (502, "upstream", "api_error"),
        ] {
            let r = LocalReply::error(status, kind, "why", None)
                .with_header("retry-after", "1".into())
                .anthropic();
            let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
            assert_eq!(
                v,
                json!({"type": "error", "error": {"type": anthropic, "message": "why"}})
            );
            assert_eq!(r.status, status);
            assert!(r.headers.contains(&("x-kvgate-reason".into(), kind.into())));
            assert!(r.headers.contains(&("retry-after".into(), "1".into())));
        }
        // Not an error: kept.
        let page = LocalReply {
            status: 200,
            headers: Vec::new(),
            body: b"{\"object\":\"list\"}".to_vec(),
        };
        assert_eq!(page.clone().anthropic(), page);
    }
}
