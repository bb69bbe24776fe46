//! Helpers shared by the fuzz targets: invariant checks on kvgate's shared records and the small
//! generators the state-machine targets use. Everything that touches a kvgate API that is still
//! moving (router placement, admission) lives in the targets themselves, next to its use.

use kvgate::admission::line::{self, QueueRecord};
use kvgate::pods::record::{self, PodRecord};
use kvgate::store::interface::Store;
use std::collections::HashSet;
use std::sync::OnceLock;

/// Whether a check for a known, reported bug is switched off, so a long run can look past it:
/// `KVGATE_FUZZ_SKIP=expired-entries,float-roundtrip` (names are listed in docs/fuzzing.md).
/// Every check is on by default.
pub fn skip(check: &str) -> bool {
    static SKIP: OnceLock<Vec<String>> = OnceLock::new();
    SKIP.get_or_init(|| {
        std::env::var("KVGATE_FUZZ_SKIP")
            .unwrap_or_default()
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect()
    })
    .iter()
    .any(|s| s == check)
}

/// The entries a pod record still holds at `now`: writers drop expired entries on every write,
/// so an expired entry is gone as far as kvgate's accounting goes.
pub fn live(rec: &PodRecord, now: u64) -> PodRecord {
    PodRecord {
        entries: rec
            .entries
            .iter()
            .filter(|e| e.expires_ms > now)
            .copied()
            .collect(),
        ..rec.clone()
    }
}

/// No count kvgate keeps (reserved tokens, active blocks) comes near this in a fuzz run: a value
/// above it is a u64 that wrapped below zero.
pub const SANE: u64 = 1_000_000_000_000;

/// Prompt block hashes over a small alphabet, chained like `prefix::block_hashes`, so that two
/// requests share their first k hashes exactly when they share their first k symbols. `path`
/// holds 16 two-bit symbols; `len` blocks are taken (at most 16, so prefixes collide often).
pub fn chain_hashes(path: u32, len: u8) -> Vec<u64> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    (0..usize::from(len % 17))
        .map(|i| {
            let sym = (path >> (2 * (i % 16))) & 3;
            h = (h ^ u64::from(sym + 1)).wrapping_mul(0x0000_0100_0000_01b3);
            h
        })
        .collect()
}

/// Reads a pod's record and checks what must hold at every moment: no count wrapped below zero,
/// no request has two entries. Returns the record for further checks.
pub fn checked_pod(store: &dyn Store, pod: &str) -> PodRecord {
    let rec = record::read(store, pod).expect("the fake host never fails a get");
    let held = rec.held_tokens();
    let blocks: u64 = rec
        .entries
        .iter()
        .map(|e| u64::from(e.prompt_blocks) + u64::from(e.output_blocks))
        .sum();
    assert!(held < SANE, "{pod}: held tokens wrapped: {held} ({rec:?})");
    assert!(blocks < SANE, "{pod}: blocks wrapped: {blocks} ({rec:?})");
    let mut ids = HashSet::new();
    for e in &rec.entries {
        assert!(
            ids.insert(e.id),
            "{pod}: request {} has two entries: {rec:?}",
            e.id
        );
        assert!(e.held_tokens < SANE, "{pod}: entry tokens wrapped: {e:?}");
    }
    if let Some(s) = rec.snapshot {
        assert!(
            s.running.is_finite() && s.running >= 0.0,
            "{pod}: running {s:?}"
        );
        assert!(
            s.waiting.is_finite() && s.waiting >= 0.0,
            "{pod}: waiting {s:?}"
        );
    }
    rec
}

/// `line::ABANDONED_MS` (private): a ticket this long past its deadline is dropped on the next
/// write of the line.
pub const ABANDONED_MS: u64 = 5_000;

/// The tickets the line still holds at `now` (abandoned ones are dropped on every write).
pub fn live_line(q: &QueueRecord, now: u64) -> QueueRecord {
    QueueRecord {
        tickets: q
            .tickets
            .iter()
            .filter(|t| t.deadline_ms.saturating_add(ABANDONED_MS) > now)
            .copied()
            .collect(),
        ..q.clone()
    }
}

/// Reads the shared line and checks its own invariants: unique tickets, kept in `line::order`,
/// finite tags.
pub fn checked_queue(store: &dyn Store) -> QueueRecord {
    let q = line::read(store).expect("the fake host never fails a get");
    let mut ids = HashSet::new();
    for t in &q.tickets {
        assert!(
            ids.insert(t.id),
            "ticket {} is in the line twice: {q:?}",
            t.id
        );
        assert!(
            t.start_tag.is_finite(),
            "ticket with a non-finite tag: {t:?}"
        );
    }
    // One drain a set of pods, and only while it measures something: a ticket waiting for its
    // pods since its first admission, or an appointment still to come.
    let mut reaches = HashSet::new();
    for d in &q.drains {
        assert!(reaches.insert(d.reach), "two drains of one set: {q:?}");
        assert!(
            d.from_ms > 0 || (d.drained == 0 && d.appointed_ms > 0),
            "a drain kept for nothing: {d:?}"
        );
    }
    for w in q.tickets.windows(2) {
        assert!(
            line::order(&w[0], &w[1]) != std::cmp::Ordering::Greater,
            "line out of order: {:?} before {:?}",
            w[0],
            w[1]
        );
    }
    // A ticket heads a line of its own exactly when no ticket ahead of it may take a pod it may
    // take; otherwise it waits behind heads ahead of it, each heading a line of its own, at
    // least one of them sharing a pod with it through its group.
    let heads: Vec<Vec<usize>> = (0..q.tickets.len()).map(|i| q.heads_of(i)).collect();
    for (i, (hs, t)) in heads.iter().zip(&q.tickets).enumerate() {
        let alone = q.tickets[..i].iter().all(|a| a.reach & t.reach == 0);
        assert_eq!(hs[..] == [i], alone, "ticket {i} of {q:?}: heads {heads:?}");
        assert!(
            !hs.is_empty() && hs.windows(2).all(|w| w[0] < w[1]),
            "heads {heads:?}"
        );
        for &h in hs {
            assert!(h <= i && heads[h][..] == [h], "ticket {i}: heads {heads:?}");
        }
    }
    // A ticket heads the line on the pods of its that no ticket ahead of it may take, when there
    // are any: every ticket heading a line of its own, on all its pods.
    let leaders = q.leaders();
    let mut ahead = 0u64;
    for (i, t) in q.tickets.iter().enumerate() {
        let free = t.reach & !ahead;
        let listed = leaders.iter().find(|(l, _)| l.id == t.id).map(|(_, f)| *f);
        assert_eq!(listed, (free != 0).then_some(free), "ticket {i} of {q:?}");
        if heads[i][..] == [i] {
            assert_eq!(free, t.reach, "ticket {i} heads a line of its own: {q:?}");
        }
        ahead |= t.reach;
    }
    assert!(
        q.virtual_time.is_finite(),
        "virtual time {}",
        q.virtual_time
    );
    for (t, f) in &q.tenants {
        assert!(f.is_finite(), "tenant {t} finish tag {f}");
    }
    q
}

/// The byte targets' common layout: a mode byte, a cut count k (its low four bits), k
/// little-endian u16 cut points, then the body. Returns (mode, the count byte, the cut points,
/// the body); `None` when the input is too short for its own count.
pub fn cut_input(data: &[u8]) -> Option<(u8, u8, Vec<u16>, &[u8])> {
    let (&mode, rest) = data.split_first()?;
    let (&count, rest) = rest.split_first()?;
    let k = usize::from(count % 16);
    let points = rest.get(..2 * k)?;
    let cuts = points
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect();
    Some((mode, count, cuts, &rest[2 * k..]))
}

/// Cuts `len` bytes at the given points (taken modulo `len + 1`, sorted, duplicates kept so that
/// empty pieces are fed too).
pub fn pieces(len: usize, cuts: &[u16]) -> Vec<(usize, usize)> {
    let mut points: Vec<usize> = cuts.iter().map(|&c| usize::from(c) % (len + 1)).collect();
    points.sort_unstable();
    let mut out = Vec::with_capacity(points.len() + 1);
    let mut start = 0;
    for p in points {
        out.push((start, p));
        start = p;
    }
    out.push((start, len));
    out
}
