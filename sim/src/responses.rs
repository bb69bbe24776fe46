//! The Responses API as vLLM serves it (`/v1/responses`, its `vllm/entrypoints/openai/
//! serving_responses.py`): `input` and `instructions` rendered as a chat, the response object,
//! its streamed events, and the in-memory store behind `previous_response_id` and
//! `GET /v1/responses/{id}` (vLLM's with `VLLM_ENABLE_RESPONSES_API_STORE=1`). The store is the
//! pod's own, as vLLM's is its API server's: a follow-up sent to another pod is not found there,
//! which is why a router must send it back to the pod that answered.

use serde_json::{json, Value};
use std::collections::{HashMap, VecDeque};

/// Responses a pod keeps (vLLM keeps every one, a leak its authors mark; the oldest go first here).
const CAPACITY: usize = 4096;

/// A stored response: the conversation's tokens so far (its prompt, history included, and its
/// answer), which a follow-up's prompt starts with, and the object `GET` returns.
pub struct Stored {
    pub tokens: Vec<u32>,
    pub object: Value,
}

#[derive(Default)]
pub struct Store {
    by_id: HashMap<String, Stored>,
    order: VecDeque<String>,
}

impl Store {
    pub fn insert(&mut self, id: String, stored: Stored) {
        if self.by_id.len() >= CAPACITY {
            if let Some(oldest) = self.order.pop_front() {
                self.by_id.remove(&oldest);
            }
        }
        self.order.push_back(id.clone());
        self.by_id.insert(id, stored);
    }

    pub fn get(&self, id: &str) -> Option<&Stored> {
        self.by_id.get(id)
    }
}

/// vLLM's answer to an id its store does not hold.
pub fn not_found_message(id: &str) -> String {
    format!("Response with id '{id}' not found.")
}

/// The request's `instructions` and `input` as chat messages: the instructions as the system
/// message, a string input as the user's, and the input's items as their roles say (a function
/// call's output as a tool message, the call itself as the assistant's).
pub fn messages(body: &Value) -> Result<Vec<Value>, String> {
    let mut out = Vec::new();
    if let Some(i) = body.get("instructions").and_then(Value::as_str) {
        out.push(json!({"role": "system", "content": i}));
    }
    match body.get("input") {
        Some(Value::String(s)) => out.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) => {
            for item in items {
                let kind = item
                    .get("type")
                    .and_then(Value::as_str)
                    .unwrap_or("message");
                match kind {
                    "message" => out.push(json!({
                        "role": item.get("role").and_then(Value::as_str).unwrap_or("user"),
                        "content": item.get("content").cloned().unwrap_or(Value::Null),
                    })),
                    "function_call_output" => out.push(json!({
                        "role": "tool",
                        "content": item.get("output").cloned().unwrap_or(Value::Null),
                    })),
                    "function_call" => out.push(json!({
                        "role": "assistant",
                        "content": null,
                        "tool_calls": [item],
                    })),
                    // Reasoning items carry nothing the prompt is rendered from here.
                    _ => {}
                }
            }
        }
        _ => return Err("input must be a string or a list of items".into()),
    }
    if out.is_empty() {
        return Err("input cannot be empty".into());
    }
    Ok(out)
}

/// The Responses API's usage object.
pub fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    })
}

/// The answer's one message item.
fn message(item_id: &str, text: &str, status: &str) -> Value {
    json!({
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    })
}

/// The response object: `in_progress` with no output yet, or `completed` with its text and
/// usage.
pub fn object(
    id: &str,
    created: u64,
    model: &str,
    answer: Option<(&str, &str, Value)>,
    previous: Option<&str>,
) -> Value {
    let (status, output, usage) = match answer {
        Some((item_id, text, usage)) => (
            "completed",
            vec![message(item_id, text, "completed")],
            usage,
        ),
        None => ("in_progress", Vec::new(), Value::Null),
    };
    json!({
        "id": id,
        "object": "response",
        "created_at": created,
        "model": model,
        "status": status,
        "output": output,
        "previous_response_id": previous,
        "usage": usage,
    })
}

/// A streamed answer's events, numbered as vLLM numbers them.
pub struct Events {
    pub item_id: String,
    seq: u64,
}

impl Events {
    pub fn new(item_id: String) -> Events {
        Events { item_id, seq: 0 }
    }

    /// One event: its type on an `event:` line, as vLLM writes it, and its JSON.
    pub fn push(&mut self, buf: &mut Vec<u8>, kind: &str, mut v: Value) {
        v["type"] = json!(kind);
        v["sequence_number"] = json!(self.seq);
        self.seq += 1;
        buf.extend_from_slice(format!("event: {kind}\ndata: {v}\n\n").as_bytes());
    }

    /// What comes before the first piece of text: the response created and in progress, its
    /// message item and text part opened.
    pub fn open(&mut self, buf: &mut Vec<u8>, response: &Value) {
        self.push(buf, "response.created", json!({"response": response}));
        self.push(buf, "response.in_progress", json!({"response": response}));
        let item = message(&self.item_id, "", "in_progress");
        self.push(
            buf,
            "response.output_item.added",
            json!({"output_index": 0, "item": item}),
        );
        let part = json!({"type": "output_text", "text": "", "annotations": []});
        self.push(
            buf,
            "response.content_part.added",
            json!({"item_id": self.item_id, "output_index": 0, "content_index": 0, "part": part}),
        );
    }

    pub fn delta(&mut self, buf: &mut Vec<u8>, text: &str) {
        let ids = json!({"item_id": self.item_id, "output_index": 0, "content_index": 0,
                         "delta": text, "logprobs": []});
        self.push(buf, "response.output_text.delta", ids);
    }

    /// What ends the answer: its text part and item closed, and the completed response.
    pub fn close(&mut self, buf: &mut Vec<u8>, text: &str, response: &Value) {
        self.push(
            buf,
            "response.output_text.done",
            json!({"item_id": self.item_id, "output_index": 0, "content_index": 0,
                   "text": text, "logprobs": []}),
        );
        let part = json!({"type": "output_text", "text": text, "annotations": []});
        self.push(
            buf,
            "response.content_part.done",
            json!({"item_id": self.item_id, "output_index": 0, "content_index": 0, "part": part}),
        );
        self.push(
            buf,
            "response.output_item.done",
            json!({"output_index": 0, "item": message(&self.item_id, text, "completed")}),
        );
        self.push(buf, "response.completed", json!({"response": response}));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_and_instructions_render_as_a_chat() {
        let m = messages(&json!({"instructions": "Be brief.", "input": "Hi"})).unwrap();
        assert_eq!(m[0]["role"], "system");
        assert_eq!(m[1], json!({"role": "user", "content": "Hi"}));
        let items = json!({"input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "reasoning", "summary": []},
        ]});
        let roles: Vec<Value> = messages(&items)
            .unwrap()
            .iter()
            .map(|m| m["role"].clone())
            .collect();
        assert_eq!(roles, [json!("user"), json!("assistant"), json!("tool")]);
        assert!(messages(&json!({"input": 3})).is_err());
        assert!(messages(&json!({"input": []})).is_err());
    }

    #[test]
    fn the_store_forgets_its_oldest_past_its_capacity() {
        let mut s = Store::default();
        for i in 0..=CAPACITY {
            s.insert(
                format!("resp_{i}"),
                Stored {
                    tokens: vec![1],
                    object: Value::Null,
                },
            );
        }
        assert!(s.get("resp_0").is_none());
        assert!(s.get("resp_1").is_some() && s.get(&format!("resp_{CAPACITY}")).is_some());
    }

    #[test]
    fn events_are_numbered_and_typed_on_their_own_line() {
        let mut e = Events::new("msg_1".into());
        let mut buf = Vec::new();
        let r = object("resp_1", 1, "m", None, None);
        e.open(&mut buf, &r);
        e.delta(&mut buf, "Hi");
        let text = String::from_utf8(buf).unwrap();
        let events: Vec<&str> = text.split("\n\n").filter(|s| !s.is_empty()).collect();
        assert_eq!(events.len(), 5);
        assert!(events[0].starts_with("event: response.created\ndata: {"));
        let last: Value = serde_json::from_str(events[4].split("data: ").nth(1).unwrap()).unwrap();
        assert_eq!(last["type"], "response.output_text.delta");
        assert_eq!(
            (last["sequence_number"].as_u64(), last["delta"].as_str()),
            (Some(4), Some("Hi"))
        );
    }
}
