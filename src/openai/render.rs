//! The canonical text a prompt renders to (`request::Request::text`), written as the body is
//! read. Chat turns render as `<role>\n<content>\n` (`<role name>` for a named participant), one
//! after another, so a conversation's next turn extends the text of the previous one; content
//! parts, inputs and JSON values render as their text.
//!
//! Every list a body may hold (messages, content parts, inputs, score inputs) is rendered
//! element by element as the parser reads it (`shapes`), each element dropped once written, so
//! a parse holds the text it writes and one element, never the list: read into lists of structs,
//! a 1 MiB body of empty messages (`{},` each) took 144 MiB of heap natively while it parsed,
//! and a wasm VM's memory, once grown, never shrinks (BENCHMARKS.md, *A body's parse in bounded
//! memory*).
//!
//! Source of truth: none; each rendering lives for one body's parse.

use super::shapes::{Content, Json, Message, Part};
use std::cell::Cell;
use std::ops::Range;

thread_local! {
    /// Room for the text of the body being parsed (`with_room`): the first rendering to start
    /// takes it (`Rendering::new`), so that a prompt's text is written into one allocation of
    /// about its size rather than grown by doublings (each a copy, and up to twice the text's
    /// size held for the request's life). Only a capacity: no result depends on it.
    static ROOM: Cell<usize> = const { Cell::new(0) };
}

/// A string with the room of the body being parsed, unless another took it first.
pub(super) fn room() -> String {
    String::with_capacity(ROOM.take())
}

/// Runs `parse` with `bytes` of room for the first rendering it starts.
pub(super) fn with_room<T>(bytes: usize, parse: impl FnOnce() -> T) -> T {
    ROOM.set(bytes);
    let parsed = parse();
    ROOM.set(0);
    parsed
}

/// How Claude Code's per-request attribution block opens (dropped from a Messages request's
/// system prompt, `Rendering::push_system`).
const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// Text being rendered, and what it holds besides its text.
#[derive(Default)]
pub(super) struct Rendering {
    pub text: String,
    /// How much of `text` (bytes, from its start) is the application's rather than the
    /// conversation's (`Request::opening`).
    pub opening: usize,
    /// Non-text content parts (`Request::non_text_parts`).
    pub non_text_parts: u64,
}

impl Rendering {
    /// A rendering with the room of the body being parsed, unless another took it first.
    pub fn new() -> Rendering {
        Rendering {
            text: room(),
            ..Rendering::default()
        }
    }

    fn open_turn(&mut self, role: &str, name: Option<&str>) {
        self.text.push('<');
        self.text.push_str(role);
        if let Some(name) = name {
            self.text.push(' ');
            self.text.push_str(name);
        }
        self.text.push_str(">\n");
    }

    pub fn push_turn(&mut self, role: &str, content: &str) {
        let opens = self.opens(role);
        self.open_turn(role, None);
        self.text.push_str(content);
        self.text.push('\n');
        self.opened(opens);
    }

    /// Whether a turn of `role` about to be pushed is part of the opening (`Request::opening`):
    /// the application's kind of turn, with nothing but the opening before it.
    fn opens(&self, role: &str) -> bool {
        self.text.len() == self.opening && matches!(role, "system" | "developer" | "tools")
    }

    /// The turn just pushed extends the opening if it `opens`.
    fn opened(&mut self, opens: bool) {
        if opens {
            self.opening = self.text.len();
        }
    }

    /// `next`, rendered on its own, after this: its opening extends this one's if all of this
    /// is opening, as if its turns had been pushed here. Taken whole when this is empty.
    pub fn append(&mut self, next: Rendering) {
        if self.opening == self.text.len() {
            self.opening += next.opening;
        }
        if self.text.is_empty() {
            self.text = next.text;
        } else {
            self.text.push_str(&next.text);
        }
        self.non_text_parts = self.non_text_parts.saturating_add(next.non_text_parts);
    }

    /// A string's text, or each part's as `Parts` rendered them.
    pub fn push_content(&mut self, c: &Content) {
        match c {
            Content::Text(t) => self.text.push_str(t.as_str()),
            Content::Parts(parts) => {
                self.text.push_str(&parts.text);
                self.non_text_parts = self.non_text_parts.saturating_add(parts.non_text_parts);
            }
        }
    }

    pub fn push_message(&mut self, m: &Message) {
        let role = m
            .role
            .as_ref()
            .or(m.kind.as_ref())
            .map_or("user", |r| r.as_str());
        let opens = self.opens(role);
        self.open_turn(role, m.name.as_ref().map(|n| n.as_str()));
        if let Some(content) = &m.content {
            self.push_content(content);
        }
        if let Some(args) = &m.arguments {
            self.text.push_str(args.as_str());
        }
        if let Some(output) = &m.output {
            push_json_text(&mut self.text, output);
        }
        if let Some(calls) = &m.tool_calls {
            self.text.push_str(&calls.0);
        }
        self.text.push('\n');
        self.opened(opens);
    }

    /// A Messages request's one system turn, as the engine renders it (vLLM's
    /// `_convert_system_message`): the top-level `system`, then every system message's text
    /// (`Turns::system`), joined, at the start of the conversation. No text, no turn.
    pub fn push_system(&mut self, top: Option<&Content>, messages: &str) {
        let opens = self.opens("system");
        let start = self.text.len();
        self.open_turn("system", None);
        let header = self.text.len();
        if let Some(top) = top {
            push_system_text(&mut self.text, top);
        }
        self.text.push_str(messages);
        if self.text.len() == header {
            self.text.truncate(start);
            return;
        }
        self.text.push('\n');
        self.opened(opens);
    }
}

/// A content's text as a Messages request's system prompt takes it: a string whole, of parts
/// only the `text` blocks' text (`Parts::texts`).
pub(super) fn push_system_text(text: &mut String, c: &Content) {
    match c {
        Content::Text(t) => text.push_str(t.as_str()),
        Content::Parts(parts) => {
            for r in &parts.texts {
                text.push_str(parts.text.get(r.clone()).unwrap_or_default());
            }
        }
    }
}

/// A list of content parts, rendered as read: each part's text one after another, and how many
/// carried none.
#[derive(Default)]
pub(super) struct Parts {
    pub text: String,
    pub non_text_parts: u64,
    /// Where each `text` block's own text lies in `text`, but a billing header (the text a
    /// Messages request's system prompt takes of them: `push_system_text`). A text block that
    /// opens with Claude Code's `x-anthropic-billing-header` is dropped there, as the engine
    /// drops it: it carries a hash that differs on every request and would end every prompt's
    /// shared prefix at its first block.
    pub texts: Vec<Range<usize>>,
}

impl Parts {
    /// A content part's text; one that carries no text field at all and names a kind (an image,
    /// audio, a file) counts as a non-text part. (A text field that is empty is text: none.)
    pub fn push(&mut self, p: &Part) {
        // Anthropic blocks the engine drops from the prompt (vLLM's `_convert_block`).
        if matches!(p.kind.as_str(), "redacted_thinking" | "tool_reference") {
            return;
        }
        if let Some(t) = p.text.as_ref().map(|t| t.as_str()) {
            if p.kind.as_str() == "text" && !t.starts_with(BILLING_HEADER) {
                let start = self.text.len();
                self.texts.push(start..start + t.len());
            }
        }
        let texts = [
            p.text.as_ref().or(p.refusal.as_ref()),
            p.thinking.as_ref(),
            p.name.as_ref(),
        ];
        let mut carried = false;
        for t in texts.into_iter().flatten() {
            self.text.push_str(t.as_str());
            carried = true;
        }
        if let Some(input) = &p.input {
            self.text.push_str(&input.0);
            carried = true;
        }
        match &p.content {
            Some(Content::Text(t)) => self.text.push_str(t.as_str()),
            Some(Content::Parts(inner)) => {
                self.text.push_str(&inner.text);
                self.non_text_parts = self.non_text_parts.saturating_add(inner.non_text_parts);
            }
            None if !carried && !p.kind.as_str().is_empty() => self.non_text_parts += 1,
            None => {}
        }
    }
}

/// A JSON value's text: a string's own characters, anything else as JSON.
fn push_json_text(text: &mut String, value: &Json) {
    match serde_json::from_str::<super::shapes::Text>(&value.0) {
        Ok(s) => text.push_str(s.as_str()),
        Err(_) => text.push_str(&value.0),
    }
}
