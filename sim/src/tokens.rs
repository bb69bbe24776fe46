//! vLLM's tokens-in, tokens-out `POST /inference/v1/generate` as vLLM serves it (its
//! `vllm/entrypoints/serve/disagg/protocol.py` `GenerateRequest` / `GenerateResponse` /
//! `GenerateStreamResponse` and `serving.py` `ServingTokens`). The request runs as a completions
//! request of token ids does here, so this module owns only the shapes around that path: the
//! request checked as its pydantic model checks it, its `sampling_params` (vLLM's
//! `SamplingParams`) as the object the path reads its limits from, the id, the answer and the
//! streamed chunks.

use serde_json::{json, Value};

use crate::lax::flag;

/// The request checked as `GenerateRequest` validates it: `token_ids` a non-empty list of
/// non-negative ids, `sampling_params` an object (required), `stream` a flag. The body goes on as
/// it is: the path reads `token_ids` as the prompt and the limits from `sampling_params`.
pub fn check(body: &Value) -> Result<(), String> {
    let ids = match body.get("token_ids") {
        None => return Err("token_ids: Field required".into()),
        Some(Value::Array(a)) => a,
        Some(_) => return Err("token_ids: Input should be a valid list".into()),
    };
    if ids.is_empty() {
        return Err("token_ids: List should have at least 1 item after validation, not 0".into());
    }
    if ids.iter().any(|t| t.as_i64().is_some_and(|t| t < 0)) {
        return Err("token_ids must not contain negative values".into());
    }
    if !ids
        .iter()
        .all(|t| t.as_u64().is_some_and(|t| u32::try_from(t).is_ok()))
    {
        return Err("token_ids: Input should be a valid list of token ids".into());
    }
    match body.get("sampling_params") {
        Some(Value::Object(_)) => {}
        None => return Err("sampling_params: Field required".into()),
        Some(_) => return Err("sampling_params: Input should be a valid dictionary".into()),
    }
    flag(body.get("stream"), "stream")?;
    Ok(())
}

/// The answer's id: `generate-tokens-` and `_base_request_id`'s choice, the `X-Request-Id`
/// header's value, else the body's `request_id` (whose default is a fresh uuid: `fresh`).
pub fn request_id(header: Option<&str>, body: &Value, fresh: String) -> String {
    let base = header
        .map(str::to_string)
        .or_else(|| {
            body.get("request_id")
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .unwrap_or(fresh);
    format!("generate-tokens-{base}")
}

/// A choice: its tokens (the EOS a natural end emitted included) and why it ended.
pub fn choice(index: usize, finish: Option<&str>, token_ids: &[u32]) -> Value {
    json!({"index": index, "logprobs": null, "finish_reason": finish, "token_ids": token_ids,
           "routed_experts": null})
}

/// `GenerateResponse` as vLLM dumps it (no field left out).
pub fn response(id: &str, model: &str, created: u64, choices: Vec<Value>, usage: Value) -> Value {
    json!({
        "request_id": id,
        "model": model,
        "created": created,
        "choices": choices,
        "usage": usage,
        "prompt_logprobs": null,
        "kv_transfer_params": null,
        "ec_transfer_params": null,
    })
}

/// A streamed chunk: one choice's new tokens, with its usage so far under
/// `continuous_usage_stats` (`model_dump_json` leaves nothing out: a null usage otherwise, and
/// no prompt details in it).
pub fn chunk(id: &str, choice: Value, usage: Option<Value>) -> Value {
    let usage = usage.map(|mut u| {
        u["prompt_tokens_details"] = Value::Null;
        u
    });
    json!({"request_id": id, "choices": [choice], "usage": usage})
}

/// The stream's usage chunk, after every choice's end (`exclude_none`: no null fields).
pub fn usage_chunk(id: &str, usage: Value) -> Value {
    json!({"request_id": id, "choices": [], "usage": usage})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_checked_as_generate_request_checks_them() {
        let ok = json!({"token_ids": [1, 2], "sampling_params": {}});
        assert!(check(&ok).is_ok());
        for (body, message) in [
            (json!({"sampling_params": {}}), "token_ids: Field required"),
            (json!({"token_ids": [1]}), "sampling_params: Field required"),
            (
                json!({"token_ids": [1, -2], "sampling_params": {}}),
                "token_ids must not contain negative values",
            ),
            (
                json!({"token_ids": [], "sampling_params": {}}),
                "token_ids: List should have at least 1 item after validation, not 0",
            ),
        ] {
            assert_eq!(check(&body).err().as_deref(), Some(message), "{body}");
        }
    }

    /// The `X-Request-Id` header names the request before the body does.
    #[test]
    fn the_id_is_the_headers_then_the_bodys() {
        let body = json!({"request_id": "b"});
        assert_eq!(
            request_id(Some("h"), &body, "u".into()),
            "generate-tokens-h"
        );
        assert_eq!(request_id(None, &body, "u".into()), "generate-tokens-b");
        assert_eq!(
            request_id(None, &json!({}), "u".into()),
            "generate-tokens-u"
        );
    }
}
