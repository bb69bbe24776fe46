//! The pool: who the pods are. The configured pods plus those the elected scraper discovers from
//! Envoy's admin `/clusters` (`pods::scrape`), kept in one shared record, `kvgate.pods`, that only
//! the lease holder writes. Each VM's router reads it at most once a second.

use crate::store::codec::{Reader, Writer};

/// Discovered pods, written by the elected scraper: `kvgate.pods`.
pub const PODS_KEY: &str = "kvgate.pods";

pub fn encode_pods(pods: &[String]) -> Vec<u8> {
    let mut w = Writer::new();
    w.u32(pods.len() as u32);
    for p in pods {
        w.bytes(p.as_bytes());
    }
    w.0
}

pub fn decode_pods(bytes: &[u8]) -> Option<Vec<String>> {
    let mut r = Reader(bytes);
    r.list(4, |r| String::from_utf8(r.bytes()?.to_vec()).ok())
}
