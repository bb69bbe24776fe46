//! The static rule: how many tokens a prompt's text holds, without a tokenizer. It walks the text's
//! characters (not bytes) once and mirrors how modern BPE tokenizers (o200k, cl100k, Llama 3)
//! pre-split text: one token per word, with camelCase humps, long words and accented words costing
//! more; digits in groups of three; a punctuation run costs about one token, a lone mark between
//! word characters (`a.b`, `snake_case`, `it's`) joins the word after it, and repeated marks
//! (`====`) merge; indentation runs and line breaks are a token each; Han, kana and hangul just
//! under one token per character. Measured against tiktoken in `tests/estimator_accuracy.rs`.
//! Learned corrections (see `calibration`) scale it per model once responses' `usage` has been
//! seen. The rule runs over every character of every prompt, so most characters are classified by
//! their first byte and counted in loops over runs (`Counter`).

/// Letters of a word piece its first token covers; common long words are one token, rare ones
/// split, so each further letter adds `LONG_WORD_EXTRA_TOKENS`.
const LONG_WORD_LETTERS: usize = 8;
const LONG_WORD_EXTRA_TOKENS: f64 = 0.125;
/// A word with an accented Latin letter (é, ü, ñ…) splits more in English-heavy vocabularies.
const ACCENTED_WORD_TOKENS: f64 = 1.0;
/// Modern vocabularies group digits by three (o200k, cl100k, Llama 3).
const DIGITS_PER_TOKEN: usize = 3;
/// Numbers do not absorb the space before them, so that space is a token of its own.
const SPACE_BEFORE_DIGIT_TOKENS: f64 = 1.0;
/// A run of two or more spaces (indentation, alignment); its last space joins the next word.
const INDENT_TOKENS: f64 = 1.0;
/// A run of line breaks, unless punctuation just before it absorbs it (`;\n`, `.\n\n`).
const NEWLINE_TOKENS: f64 = 1.0;
/// The first mark of a punctuation run.
const PUNCT_TOKENS: f64 = 1.0;
/// A lone mark after a word character and before a letter (`.field`, `_name`, `'s`, `(arg`)
/// mostly merges into the word that follows.
const ATTACHED_PUNCT_TOKENS: f64 = 0.3;
/// Further marks of a run often merge (`");`, `"},{"`).
const PUNCT_MORE_TOKENS: f64 = 0.2;
/// A mark repeating the one before it (`---`, `====`, `**`) almost always merges.
const PUNCT_REPEAT_TOKENS: f64 = 0.05;
/// Han, kana, hangul and CJK punctuation, per character: common pairs merge, rare characters split.
const CJK_TOKENS: f64 = 0.78;
/// Other alphabets (Cyrillic, Greek, Arabic…).
const OTHER_LETTERS_PER_TOKEN: usize = 4;
const SYMBOL_TOKENS: f64 = 1.0;
/// Emoji and other pictographs outside the BMP are often two byte-level tokens.
const PICTOGRAPH_TOKENS: f64 = 1.5;

#[derive(Clone, Copy, PartialEq, Eq)]
enum CharClass {
    /// Latin letters, accented ones included.
    Lower,
    Upper,
    Digit,
    Space,
    Newline,
    Punct,
    CjkPunct,
    Cjk,
    OtherLetter,
    Pictograph,
    Symbol,
}

impl CharClass {
    fn is_letter(self) -> bool {
        matches!(self, CharClass::Lower | CharClass::Upper)
    }
}

const fn ascii_class(b: u8) -> CharClass {
    match b {
        b'a'..=b'z' => CharClass::Lower,
        b'A'..=b'Z' => CharClass::Upper,
        b'0'..=b'9' => CharClass::Digit,
        b'\n' | b'\r' => CharClass::Newline,
        b' ' | b'\t' | 0x0b | 0x0c => CharClass::Space,
        _ => CharClass::Punct,
    }
}

fn class(c: char) -> CharClass {
    if c.is_ascii() {
        return ascii_class(c as u8);
    }
    match c {
        c if c.is_whitespace() => CharClass::Space,
        // General punctuation: curly quotes, dashes, ellipsis.
        '\u{2000}'..='\u{206f}' => CharClass::Punct,
        '\u{3000}'..='\u{303f}' | '\u{ff00}'..='\u{ffef}' => CharClass::CjkPunct,
        '\u{2e80}'..='\u{9fff}' | '\u{ac00}'..='\u{d7af}' | '\u{f900}'..='\u{faff}' => {
            CharClass::Cjk
        }
        '\u{20000}'..='\u{2fa1f}' => CharClass::Cjk,
        // Combining accents continue the Latin word they decorate.
        '\u{300}'..='\u{36f}' => CharClass::Lower,
        '\u{c0}'..='\u{24f}' | '\u{1e00}'..='\u{1eff}' if c.is_alphabetic() => {
            if c.is_uppercase() {
                CharClass::Upper
            } else {
                CharClass::Lower
            }
        }
        c if c.is_alphabetic() => CharClass::OtherLetter,
        '\u{1f000}'..='\u{1faff}' => CharClass::Pictograph,
        _ => CharClass::Symbol,
    }
}

/// One character of the text: its class and its length in bytes.
#[derive(Clone, Copy)]
struct Char {
    class: CharClass,
    len: u8,
}

/// Characters known from their first byte alone: every ASCII character, and the lead bytes
/// 0xE4-0xE9 and 0xEB-0xEC, whose three-byte characters (U+4000-U+9FFF, U+B000-U+CFFF) are all
/// Han or hangul. Looked up rather than decoded and matched: the rule runs over every character
/// of every prompt, and these are most of them.
const BY_LEAD_BYTE: [Option<Char>; 256] = {
    let mut table = [None; 256];
    let mut i = 0;
    while i < 256 {
        let b = i as u8;
        table[i] = match b {
            0x00..=0x7f => Some(Char {
                class: ascii_class(b),
                len: 1,
            }),
            0xe4..=0xe9 | 0xeb..=0xec => Some(Char {
                class: CharClass::Cjk,
                len: 3,
            }),
            _ => None,
        };
        i += 1;
    }
    table
};

/// The character at byte `at` if its first byte alone says what it is.
#[inline(always)]
fn known_at(bytes: &[u8], at: usize) -> Option<Char> {
    BY_LEAD_BYTE
        .get(usize::from(*bytes.get(at)?))
        .copied()
        .flatten()
}

/// The character starting at byte `at` of `text`, if there is one.
#[inline(always)]
fn char_at(text: &str, at: usize) -> Option<Char> {
    match known_at(text.as_bytes(), at) {
        Some(ch) => Some(ch),
        None => decoded_at(text, at),
    }
}

fn decoded_at(text: &str, at: usize) -> Option<Char> {
    let c = text.get(at..)?.chars().next()?;
    Some(Char {
        class: class(c),
        len: c.len_utf8() as u8,
    })
}

/// The rule's running count over a text and what it remembers of the characters before. Its
/// per-character steps are `#[inline(always)]`: left as calls (as a size-optimized build leaves
/// them), they cost several times the steps themselves.
struct Counter<'a> {
    text: &'a str,
    tokens: f64,
    prev: CharClass,
    /// The last punctuation mark's UTF-8 bytes, packed: a mark repeating the one just before it
    /// merges.
    last_mark: u32,
    /// Characters so far in the current word piece, digit run or other-alphabet run.
    run: usize,
    accented: bool,
}

impl<'a> Counter<'a> {
    fn new(text: &'a str) -> Self {
        Counter {
            text,
            tokens: 0.0,
            // The start of the text behaves like the start of a line.
            prev: CharClass::Newline,
            last_mark: 0,
            run: 0,
            accented: false,
        }
    }

    /// Counts `ch`, which starts at byte `at`, and the characters after it that continue its
    /// run at the same cost whatever follows them (the rest of an ASCII word or number, of an
    /// indentation, of Han or hangul text: most characters); returns where it stopped. Runs are
    /// counted in loops of their own, without the dispatch on each character's class.
    #[inline(always)]
    fn count_from(&mut self, at: usize, ch: Char) -> usize {
        let bytes = self.text.as_bytes();
        let mut end = at + usize::from(ch.len);
        match ch.class {
            k @ (CharClass::Lower | CharClass::Upper) => {
                self.letter(k, ch.len > 1);
                end = self.lowercase_words(end);
            }
            CharClass::Digit => {
                // Only ASCII digits are of this class.
                let digits = 1 + ascii_run(bytes, end, |b| b.is_ascii_digit());
                end = at + digits;
                self.digits(digits);
            }
            CharClass::OtherLetter => self.other_letter(),
            CharClass::Space => {
                let spaces = ascii_run(bytes, end, |b| b == b' ');
                if spaces > 0 {
                    // Every space of the run but its last is followed by a space, which `space`
                    // charges nothing: only the last one looks at what follows.
                    self.prev = CharClass::Space;
                    end += spaces;
                }
                self.space(end);
            }
            CharClass::Newline => {
                let joined = matches!(
                    self.prev,
                    CharClass::Newline | CharClass::Punct | CharClass::CjkPunct
                );
                self.charge(
                    CharClass::Newline,
                    if joined { 0.0 } else { NEWLINE_TOKENS },
                );
            }
            CharClass::Punct => self.mark(at, end),
            CharClass::Cjk => {
                self.charge(CharClass::Cjk, CJK_TOKENS);
                // The rest of the run whose lead bytes alone say Han or hangul.
                while let Some(Char {
                    class: CharClass::Cjk,
                    len,
                }) = known_at(bytes, end)
                {
                    self.charge(CharClass::Cjk, CJK_TOKENS);
                    end += usize::from(len);
                }
            }
            CharClass::CjkPunct => self.charge(CharClass::CjkPunct, CJK_TOKENS),
            CharClass::Pictograph => self.charge(CharClass::Pictograph, PICTOGRAPH_TOKENS),
            CharClass::Symbol => self.charge(CharClass::Symbol, SYMBOL_TOKENS),
        }
        end
    }

    /// Adds `t`, what a character of class `k` costs. Each character's cost is summed before it
    /// is added, and costs are added in text order: the total is the same to the last bit
    /// whichever path counted each character.
    #[inline(always)]
    fn charge(&mut self, k: CharClass, t: f64) {
        if t != 0.0 {
            self.tokens += t;
        }
        self.prev = k;
    }

    /// The class of the character at byte `at`; the end of the text is like a line break.
    #[inline(always)]
    fn class_at(&self, at: usize) -> CharClass {
        char_at(self.text, at).map_or(CharClass::Newline, |c| c.class)
    }

    #[inline(always)]
    fn letter(&mut self, k: CharClass, non_ascii: bool) {
        let mut t = 0.0;
        // A piece starts after a non-letter and at a camelCase hump.
        if !self.prev.is_letter() || (self.prev == CharClass::Lower && k == CharClass::Upper) {
            t += 1.0;
            self.run = 0;
            self.accented = false;
        }
        self.run += 1;
        if self.run > LONG_WORD_LETTERS {
            t += LONG_WORD_EXTRA_TOKENS;
        }
        if !self.accented && non_ascii {
            self.accented = true;
            t += ACCENTED_WORD_TOKENS;
        }
        self.charge(k, t);
    }

    /// Counts, from byte `at` just after a letter, the rest of its lowercase ASCII piece and the
    /// lowercase words that follow it one space apart (most of English prose); returns where it
    /// stopped. What `letter` and `space` would charge character by character, without looking
    /// up any class: a lowercase ASCII letter after a letter only lengthens the piece, costing
    /// more once it is long; a single space between a letter and a lowercase letter costs nothing
    /// (it is neither an indentation nor before a digit) and the letter after it starts a piece.
    #[inline(always)]
    fn lowercase_words(&mut self, mut at: usize) -> usize {
        let bytes = self.text.as_bytes();
        let letters = lowercase_run(bytes, at);
        if letters > 0 {
            at += letters;
            self.lengthen(letters);
            self.prev = CharClass::Lower;
        }
        // In locals, which the loop keeps in registers: one piece's state is written back once.
        let (mut tokens, mut last) = (self.tokens, 0);
        while let (Some(b' '), Some(b'a'..=b'z')) = (bytes.get(at), bytes.get(at + 1)) {
            // The next word's first letter starts a piece: what `letter` charges after a space.
            tokens += 1.0;
            // Its letters, the first included, each past the first few charged in turn.
            last = lowercase_run(bytes, at + 1);
            at += 1 + last;
            for _ in LONG_WORD_LETTERS..last {
                tokens += LONG_WORD_EXTRA_TOKENS;
            }
        }
        self.tokens = tokens;
        if last > 0 {
            self.run = last;
            self.accented = false;
            self.prev = CharClass::Lower;
        }
        at
    }

    /// `letters` more letters of the current piece, each past `LONG_WORD_LETTERS` charged in
    /// turn (one addition each, as `letter` would add them).
    #[inline(always)]
    fn lengthen(&mut self, letters: usize) {
        let long_from = self.run.max(LONG_WORD_LETTERS);
        self.run += letters;
        for _ in long_from..self.run {
            self.tokens += LONG_WORD_EXTRA_TOKENS;
        }
    }

    /// Another alphabet's letter: a token for every few letters of a run.
    #[inline(always)]
    fn other_letter(&mut self) {
        if self.prev != CharClass::OtherLetter {
            self.run = 0;
        }
        self.run += 1;
        let starts_token = (self.run - 1).is_multiple_of(OTHER_LETTERS_PER_TOKEN);
        self.charge(CharClass::OtherLetter, if starts_token { 1.0 } else { 0.0 });
    }

    /// A run of `digits` digits: a token at the first of each group of three, one addition each.
    #[inline(always)]
    fn digits(&mut self, digits: usize) {
        if self.prev != CharClass::Digit {
            self.run = 0;
        }
        let first = self.run.next_multiple_of(DIGITS_PER_TOKEN);
        self.run += digits;
        for _ in (first..self.run).step_by(DIGITS_PER_TOKEN) {
            self.tokens += 1.0;
        }
        self.prev = CharClass::Digit;
    }

    /// A space before byte `end`. Spaces are charged at the end of their run; a single space
    /// joins the next word.
    #[inline(always)]
    fn space(&mut self, end: usize) {
        let next = self.class_at(end);
        let mut t = 0.0;
        if next != CharClass::Space {
            if self.prev == CharClass::Space && next != CharClass::Newline {
                t += INDENT_TOKENS;
            }
            if next == CharClass::Digit {
                t += SPACE_BEFORE_DIGIT_TOKENS;
            }
        }
        self.charge(CharClass::Space, t);
    }

    /// A punctuation mark at bytes `at..end`.
    fn mark(&mut self, at: usize, end: usize) {
        let mark = match self.text.as_bytes().get(at..end).unwrap_or_default() {
            // Most marks are ASCII.
            [b] => u32::from(*b),
            // At most four bytes, and no character's encoding is another's with bytes added.
            bytes => bytes
                .iter()
                .rev()
                .fold(0, |packed, b| packed << 8 | u32::from(*b)),
        };
        let t = if self.prev == CharClass::Punct {
            if self.last_mark == mark {
                PUNCT_REPEAT_TOKENS
            } else {
                PUNCT_MORE_TOKENS
            }
        } else if self.prev != CharClass::Space && self.class_at(end).is_letter() {
            ATTACHED_PUNCT_TOKENS
        } else {
            PUNCT_TOKENS
        };
        self.last_mark = mark;
        self.charge(CharClass::Punct, t);
    }
}

/// How many bytes from `at` satisfy `is` in a row (runs of digits and spaces are short: a byte
/// at a time).
#[inline(always)]
fn ascii_run(bytes: &[u8], at: usize, is: impl Fn(u8) -> bool) -> usize {
    let rest = bytes.get(at..).unwrap_or_default();
    rest.iter().take_while(|&&b| is(b)).count()
}

/// How many bytes from `at` are lowercase ASCII letters in a row. Eight bytes at a time: a word's
/// end is found by arithmetic rather than by a branch on every letter, which the processor
/// would mispredict once per word.
fn lowercase_run(bytes: &[u8], at: usize) -> usize {
    const HIGH: u64 = u64::from_le_bytes([0x80; 8]);
    const A: u64 = u64::from_le_bytes([b'a'; 8]);
    const AFTER_Z: u64 = u64::from_le_bytes([b'z' + 1; 8]);
    let mut n = 0;
    while let Some(word) = bytes.get(at + n..).and_then(|rest| rest.first_chunk::<8>()) {
        let w = u64::from_le_bytes(*word);
        // Per byte, bit 7 of: ASCII, at least 'a', not past 'z' (with bit 7 set first, no
        // subtraction borrows from the next byte).
        let lower = ((w | HIGH) - A) & !((w | HIGH) - AFTER_Z) & !w & HIGH;
        let run = (!lower & HIGH).trailing_zeros() as usize / 8;
        n += run;
        if run < 8 {
            return n;
        }
    }
    let rest = bytes.get(at + n..).unwrap_or_default();
    n + rest.iter().take_while(|b| b.is_ascii_lowercase()).count()
}

/// Texts longer than this are counted on samples: the rule costs about 2 ns a byte natively (five
/// times that in the VM), which made it most of a 256 KB request's cost, while a long text's
/// tokens per byte are known well from a few spread windows of it.
const SAMPLED_ABOVE: usize = 32 << 10;
/// Windows counted in a long text, evenly spread, and the bytes of each.
const SAMPLE_WINDOWS: usize = 8;
const SAMPLE_WINDOW_BYTES: usize = 4 << 10;
/// How far a window's edge moves to reach the start of a word.
const WORD_EDGE_BYTES: usize = 64;

/// Prompt tokens by the static rule, before any learned correction. A text longer than
/// `SAMPLED_ABOVE` is counted in `SAMPLE_WINDOWS` windows spread over it, scaled to its length
/// (within 2 % of the whole count on long prose, code and mixed text: see the tests).
pub fn static_prompt_tokens(text: &str) -> f64 {
    if text.len() <= SAMPLED_ABOVE {
        return counted(text);
    }
    let stride = text.len() / SAMPLE_WINDOWS;
    let (mut tokens, mut bytes) = (0.0, 0);
    for k in 0..SAMPLE_WINDOWS {
        let start = word_start(text, k * stride);
        let end = word_start(text, start + SAMPLE_WINDOW_BYTES);
        let window = text.get(start..end).unwrap_or_default();
        tokens += counted(window);
        bytes += window.len();
    }
    if bytes == 0 {
        return counted(text);
    }
    tokens * text.len() as f64 / bytes as f64
}

/// The first byte at or after `at` that starts a word (follows whitespace), looking
/// `WORD_EDGE_BYTES` ahead; else the first character boundary; the text's end past it.
fn word_start(text: &str, at: usize) -> usize {
    if at == 0 || at >= text.len() {
        return at.min(text.len());
    }
    let bytes = text.as_bytes();
    let ahead = bytes.get(at..(at + WORD_EDGE_BYTES).min(bytes.len()));
    if let Some(i) = ahead.and_then(|a| a.iter().position(u8::is_ascii_whitespace)) {
        return at + i + 1;
    }
    (at..=text.len())
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(text.len())
}

/// The rule over every character of `text`.
fn counted(text: &str) -> f64 {
    let mut counter = Counter::new(text);
    let mut at = 0;
    while let Some(ch) = char_at(text, at) {
        at = counter.count_from(at, ch);
    }
    counter.tokens
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    /// Long texts of each kind, built from varied paragraphs (no two windows alike).
    fn long_text(kind: usize, bytes: usize) -> String {
        let prose = "The scheduler admits a request when its pod has room; otherwise it waits, \
                     and the line moves as streams end. Affinity keeps a conversation where its \
                     cache is. ";
        let code =
            "fn route(&mut self, pods: &[Pod]) -> Option<usize> {\n    let best = pods.iter()\
                    .enumerate().min_by_key(|(_, p)| p.load)?;\n    Some(best.0)\n}\n";
        let cjk = "缓存命中率在负载均衡中很重要。请求被路由到已经持有其前缀的节点。";
        let mut out = String::new();
        let mut i = 0usize;
        while out.len() < bytes {
            i += 1;
            let piece = match kind {
                0 => prose,
                1 => code,
                2 => cjk,
                // Mixed: sections of each, of varying length.
                _ => [prose, code, cjk][(i / (3 + i % 5)) % 3],
            };
            out.push_str(piece);
            out.push_str(&format!("{} item{} ", i % 97, i * 7919 % 1000));
            if i.is_multiple_of(11) {
                out.push_str("\n\n");
            }
        }
        out
    }

    #[test]
    fn long_texts_are_counted_on_samples_close_to_the_whole() {
        for kind in 0..4 {
            for size in [40 << 10, 256 << 10, 900 << 10] {
                let text = long_text(kind, size);
                let sampled = static_prompt_tokens(&text);
                let whole = counted(&text);
                let err = (sampled / whole - 1.0).abs();
                assert!(
                    err < 0.02,
                    "kind {kind}, {size} bytes: {sampled} vs {whole}"
                );
            }
        }
        // At the threshold and below, every character is counted.
        let short = long_text(3, SAMPLED_ABOVE);
        let short = &short[..short.floor_char_boundary(SAMPLED_ABOVE)];
        assert_eq!(static_prompt_tokens(short), counted(short));
    }

    #[test]
    fn sample_windows_start_at_words_and_character_boundaries() {
        let text = "abc déf ghi";
        assert_eq!(word_start(text, 1), 4);
        assert_eq!(word_start(text, 0), 0);
        assert_eq!(word_start(text, 99), text.len());
        let cjk = "你好世界你好";
        // No whitespace: the next character boundary.
        assert_eq!(word_start(cjk, 1), 3);
    }

    #[test]
    fn counts_characters_not_bytes() {
        // Six CJK characters are 18 bytes but three to six tokens (o200k: 你好 世界 你好).
        let cjk = static_prompt_tokens("你好世界你好");
        assert!((4.0..=6.0).contains(&cjk), "{cjk}");
        let latin = static_prompt_tokens("the quick brown fox jumps over the lazy dog");
        assert!((8.0..=11.0).contains(&latin), "{latin}");
        assert_eq!(static_prompt_tokens("1234567"), 3.0);
        assert_eq!(static_prompt_tokens(""), 0.0);
    }

    /// Expected values are o200k's counts (tiktoken), exact or within the rule's fractions.
    #[test]
    fn follows_how_bpe_splits_words_numbers_and_punctuation() {
        let close = |text: &str, o200k: f64, slack: f64| {
            let t = static_prompt_tokens(text);
            assert!((t - o200k).abs() <= slack, "{text:?}: {t} vs {o200k}");
        };
        // camelCase humps split; a lone mark joins the word after it.
        close("HashMap", 2.0, 0.0);
        close("self.options", 2.0, 0.5);
        close("don’t", 2.0, 0.5);
        // Indentation is one token, `;` absorbs the line break: "   ", " let", " x", " =", " ",
        // "1", ";\n".
        close("    let x = 1;\n", 7.0, 0.0);
        // A space before a number stands alone; digits go by three.
        close("in 2024, about 1,234 people", 11.0, 0.0);
        close("{\"role\":\"user\",\"content\":\"hi\"}", 9.0, 2.0);
        // Repeated marks merge into long tokens (79 '=' are two).
        close(&"=".repeat(79), 2.0, 3.0);
        // Accented words and other alphabets split more than English words.
        close("naïve café", 4.0, 0.0);
        close("Привет, мир", 4.0, 0.0);
    }

    /// The lead-byte table must say what decoding and `class` would.
    #[test]
    fn lead_bytes_classify_like_class() {
        let ascii = (0..=0x7f_u32).filter_map(char::from_u32);
        let han_hangul = (0x4000..=0x9fff).chain(0xb000..=0xcfff);
        for c in ascii.chain(han_hangul.filter_map(char::from_u32)) {
            let text = c.to_string();
            let known = known_at(text.as_bytes(), 0).map(|k| (k.class, usize::from(k.len)));
            assert!(known == Some((class(c), text.len())), "{c:?}");
        }
    }

    #[test]
    fn lowercase_runs_end_at_the_first_other_byte() {
        for len in 0..20 {
            for after in ["", "A", "`", "{", "1", " ", "é", "z"] {
                let text = format!("{}{after}", "a".repeat(len));
                let expected = text.bytes().take_while(u8::is_ascii_lowercase).count();
                assert_eq!(lowercase_run(text.as_bytes(), 0), expected, "{text:?}");
                assert_eq!(
                    lowercase_run(text.as_bytes(), 1.min(len)),
                    expected - 1.min(len)
                );
            }
        }
    }
}
