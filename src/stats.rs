//! What kvgate counts, as the core reports it: named counters and gauges buffered in the VM and
//! flushed to Envoy's stats by the shell (they appear under the `wasmcustom.` prefix in Envoy's
//! admin `/stats`). Names are bounded: fixed ones plus one set per pod.

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stat {
    Counter(String, u64),
    Gauge(String, u64),
    Histogram(String, u64),
}

/// Envoy stat names use dots as separators; a pod's `ip:port` becomes `ip_port` with dots kept
/// out, so it stays one segment.
pub fn pod_segment(pod: &str) -> String {
    pod.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

#[derive(Debug, Default)]
pub struct Stats {
    pending: Vec<Stat>,
}

impl Stats {
    pub fn count(&mut self, name: impl Into<String>, by: u64) {
        if by > 0 {
            self.pending.push(Stat::Counter(name.into(), by));
        }
    }

    pub fn gauge(&mut self, name: impl Into<String>, value: u64) {
        self.pending.push(Stat::Gauge(name.into(), value));
    }

    pub fn histogram(&mut self, name: impl Into<String>, value: u64) {
        self.pending.push(Stat::Histogram(name.into(), value));
    }

    pub fn drain(&mut self) -> std::vec::Drain<'_, Stat> {
        self.pending.drain(..)
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    #[test]
    fn pod_names_become_one_segment_and_zero_counts_are_dropped() {
        assert_eq!(pod_segment("10.0.0.1:8000"), "10_0_0_1_8000");
        let mut s = Stats::default();
        s.count("a", 0);
        s.count("b", 2);
        s.gauge("g", 0);
        let out: Vec<Stat> = s.drain().collect();
        assert_eq!(
            out,
            vec![Stat::Counter("b".into(), 2), Stat::Gauge("g".into(), 0)]
        );
    }
}
