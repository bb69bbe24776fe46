//! Reading model-server responses as they pass: counting streamed output tokens from SSE chunks
//! and finding the final `usage` (the include_usage chunk of a stream, or a JSON body's field).
//! The meter only looks; the response itself goes to the client untouched and unbuffered.

use serde::Deserialize;

/// The most of a non-streaming body, or of one SSE line, kvgate keeps to read `usage` from.
const MAX_KEPT: usize = 1024 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(default)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    #[serde(deserialize_with = "cached_tokens")]
    #[serde(rename = "prompt_tokens_details")]
    pub cached_tokens: Option<u64>,
}

fn cached_tokens<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize, Default)]
    #[serde(default)]
    struct Details {
        cached_tokens: Option<u64>,
    }
    Ok(Option::<Details>::deserialize(d)?.and_then(|x| x.cached_tokens))
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Delta {
    content: Option<String>,
    reasoning_content: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Choice {
    text: Option<String>,
    delta: Option<Delta>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Chunk {
    choices: Vec<Choice>,
    usage: Option<Usage>,
    /// The Responses API streams `response.output_text.delta` events and ends with
    /// `response.completed`, whose response carries usage in its own names.
    #[serde(rename = "type")]
    kind: Option<String>,
    response: Option<ResponsesBody>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ResponsesUsage {
    input_tokens: u64,
    output_tokens: u64,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ResponsesBody {
    usage: Option<ResponsesUsage>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Body {
    usage: Option<serde_json::Value>,
}

fn usage_from(value: serde_json::Value) -> Option<Usage> {
    if value.get("input_tokens").is_some() {
        let u: ResponsesUsage = serde_json::from_value(value).ok()?;
        return Some(Usage {
            prompt_tokens: u.input_tokens,
            completion_tokens: u.output_tokens,
            cached_tokens: None,
        });
    }
    serde_json::from_value(value).ok()
}

#[derive(Debug, Default)]
pub struct ResponseMeter {
    sse: bool,
    kept: Vec<u8>,
    overflowed: bool,
    /// Output tokens seen so far (one per streamed piece of text).
    pub streamed_tokens: u64,
    pub usage: Option<Usage>,
}

impl ResponseMeter {
    pub fn new(content_type: Option<&str>) -> Self {
        Self {
            sse: content_type.is_some_and(|c| c.contains("text/event-stream")),
            ..Self::default()
        }
    }

    /// Feeds the next piece of the body; returns how many output tokens it carried.
    pub fn feed(&mut self, bytes: &[u8]) -> u64 {
        if !self.sse {
            self.keep(bytes);
            return 0;
        }
        let before = self.streamed_tokens;
        let mut rest = bytes;
        while let Some(i) = rest.iter().position(|&b| b == b'\n') {
            self.keep(&rest[..i]);
            let line = std::mem::take(&mut self.kept);
            if !std::mem::take(&mut self.overflowed) {
                self.line(&line);
            }
            self.kept = line;
            self.kept.clear();
            rest = &rest[i + 1..];
        }
        self.keep(rest);
        self.streamed_tokens - before
    }

    /// The body has ended: reads a non-streaming body's usage.
    pub fn finish(&mut self) -> Option<Usage> {
        if !self.sse && !self.overflowed && self.usage.is_none() {
            self.usage = serde_json::from_slice::<Body>(&self.kept)
                .ok()
                .and_then(|b| b.usage)
                .and_then(usage_from);
        }
        if self.sse && !self.kept.is_empty() && !self.overflowed {
            let line = std::mem::take(&mut self.kept);
            self.line(&line);
        }
        self.usage
    }

    fn keep(&mut self, bytes: &[u8]) {
        if self.kept.len() + bytes.len() > MAX_KEPT {
            self.overflowed = true;
            self.kept.clear();
        } else if !self.overflowed {
            self.kept.extend_from_slice(bytes);
        }
    }

    fn line(&mut self, line: &[u8]) {
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        let data = data.trim_ascii();
        if data.is_empty() || data == b"[DONE]" {
            return;
        }
        let Ok(chunk) = serde_json::from_slice::<Chunk>(data) else {
            return;
        };
        for c in &chunk.choices {
            let piece = c
                .text
                .as_deref()
                .or(c.delta.as_ref().and_then(|d| d.content.as_deref()))
                .or(c
                    .delta
                    .as_ref()
                    .and_then(|d| d.reasoning_content.as_deref()));
            if piece.is_some_and(|p| !p.is_empty()) {
                self.streamed_tokens += 1;
            }
        }
        if chunk.kind.as_deref() == Some("response.output_text.delta") {
            self.streamed_tokens += 1;
        }
        if let Some(u) = chunk.usage {
            self.usage = Some(u);
        }
        if let Some(u) = chunk.response.and_then(|r| r.usage) {
            self.usage = Some(Usage {
                prompt_tokens: u.input_tokens,
                completion_tokens: u.output_tokens,
                cached_tokens: None,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    const STREAM: &str = concat!(
        "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
        "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\n\n",
        "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"}}]}\n\n",
        "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"length\"}]}\n\n",
        "data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":2,",
        "\"total_tokens\":14,\"prompt_tokens_details\":{\"cached_tokens\":8}}}\n\n",
        "data: [DONE]\n\n"
    );

    #[test]
    fn counts_stream_tokens_and_reads_usage_across_any_split() {
        for split in 1..STREAM.len() {
            let mut m = ResponseMeter::new(Some("text/event-stream; charset=utf-8"));
            let (a, b) = STREAM.as_bytes().split_at(split);
            let n = m.feed(a) + m.feed(b);
            assert_eq!(n, 2, "split at {split}");
            let u = m.finish().unwrap();
            assert_eq!(
                (u.prompt_tokens, u.completion_tokens, u.cached_tokens),
                (12, 2, Some(8))
            );
        }
    }

    #[test]
    fn completions_stream_uses_text() {
        let mut m = ResponseMeter::new(Some("text/event-stream"));
        m.feed(
            b"data: {\"choices\":[{\"text\":\"a\"}]}\r\ndata: {\"choices\":[{\"text\":\"b\"}]}\n",
        );
        assert_eq!(m.streamed_tokens, 2);
        assert_eq!(m.finish(), None);
    }

    #[test]
    fn json_body_usage_and_responses_api_usage() {
        let mut m = ResponseMeter::new(Some("application/json"));
        m.feed(b"{\"choices\":[{\"message\":{\"content\":\"hi\"}}],");
        m.feed(b"\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1}}");
        assert_eq!(m.finish().map(|u| u.prompt_tokens), Some(5));
        let mut m = ResponseMeter::new(Some("application/json"));
        m.feed(br#"{"output":[],"usage":{"input_tokens":7,"output_tokens":3}}"#);
        assert_eq!(m.finish().map(|u| u.completion_tokens), Some(3));
        let mut m = ResponseMeter::new(Some("text/event-stream"));
        m.feed(b"data: {\"type\":\"response.output_text.delta\",\"delta\":\"x\"}\n");
        m.feed(b"data: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":4,\"output_tokens\":1}}}\n");
        assert_eq!(m.streamed_tokens, 1);
        assert_eq!(m.finish().map(|u| u.prompt_tokens), Some(4));
    }

    #[test]
    fn garbage_and_oversize_are_ignored() {
        let mut m = ResponseMeter::new(Some("text/event-stream"));
        m.feed(b"data: {not json\n: comment\nevent: x\n\xff\xfe\n");
        m.feed(&vec![b'a'; MAX_KEPT + 10]);
        m.feed(b"\ndata: {\"choices\":[{\"text\":\"ok\"}]}\n");
        assert_eq!(m.streamed_tokens, 1);
        let mut m = ResponseMeter::new(None);
        m.feed(&vec![b' '; MAX_KEPT + 1]);
        m.feed(br#"{"usage":{"prompt_tokens":1}}"#);
        assert_eq!(m.finish(), None);
    }
}
