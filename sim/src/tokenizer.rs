//! Real BPE token counts via tiktoken, a fixed ChatML-style chat template, and
//! the filler vocabulary that generated tokens are drawn from.

use std::collections::HashMap;

use serde_json::Value;
use tiktoken_rs::CoreBPE;

use crate::kv::mix64;

/// Words used as generated output. Each must be one token (with its leading
/// space) in the chosen encoding; those that are not are dropped at start-up.
/// Space-prefixed words re-tokenize to the same ids when a client sends the
/// generated text back (multi-turn), so generated blocks can hit the cache.
const FILLER_WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "model", "token", "cache",
    "prefix", "block", "route", "pod", "queue", "time", "first", "large", "language", "simple",
    "system", "value", "state",
];

/// One rendered piece of a prompt: text to tokenize, or a non-text content
/// part that stands for a fixed number of pseudo tokens.
#[derive(Debug, Clone, PartialEq)]
pub enum Segment {
    Text(String),
    Media { hash: u64, tokens: usize },
}

pub struct Tokenizer {
    bpe: &'static CoreBPE,
    pub name: &'static str,
    /// The encoding's `<|endoftext|>`: the EOS a natural end ("stop") emits, which the engines'
    /// token outputs (SGLang's `output_ids`, vLLM's `token_ids`) include and their text leaves out.
    pub eos: u32,
    filler: Vec<u32>,
    pieces: HashMap<u32, String>,
}

impl Tokenizer {
    pub fn new(name: &str) -> Result<Self, String> {
        let (bpe, name, eos): (&'static CoreBPE, &'static str, u32) = match name {
            "o200k_base" | "o200k" => (tiktoken_rs::o200k_base_singleton(), "o200k_base", 199_999),
            "cl100k_base" | "cl100k" => {
                (tiktoken_rs::cl100k_base_singleton(), "cl100k_base", 100_257)
            }
            other => {
                return Err(format!(
                    "unknown tokenizer {other:?} (expected o200k_base or cl100k_base)"
                ))
            }
        };
        let mut filler = Vec::new();
        let mut pieces = HashMap::new();
        for w in FILLER_WORDS {
            let text = format!(" {w}");
            let ids = bpe.encode_ordinary(&text);
            if let [id] = ids.as_slice() {
                if pieces.insert(*id, text).is_none() {
                    filler.push(*id);
                }
            }
        }
        if filler.is_empty() {
            return Err("no single-token filler words in this encoding".into());
        }
        Ok(Tokenizer {
            bpe,
            name,
            eos,
            filler,
            pieces,
        })
    }

    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_ordinary(text)
    }

    pub fn decode(&self, ids: &[u32]) -> String {
        match self.bpe.decode_bytes(ids) {
            Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            Err(_) => {
                // Pseudo ids (non-text parts) are outside the vocabulary.
                ids.iter().map(|&i| self.piece(i)).collect()
            }
        }
    }

    /// Token ids that generated output is drawn from.
    pub fn filler(&self) -> &[u32] {
        &self.filler
    }

    /// Text of one generated token.
    pub fn piece(&self, id: u32) -> String {
        if let Some(p) = self.pieces.get(&id) {
            return p.clone();
        }
        match self.bpe.decode_bytes(&[id]) {
            Ok(b) => String::from_utf8_lossy(&b).into_owned(),
            Err(_) => String::new(),
        }
    }

    /// Tokenize rendered segments: text runs through BPE, non-text parts become
    /// `tokens` deterministic pseudo ids derived from the part's content (like
    /// vLLM's multimodal hash in block keys: equal media share a prefix).
    pub fn encode_segments(&self, segs: &[Segment]) -> Vec<u32> {
        let mut out = Vec::new();
        for s in segs {
            match s {
                Segment::Text(t) => out.extend(self.encode(t)),
                Segment::Media { hash, tokens } => {
                    for i in 0..*tokens {
                        // Keep pseudo ids away from real ids' typical range.
                        out.push(0x4000_0000 | (mix64(hash ^ i as u64) as u32 & 0x0fff_ffff));
                    }
                }
            }
        }
        out
    }
}

/// Render text into a segment list, merging adjacent text.
fn push_text(segs: &mut Vec<Segment>, t: &str) {
    if t.is_empty() {
        return;
    }
    if let Some(Segment::Text(last)) = segs.last_mut() {
        last.push_str(t);
    } else {
        segs.push(Segment::Text(t.to_string()));
    }
}

/// A string's hash: a media part's pseudo tokens, an Anthropic thinking block's signature.
pub(crate) fn hash_str(s: &str) -> u64 {
    let mut h = 0x6d65_6469_6100_0000u64;
    for b in s.bytes() {
        h = mix64(h ^ u64::from(b));
    }
    h
}

/// Render message content (string, array of parts, or null).
fn render_content(
    segs: &mut Vec<Segment>,
    content: &Value,
    media_tokens: usize,
) -> Result<(), String> {
    match content {
        Value::Null => Ok(()),
        Value::String(s) => {
            push_text(segs, s);
            Ok(())
        }
        Value::Array(parts) => {
            let mut first_text = true;
            for p in parts {
                match p {
                    Value::String(s) => {
                        if !first_text {
                            push_text(segs, "\n");
                        }
                        push_text(segs, s);
                        first_text = false;
                    }
                    Value::Object(o) => {
                        let ty = o.get("type").and_then(Value::as_str).unwrap_or("text");
                        if ty == "text" || ty == "input_text" || ty == "output_text" {
                            let t = o.get("text").and_then(Value::as_str).unwrap_or("");
                            if !first_text {
                                push_text(segs, "\n");
                            }
                            push_text(segs, t);
                            first_text = false;
                        } else {
                            segs.push(Segment::Media {
                                hash: hash_str(&p.to_string()),
                                tokens: media_tokens,
                            });
                        }
                    }
                    _ => return Err("content parts must be objects or strings".into()),
                }
            }
            Ok(())
        }
        _ => Err("message content must be a string, an array of parts, or null".into()),
    }
}

/// What closes each message the chat template renders.
pub const MESSAGE_END: &str = "<|im_end|>\n";

/// The simulator's fixed chat template (ChatML):
///
/// ```text
/// [<|im_start|>system\n# Tools\n{tools json}<|im_end|>\n]   (only when `tools` given)
/// <|im_start|>{role}\n{content}[{tool_calls json}]<|im_end|>\n   (per message)
/// <|im_start|>assistant\n                                      (add_generation_prompt)
/// ```
///
/// The whole string is tokenized with `encode_ordinary` (marker strings are
/// plain text, never special tokens), so every earlier message is a true token
/// prefix of a longer conversation.
pub fn render_chat(
    messages: &[Value],
    tools: Option<&Value>,
    add_generation_prompt: bool,
    media_tokens: usize,
) -> Result<Vec<Segment>, String> {
    let mut segs = Vec::new();
    if let Some(t) = tools {
        if !t.is_null() {
            push_text(&mut segs, "<|im_start|>system\n# Tools\n");
            push_text(&mut segs, &t.to_string());
            push_text(&mut segs, "<|im_end|>\n");
        }
    }
    for m in messages {
        let obj = m.as_object().ok_or("each message must be an object")?;
        let role = obj
            .get("role")
            .and_then(Value::as_str)
            .ok_or("message without a role")?;
        push_text(&mut segs, "<|im_start|>");
        push_text(&mut segs, role);
        push_text(&mut segs, "\n");
        render_content(
            &mut segs,
            obj.get("content").unwrap_or(&Value::Null),
            media_tokens,
        )?;
        if let Some(tc) = obj.get("tool_calls") {
            if !tc.is_null() {
                push_text(&mut segs, &tc.to_string());
            }
        }
        push_text(&mut segs, MESSAGE_END);
    }
    if add_generation_prompt {
        push_text(&mut segs, "<|im_start|>assistant\n");
    }
    Ok(segs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn filler_round_trips_as_single_tokens() {
        for enc in ["o200k_base", "cl100k_base"] {
            let t = Tokenizer::new(enc).unwrap();
            assert!(t.filler().len() >= 32, "{enc}: {}", t.filler().len());
            let ids: Vec<u32> = t.filler().iter().copied().cycle().take(100).collect();
            let text: String = ids.iter().map(|&i| t.piece(i)).collect();
            assert_eq!(
                t.encode(&text),
                ids,
                "{enc}: generated text re-tokenizes identically"
            );
        }
    }

    /// The EOS a stop ends with is each encoding's `<|endoftext|>`.
    #[test]
    fn eos_is_the_encodings_end_of_text() {
        for enc in ["o200k_base", "cl100k_base"] {
            let t = Tokenizer::new(enc).unwrap();
            assert_eq!(
                t.bpe.encode_with_special_tokens("<|endoftext|>"),
                [t.eos],
                "{enc}"
            );
        }
    }

    #[test]
    fn conversation_prefix_is_a_token_prefix() {
        let t = Tokenizer::new("o200k_base").unwrap();
        let m1 = vec![
            json!({"role": "system", "content": "You are a helpful assistant."}),
            json!({"role": "user", "content": "Tell me about caches."}),
        ];
        let p1 = t.encode_segments(&render_chat(&m1, None, true, 0).unwrap());
        let gen: Vec<u32> = t.filler()[..20].to_vec();
        let answer: String = gen.iter().map(|&i| t.piece(i)).collect();
        let mut m2 = m1.clone();
        m2.push(json!({"role": "assistant", "content": answer}));
        m2.push(json!({"role": "user", "content": [{"type": "text", "text": "More?"}]}));
        let p2 = t.encode_segments(&render_chat(&m2, None, true, 0).unwrap());
        let mut turn1: Vec<u32> = p1.clone();
        turn1.extend(&gen);
        assert_eq!(&p2[..turn1.len()], turn1.as_slice());
    }

    #[test]
    fn media_parts_count_fixed_tokens() {
        let t = Tokenizer::new("o200k_base").unwrap();
        let m = vec![json!({"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "text", "text": "What is this?"}
        ]})];
        let with = t.encode_segments(&render_chat(&m, None, true, 100).unwrap());
        let without = t.encode_segments(&render_chat(&m, None, true, 0).unwrap());
        assert_eq!(with.len(), without.len() + 100);
    }
}
