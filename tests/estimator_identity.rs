#![cfg(not(target_arch = "wasm32"))]
//! The static token rule's counts, pinned to the last bit: `static_prompt_tokens` over a large,
//! varied, deterministically generated corpus (prose, code, JSON, CJK, emoji, mixed scripts,
//! whitespace, digit and punctuation runs, random code points, random bytes made valid UTF-8,
//! soups of the rule's edge cases) and over pieces of the accuracy fixtures, compared with
//! `tests/fixtures/estimator_counts.txt`. That file was written by the rule before its hot loops
//! were rewritten for speed; it is the oracle that any rewrite must match exactly (the rule is
//! calibrated, and its accuracy measured, as it counts). The counts are f64 sums in text order,
//! so a changed order of additions shows here too.
//!
//! Only a deliberate change to the rule re-records the file, with the rule's new accuracy checked
//! in `tests/estimator_accuracy.rs`:
//!
//! ```text
//! ESTIMATOR_COUNTS_RECORD=1 cargo test -p kvgate --test estimator_identity
//! ```

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use kvgate::estimate::text::static_prompt_tokens;

/// splitmix64: the same corpus on every machine.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }

    fn chance(&mut self, one_in: usize) -> bool {
        self.below(one_in) == 0
    }
}

const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "a",
    "I",
    "model",
    "cache",
    "request",
    "server",
    "latency",
    "throughput",
    "between",
    "because",
    "memory",
    "scheduler",
    "prefix",
    "tokens",
    "however",
    "especially",
    "configuration",
    "understanding",
    "approximately",
    "infrastructure",
    "measurement",
    "internationalization",
    "don't",
    "it's",
    "naïve",
    "café",
    "résumé",
    "Zürich",
    "façade",
    "coöperate",
    "HTTP",
    "JSON",
    "McDonald",
    "iPhone",
    "eBay",
    "O'Brien",
    "well-known",
    "e.g.",
    "U.S.",
    "ﬁne",
    "straße",
];

const IDENTS: &[&str] = &[
    "request",
    "blockHashes",
    "pod_state",
    "maxTokens",
    "self",
    "config",
    "estimate",
    "buffer",
    "HashMap",
    "parse_body",
    "routingTable",
    "len",
    "value",
    "result",
    "tokens",
    "i",
    "cost",
    "XMLHttpRequest",
    "__init__",
    "_private",
    "CONSTANT_NAME",
    "x1",
    "v2beta3",
    "getHTTPResponse",
];

const STATEMENTS: &[&str] = &[
    "let {a} = {b}.{c}({a}, {n});",
    "if {a}.{b} > {n} {",
    "}",
    "return Err(Error::new(\"{a} failed\"));",
    "for {a} in {b}.iter().filter(|x| x.{c} != {n}) {",
    "// Keeps the {a} of each {b}: the {c} would otherwise grow.",
    "{a}.push(({b}, {c} * {n}));",
    "match {a} { Some({b}) => {b}, None => {n} }",
    "def {a}(self, {b}={n}):",
    "\"\"\"{a} the {b}.\"\"\"",
    "const {a} = async ({b}) => { await {c}[{n}]; };",
    "#[derive(Debug, Clone)]",
    "/* {a} */ x = {b} ?? {c} || {n};",
    "{a} := {b}[{n}:]",
    "<div class=\"{a}\">{b}</div>",
    "SELECT {a}, COUNT(*) FROM {b} WHERE {c} >= {n};",
    "=================================================",
    "    ",
    "",
];

const HAN: &str = "的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工也能下过子说产种面而方后多定行学法所民得经十三之进着等部度家电力里如水化高自二理起小物现实加量都两体制机当使点从业本去把性好应开它合还因由其些然前外天政四日那社义事平形相全表间样与关各重新线内数正心反你明看原又么利比或但质气第向道命此变条只没结解问意建月公无系军很情者最立代想已通并提直题党程展五果料象员革位入常文总次品式活设及管特件长求老头基资边流路级少图山统接知较将组见计别她手角期根论运农指几九区强放决西被干做必战先回则任取据处理𠀀𪚥豈";
const KANA_HANGUL: &str = "あいうえおかきくけこさしすせそたちつてとなにぬねのはひふへほまみむめもやゆよらりるれろわをんアイウエオカキクケコサシスセソタチツテトナニヌネノハヒフヘホマミムメモヤユヨラリルレロワヲンー가나다라마바사아자차카타파하한국어의문장입니다";
const CJK_PUNCT: &[&str] = &[
    "，", "、", "：", "；", "。", "！", "？", "「", "」", "（", "）", "《", "》", "　", "〜",
];
const OTHER_WORDS: &[&str] = &[
    "Привет",
    "мир",
    "Ωμέγα",
    "λόγος",
    "مرحبا",
    "بالعالم",
    "שלום",
    "नमस्ते",
    "ภาษาไทย",
    "Ελληνικά",
    "Қазақ",
    "ქართული",
    "Հայերեն",
    "ᚠᚢᚦ",
];
const EMOJI: &[&str] = &[
    "😀",
    "👍🏽",
    "👨‍👩‍👧",
    "🀄",
    "🧪",
    "🇫🇷",
    "❤️",
    "♥",
    "★",
    "✓",
    "→",
    "∑",
    "€",
    "©",
    "™",
    "🜁",
    "🫠",
    "\u{1f000}",
    "\u{1faff}",
    "\u{1fb00}",
];
const WHITESPACE: &[&str] = &[
    " ", " ", " ", "  ", "   ", "    ", "\t", "\t\t", "\n", "\n", "\n\n", "\r\n", "\r", "\u{b}",
    "\u{c}", "\u{a0}", "\u{2000}", "\u{2028}", "\u{2029}", "\u{3000}", "\u{85}", "\u{200b}",
    "\u{feff}", " \n", "\n ", " \t ",
];
const MARKS: &[&str] = &[
    ".", ",", ";", ":", "!", "?", "'", "\"", "(", ")", "{", "}", "[", "]", "<", ">", "=", "-", "_",
    "@", "#", "$", "%", "^", "&", "|", "~", "`", "\\", "/", "+", "*", "’", "“", "”", "—", "…", "·",
    "¿", "¡", "«", "»", "§", "¶", "†",
];
/// The pieces whose neighbours change what the rule charges: every class, word shapes, runs.
const PIECES: &[&str] = &[
    " ",
    " ",
    " ",
    "  ",
    "    ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    "\r",
    "\u{b}",
    "\u{c}",
    "a",
    "the",
    "word",
    "lowercase",
    "internationalization",
    "A",
    "The",
    "HTTP",
    "camelCase",
    "getHTTPResponse",
    "snake_case",
    "x",
    "Z",
    "é",
    "É",
    "naïve",
    "café",
    "Ångström",
    "ß",
    "ǅ",
    "e\u{301}",
    "\u{301}",
    "\u{36f}",
    "ḁ",
    "Ḁ",
    "ǉ",
    "ɐ",
    "ʰ",
    "0",
    "7",
    "42",
    "1234567",
    "3.14",
    "1,234",
    "١٢٣",
    "½",
    "²",
    ".",
    ",",
    ";",
    ":",
    "!",
    "?",
    "'",
    "\"",
    "(",
    ")",
    "{",
    "}",
    "[",
    "]",
    "<",
    ">",
    "=",
    "==",
    "===",
    "---",
    "**",
    "//",
    "->",
    "=>",
    "::",
    "_",
    "-",
    "@",
    "#",
    "$",
    "%",
    "^",
    "&",
    "|",
    "~",
    "`",
    "\\",
    "/",
    "+",
    "*",
    "’",
    "“",
    "”",
    "—",
    "…",
    "\u{2028}",
    "\u{a0}",
    "\u{3000}",
    "\u{200b}",
    "\u{2060}",
    "\u{206f}",
    "\u{2070}",
    "你",
    "好",
    "世界",
    "。",
    "，",
    "、",
    "「",
    "」",
    "！",
    "ｆｕｌｌ",
    "ﾊﾝｶｸ",
    "\u{ffef}",
    "\u{fff0}",
    "カ",
    "タカナ",
    "ひらがな",
    "한국어",
    "가",
    "\u{d7af}",
    "\u{d7b0}",
    "\u{2e80}",
    "\u{2e7f}",
    "\u{4000}",
    "\u{9fff}",
    "\u{a000}",
    "\u{abff}",
    "𠀀",
    "𪚥",
    "\u{2fa1f}",
    "\u{2fa20}",
    "豈",
    "\u{faff}",
    "Привет",
    "мир",
    "Ωμέγα",
    "مرحبا",
    "שלום",
    "नमस्ते",
    "ไทย",
    "😀",
    "👍🏽",
    "👨‍👩‍👧",
    "🀄",
    "🧪",
    "♥",
    "€",
    "©",
    "™",
    "→",
    "∑",
    "\u{fffd}",
    "\u{feff}",
    "\u{7f}",
    "\u{0}",
    "\u{1}",
    "\u{85}",
    "\u{e000}",
    "\u{10ffff}",
    "\u{1f000}",
    "\u{1faff}",
    "\u{1fb00}",
    "\u{c0}",
    "\u{d7}",
    "\u{f7}",
    "\u{24f}",
    "\u{250}",
    "\u{1e00}",
    "\u{1eff}",
    "\u{1f00}",
    "\u{2ff}",
    "\u{370}",
];

/// A scalar value drawn from ranges the rule treats differently, ASCII most often.
fn random_char(rng: &mut Rng) -> char {
    let ranges: &[(u32, u32)] = &[
        (0x00, 0x7f),
        (0x20, 0x7e),
        (0x61, 0x7a),
        (0x80, 0x24f),
        (0x250, 0x36f),
        (0x370, 0x1fff),
        (0x1e00, 0x1eff),
        (0x2000, 0x206f),
        (0x2070, 0x2e7f),
        (0x2e80, 0x9fff),
        (0xa000, 0xabff),
        (0xac00, 0xd7af),
        (0xd7b0, 0xd7ff),
        (0xe000, 0xf8ff),
        (0xf900, 0xfaff),
        (0xfb00, 0xfffd),
        (0x1_0000, 0x1_efff),
        (0x1_f000, 0x1_faff),
        (0x1_fb00, 0x1_ffff),
        (0x2_0000, 0x2_fa1f),
        (0x2_fa20, 0x10_ffff),
    ];
    let (lo, hi) = ranges[rng.below(ranges.len())];
    let c = lo + rng.below((hi - lo + 1) as usize) as u32;
    char::from_u32(c).unwrap_or('\u{fffd}')
}

fn prose(rng: &mut Rng, bytes: usize) -> String {
    let mut out = String::new();
    while out.len() < bytes {
        let words = 1 + rng.below(20);
        for i in 0..words {
            let w = rng.pick(WORDS);
            if i == 0 {
                let mut cs = w.chars();
                out.extend(cs.next().map(|c| c.to_uppercase().next().unwrap_or(c)));
                out.push_str(cs.as_str());
            } else {
                out.push_str(if rng.chance(30) { "  " } else { " " });
                match rng.below(40) {
                    0 => out.push_str(&rng.below(1_000_000).to_string()),
                    1 => out.push_str(&w.to_uppercase()),
                    2 => out.push_str(rng.pick(OTHER_WORDS)),
                    3 => {
                        out.push('"');
                        out.push_str(w);
                        out.push('"');
                    }
                    _ => out.push_str(w),
                }
                if rng.chance(9) && i + 1 < words {
                    out.push_str(rng.pick(&[",", ";", ":", " —", "…"]));
                }
            }
        }
        out.push_str(rng.pick(&[". ", ". ", "! ", "? ", ".\n\n", ".\n", ".", "...", "?!\n"]));
    }
    out
}

fn code(rng: &mut Rng, bytes: usize) -> String {
    let mut out = String::new();
    let mut depth = 0usize;
    let indent = rng.pick(&["    ", "  ", "\t"]);
    let newline = if rng.chance(5) { "\r\n" } else { "\n" };
    while out.len() < bytes {
        let stmt = rng.pick(STATEMENTS);
        if stmt.starts_with('}') {
            depth = depth.saturating_sub(1);
        }
        out.push_str(&indent.repeat(depth));
        let magnitude = 1 << (4 * rng.below(8));
        let line = stmt
            .replace("{a}", rng.pick(IDENTS))
            .replace("{b}", rng.pick(IDENTS))
            .replace("{c}", rng.pick(IDENTS))
            .replace("{n}", &rng.below(magnitude).to_string());
        out.push_str(&line);
        out.push_str(newline);
        if stmt.ends_with('{') || stmt.ends_with(':') {
            depth = (depth + 1).min(8);
        }
    }
    out
}

fn json_value(rng: &mut Rng, depth: usize, out: &mut String, pretty: bool) {
    let pad = |out: &mut String, d: usize| {
        if pretty {
            out.push('\n');
            out.push_str(&"  ".repeat(d));
        }
    };
    match if depth > 4 {
        2 + rng.below(4)
    } else {
        rng.below(6)
    } {
        0 => {
            out.push('{');
            for i in 0..rng.below(5) {
                if i > 0 {
                    out.push(',');
                }
                pad(out, depth + 1);
                let _ = write!(out, "\"{}\":", rng.pick(IDENTS));
                if pretty {
                    out.push(' ');
                }
                json_value(rng, depth + 1, out, pretty);
            }
            pad(out, depth);
            out.push('}');
        }
        1 => {
            out.push('[');
            for i in 0..rng.below(5) {
                if i > 0 {
                    out.push_str(if pretty { ", " } else { "," });
                }
                json_value(rng, depth + 1, out, pretty);
            }
            out.push(']');
        }
        2 => {
            out.push('"');
            for _ in 0..rng.below(6) {
                out.push_str(rng.pick(WORDS));
                out.push(' ');
            }
            if rng.chance(4) {
                out.push_str(rng.pick(&["\\n", "\\\"", "\\u00e9", "\\t", "你好", "😀"]));
            }
            out.push('"');
        }
        3 => {
            let _ = write!(out, "{}", rng.below(1 << 40));
        }
        4 => {
            let _ = write!(
                out,
                "-{}.{}e-{}",
                rng.below(100),
                rng.below(1000),
                rng.below(9)
            );
        }
        _ => out.push_str(rng.pick(&["true", "false", "null"])),
    }
}

fn json(rng: &mut Rng, bytes: usize) -> String {
    let pretty = rng.chance(2);
    let mut out = String::new();
    while out.len() < bytes {
        json_value(rng, 0, &mut out, pretty);
        out.push('\n');
    }
    out
}

fn cjk(rng: &mut Rng, bytes: usize) -> String {
    let han: Vec<char> = HAN.chars().collect();
    let kana: Vec<char> = KANA_HANGUL.chars().collect();
    let mut out = String::new();
    while out.len() < bytes {
        for _ in 0..1 + rng.below(16) {
            out.push(if rng.chance(4) {
                kana[rng.below(kana.len())]
            } else {
                han[rng.below(han.len())]
            });
        }
        match rng.below(10) {
            0 => out.push_str(rng.pick(&["GPU", "KV", "Envoy", "2048", "vLLM", "128", " API "])),
            1 => out.push_str(rng.pick(EMOJI)),
            2 => out.push('\n'),
            _ => {}
        }
        out.push_str(rng.pick(CJK_PUNCT));
    }
    out
}

fn emoji(rng: &mut Rng, bytes: usize) -> String {
    let mut out = String::new();
    while out.len() < bytes {
        out.push_str(rng.pick(EMOJI));
        if rng.chance(3) {
            out.push_str(rng.pick(&[" ", "", "\n", "!", " ok ", "x"]));
        }
    }
    out
}

fn mixed(rng: &mut Rng, bytes: usize) -> String {
    let mut out = String::new();
    while out.len() < bytes {
        let n = 1 + rng.below(200);
        let part = match rng.below(6) {
            0 => prose(rng, n),
            1 => code(rng, n),
            2 => json(rng, n),
            3 => cjk(rng, n),
            4 => emoji(rng, n),
            _ => {
                let mut s = String::new();
                for _ in 0..1 + rng.below(8) {
                    s.push_str(rng.pick(OTHER_WORDS));
                    s.push_str(rng.pick(&[" ", ", ", ". ", "\n", "-"]));
                }
                s
            }
        };
        out.push_str(&part);
    }
    out
}

fn whitespace(rng: &mut Rng, bytes: usize) -> String {
    let mut out = String::new();
    while out.len() < bytes {
        out.push_str(rng.pick(WHITESPACE));
        if rng.chance(2) {
            out.push_str(rng.pick(&["a", "A", "1", ".", "é", "你", "x y", "--", "😀", ""]));
        }
    }
    out
}

fn digits(rng: &mut Rng, bytes: usize) -> String {
    let mut out = String::new();
    while out.len() < bytes {
        for _ in 0..1 + rng.below(12) {
            out.push(char::from(b'0' + rng.below(10) as u8));
        }
        out.push_str(rng.pick(&[" ", ",", ".", "", "\n", "a", "-", "  ", "x", "%", "٣", "²"]));
    }
    out
}

fn punctuation(rng: &mut Rng, bytes: usize) -> String {
    let mut out = String::new();
    while out.len() < bytes {
        let mark = rng.pick(MARKS);
        for _ in 0..1 + if rng.chance(3) { rng.below(40) } else { 0 } {
            out.push_str(if rng.chance(4) { rng.pick(MARKS) } else { mark });
        }
        if rng.chance(2) {
            out.push_str(rng.pick(&["a", "word", " ", "A", "1", "\n", "é", "_x", "你"]));
        }
    }
    out
}

fn code_points(rng: &mut Rng, bytes: usize) -> String {
    let mut out = String::new();
    while out.len() < bytes {
        out.push(random_char(rng));
    }
    out
}

/// Random bytes, biased towards lead and continuation bytes, made valid UTF-8 (invalid
/// sequences become U+FFFD).
fn random_bytes(rng: &mut Rng, bytes: usize) -> String {
    let raw: Vec<u8> = (0..bytes)
        .map(|_| match rng.below(4) {
            0 => 0x80 | rng.below(0x40) as u8,
            1 => 0xc0 | rng.below(0x40) as u8,
            _ => rng.below(256) as u8,
        })
        .collect();
    String::from_utf8_lossy(&raw).into_owned()
}

fn soup(rng: &mut Rng, bytes: usize) -> String {
    let mut out = String::new();
    while out.len() < bytes {
        out.push_str(rng.pick(PIECES));
    }
    out
}

type Generator = fn(&mut Rng, usize) -> String;

const KINDS: &[(&str, Generator)] = &[
    ("prose", prose),
    ("code", code),
    ("json", json),
    ("cjk", cjk),
    ("emoji", emoji),
    ("mixed", mixed),
    ("whitespace", whitespace),
    ("digits", digits),
    ("punctuation", punctuation),
    ("codepoints", code_points),
    ("bytes", random_bytes),
    ("soup", soup),
];

/// Cases per kind listed one a line, and the largest size drawn; a few more cases of each kind
/// are longer than the rule's sampling threshold (32 KB), so the sampled path is pinned too.
const CASES_PER_KIND: u64 = 60;
const MAX_BYTES: usize = 6000;
const LONG_CASES_PER_KIND: u64 = 3;
/// Further cases per kind, hashed rather than listed (one line for all of them).
const HASHED_PER_KIND: u64 = 1000;
const HASHED_MAX_BYTES: usize = 1500;
/// Short soups of edge-case pieces, hashed: thousands of neighbourhoods in one line.
const HASHED_SOUPS: u64 = 50_000;

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// The text cut at or before byte `n`, on a character boundary.
fn cut(text: &str, n: usize) -> &str {
    let mut n = n.min(text.len());
    while !text.is_char_boundary(n) {
        n -= 1;
    }
    &text[..n]
}

/// FNV-1a over counts' bits, for cases too many to list.
struct Hash(u64, usize);

impl Hash {
    fn new() -> Self {
        Hash(0xcbf2_9ce4_8422_2325, 0)
    }

    fn add(&mut self, text: &str) {
        for b in static_prompt_tokens(text).to_bits().to_le_bytes() {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        self.1 += 1;
    }

    fn line(&self, out: &mut String, name: &str) {
        let _ = writeln!(out, "{name} {} {:016x}", self.1, self.0);
    }
}

/// One line per case: its name, its length in bytes and the rule's count (Rust prints an f64 so
/// that it parses back to the same bits, so equal lines are equal counts).
fn line(out: &mut String, name: &str, text: &str) {
    let _ = writeln!(out, "{name} {} {}", text.len(), static_prompt_tokens(text));
}

fn sorted_paths(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("{dir:?}: {e}"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    paths.sort();
    Ok(paths)
}

/// Every case's count, in a fixed order.
fn counts() -> Result<String, String> {
    let mut out = String::new();
    for (k, (kind, generate)) in (0u64..).zip(KINDS) {
        for seed in 0..CASES_PER_KIND + LONG_CASES_PER_KIND {
            let mut rng = Rng(k << 32 | seed);
            let bytes = if seed < CASES_PER_KIND {
                // Short texts often: most prompts' texts are, and ends behave differently.
                let max = if seed % 3 == 0 { 64 } else { MAX_BYTES };
                rng.below(max + 1)
            } else {
                (32 << 10) + rng.below(256 << 10)
            };
            let text = generate(&mut rng, bytes);
            line(&mut out, &format!("{kind}/{seed}"), &text);
            // A prefix ends the text mid-run, where the rule looks past the end.
            let prefix = cut(&text, rng.below(text.len() + 1));
            line(&mut out, &format!("{kind}/{seed}/prefix"), prefix);
        }
        let mut hash = Hash::new();
        for seed in 0..HASHED_PER_KIND {
            let mut rng = Rng(k << 32 | 1 << 31 | seed);
            let bytes = rng.below(HASHED_MAX_BYTES + 1);
            hash.add(&generate(&mut rng, bytes));
        }
        hash.line(&mut out, &format!("{kind}/hashed"));
    }
    // The accuracy fixtures, whole, and in windows of several sizes (hashed).
    let root = fixtures_dir().join("estimator");
    for dir in sorted_paths(&root)?.into_iter().filter(|p| p.is_dir()) {
        for path in sorted_paths(&dir)? {
            let text = std::fs::read_to_string(&path).map_err(|e| format!("{path:?}: {e}"))?;
            let name = path
                .strip_prefix(&root)
                .map_err(|e| e.to_string())?
                .to_string_lossy()
                .replace(' ', "_");
            line(&mut out, &name, &text);
            let mut hash = Hash::new();
            for window in [97, 500, 3000] {
                let mut at = 0;
                while at < text.len() {
                    let rest = &text[at..];
                    let piece = match cut(rest, window) {
                        "" => cut(rest, window + 4),
                        piece => piece,
                    };
                    hash.add(piece);
                    at += piece.len().max(1);
                    while !text.is_char_boundary(at) {
                        at += 1;
                    }
                }
            }
            hash.line(&mut out, &format!("{name}/windows"));
        }
    }
    let mut hash = Hash::new();
    for seed in 0..HASHED_SOUPS {
        let mut rng = Rng(0x50_0000_0000 | seed);
        let n = rng.below(48);
        hash.add(&soup(&mut rng, n));
    }
    hash.line(&mut out, "soups");
    Ok(out)
}

#[test]
fn static_rule_counts_match_the_recorded_counts() {
    let path = fixtures_dir().join("estimator_counts.txt");
    let now = counts().expect("corpus");
    if std::env::var_os("ESTIMATOR_COUNTS_RECORD").is_some() {
        std::fs::write(&path, &now).expect("recording the counts");
        return;
    }
    let recorded = std::fs::read_to_string(&path).expect("tests/fixtures/estimator_counts.txt");
    let (mut cases, mut differ) = (0, Vec::new());
    for (a, b) in recorded.lines().zip(now.lines()) {
        cases += 1;
        if a != b {
            differ.push(format!("  recorded {a}\n  now      {b}"));
        }
    }
    assert_eq!(
        recorded.lines().count(),
        now.lines().count(),
        "the corpus changed shape: regenerate only for a deliberate change to the rule"
    );
    assert!(
        differ.is_empty(),
        "{} of {cases} counts differ, e.g.:\n{}",
        differ.len(),
        differ[..differ.len().min(10)].join("\n")
    );
}
