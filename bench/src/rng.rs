//! A small seeded PRNG (SplitMix64): workloads must be reproducible from a seed, and the
//! benchmark needs nothing stronger than this.

#[derive(Debug, Clone)]
pub struct Rng {
    state: u64,
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng {
            state: seed ^ 0x9E37_79B9_7F4A_7C15,
        }
    }

    /// An independent stream derived from a seed and a label, so one part of a workload (a
    /// group's system prompt, a session's turns) does not shift when another part changes.
    pub fn derive(seed: u64, label: &[u64]) -> Self {
        let mut r = Rng::new(seed);
        for &l in label {
            r.state ^= l.wrapping_mul(0xD1B5_4A32_D192_ED03);
            r.next_u64();
        }
        r
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform integer in [lo, hi] (inclusive); `lo` when hi <= lo.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            return lo;
        }
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// Exponentially distributed with the given mean (inter-arrival times of a Poisson process).
    pub fn exp(&mut self, mean: f64) -> f64 {
        let u = 1.0 - self.f64(); // (0, 1]
        -u.ln() * mean
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u = 1.0 - self.f64(); // (0, 1]
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * self.f64()).cos()
    }

    /// Index drawn according to weights (which need not sum to 1).
    pub fn weighted(&mut self, weights: &[f64]) -> usize {
        let total: f64 = weights.iter().sum();
        let mut x = self.f64() * total;
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                return i;
            }
            x -= w;
        }
        weights.len().saturating_sub(1)
    }

    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_and_derived_streams_differ() {
        let a: Vec<u64> = (0..8).map(|_| Rng::new(7).next_u64()).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        let mut x = Rng::derive(7, &[1]);
        let mut y = Rng::derive(7, &[2]);
        assert_ne!(x.next_u64(), y.next_u64());
    }

    #[test]
    fn uniform_and_range_stay_in_bounds() {
        let mut r = Rng::new(1);
        for _ in 0..10_000 {
            let f = r.f64();
            assert!((0.0..1.0).contains(&f));
            let k = r.range(3, 9);
            assert!((3..=9).contains(&k));
        }
        assert_eq!(r.range(5, 5), 5);
    }

    #[test]
    fn weighted_follows_weights() {
        let mut r = Rng::new(3);
        let mut counts = [0usize; 3];
        for _ in 0..30_000 {
            counts[r.weighted(&[0.2, 0.5, 0.3])] += 1;
        }
        let f: Vec<f64> = counts.iter().map(|&c| c as f64 / 30_000.0).collect();
        assert!(
            (f[0] - 0.2).abs() < 0.02 && (f[1] - 0.5).abs() < 0.02 && (f[2] - 0.3).abs() < 0.02
        );
    }
}
