//! The Prometheus text exposition format (0.0.4, and OpenMetrics' variant) as kvgate reads it:
//! bounded line by line, comments and `# EOF`, a cut-off last line, then one sample's name, labels,
//! value and the timestamp or exemplar after it. Escapes in label values are skipped over, never
//! decoded (see `label_set`).

use super::aggregate::Tally;
use super::figures::{LoraInfo, MetricsError, PodMetrics};
use super::series::{classify, Labels};

/// Lines longer than this are skipped unread: no series kvgate needs comes near it, while a line
/// of this size is either a label explosion or garbage.
pub const MAX_LINE_BYTES: usize = 64 * 1024;
/// A body with more lines than this is refused. A vLLM or SGLang pod exposes a few thousand.
pub const MAX_LINES: usize = 50_000;

/// [`parse`] for a raw HTTP body; a body that is not UTF-8 is refused as a whole.
pub fn parse_bytes(body: &[u8]) -> Result<PodMetrics, MetricsError> {
    core::str::from_utf8(body)
        .map_err(|_| MetricsError::InvalidUtf8)
        .and_then(parse)
}

/// Reads a `/metrics` body. Lines that do not parse are skipped; so is a last line without its
/// terminating `\n` (see the module notes on truncation).
pub fn parse(text: &str) -> Result<PodMetrics, MetricsError> {
    let mut tally = Tally::new();
    samples(text, |line| sample_line(&mut tally, line))?;
    tally.finish()
}

/// The adapter state in a vLLM `/metrics` body: of the `vllm:lora_requests_info` series, the one
/// set last (vLLM sets the current label set's gauge to the time; the label sets of earlier steps
/// stay exposed with older times). `None` when the pod exposes none (LoRA off, or not vLLM).
pub fn lora_info(body: &[u8]) -> Option<LoraInfo> {
    const NAME: &str = "vllm:lora_requests_info";
    let text = core::str::from_utf8(body).ok()?;
    let mut best: Option<(f64, LoraInfo)> = None;
    let read = samples(text, |line| {
        let Some(rest) = line.strip_prefix(NAME) else {
            return;
        };
        let mut labels = Labels::default();
        let Some(at) = sample_value(rest, &mut labels) else {
            return;
        };
        let info = LoraInfo {
            max_lora: labels.max_lora.and_then(|m| m.parse().ok()).unwrap_or(0),
            running: unescape(labels.running_lora_adapters.unwrap_or("")),
            waiting: unescape(labels.waiting_lora_adapters.unwrap_or("")),
        };
        if best.as_ref().is_none_or(|(t, _)| at > *t) {
            best = Some((at, info));
        }
    });
    read.ok().and(best).map(|(_, info)| info)
}

/// A label value with the exposition's escapes (`\\`, `\"`, `\n`) decoded.
fn unescape(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some(other) => out.push(other),
            None => {}
        }
    }
    out
}

/// Calls `sample` with each sample line of a body (comments, blank prefixes and a cut-off last
/// line left out), bounded as the module notes say.
fn samples(text: &str, mut sample: impl FnMut(&str)) -> Result<(), MetricsError> {
    let mut rest = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut lines = 0usize;
    while !rest.is_empty() {
        let (line, terminated) = match rest.split_once('\n') {
            Some((line, next)) => {
                rest = next;
                (line, true)
            }
            None => {
                let line = rest;
                rest = "";
                (line, false)
            }
        };
        lines += 1;
        if lines > MAX_LINES {
            return Err(MetricsError::TooManyLines);
        }
        if line.len() > MAX_LINE_BYTES {
            continue;
        }
        let line = line.strip_suffix('\r').unwrap_or(line);
        let line = line.trim_start_matches([' ', '\t']);
        if line.starts_with('#') {
            if line.trim_end_matches([' ', '\t']) == "# EOF" {
                break;
            }
            continue;
        }
        if !terminated {
            break;
        }
        sample(line);
    }
    Ok(())
}

/// One sample line into the tally: skipped unless `series` knows its name and its labels are
/// readable.
fn sample_line(tally: &mut Tally, line: &str) {
    // Almost every line is a histogram bucket or a Python runtime metric; reject those on
    // the name alone, before any label is looked at.
    if !(line.starts_with("vllm:") || line.starts_with("sglang:")) {
        return;
    }
    let name_len = line
        .bytes()
        .position(|b| !is_name_byte(b))
        .unwrap_or(line.len());
    let (Some(name), Some(rest)) = (line.get(..name_len), line.get(name_len..)) else {
        return;
    };
    let Some((engine, metric)) = classify(name) else {
        return;
    };
    let mut labels = Labels::default();
    let Some(value) = sample_value(rest, &mut labels) else {
        return;
    };
    if labels.priority.is_some_and(|p| !p.is_empty()) {
        return;
    }
    tally.apply(engine, metric, value, &labels);
}

fn is_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b':'
}

fn is_blank(b: u8) -> bool {
    b == b' ' || b == b'\t'
}

fn skip_blank(b: &[u8], mut i: usize) -> usize {
    while b.get(i).copied().is_some_and(is_blank) {
        i += 1;
    }
    i
}

/// Everything after the metric name: `[{labels}] value [timestamp] [# exemplar]`. Labels are
/// handed to `labels` as they are read; on `None` the caller drops them with the line.
fn sample_value<'a>(rest: &'a str, labels: &mut Labels<'a>) -> Option<f64> {
    let b = rest.as_bytes();
    // The name must end at a blank or a label set; otherwise `name-3` would read as `name -3`.
    let mut i = skip_blank(b, 0);
    if i == 0 && b.first() != Some(&b'{') {
        return None;
    }
    if b.get(i) == Some(&b'{') {
        i = label_set(rest, i + 1, labels)?;
    }
    let mut tokens = rest.get(i..)?.split([' ', '\t']).filter(|t| !t.is_empty());
    let value: f64 = tokens.next()?.parse().ok()?;
    // A timestamp is integer milliseconds in 0.0.4 and float seconds in OpenMetrics; either way
    // it must be a number. OpenMetrics may append an exemplar after `#`.
    let mut after_value = tokens.next();
    if let Some(ts) = after_value.filter(|t| !t.starts_with('#')) {
        if !ts.parse::<f64>().ok()?.is_finite() {
            return None;
        }
        after_value = tokens.next();
    }
    match after_value {
        None => Some(value),
        Some(t) if t.starts_with('#') => Some(value),
        Some(_) => None,
    }
}

/// Reads `name="value", ...}` from byte `i` of `s`, just past the `{`; returns the index just past
/// the `}`. Escapes are skipped over, not decoded: a backslash hides the next byte, which is all it
/// takes to find the closing quote.
fn label_set<'a>(s: &'a str, mut i: usize, labels: &mut Labels<'a>) -> Option<usize> {
    let b = s.as_bytes();
    loop {
        i = skip_blank(b, i);
        match *b.get(i)? {
            b'}' => return Some(i + 1),
            c if c.is_ascii_alphabetic() || c == b'_' => {}
            _ => return None,
        }
        let key_start = i;
        while b
            .get(i)
            .is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'_')
        {
            i += 1;
        }
        let key = s.get(key_start..i)?;
        i = skip_blank(b, i);
        if b.get(i) != Some(&b'=') {
            return None;
        }
        i = skip_blank(b, i + 1);
        if b.get(i) != Some(&b'"') {
            return None;
        }
        i += 1;
        let value_start = i;
        loop {
            match *b.get(i)? {
                b'"' => break,
                b'\\' => i += 2,
                _ => i += 1,
            }
        }
        labels.record(key, s.get(value_start..i)?);
        i = skip_blank(b, i + 1);
        match *b.get(i)? {
            b',' => i += 1,
            b'}' => return Some(i + 1),
            _ => return None,
        }
    }
}
