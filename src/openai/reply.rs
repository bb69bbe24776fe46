//! Answers kvgate gives itself instead of forwarding: status, headers and an OpenAI-style JSON
//! error body, so clients' SDKs surface the reason.

use serde_json::json;

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
                ("x-kvgate-reason".into(), kind.into()),
            ],
            body: body.to_string().into_bytes(),
        }
    }

    pub fn with_header(mut self, name: &str, value: String) -> Self {
        self.headers.push((name.to_string(), value));
        self
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
}
