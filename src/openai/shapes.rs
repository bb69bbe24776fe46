//! The shapes a request's prompt takes in the body: a message's `content` (a string or a list of
//! parts, OpenAI's or an Anthropic Messages request's blocks), a completions `prompt` and a responses or embeddings `input` (a string, a list of
//! strings, token ids, lists of token ids, or — for `input` — items). `request` renders them into
//! the canonical text.
//!
//! Each is told apart by the first thing the parser meets (a quote, a bracket, a digit, a brace)
//! and read once, straight from the body. `#[serde(untagged)]` would buffer the whole value first
//! and then try each shape on the copy: cheap for a string (the buffer borrows it), but a list
//! of parts or items was built twice (read this way, a responses body with items and parts
//! parses in 40 % fewer instructions: BENCHMARKS.md, *Per-request cost*, 2026-11-27); and its
//! errors named no element.
//!
//! Source of truth: none; these borrow the request body and die with the parse.

use serde::de::{self, value::MapAccessDeserializer, DeserializeSeed, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
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

/// A message's `content`.
pub(super) enum Content<'a> {
    Text(Text<'a>),
    Parts(Vec<Part<'a>>),
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
    pub input: Option<serde_json::Value>,
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
    pub tool_calls: Option<serde_json::Value>,
    /// Responses API items that are not messages (function calls, outputs) carry these.
    #[serde(rename = "type", borrow)]
    pub kind: Option<Text<'a>>,
    #[serde(borrow)]
    pub arguments: Option<Text<'a>>,
    pub output: Option<serde_json::Value>,
}

/// A responses or embeddings `input`, or (without `Items`) a completions `prompt`.
pub(super) enum Input<'a> {
    Text(Text<'a>),
    Texts(Vec<Text<'a>>),
    /// A batch of lists of token ids, each a prompt: how many ids and lists, and the first list
    /// (whose prefix the batch is routed by).
    Tokens {
        ids: u64,
        lists: u64,
        first: Ids,
    },
    /// One list of token ids: one prompt, whose ids are the engine's own.
    Ids(Ids),
    Items(Vec<Message<'a>>),
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

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut parts = Vec::new();
                while let Some(part) = seq.next_element()? {
                    parts.push(part);
                }
                Ok(Content::Parts(parts))
            }
        }
        d.deserialize_any(V(PhantomData))
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
            None => Input::Texts(Vec::new()),
            Some(First::Text(t)) => {
                let mut texts = vec![t];
                while let Some(t) = seq.next_element()? {
                    texts.push(t);
                }
                Input::Texts(texts)
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
                let mut items = vec![m];
                while let Some(m) = seq.next_element()? {
                    items.push(m);
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
/// input of its own (vLLM's `validate_score_input`). Each input is a string or parts.
pub(super) struct ScoreInputs<'a>(pub Vec<Content<'a>>);

/// A multimodal score input, `{"content": [parts]}` (vLLM's `ScoreMultiModalParam`).
#[derive(Deserialize)]
struct ScoreParts<'a> {
    #[serde(borrow)]
    content: Vec<Part<'a>>,
}

/// One element of a list of score inputs: a string or a `ScoreParts`.
struct ScoreInput<'a>(Content<'a>);

impl<'de: 'a, 'a> Deserialize<'de> for ScoreInput<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = ScoreInput<'a>;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or an object with `content` parts")
            }

            text_visits!(|t| ScoreInput(Content::Text(t)));

            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                let parts = ScoreParts::deserialize(MapAccessDeserializer::new(map))?;
                Ok(ScoreInput(Content::Parts(parts.content)))
            }
        }
        d.deserialize_any(V(PhantomData))
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for ScoreInputs<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = ScoreInputs<'a>;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, an object with `content` parts, or an array of them")
            }

            text_visits!(|t| ScoreInputs(vec![Content::Text(t)]));

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut inputs = Vec::new();
                while let Some(ScoreInput(c)) = seq.next_element()? {
                    inputs.push(c);
                }
                Ok(ScoreInputs(inputs))
            }

            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                let parts = ScoreParts::deserialize(MapAccessDeserializer::new(map))?;
                let each = parts.content.into_iter();
                Ok(ScoreInputs(each.map(|p| Content::Parts(vec![p])).collect()))
            }
        }
        d.deserialize_any(V(PhantomData))
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
        assert!(matches!(input(r#"["a","b"]"#), Ok(Input::Texts(t)) if t.len() == 2));
        assert!(matches!(input("[]"), Ok(Input::Texts(t)) if t.is_empty()));
        assert!(matches!(input("[1,2,3]"), Ok(Input::Ids(ids))
            if ids.count == 3 && ids.bytes == [1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0]));
        assert!(matches!(
            input("[[1,2],[],[3]]"),
            Ok(Input::Tokens { ids: 3, lists: 3, first }) if first.bytes == [1, 0, 0, 0, 2, 0, 0, 0]
        ));
        assert!(matches!(input(r#"[{"role":"user"},{}]"#), Ok(Input::Items(m)) if m.len() == 2));
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
    fn text_without_escapes_is_borrowed_from_the_body() {
        let t = match input(r#"["plain","esc\"aped"]"#) {
            Ok(Input::Texts(t)) => t,
            _ => Vec::new(),
        };
        assert_eq!(t.len(), 2);
        assert!(matches!(t[0].0, Cow::Borrowed("plain")));
        assert!(matches!(&t[1].0, Cow::Owned(s) if s == "esc\"aped"));
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
        let side = |json| serde_json::from_str::<ScoreInputs>(json).map(|s| s.0);
        let kinds = |json| -> Vec<usize> {
            side(json)
                .unwrap_or_default()
                .iter()
                .map(|c| match c {
                    Content::Text(_) => 0,
                    Content::Parts(p) => p.len(),
                })
                .collect()
        };
        assert_eq!(kinds(r#""q""#), [0]);
        assert_eq!(kinds(r#"["a","b"]"#), [0, 0]);
        assert_eq!(
            kinds(r#"["a",{"content":[{"type":"image_url"},{"type":"text","text":"t"}]}]"#),
            [0, 2]
        );
        // A lone object: each of its parts is an input of its own.
        assert_eq!(
            kinds(r#"{"content":[{"type":"image_url"},{"type":"text","text":"t"}]}"#),
            [1, 1]
        );
        assert_eq!(kinds("[]"), Vec::<usize>::new());
        for bad in ["5", "[5]", "[[\"a\"]]", "{}", r#"[{"text":"a"}]"#, "null"] {
            assert!(side(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn content_is_a_string_or_parts() {
        let c = |json| serde_json::from_str::<Content>(json);
        assert!(matches!(c(r#""hi""#), Ok(Content::Text(t)) if t.as_str() == "hi"));
        assert!(
            matches!(c(r#"[{"type":"text","text":"a"},{"type":"image_url"}]"#), Ok(Content::Parts(p)) if p.len() == 2)
        );
        assert!(c("5").is_err());
        assert!(c(r#"{"type":"text"}"#).is_err());
    }
}
