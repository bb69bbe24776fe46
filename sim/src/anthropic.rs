//! The Anthropic Messages API as vLLM serves it (`POST /v1/messages` and
//! `/v1/messages/count_tokens`, its `vllm/entrypoints/anthropic/serving.py`, `protocol.py` and
//! `api_router.py`). vLLM turns the request into a chat completions request and runs that, so
//! this module owns only the shapes around the chat path: the request as a chat body (the system
//! text hoisted into one system message, content blocks as chat parts, tool results as tool
//! messages), the answer's message object, the events a chat stream's chunks become, and the
//! error shape (`translate_error_response`). Everything else (KV, scheduling, metrics, lengths)
//! is the chat request's.

use serde_json::{json, Map, Value};

use crate::engine::FinishReason;
use crate::kv::mix64;
use crate::lax::{count, flag};
use crate::tokenizer::hash_str;

/// Claude Code's attribution header: vLLM drops it from the system prompt, as its per-request
/// hash would defeat prefix caching.
const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// The block types vLLM's `AnthropicContentBlock` takes; any other fails its validation.
const BLOCK_TYPES: [&str; 7] = [
    "text",
    "image",
    "tool_use",
    "tool_result",
    "tool_reference",
    "thinking",
    "redacted_thinking",
];

/// A message's content as the request gives it: a string, or blocks.
enum Content<'a> {
    Text(&'a str),
    Blocks(&'a [Value]),
}

/// A field of blocks (`system`, a message's content): each an object of a known type.
fn blocks<'a>(v: &'a [Value], field: &str) -> Result<&'a [Value], String> {
    for b in v {
        let ty = b.get("type").and_then(Value::as_str);
        if !ty.is_some_and(|t| BLOCK_TYPES.contains(&t)) {
            return Err(format!(
                "{field}: each block must be an object of a known type"
            ));
        }
    }
    Ok(v)
}

fn content<'a>(v: Option<&'a Value>, field: &str) -> Result<Content<'a>, String> {
    match v {
        Some(Value::String(s)) => Ok(Content::Text(s)),
        Some(Value::Array(a)) => Ok(Content::Blocks(blocks(a, field)?)),
        _ => Err(format!("{field} must be a string or a list of blocks")),
    }
}

fn str_of<'a>(b: &'a Value, key: &str) -> Option<&'a str> {
    b.get(key).and_then(Value::as_str)
}

/// A block's non-empty `text`: vLLM skips empty text blocks.
fn text_of(b: &Value) -> Option<&str> {
    str_of(b, "text").filter(|t| !t.is_empty())
}

/// The text of the system blocks, less Claude Code's billing header.
fn push_system(blocks: &[Value], out: &mut String) {
    let texts = blocks.iter().filter(|b| str_of(b, "type") == Some("text"));
    for t in texts.filter_map(text_of) {
        if !t.starts_with(BILLING_HEADER) {
            out.push_str(t);
        }
    }
}

/// An image source as the URL of an OpenAI `image_url` part (`_convert_image_source_to_url`):
/// a URL as given, anything else as a base64 data URI.
fn image_url(source: Option<&Map<String, Value>>) -> String {
    let field = |k: &str| source.and_then(|s| s.get(k)).and_then(Value::as_str);
    if field("type") == Some("url") {
        return field("url").unwrap_or_default().to_string();
    }
    let media = field("media_type").unwrap_or("image/jpeg");
    format!("data:{media};base64,{}", field("data").unwrap_or_default())
}

fn image_part(url: String) -> Value {
    json!({"type": "image_url", "image_url": {"url": url}})
}

/// A user's `tool_result` block as vLLM's `_convert_user_tool_result` makes it: a tool message
/// of its text, then a user message of its images, if any.
fn push_tool_result(b: &Value, out: &mut Vec<Value>) {
    let mut images = Vec::new();
    let text = match b.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) => {
            let mut texts = Vec::new();
            for item in items {
                match str_of(item, "type") {
                    Some("text") => texts.push(str_of(item, "text").unwrap_or_default()),
                    Some("image") => {
                        let url = image_url(item.get("source").and_then(Value::as_object));
                        if !url.is_empty() {
                            images.push(image_part(url));
                        }
                    }
                    // vLLM's tool message of `tool_reference` parts is left out: the sim's
                    // template would count such parts as media, which they are not.
                    _ => {}
                }
            }
            texts.join("\n")
        }
        _ => String::new(),
    };
    let id = str_of(b, "tool_use_id").unwrap_or_default();
    out.push(json!({"role": "tool", "tool_call_id": id, "content": text}));
    if !images.is_empty() {
        out.push(json!({"role": "user", "content": images}));
    }
}

/// An assistant's `tool_use` block as an OpenAI tool call.
fn tool_call(b: &Value) -> Value {
    let id = match str_of(b, "id").filter(|s| !s.is_empty()) {
        Some(id) => id.to_string(),
        None => format!("call_{}", crate::server::unix_now()),
    };
    let input = b
        .get("input")
        .filter(|i| !i.is_null())
        .cloned()
        .unwrap_or_else(|| json!({}));
    // Python's `json.dumps` puts a space after `:` and `,`; the arguments here are compact, as
    // a chat client sending the same call would send them.
    json!({"id": id, "type": "function",
           "function": {"name": str_of(b, "name").unwrap_or_default(),
                        "arguments": input.to_string()}})
}

/// One non-system message as chat messages (`_convert_messages`): a tool result as a message
/// of its own ahead of the message it came in, thinking as the message's `reasoning`, tool uses
/// as its tool calls, and a lone text part as plain content.
fn push_message(role: &str, content: &Content, out: &mut Vec<Value>) {
    let mut msg = Map::new();
    msg.insert("role".into(), json!(role));
    match content {
        Content::Text(s) => {
            msg.insert("content".into(), json!(s));
        }
        Content::Blocks(blocks) => {
            let mut parts = Vec::new();
            let mut calls = Vec::new();
            let mut reasoning: Option<String> = None;
            for b in *blocks {
                match str_of(b, "type") {
                    Some("text") => {
                        if let Some(t) = text_of(b) {
                            parts.push(json!({"type": "text", "text": t}));
                        }
                    }
                    Some("image") => {
                        let source = b.get("source").and_then(Value::as_object);
                        if source.is_some_and(|s| !s.is_empty()) {
                            parts.push(image_part(image_url(source)));
                        }
                    }
                    Some("thinking") => {
                        if let Some(t) = str_of(b, "thinking") {
                            reasoning.get_or_insert_with(String::new).push_str(t);
                        }
                    }
                    Some("tool_use") => calls.push(tool_call(b)),
                    Some("tool_result") if role == "user" => push_tool_result(b, out),
                    Some("tool_result") => {
                        // Python's `str()` of a list is its repr; its JSON stands in for it.
                        let result = match b.get("content") {
                            Some(Value::String(s)) => s.clone(),
                            Some(v) if !v.is_null() => v.to_string(),
                            _ => String::new(),
                        };
                        let text = format!("Tool result: {result}");
                        parts.push(json!({"type": "text", "text": text}));
                    }
                    // `redacted_thinking` is opaque and `tool_reference` is expanded only
                    // inside a tool result: vLLM renders neither.
                    _ => {}
                }
            }
            if let Some(r) = reasoning {
                msg.insert("reasoning".into(), json!(r));
            }
            if !calls.is_empty() {
                msg.insert("tool_calls".into(), json!(calls));
            }
            match parts.as_slice() {
                [] => {}
                [one] if one["type"] == "text" => {
                    msg.insert("content".into(), one["text"].clone());
                }
                _ => {
                    msg.insert("content".into(), json!(parts));
                }
            }
        }
    }
    // A user message that was only tool results has gone out as tool messages.
    if role != "user" || msg.contains_key("content") {
        out.push(Value::Object(msg));
    }
}

/// Tools as OpenAI function tools (`_convert_tools`); a schema without a `type` is an object's,
/// as vLLM's `AnthropicTool` validator makes it.
fn tools(v: &Value) -> Result<Value, String> {
    let list = v.as_array().ok_or("tools must be a list")?;
    let tools = list.iter().map(|t| -> Result<Value, String> {
        let name = str_of(t, "name").ok_or("each tool needs a name")?;
        let mut schema = t
            .get("input_schema")
            .and_then(Value::as_object)
            .cloned()
            .ok_or("input_schema must be a dictionary")?;
        schema.entry("type").or_insert_with(|| json!("object"));
        let mut function = json!({"name": name, "parameters": schema});
        if let Some(d) = t.get("description").filter(|d| !d.is_null()) {
            function["description"] = d.clone();
        }
        Ok(json!({"type": "function", "function": function}))
    });
    Ok(Value::Array(tools.collect::<Result<_, String>>()?))
}

/// The request's conversation as a chat completions body (vLLM's
/// `_convert_anthropic_to_openai_request`, as count_tokens runs it): its model, one system
/// message first of the top-level `system` and every system message's text joined, the other
/// messages in order, and its tools.
pub fn chat_body(body: &Value) -> Result<Value, String> {
    let model = match body.get("model") {
        Some(Value::String(m)) if !m.is_empty() => m,
        Some(Value::String(_)) => return Err("Model is required".into()),
        _ => return Err("model must be a string".into()),
    };
    let list = body
        .get("messages")
        .and_then(Value::as_array)
        .ok_or("messages must be a list")?;
    let mut messages = Vec::with_capacity(list.len());
    for m in list {
        // vLLM maps the roles recent Claude Code clients send (`ctx`, `msg`) to the user's.
        let role = match str_of(m, "role") {
            Some("ctx" | "msg") => "user",
            Some(r @ ("user" | "assistant" | "system")) => r,
            _ => return Err("role must be one of 'user', 'assistant' or 'system'".into()),
        };
        messages.push((role, content(m.get("content"), "content")?));
    }
    let mut system = String::new();
    match body.get("system") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => system.push_str(s),
        Some(Value::Array(a)) => push_system(blocks(a, "system")?, &mut system),
        Some(_) => return Err("system must be a string or a list of blocks".into()),
    }
    for (_, c) in messages.iter().filter(|(role, _)| *role == "system") {
        match c {
            Content::Text(s) => system.push_str(s),
            Content::Blocks(b) => push_system(b, &mut system),
        }
    }
    let mut chat = Vec::new();
    if !system.is_empty() {
        chat.push(json!({"role": "system", "content": system}));
    }
    for (role, c) in messages.iter().filter(|(role, _)| *role != "system") {
        push_message(role, c, &mut chat);
    }
    let mut out = json!({"model": model, "messages": chat});
    if let Some(t) = body.get("tools").filter(|t| !t.is_null()) {
        out["tools"] = tools(t)?;
    }
    Ok(out)
}

/// A /v1/messages request as the chat request vLLM runs: its conversation, its `max_tokens`
/// (required and positive: no default, unlike a chat's), and, streamed, usage in every chunk,
/// as vLLM forces it to build the events from. Sampling fields shape nothing the sim makes.
pub fn chat_request(body: &Value) -> Result<Value, String> {
    let mut chat = chat_body(body)?;
    let max_tokens = match body.get("max_tokens") {
        None => return Err("max_tokens: Field required".into()),
        Some(v) if v.as_i64().is_some_and(|n| n <= 0) => return Err(POSITIVE.into()),
        v => count(v, "max_tokens")?.ok_or("max_tokens should be a valid integer")?,
    };
    if max_tokens == 0 {
        return Err(POSITIVE.into());
    }
    chat["max_tokens"] = json!(max_tokens);
    // vLLM passes a Messages request's `cache_salt` on to its chat request, whose validator
    // checks it and whose prompt it keys (vllm-project/vllm#49498).
    if let Some(salt) = body.get("cache_salt") {
        chat["cache_salt"] = salt.clone();
    }
    if flag(body.get("stream"), "stream")?.unwrap_or(false) {
        chat["stream"] = json!(true);
        chat["stream_options"] = json!({"include_usage": true, "continuous_usage_stats": true});
    }
    Ok(chat)
}

const POSITIVE: &str = "max_tokens must be positive";

/// vLLM's `stop_reason_map` of the chat's finish reasons.
fn stop_reason(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "end_turn",
        FinishReason::Length => "max_tokens",
    }
}

fn usage(input: usize, output: usize) -> Value {
    json!({"input_tokens": input, "output_tokens": output})
}

/// A thinking block's signature: vLLM's is a fresh `uuid4().hex`; the sim's, as long, is the
/// answer id's and the block's, so a replayed answer is signed alike.
fn signature(id: &str, index: usize) -> String {
    let h = hash_str(id) ^ index as u64;
    format!("{:016x}{:016x}", mix64(h), mix64(!h))
}

/// The answer (`messages_full_converter`) as vLLM dumps it, without its `None` fields: its
/// reasoning as a signed thinking block and its text, each only if there is some.
pub fn message(
    id: &str,
    model: &str,
    reasoning: &str,
    text: &str,
    reason: FinishReason,
    input: usize,
    output: usize,
) -> Value {
    let mut content = Vec::new();
    if !reasoning.is_empty() {
        let sig = signature(id, 0);
        content.push(json!({"type": "thinking", "thinking": reasoning, "signature": sig}));
    }
    if !text.is_empty() {
        content.push(json!({"type": "text", "text": text}));
    }
    json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": model,
        "stop_reason": stop_reason(reason),
        "usage": usage(input, output),
    })
}

/// count_tokens' answer: the prompt's tokens, also as the context's original count.
pub fn token_count(n: usize) -> Value {
    json!({"input_tokens": n, "context_management": {"original_input_tokens": n}})
}

/// vLLM's `AnthropicErrorResponse` of a chat path error, its type and message.
pub fn error(kind: &str, message: &str) -> Value {
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Block {
    Thinking,
    Text,
}

/// A streamed answer's events, as vLLM's `message_stream_converter` makes them of the chat
/// chunks: blocks numbered as they open, one open at a time.
pub struct Events {
    id: String,
    index: usize,
    open: Option<Block>,
}

impl Events {
    pub fn new(id: &str) -> Events {
        Events {
            id: id.to_string(),
            index: 0,
            open: None,
        }
    }

    /// One event: its type on an `event:` line, as vLLM writes it, and its JSON.
    fn push(buf: &mut Vec<u8>, kind: &str, mut v: Value) {
        v["type"] = json!(kind);
        buf.extend_from_slice(format!("event: {kind}\ndata: {v}\n\n").as_bytes());
    }

    /// `message_start`, of the chat stream's first chunk. vLLM dumps it leaving out the fields
    /// it did not set: the message's `type` and `role` among them.
    pub fn start(&mut self, buf: &mut Vec<u8>, model: &str, input: usize) {
        let message = json!({"id": self.id, "content": [], "model": model, "stop_reason": null,
                             "stop_sequence": null, "usage": usage(input, 0)});
        Self::push(buf, "message_start", json!({ "message": message }));
    }

    /// A chunk's reasoning, as a thinking block's delta.
    pub fn thinking(&mut self, buf: &mut Vec<u8>, text: &str) {
        self.delta(buf, Block::Thinking, text);
    }

    /// A chunk's answer text, as a text block's delta.
    pub fn text(&mut self, buf: &mut Vec<u8>, text: &str) {
        self.delta(buf, Block::Text, text);
    }

    /// A delta of a block of this kind, opening it (and closing the other) first; empty text
    /// makes no event.
    fn delta(&mut self, buf: &mut Vec<u8>, kind: Block, text: &str) {
        if text.is_empty() {
            return;
        }
        let (name, delta) = match kind {
            Block::Thinking => ("thinking", "thinking_delta"),
            Block::Text => ("text", "text_delta"),
        };
        if self.open != Some(kind) {
            self.close(buf);
            let block = json!({"type": name, name: ""});
            let start = json!({"index": self.index, "content_block": block});
            Self::push(buf, "content_block_start", start);
            self.open = Some(kind);
        }
        let d = json!({"index": self.index, "delta": {"type": delta, name: text}});
        Self::push(buf, "content_block_delta", d);
    }

    /// Closes the open block, a thinking block with its signature first.
    fn close(&mut self, buf: &mut Vec<u8>) {
        let Some(kind) = self.open.take() else {
            return;
        };
        if kind == Block::Thinking {
            let sig =
                json!({"type": "signature_delta", "signature": signature(&self.id, self.index)});
            Self::push(
                buf,
                "content_block_delta",
                json!({"index": self.index, "delta": sig}),
            );
        }
        Self::push(buf, "content_block_stop", json!({"index": self.index}));
        self.index += 1;
    }

    /// The end, of the chat stream's usage chunk and `[DONE]`: the open block closed,
    /// `message_delta` with the stop reason and usage, and `message_stop`.
    pub fn stop(&mut self, buf: &mut Vec<u8>, reason: FinishReason, input: usize, output: usize) {
        self.close(buf);
        let delta = json!({"delta": {"stop_reason": stop_reason(reason)},
                           "usage": usage(input, output)});
        Self::push(buf, "message_delta", delta);
        Self::push(buf, "message_stop", json!({}));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The system text is hoisted into one system message (the billing header dropped), tool
    /// results become tool messages ahead of their user message, tool uses tool calls, thinking
    /// the message's reasoning, and an image an `image_url` part.
    #[test]
    fn a_conversation_converts_as_vllm_converts_it() {
        let body = json!({
            "model": "m",
            "max_tokens": 10,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc=1;"},
                       {"type": "text", "text": "Be brief. "}],
            "messages": [
                {"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": "AAAA"}},
                    {"type": "text", "text": "What is this?"}]},
                {"role": "system", "content": "Use tools."},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Hmm.", "signature": "s"},
                    {"type": "redacted_thinking", "data": "xx"},
                    {"type": "tool_use", "id": "t1", "name": "look", "input": {"q": 1}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1",
                     "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
                {"role": "user", "content": [{"type": "text", "text": "Thanks"}]},
            ],
            "tools": [{"name": "look", "input_schema": {"properties": {}}}],
        });
        let chat = chat_request(&body).unwrap();
        let m = chat["messages"].as_array().unwrap();
        assert_eq!(
            m[0],
            json!({"role": "system", "content": "Be brief. Use tools."})
        );
        assert_eq!(
            m[1]["content"][0],
            json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}})
        );
        assert_eq!(m[2]["reasoning"], "Hmm.");
        assert!(m[2].get("content").is_none());
        assert_eq!(
            m[2]["tool_calls"][0],
            json!({"id": "t1", "type": "function",
                   "function": {"name": "look", "arguments": "{\"q\":1}"}})
        );
        assert_eq!(
            m[3],
            json!({"role": "tool", "tool_call_id": "t1", "content": "a\nb"})
        );
        assert_eq!(m[4], json!({"role": "user", "content": "Thanks"}));
        assert_eq!(m.len(), 5);
        assert_eq!(
            chat["tools"][0]["function"]["parameters"],
            json!({"type": "object", "properties": {}})
        );
        assert_eq!(chat["max_tokens"], 10);
        assert!(chat.get("stream").is_none());
    }

    #[test]
    fn max_tokens_is_required_and_positive() {
        let with = |mt: Value| {
            let mut b = json!({"model": "m", "messages": []});
            if !mt.is_null() {
                b["max_tokens"] = mt;
            }
            chat_request(&b).err()
        };
        assert_eq!(
            with(Value::Null).as_deref(),
            Some("max_tokens: Field required")
        );
        assert_eq!(with(json!(0)).as_deref(), Some(POSITIVE));
        assert_eq!(with(json!(-3)).as_deref(), Some(POSITIVE));
        assert_eq!(with(json!("0")).as_deref(), Some(POSITIVE));
        assert_eq!(with(json!(5)), None);
        let nameless = json!({"model": "", "messages": [], "max_tokens": 5});
        assert!(chat_request(&nameless).is_err());
    }

    /// Reasoning then text: the thinking block closes with its signature before the text block
    /// opens at the next index; the end closes the text block and reports the usage.
    #[test]
    fn events_number_their_blocks_and_sign_thinking() {
        let mut e = Events::new("chatcmpl-1");
        let mut buf = Vec::new();
        e.start(&mut buf, "m", 7);
        e.thinking(&mut buf, "Let me");
        e.text(&mut buf, "");
        e.thinking(&mut buf, " see");
        e.text(&mut buf, "Hi");
        e.stop(&mut buf, FinishReason::Length, 7, 4);
        let text = String::from_utf8(buf).unwrap();
        let events: Vec<(&str, Value)> = text
            .split("\n\n")
            .filter(|s| !s.is_empty())
            .map(|s| {
                let (kind, data) = s.split_once("\ndata: ").unwrap();
                let v: Value = serde_json::from_str(data).unwrap();
                assert_eq!(kind.strip_prefix("event: "), v["type"].as_str());
                (kind, v)
            })
            .collect();
        let kinds: Vec<&str> = events.iter().map(|(k, _)| &k[7..]).collect();
        assert_eq!(
            kinds,
            [
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop",
            ]
        );
        assert_eq!(events[0].1["message"]["usage"], usage(7, 0));
        assert_eq!(
            events[1].1["content_block"],
            json!({"type": "thinking", "thinking": ""})
        );
        assert_eq!(events[4].1["delta"]["type"], "signature_delta");
        assert_eq!(
            events[4].1["delta"]["signature"].as_str().unwrap().len(),
            32
        );
        assert_eq!(events[6].1["index"], 1);
        assert_eq!(
            events[7].1["delta"],
            json!({"type": "text_delta", "text": "Hi"})
        );
        assert_eq!(
            events[9].1,
            json!({"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                   "usage": {"input_tokens": 7, "output_tokens": 4}})
        );
        assert_eq!(events[10].1, json!({"type": "message_stop"}));
    }
}
