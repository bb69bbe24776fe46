//! Reading model-server responses as they pass: counting streamed output tokens from SSE chunks
//! and finding the final `usage` (the include_usage chunk of a stream, or a JSON body's field;
//! SGLang's native `/generate` gives its counts in each answer's `meta_info` instead).
//! The meter only looks; the response itself goes to the client untouched and unbuffered.

use serde::Deserialize;

use super::long_body::LongBody;
use super::sse_chunk::TEXT_EVENTS;

/// The most of a non-streaming body, or of one SSE line, kvgate keeps to read `usage` from (a
/// longer body is walked for it instead, `long_body`).
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
    reasoning: Option<String>,
    reasoning_content: Option<String>,
    tool_calls: Option<Vec<ToolCall>>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ToolCall {
    function: Option<Function>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Function {
    name: Option<String>,
    arguments: Option<String>,
}

/// Whether a field holds text.
fn some(text: &Option<String>) -> bool {
    text.as_ref().is_some_and(|t| !t.is_empty())
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Choice {
    text: Option<String>,
    delta: Option<Delta>,
    /// A vLLM `/inference/v1/generate` stream's piece: its new ids.
    token_ids: Option<Vec<serde::de::IgnoredAny>>,
}

/// A chunk of a stream of several answers, read again for which answer each of its choices is
/// (`index`) and whether it ends there (`finish_reason`). Read apart from `Chunk`, whose reading
/// `sse_chunk` must match, which these fields would change (a key given twice, a value of
/// another type).
#[derive(Deserialize, Default)]
#[serde(default)]
struct AnswerChunk {
    choices: Vec<AnswerPiece>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct AnswerPiece {
    index: Option<serde_json::Value>,
    finish_reason: Option<serde_json::Value>,
    #[serde(flatten)]
    choice: Choice,
}

impl Choice {
    /// Whether it carries any text: its `text`, or its delta's answer, reasoning under either
    /// name, or a tool call's name or arguments, or token ids.
    fn has_text(&self) -> bool {
        some(&self.text)
            || self.token_ids.as_ref().is_some_and(|ids| !ids.is_empty())
            || self.delta.as_ref().is_some_and(|d| {
                some(&d.content)
                    || some(&d.reasoning)
                    || some(&d.reasoning_content)
                    || d.tool_calls.iter().flatten().any(|t| {
                        t.function
                            .as_ref()
                            .is_some_and(|f| some(&f.name) || some(&f.arguments))
                    })
            })
    }
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Chunk {
    choices: Vec<Choice>,
    /// In either API's names: an Anthropic Messages stream's `message_delta` carries its usage
    /// as `input_tokens` and `output_tokens`.
    usage: Option<UsageFields>,
    /// The Responses API streams events (`sse_chunk::TEXT_EVENTS`) and ends with
    /// `response.completed`, whose response carries usage in its own names.
    #[serde(rename = "type")]
    kind: Option<String>,
    response: Option<ResponsesBody>,
    /// SGLang's native `/generate` streams its answer whole so far, with its counts so far.
    meta_info: Option<MetaInfo>,
}

/// An SGLang `/generate` answer's counts (its `meta_info`), so far or in full: which answer
/// (`id`, one of a batch's or of `n`'s), its prompt, the tokens made, the prompt's tokens found
/// in the prefix cache, and whether it has ended (a `finish_reason` that is not null).
#[derive(Debug, Clone, Deserialize, Default, PartialEq, Eq)]
#[serde(default)]
struct MetaInfo {
    id: Option<String>,
    prompt_tokens: u64,
    completion_tokens: u64,
    cached_tokens: Option<u64>,
    #[serde(rename = "finish_reason", deserialize_with = "not_null")]
    ended: bool,
}

/// A value there and not null, skipped whatever it holds.
fn not_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    Option::<serde::de::IgnoredAny>::deserialize(d).map(|v| v.is_some())
}

/// SGLang `/generate` answers as JSON, an object or a list of one an answer: each answer's
/// counts, read as the parser meets them (its text and ids skipped). Read as an untagged enum,
/// the whole body was first copied into a tree of values, 25 to 65 times its size, and a batch
/// of one answer was read as one answer whose `meta_info` was the answer itself (serde reads a
/// struct from a list by position), its counts all zero.
struct NativeCounts(Vec<MetaInfo>);

#[derive(Deserialize, Default)]
#[serde(default)]
struct NativeAnswer {
    meta_info: Option<MetaInfo>,
}

impl<'de> Deserialize<'de> for NativeCounts {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = NativeCounts;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an answer or a list of them")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<NativeCounts, A::Error> {
                let one =
                    NativeAnswer::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
                Ok(NativeCounts(one.meta_info.into_iter().collect()))
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<NativeCounts, A::Error> {
                let mut counts = Vec::new();
                while let Some(answer) = seq.next_element::<NativeAnswer>()? {
                    counts.extend(answer.meta_info);
                }
                Ok(NativeCounts(counts))
            }
        }
        d.deserialize_any(V)
    }
}

/// A JSON body with no `usage`: SGLang's `/generate` answers, their counts summed.
fn native_usage(bytes: &[u8]) -> Option<Usage> {
    let counts = serde_json::from_slice::<NativeCounts>(bytes).ok()?.0;
    (!counts.is_empty()).then(|| summed(&counts))
}

/// Answers' counts as one usage.
fn summed(counts: &[MetaInfo]) -> Usage {
    let cached = counts.iter().map(|m| m.cached_tokens);
    Usage {
        prompt_tokens: counts.iter().map(|m| m.prompt_tokens).sum(),
        completion_tokens: counts.iter().map(|m| m.completion_tokens).sum(),
        cached_tokens: cached.sum(),
    }
}

impl Chunk {
    /// Its pieces of text: each choice that carries any (its `text`, or its delta's answer,
    /// reasoning under either name, or a tool call's name or arguments), and each Responses
    /// API event that carries one.
    fn pieces(&self) -> u64 {
        let choices = self.choices.iter().filter(|c| c.has_text());
        let event = self
            .kind
            .as_deref()
            .is_some_and(|k| TEXT_EVENTS.contains(&k));
        choices.count() as u64 + u64::from(event)
    }
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
    id: Option<String>,
}

/// A non-streaming Responses API body's id.
#[derive(Deserialize, Default)]
#[serde(default)]
struct Id {
    id: Option<String>,
}

/// A non-streaming body, its `usage` read as `U`.
#[derive(Deserialize, Default)]
#[serde(default)]
struct Body<U> {
    usage: Option<U>,
}

/// A JSON body's usage, either API's: read straight into numbers ([`UsageFields`]) when it has
/// the usual shape, else through a `serde_json::Value` as any shape was read before (`by_value`).
/// The direct reading fails rather than differ: it takes an object only, each field of interest
/// of the type the reading by value requires (a repeated one's last value, as a `Value` keeps),
/// and validates the fields it does not use as a `Value` (so its depth limit and number ranges
/// apply alike). So wherever it succeeds both readings agree, and a body it refuses gets the
/// reading by value.
fn body_usage(bytes: &[u8]) -> Option<Usage> {
    if !is_object(bytes) {
        return None;
    }
    match serde_json::from_slice::<Body<UsageFields>>(bytes) {
        Ok(body) => body.usage.map(UsageFields::usage),
        Err(_) => by_value(bytes),
    }
}

/// Only an object has a `usage`: serde reads a struct from a list by position, which read an
/// SGLang batch of one answer (`native_usage`) as that answer's usage, all zero.
fn is_object(bytes: &[u8]) -> bool {
    bytes.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{')
}

fn by_value(bytes: &[u8]) -> Option<Usage> {
    if !is_object(bytes) {
        return None;
    }
    let value = serde_json::from_slice::<Body<serde_json::Value>>(bytes)
        .ok()?
        .usage?;
    if value.get("input_tokens").is_some() {
        let u: ResponsesUsage = serde_json::from_value(value).ok()?;
        return Some(Usage {
            prompt_tokens: u.input_tokens,
            completion_tokens: u.output_tokens,
            cached_tokens: None,
        });
    }
    let total = value
        .get("total_tokens")
        .and_then(serde_json::Value::as_u64);
    let prompt_given = value.get("prompt_tokens").is_some();
    let mut usage: Usage = serde_json::from_value(value).ok()?;
    let prompt = prompt_given.then_some(usage.prompt_tokens);
    usage.prompt_tokens = prompt_count(prompt, total, usage.completion_tokens);
    Some(usage)
}

/// The prompt's count: `prompt_tokens`, else a count of the whole only
/// (`UsageFields::total_tokens`) less any output.
fn prompt_count(prompt: Option<u64>, total: Option<u64>, completion: u64) -> u64 {
    prompt
        .or_else(|| total.map(|t| t.saturating_sub(completion)))
        .unwrap_or(0)
}

/// The fields of a usage object either API writes, each as read (`None` when absent).
#[derive(Default)]
struct UsageFields {
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    /// Read for the prompt's count where `prompt_tokens` is absent: vLLM's rerank answers
    /// carried only `total_tokens` in earlier releases (its `RerankUsage`), as Jina's do, all of
    /// it prompt.
    total_tokens: Option<u64>,
    /// From `prompt_tokens_details`.
    cached_tokens: Option<u64>,
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
}

impl UsageFields {
    fn usage(self) -> Usage {
        // The Responses API's names, when it is its object (the reading by value's test).
        if let Some(input) = self.input_tokens {
            return Usage {
                prompt_tokens: input,
                completion_tokens: self.output_tokens.unwrap_or(0),
                cached_tokens: None,
            };
        }
        let completion_tokens = self.completion_tokens.unwrap_or(0);
        Usage {
            prompt_tokens: prompt_count(self.prompt_tokens, self.total_tokens, completion_tokens),
            completion_tokens,
            cached_tokens: self.cached_tokens,
        }
    }
}

#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum UsageField {
    PromptTokens,
    CompletionTokens,
    TotalTokens,
    PromptTokensDetails,
    InputTokens,
    OutputTokens,
    CachedTokens,
    #[serde(other)]
    Other,
}

/// Reads an object's fields with `field` (which takes the value of each it knows and returns
/// false for any other); the others are read as a `Value`, and dropped.
fn each_field<'de, A: serde::de::MapAccess<'de>>(
    mut map: A,
    mut field: impl FnMut(UsageField, &mut A) -> Result<bool, A::Error>,
) -> Result<(), A::Error> {
    while let Some(key) = map.next_key::<UsageField>()? {
        if !field(key, &mut map)? {
            map.next_value::<serde_json::Value>()?;
        }
    }
    Ok(())
}

impl<'de> Deserialize<'de> for UsageFields {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> serde::de::Visitor<'de> for Fields {
            type Value = UsageFields;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a usage object")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<UsageFields, A::Error> {
                let mut u = UsageFields::default();
                each_field(map, |key, map| {
                    match key {
                        UsageField::PromptTokens => u.prompt_tokens = Some(map.next_value()?),
                        UsageField::CompletionTokens => {
                            u.completion_tokens = Some(map.next_value()?)
                        }
                        UsageField::TotalTokens => u.total_tokens = Some(map.next_value()?),
                        UsageField::InputTokens => u.input_tokens = Some(map.next_value()?),
                        UsageField::OutputTokens => u.output_tokens = Some(map.next_value()?),
                        UsageField::PromptTokensDetails => {
                            let details = map.next_value::<Option<CachedTokens>>()?;
                            u.cached_tokens = details.and_then(|c| c.0);
                        }
                        UsageField::CachedTokens | UsageField::Other => return Ok(false),
                    }
                    Ok(true)
                })?;
                Ok(u)
            }
        }
        d.deserialize_map(Fields)
    }
}

/// `prompt_tokens_details`, read as `UsageFields` is: an object, its `cached_tokens` if any.
struct CachedTokens(Option<u64>);

impl<'de> Deserialize<'de> for CachedTokens {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Details;
        impl<'de> serde::de::Visitor<'de> for Details {
            type Value = CachedTokens;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a usage details object")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<CachedTokens, A::Error> {
                let mut cached = None;
                each_field(map, |key, map| {
                    if !matches!(key, UsageField::CachedTokens) {
                        return Ok(false);
                    }
                    cached = map.next_value()?;
                    Ok(true)
                })?;
                Ok(CachedTokens(cached))
            }
        }
        d.deserialize_map(Details)
    }
}

#[derive(Debug, Default)]
pub struct ResponseMeter {
    sse: bool,
    kept: Vec<u8>,
    overflowed: bool,
    /// A JSON answer past `MAX_KEPT`, walked for its usage and id instead of kept.
    long: Option<Box<LongBody>>,
    /// Pieces of text streamed so far: a token each from an engine that sends a token a chunk,
    /// several from one that sends more (the flow counts them at the model's learned tokens per
    /// piece, `calibration`).
    pub pieces: u64,
    pub usage: Option<Usage>,
    /// Whether to read the Responses API response's id (`keeping_id`), and the id read.
    wants_id: bool,
    pub response_id: Option<String>,
    /// A stream of several answers (`answering`): each answer's pieces, and which have ended.
    answers: Option<Answers>,
    /// An SGLang `/generate` stream's answers, each by its last counts (at most
    /// [`MAX_ANSWERS`]; a later one is taken as the last's).
    native: Vec<MetaInfo>,
}

/// The answers of a request for several (`n`): their chunks say which each piece is for and when
/// each ends, and the engine frees an answer's tokens when it ends (vLLM V1 runs each as a
/// request of its own), while the others run on.
#[derive(Debug, Default)]
struct Answers(Vec<Answer>);

/// One answer of several: its pieces so far, and whether it has ended.
#[derive(Debug, Clone, Copy, Default)]
struct Answer {
    pieces: u64,
    ended: bool,
}

impl Answers {
    /// Each of the chunk's choices: a piece of its answer when it carries text (when the chunk's
    /// `pieces`, as the stream counted them, are those, so that its answers never carry more
    /// than the stream), and its end.
    fn read(&mut self, data: &[u8], pieces: u64) {
        let Ok(chunk) = serde_json::from_slice::<AnswerChunk>(data) else {
            return;
        };
        let texts = chunk.choices.iter().filter(|c| c.choice.has_text()).count();
        let counted = texts as u64 == pieces;
        for c in &chunk.choices {
            let i = c.index.as_ref().map_or(Some(0), serde_json::Value::as_u64);
            let i = i
                .and_then(|i| usize::try_from(i).ok())
                .unwrap_or(usize::MAX);
            if let Some(a) = self.0.get_mut(i) {
                a.pieces += u64::from(counted && c.choice.has_text());
                let reason = c.finish_reason.as_ref().and_then(serde_json::Value::as_str);
                a.ended |= reason.is_some_and(|r| !r.is_empty());
            }
        }
    }
}

/// Answers told apart, at most: a request for more is metered as one stream, ended as a whole.
pub const MAX_ANSWERS: u64 = 256;

/// The answers of a stream of several that have ended, and the pieces they carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EndedAnswers {
    pub answers: u64,
    pub pieces: u64,
}

impl ResponseMeter {
    pub fn new(content_type: Option<&str>) -> Self {
        Self {
            sse: content_type.is_some_and(|c| c.contains("text/event-stream")),
            ..Self::default()
        }
    }

    /// A meter that also reads the Responses API response's id (`routing::stored`): a streamed
    /// one's from its events' `response`, a JSON one's from its body.
    pub fn keeping_id(self) -> Self {
        Self {
            wants_id: true,
            ..self
        }
    }

    /// A meter that also follows each of `n` answers (up to [`MAX_ANSWERS`]), for a request of
    /// several: each chunk is read through serde once more, for which answer it is and whether
    /// it ends it (a request of one is read as before).
    pub fn answering(self, n: u64) -> Self {
        let answers = (2..=MAX_ANSWERS)
            .contains(&n)
            .then(|| Answers(vec![Answer::default(); n as usize]));
        Self { answers, ..self }
    }

    /// The answers that have ended so far, of a stream of several (`answering`).
    pub fn ended(&self) -> EndedAnswers {
        let Some(a) = &self.answers else {
            return EndedAnswers::default();
        };
        let ended = a.0.iter().filter(|a| a.ended);
        ended.fold(EndedAnswers::default(), |sum, a| EndedAnswers {
            answers: sum.answers + 1,
            pieces: sum.pieces + a.pieces,
        })
    }

    /// Feeds the next piece of the body; returns how many pieces of text it carried.
    pub fn feed(&mut self, bytes: &[u8]) -> u64 {
        if !self.sse {
            self.keep(bytes);
            return 0;
        }
        let before = self.pieces;
        let mut rest = bytes;
        while let Some(i) = memchr::memchr(b'\n', rest) {
            if self.kept.is_empty() && !self.overflowed && i <= MAX_KEPT {
                // A whole line in this piece (a chunk's usual lot): read where it lies, as it
                // would be read kept (a longer one is skipped, as `keep` skips it).
                self.line(&rest[..i]);
                rest = &rest[i + 1..];
                continue;
            }
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
        self.pieces - before
    }

    /// The body has ended: reads a non-streaming body's usage.
    pub fn finish(&mut self) -> Option<Usage> {
        if let Some(long) = self.long.as_deref().filter(|_| self.usage.is_none()) {
            self.usage = long.usage().and_then(|value| {
                let body = [&b"{\"usage\":"[..], value, b"}"].concat();
                body_usage(&body)
            });
            if self.wants_id {
                self.response_id = long.id();
            }
        } else if !self.sse && !self.overflowed && self.usage.is_none() {
            self.usage = body_usage(&self.kept).or_else(|| native_usage(&self.kept));
            if self.wants_id {
                self.response_id = serde_json::from_slice::<Id>(&self.kept)
                    .ok()
                    .and_then(|b| b.id);
            }
        }
        if self.sse && !self.kept.is_empty() && !self.overflowed {
            let line = std::mem::take(&mut self.kept);
            self.line(&line);
        }
        self.usage
    }

    fn keep(&mut self, bytes: &[u8]) {
        if let Some(long) = &mut self.long {
            long.feed(bytes);
            return;
        }
        if self.kept.len() + bytes.len() > MAX_KEPT {
            self.overflowed = true;
            if !self.sse {
                // A JSON answer too long to keep: walked for its usage and id from here on.
                let mut long = LongBody::default();
                long.feed(&self.kept);
                long.feed(bytes);
                self.long = Some(Box::new(long));
                self.kept = Vec::new();
                return;
            }
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
        let before = self.pieces;
        match crate::openai::sse_chunk::pieces(data) {
            Some(pieces) => self.pieces += pieces,
            None => self.read_chunk(data),
        }
        if let Some(a) = &mut self.answers {
            a.read(data, self.pieces - before);
        }
    }

    /// An SGLang `/generate` chunk's counts so far, for its answer: the tokens it made since
    /// its last chunk are the stream's pieces (one a token, as the engine counted them), and
    /// the answers' counts together are the usage so far.
    fn native(&mut self, m: MetaInfo) {
        let before: u64 = self.native.iter().map(|a| a.completion_tokens).sum();
        let i = match self.native.iter().position(|a| a.id == m.id) {
            Some(i) => i,
            None if self.native.len() < MAX_ANSWERS as usize => {
                self.native.push(MetaInfo::default());
                self.native.len() - 1
            }
            None => self.native.len().saturating_sub(1),
        };
        // A request of several (`answering`): an answer that ends frees its tokens while the
        // others run on, as the answers of the OpenAI paths' streams do.
        let ended = m.ended;
        if let Some(a) = self.answers.as_mut().and_then(|a| a.0.get_mut(i)) {
            a.pieces = m.completion_tokens;
            a.ended |= ended;
        }
        if let Some(slot) = self.native.get_mut(i) {
            *slot = m;
        }
        let usage = summed(&self.native);
        self.pieces += usage.completion_tokens.saturating_sub(before);
        self.usage = Some(usage);
    }

    /// An SSE chunk through serde: what `sse_chunk` declines (usage among it).
    fn read_chunk(&mut self, data: &[u8]) {
        let Ok(chunk) = serde_json::from_slice::<Chunk>(data) else {
            return;
        };
        self.pieces += chunk.pieces();
        if let Some(u) = chunk.usage {
            self.usage = Some(u.usage());
        }
        if let Some(m) = chunk.meta_info {
            self.native(m);
        }
        let Some(response) = chunk.response else {
            return;
        };
        if self.wants_id && response.id.is_some() {
            self.response_id = response.id;
        }
        if let Some(u) = response.usage {
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

    /// Two answers interleaved, as vLLM streams a request with `n` 2: each chunk says whose
    /// piece it is, and each answer ends with a chunk of its own (an empty delta and its
    /// `finish_reason`); the answers that ended, and their pieces, are known from there.
    #[test]
    fn the_answers_of_a_request_for_several_are_followed_to_their_ends() {
        let piece = |i: u64, text: &str| {
            format!("data: {{\"choices\":[{{\"index\":{i},\"delta\":{{\"content\":\"{text}\"}},\"finish_reason\":null}}]}}\n\n")
        };
        let end = |i: u64| {
            format!("data: {{\"choices\":[{{\"index\":{i},\"delta\":{{}},\"finish_reason\":\"stop\"}}]}}\n\n")
        };
        let mut m = ResponseMeter::new(Some("text/event-stream")).answering(2);
        for chunk in [
            piece(0, "a"),
            piece(1, "b"),
            piece(0, "c"),
            piece(1, "d"),
            piece(1, "e"),
        ] {
            assert_eq!(m.feed(chunk.as_bytes()), 1);
        }
        assert_eq!(m.ended(), EndedAnswers::default());
        assert_eq!(m.feed(end(0).as_bytes()), 0);
        assert_eq!(
            m.ended(),
            EndedAnswers {
                answers: 1,
                pieces: 2
            }
        );
        m.feed(piece(1, "f").as_bytes());
        m.feed(end(1).as_bytes());
        assert_eq!(
            m.ended(),
            EndedAnswers {
                answers: 2,
                pieces: 6
            }
        );
        assert_eq!(m.pieces, 6);
        // One answer, or more than are told apart: read as one stream.
        let mut one = ResponseMeter::new(Some("text/event-stream")).answering(1);
        one.feed(end(0).as_bytes());
        assert_eq!(one.ended(), EndedAnswers::default());
        let many = ResponseMeter::new(Some("text/event-stream")).answering(MAX_ANSWERS + 1);
        assert!(many.answers.is_none());
        // An index past the answers, or of another type, is nobody's.
        let mut odd = ResponseMeter::new(Some("text/event-stream")).answering(2);
        odd.feed(end(7).as_bytes());
        odd.feed(b"data: {\"choices\":[{\"index\":\"0\",\"finish_reason\":\"stop\"}]}\n\n");
        assert_eq!(odd.ended(), EndedAnswers::default());
    }

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
        assert_eq!(m.pieces, 2);
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
        assert_eq!(m.pieces, 1);
        assert_eq!(m.finish().map(|u| u.prompt_tokens), Some(4));
    }

    /// An Anthropic Messages answer as vLLM streams it (`event:` lines, a piece a
    /// `content_block_delta`, usage in its own names on `message_delta`) and as it answers
    /// whole.
    #[test]
    fn an_anthropic_messages_answer_is_metered() {
        let stream = concat!(
            "event: message_start\n",
            "data: {\"type\":\"message_start\",\"message\":{\"id\":\"chatcmpl-1\",\"type\":\"message\",",
            "\"role\":\"assistant\",\"content\":[],\"model\":\"m\",\"stop_reason\":null,",
            "\"stop_sequence\":null,\"usage\":{\"input_tokens\":12,\"output_tokens\":0}}}\n\n",
            "event: content_block_start\n",
            "data: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n",
            "event: content_block_delta\n",
            "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hel\"}}\n\n",
            "event: content_block_delta\n",
            "data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"lo\"}}\n\n",
            "event: content_block_stop\n",
            "data: {\"type\":\"content_block_stop\",\"index\":0}\n\n",
            "event: message_delta\n",
            "data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"max_tokens\"},",
            "\"usage\":{\"input_tokens\":12,\"output_tokens\":2}}\n\n",
            "event: message_stop\n",
            "data: {\"type\":\"message_stop\"}\n\n",
        );
        let mut m = ResponseMeter::new(Some("text/event-stream; charset=utf-8"));
        let pieces: u64 = stream.as_bytes().chunks(7).map(|c| m.feed(c)).sum();
        assert_eq!(pieces, 2);
        let usage = Usage {
            prompt_tokens: 12,
            completion_tokens: 2,
            cached_tokens: None,
        };
        assert_eq!(m.finish(), Some(usage));
        let mut m = ResponseMeter::new(Some("application/json"));
        m.feed(br#"{"id":"chatcmpl-1","type":"message","role":"assistant","content":[{"type":"text","text":"Hello"}],"model":"m","stop_reason":"end_turn","usage":{"input_tokens":12,"output_tokens":2}}"#);
        assert_eq!(m.finish(), Some(usage));
    }

    /// SGLang's `/generate` streams each answer whole so far with its counts so far: the tokens
    /// each chunk adds are pieces, a batch's answers told apart by their ids, and the last
    /// counts summed are the usage; a JSON answer (one, or a list) gives its counts alike.
    #[test]
    fn an_sglang_generate_answer_is_metered() {
        let chunk = |id: &str, text: &str, made: u64, end: &str| {
            format!(
                "data: {{\"text\":\"{text}\",\"output_ids\":[5,6],\"meta_info\":{{\"id\":\"{id}\",\"finish_reason\":{end},\"prompt_tokens\":10,\"completion_tokens\":{made},\"cached_tokens\":4}}}}\n\n"
            )
        };
        let stream = [
            chunk("a", "He", 1, "null"),
            chunk("b", "Yo", 2, "null"),
            chunk("a", "Hello", 3, "null"),
            chunk("b", "Yo!", 3, r#"{"type":"length","length":3}"#),
            chunk("a", "Hello w", 4, r#"{"type":"stop","matched":2}"#),
            "data: [DONE]\n\n".to_string(),
        ]
        .concat();
        let mut m = ResponseMeter::new(Some("text/event-stream")).answering(2);
        let fed: Vec<u64> = stream
            .as_bytes()
            .chunks(stream.len() / 6 + 1)
            .map(|c| m.feed(c))
            .collect();
        assert_eq!(fed.iter().sum::<u64>(), 7, "{fed:?}");
        // Each answer's end, as its last chunk says.
        let ended = EndedAnswers {
            answers: 2,
            pieces: 7,
        };
        assert_eq!(m.ended(), ended);
        let usage = Usage {
            prompt_tokens: 20,
            completion_tokens: 7,
            cached_tokens: Some(8),
        };
        assert_eq!(m.finish(), Some(usage));
        let one = r#"{"text":"Hello","output_ids":[1,2],"meta_info":{"id":"a","prompt_tokens":10,"completion_tokens":2,"cached_tokens":0,"e2e_latency":0.1}}"#;
        let mut m = ResponseMeter::new(Some("application/json"));
        m.feed(one.as_bytes());
        let usage = Usage {
            prompt_tokens: 10,
            completion_tokens: 2,
            cached_tokens: Some(0),
        };
        assert_eq!(m.finish(), Some(usage));
        let mut m = ResponseMeter::new(Some("application/json"));
        m.feed(format!("[{one},{}]", one.replace(r#""a""#, r#""b""#)).as_bytes());
        let both = Usage {
            prompt_tokens: 20,
            completion_tokens: 4,
            cached_tokens: Some(0),
        };
        assert_eq!(m.finish(), Some(both));
        // A batch of one answer is a list of one.
        let mut m = ResponseMeter::new(Some("application/json"));
        m.feed(format!("[{one}]").as_bytes());
        assert_eq!(m.finish(), Some(usage));
    }

    #[test]
    fn usual_usage_objects_are_read_directly() {
        for (body, usage) in [
            // OpenAI, vLLM (null details), the Responses API.
            (
                &br#"{"id":"x","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":9,
                "completion_tokens":2,"total_tokens":11,"prompt_tokens_details":{"cached_tokens":8,
                "audio_tokens":0},"completion_tokens_details":{"reasoning_tokens":0}}}"#[..],
                (9, 2, Some(8)),
            ),
            (
                br#"{"usage":{"prompt_tokens":9,"total_tokens":11,"completion_tokens":2,"prompt_tokens_details":null}}"#,
                (9, 2, None),
            ),
            (
                br#"{"output":[],"usage":{"input_tokens":7,"input_tokens_details":{"cached_tokens":1},
                "output_tokens":3,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":10}}"#,
                (7, 3, None),
            ),
            // vLLM's rerank answers: the prompt's count, or (earlier releases, Jina's) only the
            // total, which is all prompt.
            (
                br#"{"id":"rerank-1","results":[],"usage":{"prompt_tokens":40,"total_tokens":40}}"#,
                (40, 0, None),
            ),
            (
                br#"{"id":"rerank-1","usage":{"total_tokens":40},"results":[{"index":0}]}"#,
                (40, 0, None),
            ),
        ] {
            assert!(serde_json::from_slice::<Body<UsageFields>>(body).is_ok());
            let u = body_usage(body).unwrap();
            assert_eq!((u.prompt_tokens, u.completion_tokens, u.cached_tokens), usage);
        }
    }

    /// Draws in `0..n` from a fixed seed, so a randomized test repeats exactly.
    fn xorshift(mut rng: u64) -> impl FnMut(usize) -> usize {
        move |n| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng % n as u64) as usize
        }
    }

    /// The direct reading of a JSON body's usage against the reading by value, on bodies built
    /// from the fields either API writes and values of every JSON type (repeated fields, numbers
    /// out of range, nesting past serde_json's depth limit, strings that are not UTF-8, usage
    /// that is not an object): the same answer for every body.
    #[test]
    fn usage_is_read_as_the_reading_by_value_reads_it() {
        let deep = format!("{}1{}", "[".repeat(130), "]".repeat(130));
        let values: Vec<&[u8]> = vec![
            b"0",
            b"7",
            b"18446744073709551615",
            b"18446744073709551616",
            b"-1",
            b"-0",
            b"1.5",
            b"1e2",
            b"1e400",
            br#""7""#,
            b"null",
            b"true",
            b"{}",
            b"[]",
            b"[7]",
            b"[7,8,null]",
            br#"{"cached_tokens":3}"#,
            br#"{"cached_tokens":null,"x":[1]}"#,
            br#"{"cached_tokens":"3"}"#,
            br#"{"cached_tokens":3,"cached_tokens":4}"#,
            br#"{"cached_tokens":1e400}"#,
            deep.as_bytes(),
            b"\"\xff\"",
            br#""\ud800""#,
            br#""\u00e9""#,
        ];
        let keys: [&[u8]; 11] = [
            b"prompt_tokens",
            b"completion_tokens",
            b"total_tokens",
            b"prompt_tokens_details",
            b"input_tokens",
            b"output_tokens",
            b"cached_tokens",
            b"completion_tokens_details",
            b"input_tokens_details",
            br"prompt\u005ftokens",
            b"\xff",
        ];
        let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
        let mut direct = 0;
        for _ in 0..20_000 {
            let mut usage = Vec::new();
            match next(10) {
                0 => usage.extend_from_slice(values[next(values.len())]),
                1 => {
                    usage.push(b'[');
                    for i in 0..next(5) {
                        if i > 0 {
                            usage.push(b',');
                        }
                        usage.extend_from_slice(values[next(values.len())]);
                    }
                    usage.push(b']');
                }
                _ => {
                    usage.push(b'{');
                    for i in 0..next(6) {
                        if i > 0 {
                            usage.push(b',');
                        }
                        usage.push(b'"');
                        usage.extend_from_slice(keys[next(keys.len())]);
                        usage.extend_from_slice(b"\":");
                        // Mostly numbers, as engines write them.
                        if next(3) > 0 {
                            usage.extend_from_slice(values[next(3)]);
                        } else {
                            usage.extend_from_slice(values[next(values.len())]);
                        }
                    }
                    usage.push(b'}');
                }
            }
            let mut body = Vec::new();
            match next(8) {
                0 => {
                    body.extend_from_slice(b"[");
                    body.extend_from_slice(&usage);
                    body.extend_from_slice(b"]");
                }
                1 => {
                    body.extend_from_slice(b"{\"usage\":{},\"usage\":");
                    body.extend_from_slice(&usage);
                    body.extend_from_slice(b"}");
                }
                _ => {
                    body.extend_from_slice(br#"{"id":"x","choices":[{"text":"a"}],"usage":"#);
                    body.extend_from_slice(&usage);
                    body.extend_from_slice(b"}");
                }
            }
            direct += usize::from(serde_json::from_slice::<Body<UsageFields>>(&body).is_ok());
            assert_eq!(
                body_usage(&body),
                by_value(&body),
                "{}",
                String::from_utf8_lossy(&body)
            );
        }
        // Both readings were exercised.
        assert!((2_000..18_000).contains(&direct), "{direct} read directly");
    }

    /// What the meter counts of a chunk through serde (0 when serde refuses it), and whether
    /// serde read it at all and found no usage in it.
    fn serde_reading(data: &[u8]) -> (u64, bool) {
        match serde_json::from_slice::<Chunk>(data) {
            Ok(c) => (
                c.pieces(),
                c.usage.is_none() && c.response.is_none() && c.meta_info.is_none(),
            ),
            Err(_) => (0, false),
        }
    }

    /// `sse_chunk::pieces` against the serde reading, on chunks built from what engines send
    /// and what they should not (values of every type where a string is read, repeated and
    /// escaped keys, escapes and bytes that are not UTF-8, usage, nesting, and a quarter of the
    /// chunks with a byte cut out or put in): wherever the walk answers, serde read the chunk,
    /// found no usage in it and counted the same.
    #[test]
    fn pieces_are_counted_as_the_serde_reading_counts_them() {
        type Next<'a> = dyn FnMut(usize) -> usize + 'a;
        type Member<'a> = dyn FnMut(&[u8], &mut Next) -> Vec<u8> + 'a;
        let deep = format!("{}1{}", "[".repeat(40), "]".repeat(40));
        // The first four are what engines write where a string is read.
        let values: Vec<&[u8]> = vec![
            br#""""#,
            br#"" tok""#,
            br#""a\"b\\ \/\n""#,
            b"null",
            br#""\u00e9""#,
            br#""\ud83d\ude00""#,
            br#""\ud800""#,
            br#""\x""#,
            "\"caf\u{e9} \u{4e16}\"".as_bytes(),
            b"\"\xff\"",
            b"\"\x01\"",
            b"7",
            b"-0.5e+3",
            b"01",
            b"true",
            b"[]",
            br#"{"x":1}"#,
            br#"["a",{"b":[null]}]"#,
            deep.as_bytes(),
        ];
        let mut next = xorshift(0x2545_f491_4f6c_dd1d);
        let value = |next: &mut Next| {
            values[if next(3) > 0 {
                next(4)
            } else {
                next(values.len())
            }]
            .to_vec()
        };
        // An object of up to four members, each key from `keys`, its value from `member`.
        let object = |keys: &[&[u8]], next: &mut Next, member: &mut Member| {
            let mut o = b"{".to_vec();
            for i in 0..next(5) {
                if i > 0 {
                    o.push(b',');
                }
                let key = keys[next(keys.len())];
                o.extend_from_slice(&[b"\"", key, b"\":"].concat());
                o.extend(member(key, next));
            }
            o.push(b'}');
            o
        };
        let delta_keys: [&[u8]; 6] = [
            b"role",
            b"content",
            b"reasoning",
            b"reasoning_content",
            b"tool_calls",
            b"re\\u0061soning",
        ];
        let call_keys: [&[u8]; 4] = [b"index", b"id", b"type", b"function"];
        let function_keys: [&[u8]; 3] = [b"name", b"arguments", b"n\\u0061me"];
        let choice_keys: [&[u8]; 7] = [
            b"index",
            b"text",
            b"delta",
            b"logprobs",
            b"finish_reason",
            b"token_ids",
            b"te\\u0078t",
        ];
        let top_keys: [&[u8]; 10] = [
            b"id",
            b"object",
            b"created",
            b"model",
            b"choices",
            b"type",
            b"usage",
            b"response",
            b"meta_info",
            b"ch\\u006fices",
        ];
        let (mut answered, mut counted) = (0, 0);
        for round in 0..30_000 {
            let mut chunk = object(&top_keys, &mut next, &mut |key, next| match key {
                b"choices" if next(10) > 0 => {
                    let mut a = b"[".to_vec();
                    for k in 0..next(3) {
                        if k > 0 {
                            a.push(b',');
                        }
                        if next(20) == 0 {
                            a.extend_from_slice(b"null");
                            continue;
                        }
                        a.extend(object(
                            &choice_keys,
                            next,
                            &mut |key, next| match (key, next(8)) {
                                (b"delta", 0) => value(next),
                                (b"delta", _) => object(&delta_keys, next, &mut |key, next| {
                                    if key != b"tool_calls" || next(4) == 0 {
                                        return value(next);
                                    }
                                    let mut a = b"[".to_vec();
                                    for k in 0..next(3) {
                                        if k > 0 {
                                            a.push(b',');
                                        }
                                        a.extend(if next(10) == 0 {
                                            value(next)
                                        } else {
                                            object(&call_keys, next, &mut |key, next| {
                                                if key == b"function" && next(5) > 0 {
                                                    object(&function_keys, next, &mut |_, next| {
                                                        value(next)
                                                    })
                                                } else {
                                                    value(next)
                                                }
                                            })
                                        });
                                    }
                                    a.push(b']');
                                    a
                                }),
                                _ => value(next),
                            },
                        ));
                    }
                    a.push(b']');
                    a
                }
                b"type" => match next(3 + TEXT_EVENTS.len()) {
                    0 => br#""response.output_text.delt\u0061""#.to_vec(),
                    1 => values[next(values.len())].to_vec(),
                    2 => br#""response.output_text.done""#.to_vec(),
                    k => format!("\"{}\"", TEXT_EVENTS[k - 3]).into_bytes(),
                },
                b"usage" | b"response" if next(2) > 0 => b"null".to_vec(),
                b"usage" => br#"{"prompt_tokens":3,"completion_tokens":1}"#.to_vec(),
                b"response" => br#"{"usage":{"input_tokens":3,"output_tokens":1}}"#.to_vec(),
                _ => values[next(values.len())].to_vec(),
            });
            if round % 4 == 3 {
                let at = next(chunk.len());
                if next(2) == 0 {
                    chunk.remove(at);
                } else {
                    chunk.insert(at, b",:{}[]\" 0"[next(8)]);
                }
            }
            let (serde, no_usage) = serde_reading(&chunk);
            if let Some(n) = crate::openai::sse_chunk::pieces(&chunk) {
                answered += 1;
                counted += usize::from(n > 0);
                assert!(no_usage, "{}", String::from_utf8_lossy(&chunk));
                assert_eq!(n, serde, "{}", String::from_utf8_lossy(&chunk));
            }
        }
        // The walk answered for many chunks, some with text in them.
        assert!(
            answered > 6_000 && counted > 500,
            "{answered} answered, {counted} with text"
        );
    }

    /// The chunks engines stream are counted by the walk, not handed to serde.
    #[test]
    fn engines_chunks_are_counted_without_serde() {
        for (chunk, n) in [
            (&br#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1764000000,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}"#[..], 0),
            (br#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1764000000,"model":"m","choices":[{"index":0,"delta":{"content":" caf\u00e9 \"x\""},"logprobs":null,"finish_reason":null}]}"#, 1),
            ("{\"choices\":[{\"index\":0,\"delta\":{\"reasoning_content\":\"\u{4e16}\"}}]}".as_bytes(), 1),
            (br#"{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" a","logprobs":null,"finish_reason":null,"stop_reason":null}],"usage":null}"#, 1),
            (br#"{"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"length"}]}"#, 0),
            (br#"{"type":"response.output_text.delta","sequence_number":4,"item_id":"msg_1","output_index":0,"content_index":0,"delta":"x","logprobs":[]}"#, 1),
            (br#"{"type":"response.content_part.added","part":{"type":"output_text","text":""}}"#, 0),
            (br#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"x"}}"#, 1),
            (br#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#, 0),
            // vLLM's reasoning (its name since vLLM PR 27752), and at the end of it a step whose
            // text is both reasoning and answer: one piece.
            (br#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"reasoning":" step"},"logprobs":null,"finish_reason":null}]}"#, 1),
            (br#"{"choices":[{"index":0,"delta":{"reasoning":".","content":"The"}}]}"#, 1),
            (br#"{"choices":[{"index":0,"text":"","delta":{"content":"x"}}]}"#, 1),
            // A tool call as vLLM streams it: its name, then its arguments a piece at a time.
            (br#"{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"id":"chatcmpl-tool-1","type":"function","index":0,"function":{"name":"get_weather"}}]},"logprobs":null,"finish_reason":null}]}"#, 1),
            (br#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"city\": \""}}]},"logprobs":null,"finish_reason":null}]}"#, 1),
            (br#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":""}}]}}]}"#, 0),
            (br#"{"type":"response.reasoning_text.delta","content_index":0,"delta":" is","item_id":"r","output_index":0,"sequence_number":95}"#, 1),
            (br#"{"type":"response.function_call_arguments.delta","delta":"{\"","item_id":"fc","output_index":1,"sequence_number":7}"#, 1),
            // vLLM's `/inference/v1/generate` streams a choice's new ids.
            (br#"{"request_id":"generate-tokens-1","choices":[{"index":0,"logprobs":null,"finish_reason":null,"token_ids":[665,860]}],"usage":null}"#, 1),
            (br#"{"request_id":"generate-tokens-1","choices":[{"index":0,"finish_reason":"stop","token_ids":[]}],"usage":null}"#, 0),
        ] {
            assert_eq!(crate::openai::sse_chunk::pieces(chunk), Some(n), "{}", String::from_utf8_lossy(chunk));
            assert_eq!(serde_reading(chunk).0, n);
        }
        // Usage is serde's to read.
        assert_eq!(
            crate::openai::sse_chunk::pieces(br#"{"choices":[],"usage":{"prompt_tokens":1}}"#),
            None
        );
    }

    #[test]
    fn garbage_and_oversize_are_ignored() {
        let mut m = ResponseMeter::new(Some("text/event-stream"));
        m.feed(b"data: {not json\n: comment\nevent: x\n\xff\xfe\n");
        m.feed(&vec![b'a'; MAX_KEPT + 10]);
        m.feed(b"\ndata: {\"choices\":[{\"text\":\"ok\"}]}\n");
        assert_eq!(m.pieces, 1);
        // A line past the limit is skipped whether it comes in pieces or whole.
        let mut long = br#"data: {"choices":[{"text":"a"}],"x":""#.to_vec();
        long.resize(MAX_KEPT + 10, b'x');
        long.extend_from_slice(b"\"}\ndata: {\"choices\":[{\"text\":\"ok\"}]}\n");
        let mut whole = ResponseMeter::new(Some("text/event-stream"));
        whole.feed(&long);
        let mut pieces = ResponseMeter::new(Some("text/event-stream"));
        long.chunks(4096).for_each(|p| _ = pieces.feed(p));
        assert_eq!((whole.pieces, pieces.pieces), (1, 1));
        let mut m = ResponseMeter::new(None);
        m.feed(&vec![b'x'; MAX_KEPT + 1]);
        m.feed(br#"{"usage":{"prompt_tokens":1}}"#);
        assert_eq!(m.finish(), None);
    }

    /// A JSON answer longer than the meter keeps (a batch of embeddings, log probabilities) is
    /// read for its usage and id as it passes, in whatever pieces it comes.
    #[test]
    fn a_json_answer_too_long_to_keep_is_read_for_its_usage_and_id() {
        let floats = vec!["-0.0123456789"; 4096].join(",");
        let item = format!(r#"{{"index":0,"object":"embedding","embedding":[{floats}]}}"#);
        let data = vec![item; 40].join(",");
        let body = format!(
            r#"{{"id":"embd-7","object":"list","created":1,"model":"m","data":[{data}],"usage":{{"prompt_tokens":3000,"total_tokens":3000,"completion_tokens":0,"prompt_tokens_details":{{"cached_tokens":64}}}}}}"#
        );
        assert!(body.len() > 2 * MAX_KEPT);
        for piece in [16 * 1024, 1 << 20, body.len()] {
            let mut m = ResponseMeter::new(Some("application/json")).keeping_id();
            body.as_bytes().chunks(piece).for_each(|p| _ = m.feed(p));
            let usage = Usage {
                prompt_tokens: 3000,
                completion_tokens: 0,
                cached_tokens: Some(64),
            };
            assert_eq!(m.finish(), Some(usage), "pieces of {piece}");
            assert_eq!(m.response_id.as_deref(), Some("embd-7"));
        }
        // The Responses API's names, past the limit too.
        let mut m = ResponseMeter::new(None);
        m.feed(&vec![b' '; MAX_KEPT + 1]);
        m.feed(br#"{"usage":{"input_tokens":5,"output_tokens":2}}"#);
        assert_eq!(
            m.finish().map(|u| (u.prompt_tokens, u.completion_tokens)),
            Some((5, 2))
        );
    }
}
