//! A JSON answer too long to keep whole (past the meter's `MAX_KEPT`: a batch of embeddings,
//! an answer with log probabilities) read as it passes, for the two top-level fields kvgate
//! needs: its `usage` (the engine's counts, which calibration learns from) and its `id` (a
//! Responses API answer's, for its follow-ups). Everything else is only walked over: nesting
//! and strings are tracked byte by byte, and the two values are copied, each up to
//! [`MAX_VALUE`] bytes. vLLM and OpenAI write `usage` after the answer's content
//! (`ResponseMeter` reads a body it kept with serde instead).

/// The longest value copied: a usage object with every detail the engines add is well under it.
const MAX_VALUE: usize = 4096;
/// The longest key told apart, as written (`usage`, `id`, or either spelt in `\u` escapes); a
/// longer one is some other key.
const MAX_KEY: usize = 32;

#[derive(Debug, Default)]
pub struct LongBody {
    depth: u32,
    in_string: bool,
    escaped: bool,
    /// Where the walk is in the top-level object, between its containers' brackets.
    at: Place,
    key: Vec<u8>,
    /// Which field's value is being copied, while it runs.
    copying: Option<Field>,
    usage: Value,
    id: Value,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// Before the top-level object.
    #[default]
    Before,
    /// Within a top-level array (SGLang's batch: no fields), or after the object.
    Outside,
    /// Not one JSON object: something else before or after it. Nothing is read.
    Broken,
    /// Where a key may start: after the object's `{` or a value's `,`.
    BeforeKey,
    InKey,
    /// After a key, before its `:`.
    AfterKey,
    /// Within a value (at any depth).
    InValue,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Usage,
    Id,
}

/// A copied value: its bytes, or none once it ran past [`MAX_VALUE`] or its key came twice
/// (the meter's reading of a body it keeps refuses a repeated field, and so does this one).
#[derive(Debug, Default)]
struct Value {
    bytes: Vec<u8>,
    seen: bool,
    unreadable: bool,
}

impl Value {
    fn push(&mut self, b: u8) {
        if self.bytes.len() >= MAX_VALUE {
            self.unreadable = true;
        } else if !self.unreadable {
            self.bytes.push(b);
        }
    }

    fn read(&self) -> Option<&[u8]> {
        (!self.unreadable && !self.bytes.is_empty()).then_some(self.bytes.as_slice())
    }
}

impl LongBody {
    /// Walks the next piece of the body.
    pub fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.at == Place::Broken {
                return;
            }
            // Nothing is copied here: skip to the next byte that can change where the walk is
            // (most of a long answer is numbers in nested lists, or text in strings).
            if self.copying.is_none() && self.at != Place::InKey {
                let next = if self.in_string && !self.escaped {
                    memchr::memchr2(b'"', b'\\', bytes)
                } else if !self.in_string && self.depth >= 2 {
                    bytes
                        .iter()
                        .position(|c| matches!(c, b'"' | b'{' | b'}' | b'[' | b']'))
                } else if self.depth == 0 {
                    bytes.iter().position(|c| !c.is_ascii_whitespace())
                } else {
                    Some(0)
                };
                let Some(next) = next else {
                    return;
                };
                bytes = bytes.get(next..).unwrap_or_default();
            }
            let Some((&b, rest)) = bytes.split_first() else {
                return;
            };
            self.byte(b);
            bytes = rest;
        }
    }

    /// The top-level `usage` value's bytes, once read whole.
    pub fn usage(&self) -> Option<&[u8]> {
        let whole = self.at != Place::Broken && self.copying != Some(Field::Usage);
        self.usage.read().filter(|_| whole)
    }

    /// The top-level `id`, when it is a string.
    pub fn id(&self) -> Option<String> {
        let whole = self.at != Place::Broken && self.copying != Some(Field::Id);
        let raw = self.id.read().filter(|_| whole)?;
        serde_json::from_slice::<String>(raw.trim_ascii()).ok()
    }

    /// The key just read, its escapes undone (a JSON reader matches `"us\u0061ge"` as `usage`).
    fn key_read(&self) -> Option<Vec<u8>> {
        if self.key.len() > MAX_KEY {
            return None;
        }
        if !self.key.contains(&b'\\') {
            return Some(self.key.clone());
        }
        let quoted = [&b"\""[..], &self.key, b"\""].concat();
        serde_json::from_slice::<String>(&quoted)
            .ok()
            .map(String::into_bytes)
    }

    fn byte(&mut self, b: u8) {
        if self.depth == 0 && !b.is_ascii_whitespace() {
            self.at = match (self.at, b) {
                (Place::Before, b'{') => Place::BeforeKey,
                (Place::Before, b'[') => Place::Outside,
                _ => Place::Broken,
            };
        }
        if self.at == Place::Broken {
            self.copying = None;
            return;
        }
        if let Some(field) = self.copying {
            // A value ends at its object's next `,` or `}` outside any string.
            let ends = self.depth == 1 && !self.in_string && matches!(b, b',' | b'}');
            if !ends {
                match field {
                    Field::Usage => self.usage.push(b),
                    Field::Id => self.id.push(b),
                }
            } else {
                self.copying = None;
            }
        }
        if self.in_string {
            let ends = !self.escaped && b == b'"';
            self.escaped = !self.escaped && b == b'\\';
            if ends {
                self.in_string = false;
                if self.at == Place::InKey {
                    self.at = Place::AfterKey;
                }
            } else if self.at == Place::InKey && self.key.len() <= MAX_KEY {
                // As written, escapes and all: `key_read` undoes them.
                self.key.push(b);
            }
            return;
        }
        match b {
            b'"' => {
                self.in_string = true;
                if self.depth == 1 && self.at == Place::BeforeKey {
                    self.at = Place::InKey;
                    self.key.clear();
                }
            }
            b'{' | b'[' => self.depth = self.depth.saturating_add(1),
            b'}' | b']' => {
                self.depth = self.depth.saturating_sub(1);
                if self.depth == 0 {
                    self.at = Place::Outside;
                }
            }
            b':' if self.depth == 1 && self.at == Place::AfterKey => {
                self.at = Place::InValue;
                self.copying = match self.key_read().as_deref() {
                    Some(b"usage") => Some(Field::Usage),
                    Some(b"id") => Some(Field::Id),
                    _ => None,
                };
                let value = match self.copying {
                    Some(Field::Usage) => &mut self.usage,
                    Some(Field::Id) => &mut self.id,
                    None => return,
                };
                value.unreadable |= value.seen;
                value.seen = true;
            }
            b',' if self.depth == 1 && self.at == Place::InValue => self.at = Place::BeforeKey,
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn walked(body: &[u8], piece: usize) -> LongBody {
        let mut l = LongBody::default();
        body.chunks(piece.max(1)).for_each(|p| l.feed(p));
        l
    }

    #[test]
    fn finds_the_top_level_usage_and_id_past_any_content() {
        let floats = vec!["0.125"; 5000].join(",");
        let body = format!(
            r#"{{"id":"embd-1","object":"list","data":[{{"index":0,"embedding":[{floats}],"usage":{{"prompt_tokens":9}}}}],"note":"a \"usage\": {{ }} , ","usage":{{"prompt_tokens":42,"total_tokens":42,"completion_tokens":0,"prompt_tokens_details":null}}}}"#
        );
        for piece in [1, 7, 4096, body.len()] {
            let l = walked(body.as_bytes(), piece);
            assert_eq!(
                l.usage(),
                Some(&br#"{"prompt_tokens":42,"total_tokens":42,"completion_tokens":0,"prompt_tokens_details":null}"#[..]),
                "pieces of {piece}"
            );
            assert_eq!(l.id().as_deref(), Some("embd-1"));
        }
    }

    #[test]
    fn reads_nothing_it_cannot_vouch_for() {
        // No usage; a nested one only; one cut off; one too long; a top-level array.
        for body in [
            &br#"{"data":[1,2,3]}"#[..],
            br#"{"data":{"usage":{"prompt_tokens":1}}}"#,
            br#"{"usage":{"prompt_tokens":1"#,
            br#"[{"usage":{"prompt_tokens":1}}]"#,
            br#"{"usage"  :  "#,
            br#"x{"usage":{"prompt_tokens":1}}"#,
            br#"{"usage":{"prompt_tokens":1}} {"#,
            br#"{"usage":{"prompt_tokens":1}}}"#,
        ] {
            let l = walked(body, 3);
            assert_eq!(l.usage(), None, "{}", String::from_utf8_lossy(body));
        }
        let long = format!(r#"{{"usage":{{"x":"{}"}}}}"#, "y".repeat(MAX_VALUE));
        assert_eq!(walked(long.as_bytes(), 100).usage(), None);
        // Spacing around the value is the value's; a repeated key is read as none, as the
        // kept body's reader refuses it.
        let l = walked(br#" { "id" : "r\"1" , "usage" : {"prompt_tokens":2} } "#, 2);
        assert_eq!(l.usage(), Some(&br#" {"prompt_tokens":2} "#[..]));
        assert_eq!(l.id().as_deref(), Some("r\"1"));
        let l = walked(
            br#"{"usage":"m","usage":{"prompt_tokens":2},"id":"a","id":"b"}"#,
            3,
        );
        assert_eq!((l.usage(), l.id()), (None, None));
        // A key longer than any asked for is not mistaken for one that starts alike; an
        // escaped one is read as a JSON reader reads it.
        let l = walked(br#"{"usage_extra":{"prompt_tokens":3},"identity":"x"}"#, 5);
        assert_eq!((l.usage(), l.id()), (None, None));
        let l = walked(br#"{"\u0075s\u0061ge":{"prompt_tokens":3},"i\"d":"x"}"#, 5);
        assert_eq!(
            (l.usage(), l.id()),
            (Some(&br#"{"prompt_tokens":3}"#[..]), None)
        );
    }
}
