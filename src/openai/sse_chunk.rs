//! A streamed chunk's pieces of text counted without deserializing it. A streamed answer is a
//! server-sent event per token, each a response-body callback in which the meter
//! (`response::ResponseMeter`) counts the chunk's pieces of text, so that reading costs once per
//! token, not once per request; through serde_json it was about 5,000 instructions a chunk, more
//! than the rest of the request together (`examples/request_cost --stream`).
//!
//! [`pieces`] walks the chunk's JSON once, allocating nothing, and counts what the serde reading
//! (`response::Chunk`) counts: each of `choices` that carries any text — its `text`, or its
//! delta's `content`, `reasoning` (vLLM's name since its PR 27752), `reasoning_content`
//! (SGLang's, and vLLM's before) or a tool call's function `name` or `arguments`, or the ids of a
//! vLLM `/inference/v1/generate` stream's `token_ids` —, and each
//! event of [`TEXT_EVENTS`] (the Responses and Anthropic Messages APIs'). It declines (`None`) rather than differ: wherever a
//! chunk's shape or bytes leave any doubt that serde_json would read it alike (a `usage`, `response` or SGLang `/generate` `meta_info` that is not null, a field
//! of interest of another type or given twice, an escaped key or event type, a `\u` escape of a
//! surrogate, bytes that are not UTF-8, nesting past `MAX_DEPTH`, any syntax error), and the
//! meter then reads the chunk through serde as before. Usage, once a stream, is always read
//! through serde. The test `pieces_are_counted_as_the_serde_reading_counts_them` holds the two to
//! each other.

/// The streamed events that each carry a piece of the answer: the Responses API's text, reasoning
/// (vLLM's `response.reasoning_text.delta`) and a function call's arguments, and the Anthropic
/// Messages API's `content_block_delta` (text, thinking or a tool call's JSON; vLLM also closes
/// each thinking block with one carrying its signature, counted as a piece too: one a block).
pub const TEXT_EVENTS: [&str; 4] = [
    "response.output_text.delta",
    "response.reasoning_text.delta",
    "response.function_call_arguments.delta",
    "content_block_delta",
];

/// Deeper than this is declined (serde_json's own limit is 128).
const MAX_DEPTH: u32 = 32;

/// The bytes a string may hold as they are: all but the quote, the backslash and control bytes
/// (bytes past ASCII too: a string that has any is checked as UTF-8 whole).
const PLAIN: [bool; 256] = {
    let mut plain = [true; 256];
    let mut b = 0;
    while b < 0x20 {
        plain[b] = false;
        b += 1;
    }
    plain[b'"' as usize] = false;
    plain[b'\\' as usize] = false;
    plain
};

/// The pieces of text in one SSE chunk's JSON (`data`, trimmed), or `None` when the serde reading
/// must decide.
pub fn pieces(data: &[u8]) -> Option<u64> {
    let mut c = Cursor { b: data, i: 0 };
    c.ws();
    let mut count = 0;
    c.fields(
        0,
        [b"choices", b"type", b"usage", b"response", b"meta_info"],
        |c, field| {
            match field {
                0 => count += c.choices()?,
                1 => {
                    // Compared as written: an escaped name is serde's to read.
                    let kind = c.text_or_null()?;
                    if kind.is_some_and(|k| k.contains(&b'\\')) {
                        return None;
                    }
                    count += u64::from(
                        kind.is_some_and(|k| TEXT_EVENTS.iter().any(|e| e.as_bytes() == k)),
                    );
                }
                // Present with a value: the serde reading takes it.
                _ => c.null().then_some(())?,
            }
            Some(())
        },
    )?;
    c.ws();
    (c.i == c.b.len()).then_some(count)
}

struct Cursor<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Cursor<'a> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\n' | b'\t' | b'\r')) {
            self.i += 1;
        }
    }

    fn eat(&mut self, byte: u8) -> Option<()> {
        self.ws();
        (self.peek() == Some(byte)).then(|| self.i += 1)
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        self.ws();
        let rest = self.b.get(self.i..)?;
        rest.starts_with(word).then(|| self.i += word.len())
    }

    /// An object's members, `member` reading each value after its (unescaped) key.
    fn object(
        &mut self,
        depth: u32,
        mut member: impl FnMut(&mut Self, &'a [u8]) -> Option<()>,
    ) -> Option<()> {
        self.sequence(depth, b'{', b'}', |c| {
            c.ws();
            let (key, plain) = c.string()?;
            if !plain {
                return None;
            }
            c.eat(b':')?;
            member(c, key)
        })
    }

    /// An object's members of interest, `field` reading the value of `names[i]` as `i`: each at
    /// most once (one given twice declines), the others checked and skipped.
    fn fields<const N: usize>(
        &mut self,
        depth: u32,
        names: [&[u8]; N],
        mut field: impl FnMut(&mut Self, usize) -> Option<()>,
    ) -> Option<()> {
        let mut seen = [false; N];
        self.object(depth, |c, key| {
            let Some(i) = names.iter().position(|&n| n == key) else {
                return c.value(depth + 1);
            };
            if std::mem::replace(&mut seen[i], true) {
                return None;
            }
            field(c, i)
        })
    }

    /// An array's elements, `element` reading each.
    fn array(&mut self, depth: u32, element: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        self.sequence(depth, b'[', b']', element)
    }

    /// `open`, items separated by commas (each read by `item`), `close`.
    fn sequence(
        &mut self,
        depth: u32,
        open: u8,
        close: u8,
        mut item: impl FnMut(&mut Self) -> Option<()>,
    ) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.eat(open)?;
        if self.eat(close).is_some() {
            return Some(());
        }
        loop {
            item(self)?;
            self.ws();
            match self.peek()? {
                b',' => self.i += 1,
                b if b == close => {
                    self.i += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    /// A string at the cursor: its raw bytes between the quotes, and whether it has no escape.
    fn string(&mut self) -> Option<(&'a [u8], bool)> {
        if self.peek()? != b'"' {
            return None;
        }
        let start = self.i + 1;
        let mut i = start;
        let mut plain = true;
        loop {
            // Most bytes need no look (`PLAIN`): skipped in one tight loop.
            i += self
                .b
                .get(i..)?
                .iter()
                .position(|&b| !PLAIN[usize::from(b)])?;
            match *self.b.get(i)? {
                b'"' => break,
                b'\\' => {
                    plain = false;
                    match *self.b.get(i + 1)? {
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => i += 2,
                        b'u' => {
                            let hex = self.b.get(i + 2..i + 6)?;
                            if !hex.iter().all(u8::is_ascii_hexdigit) {
                                return None;
                            }
                            let unit = hex.iter().fold(0, |unit, &h| {
                                unit * 16 + char::from(h).to_digit(16).unwrap_or(0)
                            });
                            // serde_json reads a surrogate in a string only as half of a pair.
                            if (0xd800..0xe000).contains(&unit) {
                                return None;
                            }
                            i += 6;
                        }
                        _ => return None,
                    }
                }
                // A control byte.
                _ => return None,
            }
        }
        let raw = self.b.get(start..i)?;
        if !raw.is_ascii() {
            std::str::from_utf8(raw).ok()?;
        }
        self.i = i + 1;
        Some((raw, plain))
    }

    /// Whether a null is next (and then past it).
    fn null(&mut self) -> bool {
        self.literal(b"null").is_some()
    }

    /// A string field of interest (its raw bytes) or null; any other value declines.
    fn text_or_null(&mut self) -> Option<Option<&'a [u8]>> {
        if self.null() {
            return Some(None);
        }
        Some(Some(self.string()?.0))
    }

    /// A string field of interest or null: whether it holds text.
    fn some_text(&mut self) -> Option<bool> {
        Some(self.text_or_null()?.is_some_and(|t| !t.is_empty()))
    }

    /// `choices`: an array of objects; the pieces of text among them (a choice with any text).
    fn choices(&mut self) -> Option<u64> {
        let mut count = 0;
        self.array(1, |c| {
            let mut text = false;
            c.fields(2, [b"text", b"delta", b"token_ids"], |c, field| {
                text |= match field {
                    0 => c.some_text()?,
                    _ if c.null() => false,
                    1 => c.delta()?,
                    _ => {
                        let mut ids = 0;
                        c.array(3, |c| {
                            ids += 1;
                            c.value(4)
                        })?;
                        ids > 0
                    }
                };
                Some(())
            })?;
            count += u64::from(text);
            Some(())
        })?;
        Some(count)
    }

    /// A choice's `delta` (an object): whether any of its answer, reasoning (under either name)
    /// or tool calls' names and arguments carries text.
    fn delta(&mut self) -> Option<bool> {
        let mut text = false;
        let names: [&[u8]; 4] = [
            b"content",
            b"reasoning",
            b"reasoning_content",
            b"tool_calls",
        ];
        self.fields(3, names, |c, field| {
            text |= if field == 3 {
                c.tool_calls()?
            } else {
                c.some_text()?
            };
            Some(())
        })?;
        Some(text)
    }

    /// A delta's `tool_calls` (an array of objects, or null): whether any call's function has a
    /// name or arguments in this chunk.
    fn tool_calls(&mut self) -> Option<bool> {
        if self.null() {
            return Some(false);
        }
        let mut text = false;
        self.array(4, |c| {
            c.fields(5, [b"function"], |c, _| {
                if c.null() {
                    return Some(());
                }
                c.fields(6, [b"name", b"arguments"], |c, _| {
                    text |= c.some_text()?;
                    Some(())
                })
            })
        })?;
        Some(text)
    }

    /// Any JSON value, checked and skipped.
    fn value(&mut self, depth: u32) -> Option<()> {
        self.ws();
        match self.peek()? {
            b'{' => self.object(depth, |c, _| c.value(depth + 1)),
            b'[' => self.array(depth, |c| c.value(depth + 1)),
            b'"' => self.string().map(|_| ()),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            _ => self.number(),
        }
    }

    /// A number, by JSON's grammar: `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`.
    fn number(&mut self) -> Option<()> {
        if self.peek() == Some(b'-') {
            self.i += 1;
        }
        match self.peek()? {
            b'0' => self.i += 1,
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        if self.peek() == Some(b'.') {
            self.i += 1;
            self.some_digits()?;
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.i += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.i += 1;
            }
            self.some_digits()?;
        }
        Some(())
    }

    fn digits(&mut self) {
        while self.peek().is_some_and(|d| d.is_ascii_digit()) {
            self.i += 1;
        }
    }

    fn some_digits(&mut self) -> Option<()> {
        let start = self.i;
        self.digits();
        (self.i > start).then_some(())
    }
}
