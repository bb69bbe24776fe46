//! A small little-endian binary codec for records kept in shared data. Records on the request
//! path are read by every worker for every request, so they are packed by hand rather than as
//! JSON; a record that fails to decode is treated as absent, never trusted in part.

pub struct Writer(pub Vec<u8>);

impl Writer {
    pub fn new() -> Self {
        Writer(Vec::with_capacity(64))
    }

    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }

    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn f64(&mut self, v: f64) -> &mut Self {
        self.u64(v.to_bits())
    }

    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.u32(v.len() as u32);
        self.0.extend_from_slice(v);
        self
    }
}

impl Default for Writer {
    fn default() -> Self {
        Self::new()
    }
}

/// Packs a fixed-size part of a record (a record's repeated entries) into an array, then into
/// the record with one copy: `Writer` checks the vector's room at every field, and a pod record
/// of hundreds of entries is written twice a request. A field past `N` is dropped, which the
/// record's own tests would show (its size is a constant, `N` its sum).
pub struct Packer<const N: usize> {
    buf: [u8; N],
    at: usize,
}

impl<const N: usize> Packer<N> {
    pub fn new() -> Self {
        Packer { buf: [0; N], at: 0 }
    }

    fn put(&mut self, v: &[u8]) -> &mut Self {
        if let Some(dst) = self.buf.get_mut(self.at..self.at + v.len()) {
            dst.copy_from_slice(v);
        }
        self.at += v.len();
        self
    }

    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.put(&[v])
    }

    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.put(&v.to_le_bytes())
    }

    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.put(&v.to_le_bytes())
    }

    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.put(&v.to_le_bytes())
    }

    pub fn bytes_raw(&mut self, v: &[u8]) -> &mut Self {
        self.put(v)
    }

    /// The packed bytes, all `N` of them.
    pub fn packed(&self) -> &[u8; N] {
        &self.buf
    }
}

impl<const N: usize> Default for Packer<N> {
    fn default() -> Self {
        Self::new()
    }
}

pub struct Reader<'a>(pub &'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    pub fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }

    /// The next `N` bytes as an array: a fixed-size part read field by field from a reader over
    /// it, whose bounds the compiler then knows.
    pub fn array<const N: usize>(&mut self) -> Option<&'a [u8; N]> {
        self.take(N)?.try_into().ok()
    }

    pub fn u16(&mut self) -> Option<u16> {
        self.take(2)?.try_into().ok().map(u16::from_le_bytes)
    }

    pub fn u32(&mut self) -> Option<u32> {
        self.take(4)?.try_into().ok().map(u32::from_le_bytes)
    }

    pub fn u64(&mut self) -> Option<u64> {
        self.take(8)?.try_into().ok().map(u64::from_le_bytes)
    }

    pub fn f64(&mut self) -> Option<f64> {
        self.u64().map(f64::from_bits)
    }

    pub fn bytes(&mut self) -> Option<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }

    /// A count that must fit in what is left, each element at least `min_size` bytes: a corrupt
    /// length can never make a decoder allocate more than the record holds.
    pub fn count(&mut self, min_size: usize) -> Option<usize> {
        let n = self.u32()? as usize;
        (n.saturating_mul(min_size.max(1)) <= self.0.len()).then_some(n)
    }

    /// A [`count`](Self::count) of elements, each read by `item`, in a vector sized once: a
    /// list collected through `Option` grows by doublings (a tenth of a replayed pick's
    /// instructions went to regrowing its hashes).
    pub fn list<T>(
        &mut self,
        min_size: usize,
        mut item: impl FnMut(&mut Self) -> Option<T>,
    ) -> Option<Vec<T>> {
        let n = self.count(min_size)?;
        let mut items = Vec::with_capacity(n);
        for _ in 0..n {
            items.push(item(self)?);
        }
        Some(items)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    #[test]
    fn round_trip_and_truncation() {
        let mut w = Writer::new();
        w.u8(7).u32(9).u64(u64::MAX).f64(0.5).bytes(b"abc");
        let mut r = Reader(&w.0);
        assert_eq!(r.u8(), Some(7));
        assert_eq!(r.u32(), Some(9));
        assert_eq!(r.u64(), Some(u64::MAX));
        assert_eq!(r.f64(), Some(0.5));
        assert_eq!(r.bytes(), Some(&b"abc"[..]));
        assert!(r.is_empty());
        assert_eq!(Reader(&w.0[..3]).u32(), None);
        let mut w = Writer::new();
        w.u32(1_000_000);
        assert_eq!(Reader(&w.0).count(8), None);
    }

    #[test]
    fn a_list_is_read_whole_sized_once_or_not_at_all() {
        let mut w = Writer::new();
        w.u32(3).u64(1).u64(2).u64(3).u8(9);
        let mut r = Reader(&w.0);
        let list = r.list(8, Reader::u64).unwrap();
        assert_eq!((list.as_slice(), list.capacity()), (&[1, 2, 3][..], 3));
        assert_eq!(r.u8(), Some(9), "the reader stops after the list");
        assert_eq!(
            Reader(&w.0[..20]).list(8, Reader::u64),
            None,
            "a count past the bytes left"
        );
        let odd = |r: &mut Reader| r.u64().filter(|v| v % 2 == 1);
        assert_eq!(
            Reader(&w.0).list(8, odd),
            None,
            "an element that does not read"
        );
    }

    #[test]
    fn a_packed_part_is_the_writers_bytes_and_reads_back_whole() {
        let mut p = Packer::<16>::new();
        p.u8(7).u32(9).bytes_raw(b"ab").u64(u64::MAX).u8(1);
        let mut w = Writer::new();
        w.u8(7).u32(9);
        w.0.extend_from_slice(b"ab");
        w.u64(u64::MAX).u8(1);
        assert_eq!(&p.packed()[..], &w.0[..]);
        let mut r = Reader(&w.0);
        let mut part = Reader(r.array::<16>().unwrap());
        assert_eq!((part.u8(), part.u32()), (Some(7), Some(9)));
        assert!(r.is_empty());
        assert_eq!(Reader(&w.0[..15]).array::<16>(), None);
    }
}
