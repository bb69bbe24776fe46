//! The shapes a request's prompt takes in the body: a message's `content` (a string or a list of
//! parts, OpenAI's or an Anthropic Messages request's blocks), a conversation's `messages`, a
//! completions `prompt` and a responses or embeddings `input` (a string, a list of strings,
//! token ids, lists of token ids, or — for `input` — items), a score request's inputs. A string
//! stays as the body has it; every list is rendered into the canonical text as it is read, one
//! element at a time (`render`), so the parse of a body never holds a list of its elements.
//!
//! Each is told apart by the first thing the parser meets (a quote, a bracket, a digit, a brace)
//! and read once, straight from the body. `#[serde(untagged)]` would buffer the whole value first
//! and then try each shape on the copy: cheap for a string (the buffer borrows it), but a list
//! of parts or items was built twice (read this way, a responses body with items and parts
//! parses in 40 % fewer instructions: BENCHMARKS.md, *Per-request cost*, 2026-11-27); and its
//! errors named no element.
//!
//! Source of truth: none; these borrow the request body and die with the parse.

use super::render::{push_system_text, room, Parts, Rendering};
use serde::de::{self, value::MapAccessDeserializer, DeserializeSeed, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

/// Text as it appears in the body: borrowed from the body when the JSON string has no escapes,
/// decoded into its own buffer when it has.
#[derive(Deserialize, Default)]
pub(super) struct Text<'a>(#[serde(borrow)] Cow<'a, str>);

impl<'a> Text<'a> {
    pub(super) fn as_str(&self) -> &str {
        &self.0
    }

    fn borrowed(s: &'a str) -> Self {
        Text(Cow::Borrowed(s))
    }

    fn owned(s: String) -> Self {
        Text(Cow::Owned(s))
    }
}

/// JSON the prompt carries as JSON (`tools`, `tool_calls`, a block's `input`, an item's
/// `output`), as the client wrote it without the whitespace between its tokens (keys in the
/// client's order, strings and numbers as written): never built into a tree, whose nodes took up
/// to 24 times the bytes they were read from. Nested deeper than serde_json's own limit of 128,
/// it is refused as the fields read into values are (the engine refuses it too).
pub(super) struct Json(pub String);

/// serde_json's recursion limit.
const MAX_DEPTH: usize = 128;

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = <&RawValue>::deserialize(d)?;
        compact(raw.get())
            .map(Json)
            .ok_or_else(|| de::Error::custom("recursion limit exceeded"))
    }
}

/// `raw` (valid JSON) without the whitespace between its tokens, in one pass that skips each
/// string to its closing quote; `None` when it nests deeper than `MAX_DEPTH`.
fn compact(raw: &str) -> Option<String> {
    let bytes = raw.as_bytes();
    let mut out = String::with_capacity(raw.len());
    let (mut depth, mut from, mut i) = (0usize, 0, 0);
    while let Some(&b) = bytes.get(i) {
        i += 1;
        match b {
            b'"' => {
                while let Some(k) = memchr::memchr2(b'"', b'\\', bytes.get(i..).unwrap_or_default())
                {
                    let escape = bytes.get(i + k) == Some(&b'\\');
                    i += k + if escape { 2 } else { 1 };
                    if !escape {
                        break;
                    }
                }
            }
            b'[' | b'{' => {
                depth += 1;
                if depth > MAX_DEPTH {
                    return None;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            b' ' | b'\t' | b'\n' | b'\r' => {
                out.push_str(raw.get(from..i - 1).unwrap_or_default());
                from = i;
            }
            _ => {}
        }
    }
    out.push_str(raw.get(from..).unwrap_or_default());
    Some(out)
}

/// A message's `content`: a string, or its parts rendered.
pub(super) enum Content<'a> {
    Text(Text<'a>),
    Parts(Parts),
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub(super) struct Part<'a> {
    #[serde(rename = "type", borrow)]
    pub kind: Text<'a>,
    #[serde(borrow)]
    pub text: Option<Text<'a>>,
    /// Responses API refusals and outputs carry their text here.
    #[serde(borrow)]
    pub refusal: Option<Text<'a>>,
    /// Anthropic Messages blocks carry their text in fields of their own: a `thinking` block's
    /// reasoning, a `tool_use` block's tool `name` and `input` (JSON, which the engine renders
    /// as the call's arguments), a `tool_result` block's `content` (a string or blocks).
    #[serde(borrow)]
    pub thinking: Option<Text<'a>>,
    #[serde(borrow)]
    pub name: Option<Text<'a>>,
    pub input: Option<Json>,
    #[serde(borrow)]
    pub content: Option<Content<'a>>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub(super) struct Message<'a> {
    #[serde(borrow)]
    pub role: Option<Text<'a>>,
    #[serde(borrow)]
    pub content: Option<Content<'a>>,
    #[serde(borrow)]
    pub name: Option<Text<'a>>,
    /// Assistant tool calls are prefilled on the next turn; their JSON is counted as text.
    pub tool_calls: Option<Json>,
    /// Responses API items that are not messages (function calls, outputs) carry these.
    #[serde(rename = "type", borrow)]
    pub kind: Option<Text<'a>>,
    #[serde(borrow)]
    pub arguments: Option<Text<'a>>,
    pub output: Option<Json>,
}

/// A responses or embeddings `input`, or (without `Items`) a completions `prompt`.
pub(super) enum Input<'a> {
    Text(Text<'a>),
    /// A batch of strings, each a prompt: their text one after another, where the first ends,
    /// and how many.
    Texts {
        text: String,
        first: usize,
        count: u64,
    },
    /// A batch of lists of token ids, each a prompt: how many ids and lists, and the first list
    /// (whose prefix the batch is routed by).
    Tokens {
        ids: u64,
        lists: u64,
        first: Ids,
    },
    /// One list of token ids: one prompt, whose ids are the engine's own.
    Ids(Ids),
    Items(Turns<SystemInline>),
}

/// Where a conversation's system messages go: turns of their own, or apart.
pub(super) trait SystemRule: Default {
    const APART: bool;
}

/// System messages are turns like any other (chat completions, responses items).
#[derive(Default)]
pub(super) struct SystemInline;

/// System messages join the system prompt (Anthropic's Messages API).
#[derive(Default)]
pub(super) struct SystemApart;

impl SystemRule for SystemInline {
    const APART: bool = false;
}

impl SystemRule for SystemApart {
    const APART: bool = true;
}

/// A conversation's messages, rendered as read: their turns, and how many. Under `SystemApart`
/// system messages are no turns of their own: their text joins the request's system prompt
/// (`Rendering::push_system`), and is kept apart in `system`.
#[derive(Default)]
pub(super) struct Turns<S: SystemRule> {
    pub rendering: Rendering,
    pub count: u64,
    pub system: String,
    rule: PhantomData<S>,
}

impl<S: SystemRule> Turns<S> {
    fn new() -> Self {
        Turns {
            rendering: Rendering::new(),
            ..Turns::default()
        }
    }

    fn push(&mut self, m: &Message) {
        self.count += 1;
        if S::APART && m.role.as_ref().is_some_and(|r| r.as_str() == "system") {
            if let Some(c) = &m.content {
                push_system_text(&mut self.system, c);
            }
        } else {
            self.rendering.push_message(m);
        }
    }
}

impl<'de, S: SystemRule> Deserialize<'de> for Turns<S> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<S>(PhantomData<S>);
        impl<'de, S: SystemRule> Visitor<'de> for V<S> {
            type Value = Turns<S>;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an array of messages")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut turns = Turns::new();
                while let Some(m) = seq.next_element::<Message>()? {
                    turns.push(&m);
                }
                Ok(turns)
            }
        }
        d.deserialize_seq(V(PhantomData))
    }
}

/// The most ids of one list kept (`Ids::bytes`, 256 KB): the most blocks a prompt is hashed in
/// (`routing.maxPromptBlocks` at most 4,096) of 16 tokens; of larger blocks, as many as they
/// fill. The rest are only counted.
const MAX_KEPT_IDS: u64 = 65_536;

/// A list of token ids: how many, and the first `MAX_KEPT_IDS` of them, four little-endian bytes
/// each (`routing::prefix::id_block_hashes` hashes them in the engine's blocks).
#[derive(Default)]
pub(super) struct Ids {
    pub count: u64,
    pub bytes: Vec<u8>,
}

impl Ids {
    fn push(&mut self, id: u32) {
        self.count += 1;
        if self.count <= MAX_KEPT_IDS {
            self.bytes.extend_from_slice(&id.to_le_bytes());
        }
    }
}

/// A completions `prompt`: an input that cannot hold items.
pub(super) struct Prompt<'a>(pub Input<'a>);

/// The strings every shape's visitor takes as text.
macro_rules! text_visits {
    ($value:expr) => {
        fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Self::Value, E> {
            Ok($value(Text::borrowed(s)))
        }

        fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
            Ok($value(Text::owned(s.to_owned())))
        }

        fn visit_string<E: de::Error>(self, s: String) -> Result<Self::Value, E> {
            Ok($value(Text::owned(s)))
        }
    };
}

impl<'de: 'a, 'a> Deserialize<'de> for Content<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Content<'a>;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or an array of content parts")
            }

            text_visits!(Content::Text);

            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
                read_parts(seq).map(Content::Parts)
            }
        }
        d.deserialize_any(V(PhantomData))
    }
}

/// A list of content parts, each rendered as it is read.
fn read_parts<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<Parts, A::Error> {
    let mut parts = Parts::default();
    while let Some(part) = seq.next_element::<Part>()? {
        parts.push(&part);
    }
    Ok(parts)
}

impl<'de> Deserialize<'de> for Parts {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Parts;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an array of content parts")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
                read_parts(seq)
            }
        }
        d.deserialize_seq(V)
    }
}

/// How many token ids a list holds (each must be one: a whole number that fits 32 bits).
struct TokenCount(u64);

impl<'de> Deserialize<'de> for TokenCount {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TokenCount;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an array of token ids")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut n = 0;
                while seq.next_element::<u32>()?.is_some() {
                    n += 1;
                }
                Ok(TokenCount(n))
            }
        }
        d.deserialize_seq(V)
    }
}

/// The first element of a list, which says what the others must be.
enum First<'a> {
    Text(Text<'a>),
    Token(u32),
    List(Ids),
    Item(Message<'a>),
}

/// Whether a list may hold input items (an `input`) or not (a `prompt`).
#[derive(Clone, Copy)]
struct Kinds<'a> {
    items: bool,
    life: PhantomData<&'a ()>,
}

impl<'a> Kinds<'a> {
    fn new(items: bool) -> Self {
        Kinds {
            items,
            life: PhantomData,
        }
    }

    /// What a list's element may be.
    fn element(self) -> &'static str {
        if self.items {
            "a string, a token id, an array of token ids or an input item"
        } else {
            "a string, a token id or an array of token ids"
        }
    }

    /// What the whole value may be.
    fn whole(self) -> &'static str {
        if self.items {
            "a string or an array of strings, token ids, arrays of token ids or input items"
        } else {
            "a string or an array of strings, token ids or arrays of token ids"
        }
    }
}

/// Reads a list's first element, whatever it is; an object only where items are allowed.
struct FirstSeed<'a>(Kinds<'a>);

impl<'de: 'a, 'a> DeserializeSeed<'de> for FirstSeed<'a> {
    type Value = First<'a>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de: 'a, 'a> Visitor<'de> for FirstSeed<'a> {
    type Value = First<'a>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.0.element())
    }

    text_visits!(First::Text);

    fn visit_u64<E: de::Error>(self, id: u64) -> Result<Self::Value, E> {
        u32::try_from(id)
            .map(First::Token)
            .map_err(|_| E::invalid_value(de::Unexpected::Unsigned(id), &"a token id"))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut ids = Ids::default();
        while let Some(id) = seq.next_element::<u32>()? {
            ids.push(id);
        }
        Ok(First::List(ids))
    }

    fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        if !self.0.items {
            return Err(de::Error::invalid_type(de::Unexpected::Map, &self));
        }
        Message::deserialize(MapAccessDeserializer::new(map)).map(First::Item)
    }
}

/// Reads an input or a prompt: a string, or a list whose elements are all of the kind its first
/// one is.
struct InputVisitor<'a>(Kinds<'a>);

impl<'de: 'a, 'a> Visitor<'de> for InputVisitor<'a> {
    type Value = Input<'a>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.0.whole())
    }

    text_visits!(Input::Text);

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        Ok(match seq.next_element_seed(FirstSeed(self.0))? {
            None => Input::Texts {
                text: String::new(),
                first: 0,
                count: 0,
            },
            Some(First::Text(t)) => {
                let mut text = room();
                text.push_str(t.as_str());
                let (first, mut count) = (text.len(), 1);
                while let Some(t) = seq.next_element::<Text>()? {
                    text.push_str(t.as_str());
                    count += 1;
                }
                Input::Texts { text, first, count }
            }
            Some(First::Token(first)) => {
                let mut ids = Ids::default();
                ids.push(first);
                while let Some(id) = seq.next_element::<u32>()? {
                    ids.push(id);
                }
                Input::Ids(ids)
            }
            Some(First::List(first)) => {
                let (mut ids, mut lists) = (first.count, 1);
                while let Some(more) = seq.next_element::<TokenCount>()? {
                    (ids, lists) = (ids + more.0, lists + 1);
                }
                Input::Tokens { ids, lists, first }
            }
            Some(First::Item(m)) => {
                let mut items = Turns::new();
                items.push(&m);
                while let Some(m) = seq.next_element::<Message>()? {
                    items.push(&m);
                }
                Input::Items(items)
            }
        })
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Input<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(InputVisitor(Kinds::new(true)))
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Prompt<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(InputVisitor(Kinds::new(false)))
            .map(Prompt)
    }
}

/// One side of a score or rerank request (vLLM's `ScoreInputs`): a string, a list of strings and
/// `{"content": [parts]}` objects (each one input), or one such object, each of whose parts is an
/// input of its own (vLLM's `validate_score_input`). Each input is a string or parts, rendered as
/// read: their text one after another, where each ends, and their non-text parts (the first
/// input's also apart: a lone query's count once a pair).
#[derive(Default)]
pub(super) struct ScoreInputs {
    text: String,
    ends: Vec<usize>,
    pub non_text_parts: u64,
    pub first_non_text_parts: u64,
}

impl ScoreInputs {
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// The text of input `i` (empty past the last).
    pub fn get(&self, i: usize) -> &str {
        let start = i.checked_sub(1).and_then(|j| self.ends.get(j)).copied();
        let end = self.ends.get(i).copied().unwrap_or(0);
        self.text.get(start.unwrap_or(0)..end).unwrap_or_default()
    }

    /// The text of input `i` and every one after it.
    pub fn rest(&self, i: usize) -> &str {
        let start = i.checked_sub(1).and_then(|j| self.ends.get(j)).copied();
        self.text.get(start.unwrap_or(0)..).unwrap_or_default()
    }

    fn push(&mut self, text: &str, non_text_parts: u64) {
        self.text.push_str(text);
        if self.ends.is_empty() {
            self.first_non_text_parts = non_text_parts;
        }
        self.non_text_parts = self.non_text_parts.saturating_add(non_text_parts);
        self.ends.push(self.text.len());
    }
}

/// A multimodal score input, `{"content": [parts]}` (vLLM's `ScoreMultiModalParam`).
#[derive(Deserialize)]
struct ScoreParts {
    content: Parts,
}

/// Reads one element of a list of score inputs (a string or a `ScoreParts`) into the list.
struct ScoreInput<'s>(&'s mut ScoreInputs);

impl<'de> DeserializeSeed<'de> for ScoreInput<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ScoreInput<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string or an object with `content` parts")
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<(), E> {
        self.0.push(s, 0);
        Ok(())
    }

    fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        let parts = ScoreParts::deserialize(MapAccessDeserializer::new(map))?;
        self.0
            .push(&parts.content.text, parts.content.non_text_parts);
        Ok(())
    }
}

/// Reads a lone object's `content` parts, each an input of its own, into the list.
struct EachPart<'s>(&'s mut ScoreInputs);

impl<'de> DeserializeSeed<'de> for EachPart<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for EachPart<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array of content parts")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut one = Parts::default();
        while let Some(part) = seq.next_element::<Part>()? {
            one.text.clear();
            one.texts.clear();
            one.non_text_parts = 0;
            one.push(&part);
            self.0.push(&one.text, one.non_text_parts);
        }
        Ok(())
    }
}

impl<'de> Deserialize<'de> for ScoreInputs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ScoreInputs;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, an object with `content` parts, or an array of them")
            }

            fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
                let mut inputs = ScoreInputs::default();
                inputs.push(s, 0);
                Ok(inputs)
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut inputs = ScoreInputs::default();
                while seq.next_element_seed(ScoreInput(&mut inputs))?.is_some() {}
                Ok(inputs)
            }

            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut inputs = ScoreInputs::default();
                let mut content = false;
                while let Some(key) = map.next_key::<Text>()? {
                    if key.as_str() != "content" {
                        map.next_value::<de::IgnoredAny>()?;
                    } else if content {
                        return Err(de::Error::duplicate_field("content"));
                    } else {
                        map.next_value_seed(EachPart(&mut inputs))?;
                        content = true;
                    }
                }
                if !content {
                    return Err(de::Error::missing_field("content"));
                }
                Ok(inputs)
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    fn input(json: &str) -> Result<Input<'_>, serde_json::Error> {
        serde_json::from_str(json)
    }

    fn prompt(json: &str) -> Result<Prompt<'_>, serde_json::Error> {
        serde_json::from_str(json)
    }

    #[test]
    fn each_shape_is_told_apart_by_its_first_element() {
        assert!(matches!(input(r#""a""#), Ok(Input::Text(t)) if t.as_str() == "a"));
        assert!(matches!(input(r#"["a","bc"]"#),
            Ok(Input::Texts { text, first: 1, count: 2 }) if text == "abc"));
        assert!(matches!(input("[]"), Ok(Input::Texts { text, count: 0, .. }) if text.is_empty()));
        assert!(matches!(input("[1,2,3]"), Ok(Input::Ids(ids))
            if ids.count == 3 && ids.bytes == [1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0]));
        assert!(matches!(
            input("[[1,2],[],[3]]"),
            Ok(Input::Tokens { ids: 3, lists: 3, first }) if first.bytes == [1, 0, 0, 0, 2, 0, 0, 0]
        ));
        assert!(matches!(input(r#"[{"role":"user"},{}]"#),
            Ok(Input::Items(m)) if m.count == 2 && m.rendering.text == "<user>\n\n<user>\n\n"));
        assert!(matches!(
            prompt("[[4294967295]]"),
            Ok(Prompt(Input::Tokens {
                ids: 1,
                lists: 1,
                ..
            }))
        ));
    }

    #[test]
    fn a_string_without_escapes_is_borrowed_from_the_body() {
        assert!(matches!(
            input(r#""plain""#),
            Ok(Input::Text(Text(Cow::Borrowed("plain"))))
        ));
        assert!(
            matches!(input(r#""esc\"aped""#), Ok(Input::Text(Text(Cow::Owned(s)))) if s == "esc\"aped")
        );
        // A list's strings are rendered one after another, escapes decoded.
        assert!(matches!(input(r#"["plain","esc\"aped"]"#),
            Ok(Input::Texts { text, first: 5, count: 2 }) if text == "plainesc\"aped"));
    }

    #[test]
    fn mixed_lists_and_wrong_kinds_are_refused() {
        for bad in [
            r#"["a",1]"#,
            r#"[1,"a"]"#,
            "[[1],2]",
            "[1,[2]]",
            "[-1]",
            "[4294967296]",
            "[1.5]",
            "[[\"a\"]]",
            r#"[{"role":"user"},"a"]"#,
            "5",
            "true",
            "{}",
        ] {
            assert!(input(bad).is_err(), "{bad}");
        }
        // A prompt holds no items.
        assert!(prompt(r#"[{"role":"user"}]"#).is_err());
        assert!(prompt(r#"["a"]"#).is_ok());
    }

    #[test]
    fn score_inputs_are_strings_or_content_parts_each_part_of_a_lone_object_its_own() {
        let side = |json| serde_json::from_str::<ScoreInputs>(json);
        // Each input's text, and the non-text parts of all and of the first.
        let inputs = |json| {
            let s = side(json).unwrap_or_default();
            let texts: Vec<String> = (0..s.len()).map(|i| s.get(i).to_owned()).collect();
            (texts, s.non_text_parts, s.first_non_text_parts)
        };
        assert_eq!(inputs(r#""q""#), (vec!["q".into()], 0, 0));
        assert_eq!(
            inputs(r#"["a","b\n"]"#),
            (vec!["a".into(), "b\n".into()], 0, 0)
        );
        assert_eq!(
            inputs(r#"["a",{"content":[{"type":"image_url"},{"type":"text","text":"t"}]}]"#),
            (vec!["a".into(), "t".into()], 1, 0)
        );
        // A lone object: each of its parts is an input of its own.
        assert_eq!(
            inputs(r#"{"content":[{"type":"image_url"},{"type":"text","text":"t"}],"x":1}"#),
            (vec!["".into(), "t".into()], 1, 1)
        );
        assert_eq!(inputs("[]"), (vec![], 0, 0));
        let s = side(r#"["ab","c","de"]"#).unwrap_or_default();
        assert_eq!((s.rest(1), s.get(3), s.rest(3)), ("cde", "", ""));
        for bad in [
            "5",
            "[5]",
            "[[\"a\"]]",
            "{}",
            r#"{"content":[],"content":[]}"#,
            r#"[{"text":"a"}]"#,
            "null",
        ] {
            assert!(side(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn json_is_kept_compact_with_its_strings_as_written() {
        let json = |text: &str| serde_json::from_str::<Json>(text).map(|j| j.0);
        assert_eq!(
            json(" { \"b\" : [1, 2.50e1 ,\n\t\"a b\\\" \\\\\" ] , \"a\":{} } ").ok(),
            Some(r#"{"b":[1,2.50e1,"a b\" \\"],"a":{}}"#.to_owned())
        );
        assert_eq!(json(r#""x \" y""#).ok(), Some(r#""x \" y""#.to_owned()));
        assert_eq!(json("7").ok(), Some("7".to_owned()));
        // Nesting is counted outside strings only, to serde_json's limit.
        let nested = |open: &str, close: &str, n| format!("{}0{}", open.repeat(n), close.repeat(n));
        assert!(json(&nested("[", "]", MAX_DEPTH)).is_ok());
        assert!(json(&nested("[", "]", MAX_DEPTH + 1)).is_err());
        assert!(json(&nested(r#"["]}\"[{","#, "]", MAX_DEPTH)).is_ok());
        assert!(json(&nested(r#"{"a":"#, "}", MAX_DEPTH + 1)).is_err());
    }

    #[test]
    fn content_is_a_string_or_parts() {
        let c = |json| serde_json::from_str::<Content>(json);
        assert!(matches!(c(r#""hi""#), Ok(Content::Text(t)) if t.as_str() == "hi"));
        assert!(matches!(
            c(r#"[{"type":"text","text":"a"},{"type":"image_url"},{"type":"text","text":"b"}]"#),
            Ok(Content::Parts(p)) if p.text == "ab" && p.non_text_parts == 1 && p.texts == [0..1, 1..2]
        ));
        assert!(c("5").is_err());
        assert!(c(r#"{"type":"text"}"#).is_err());
    }
}
