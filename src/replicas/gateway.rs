//! etcd v3's HTTP/JSON gateway, both ways: the request bodies kvgate sends (lease grant and
//! keep-alive, a range read, a txn) and the answers it reads. Pure text; the shell only sends.
//!
//! The gateway's quirks, each handled here: keys and values travel in base64; 64-bit numbers
//! (revisions, lease ids, TTLs) come back as JSON strings; fields at their zero value are left out
//! (a failed txn has no `"succeeded"`, an expired lease's keep-alive no `"TTL"`); the keep-alive
//! endpoint is a stream that answers one renewal per POST, wrapped in `"result"`.

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use serde::Deserialize;
use serde_json::{json, Value};

pub const LEASE_GRANT: &str = "/v3/lease/grant";
pub const LEASE_KEEPALIVE: &str = "/v3/lease/keepalive";
pub const RANGE: &str = "/v3/kv/range";
pub const TXN: &str = "/v3/kv/txn";
pub const COMPACTION: &str = "/v3/kv/compaction";

fn b64(bytes: &[u8]) -> String {
    STANDARD.encode(bytes)
}

/// A 64-bit number as the gateway writes it: a string, or (from older gateways) a number.
fn number(v: Option<&Value>) -> Option<i64> {
    match v? {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_i64(),
        _ => None,
    }
}

pub fn lease_grant(ttl_seconds: u32) -> Vec<u8> {
    json!({ "TTL": ttl_seconds }).to_string().into_bytes()
}

pub fn lease_keepalive(lease: i64) -> Vec<u8> {
    json!({ "ID": lease.to_string() }).to_string().into_bytes()
}

/// Every key starting with `prefix`: etcd's range end is the prefix with its last byte raised.
pub fn range_prefix(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    if let Some(last) = end.last_mut() {
        *last = last.saturating_add(1);
    }
    json!({ "key": b64(prefix.as_bytes()), "range_end": b64(&end) })
        .to_string()
        .into_bytes()
}

/// Drops the history of every key before `revision` (current values stay).
pub fn compaction(revision: i64) -> Vec<u8> {
    json!({ "revision": revision.to_string() })
        .to_string()
        .into_bytes()
}

/// The new lease's id, or `None` when the answer is not a grant.
pub fn parse_lease_grant(body: &[u8]) -> Option<i64> {
    let v: Value = serde_json::from_slice(body).ok()?;
    number(v.get("ID")).filter(|&id| id != 0 && number(v.get("TTL")).unwrap_or(0) > 0)
}

/// The keep-alive's answer: `Some(true)` renewed, `Some(false)` the lease is gone (expired, or
/// etcd lost it), `None` not an answer at all.
pub fn parse_keepalive(body: &[u8]) -> Option<bool> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let result = v.get("result")?;
    Some(number(result.get("TTL")).unwrap_or(0) > 0)
}

/// One key as a range read returns it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Kv {
    pub key: String,
    pub value: Vec<u8>,
    pub mod_revision: i64,
}

#[derive(Deserialize)]
struct RawKv {
    key: String,
    #[serde(default)]
    value: String,
    #[serde(default)]
    mod_revision: Value,
}

#[derive(Deserialize)]
struct RawRange {
    #[serde(default)]
    header: Option<Value>,
    #[serde(default)]
    kvs: Vec<RawKv>,
}

/// What a range read returned: the store's revision when it was read, and the keys.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Range {
    pub revision: i64,
    pub kvs: Vec<Kv>,
}

/// A range read's answer; `None` when it is not a range response (an error object, a proxy's
/// page). Keys that are not UTF-8 or not base64 are left out: kvgate writes none.
pub fn parse_range(body: &[u8]) -> Option<Range> {
    let raw: RawRange = serde_json::from_slice(body).ok()?;
    let header = raw.header.as_ref()?;
    Some(Range {
        revision: number(header.get("revision")).unwrap_or(0),
        kvs: raw
            .kvs
            .into_iter()
            .filter_map(|kv| {
                Some(Kv {
                    key: String::from_utf8(STANDARD.decode(kv.key).ok()?).ok()?,
                    value: STANDARD.decode(kv.value).ok()?,
                    mod_revision: number(Some(&kv.mod_revision)).unwrap_or(0),
                })
            })
            .collect(),
    })
}

/// A txn's condition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Compare {
    /// The key's last modification is `revision` (0: the key does not exist).
    ModRevision(String, i64),
}

/// A txn's operation, run when every condition holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Put {
        key: String,
        value: Vec<u8>,
        lease: Option<i64>,
    },
    Delete(String),
}

pub fn txn(compares: &[Compare], ops: &[Op]) -> Vec<u8> {
    let compare: Vec<Value> = compares
        .iter()
        .map(|c| match c {
            Compare::ModRevision(key, rev) => json!({
                "key": b64(key.as_bytes()),
                "target": "MOD",
                "result": "EQUAL",
                "mod_revision": rev.to_string(),
            }),
        })
        .collect();
    let success: Vec<Value> = ops
        .iter()
        .map(|op| match op {
            Op::Put { key, value, lease } => {
                let mut put = json!({ "key": b64(key.as_bytes()), "value": b64(value) });
                if let Some(lease) = lease {
                    put["lease"] = Value::String(lease.to_string());
                }
                json!({ "request_put": put })
            }
            Op::Delete(key) => json!({ "request_delete_range": { "key": b64(key.as_bytes()) } }),
        })
        .collect();
    json!({ "compare": compare, "success": success })
        .to_string()
        .into_bytes()
}

/// A txn's outcome: `Some(true)` applied, `Some(false)` a condition failed (nothing applied),
/// `None` not a txn answer (an error: nothing is known to be applied).
pub fn parse_txn(body: &[u8]) -> Option<bool> {
    let v: Value = serde_json::from_slice(body).ok()?;
    v.get("header")?;
    Some(v.get("succeeded").and_then(Value::as_bool).unwrap_or(false))
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    #[test]
    fn requests_are_the_gateways_json() {
        let r: Value = serde_json::from_slice(&range_prefix("/kvgate/")).unwrap();
        assert_eq!(r["key"], b64(b"/kvgate/"));
        assert_eq!(r["range_end"], b64(b"/kvgate0"));
        let k: Value = serde_json::from_slice(&lease_keepalive(7_587_882_716_187_386_901)).unwrap();
        assert_eq!(k["ID"], "7587882716187386901", "64-bit ids as strings");
        let c: Value = serde_json::from_slice(&compaction(12_345)).unwrap();
        assert_eq!(c["revision"], "12345");
        let t: Value = serde_json::from_slice(&txn(
            &[Compare::ModRevision("/g".into(), 0)],
            &[
                Op::Put {
                    key: "/a".into(),
                    value: b"{}".to_vec(),
                    lease: Some(5),
                },
                Op::Delete("/b".into()),
            ],
        ))
        .unwrap();
        assert_eq!(t["compare"][0]["target"], "MOD");
        assert_eq!(t["compare"][0]["mod_revision"], "0");
        assert_eq!(t["success"][0]["request_put"]["lease"], "5");
        assert_eq!(t["success"][0]["request_put"]["value"], b64(b"{}"));
        assert_eq!(t["success"][1]["request_delete_range"]["key"], b64(b"/b"));
    }

    #[test]
    fn answers_with_their_quirks() {
        assert_eq!(
            parse_lease_grant(br#"{"header":{},"ID":"7587882716187386901","TTL":"10"}"#),
            Some(7_587_882_716_187_386_901)
        );
        assert_eq!(
            parse_lease_grant(br#"{"error":"etcdserver: too many requests"}"#),
            None
        );
        assert_eq!(
            parse_keepalive(br#"{"result":{"header":{},"ID":"5","TTL":"10"}}"#),
            Some(true)
        );
        assert_eq!(
            parse_keepalive(br#"{"result":{"header":{},"ID":"5"}}"#),
            Some(false),
            "an expired lease's renewal carries no TTL"
        );
        assert_eq!(parse_keepalive(br#"{"error":{"grpc_code":14}}"#), None);
        let body = format!(
            r#"{{"header":{{"revision":"9"}},"kvs":[{{"key":"{}","value":"{}","mod_revision":"8"}},{{"key":"{}","mod_revision":"3"}}],"count":"2"}}"#,
            b64(b"/kvgate/a"),
            b64(b"x"),
            b64(b"/kvgate/b")
        );
        let range = parse_range(body.as_bytes()).unwrap();
        assert_eq!(range.revision, 9);
        assert_eq!(
            range.kvs,
            [
                Kv {
                    key: "/kvgate/a".into(),
                    value: b"x".to_vec(),
                    mod_revision: 8
                },
                Kv {
                    key: "/kvgate/b".into(),
                    value: Vec::new(),
                    mod_revision: 3
                }
            ]
        );
        assert_eq!(
            parse_range(br#"{"header":{"revision":"9"}}"#),
            Some(Range {
                revision: 9,
                kvs: vec![]
            }),
            "no keys"
        );
        assert_eq!(parse_range(br#"{"code":14,"message":"unavailable"}"#), None);
        assert_eq!(parse_txn(br#"{"header":{},"succeeded":true}"#), Some(true));
        assert_eq!(
            parse_txn(br#"{"header":{"revision":"4"}}"#),
            Some(false),
            "a failed txn omits succeeded"
        );
        assert_eq!(parse_txn(b"upstream connect error"), None);
    }
}
