//! A 4-ary min-heap of fair-queue entries.
//!
//! Why not `std::collections::BinaryHeap`: at 10,000 active leaves the scheduler's cost is
//! cache misses in heap sifts. A 4-ary heap halves the depth (log4 n), and the four children
//! of a node are 64 contiguous bytes, so each level costs about one cache line; the served
//! client, whose key just grew, usually sinks to the bottom, which is where a shallower heap
//! saves the most. Entries compare by `(key, seq)`.

/// One queued client: ordered by smallest key, then by smallest sequence number (so equal keys
/// are served in the order they were queued). 16 bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) key: u64,
    pub(crate) seq: u32,
    pub(crate) id: u32,
}

impl Entry {
    #[inline]
    fn before(&self, other: &Entry) -> bool {
        self.key < other.key || (self.key == other.key && self.seq < other.seq)
    }
}

const ARITY: usize = 4;

#[derive(Debug, Default)]
pub(crate) struct QuadHeap {
    v: Vec<Entry>,
}

impl QuadHeap {
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.v.len()
    }

    #[inline]
    pub(crate) fn peek(&self) -> Option<&Entry> {
        self.v.first()
    }

    pub(crate) fn push(&mut self, e: Entry) {
        self.v.push(e);
        self.sift_up(self.v.len() - 1);
    }

    pub(crate) fn pop(&mut self) -> Option<Entry> {
        let last = self.v.pop()?;
        if self.v.is_empty() {
            return Some(last);
        }
        let top = std::mem::replace(&mut self.v[0], last);
        self.sift_down_to_bottom();
        Some(top)
    }

    /// Replaces the top entry (which must exist) and restores the heap order.
    #[inline]
    pub(crate) fn replace_top(&mut self, e: Entry) {
        self.v[0] = e;
        self.sift_down_to_bottom();
    }

    /// Floyd's trick for an entry at the root that most likely belongs near the bottom (the
    /// client just served, whose key grew; or the last leaf moved up by `pop`): move the hole
    /// down along the smallest children without comparing against the entry, then sift the
    /// entry up from the bottom (usually zero or one step).
    #[inline]
    fn sift_down_to_bottom(&mut self) {
        let v = &mut self.v[..];
        let n = v.len();
        let e = v[0];
        let mut i = 0;
        loop {
            let first = ARITY * i + 1;
            if first >= n {
                break;
            }
            let end = (first + ARITY).min(n);
            let kids = &v[first..end];
            let mut best = 0;
            let mut best_e = kids[0];
            for (c, k) in kids.iter().enumerate().skip(1) {
                if k.before(&best_e) {
                    best = c;
                    best_e = *k;
                }
            }
            v[i] = best_e;
            i = first + best;
        }
        v[i] = e;
        self.sift_up(i);
    }

    /// Keeps only the entries for which `keep` is true.
    pub(crate) fn retain(&mut self, keep: impl FnMut(&Entry) -> bool) {
        self.v.retain(keep);
        // Floyd's heapify, bottom-up from the last parent.
        if self.v.len() > 1 {
            let last_parent = (self.v.len() - 2) / ARITY;
            for i in (0..=last_parent).rev() {
                self.sift_down(i);
            }
        }
    }

    #[inline]
    fn sift_up(&mut self, mut i: usize) {
        let v = &mut self.v[..];
        let e = v[i];
        while i > 0 {
            let parent = (i - 1) / ARITY;
            let p = v[parent];
            if !e.before(&p) {
                break;
            }
            v[i] = p;
            i = parent;
        }
        v[i] = e;
    }

    #[inline]
    fn sift_down(&mut self, mut i: usize) {
        let v = &mut self.v[..];
        let n = v.len();
        let e = v[i];
        loop {
            let first = ARITY * i + 1;
            if first >= n {
                break;
            }
            let end = (first + ARITY).min(n);
            let kids = &v[first..end];
            let mut best = 0;
            let mut best_e = kids[0];
            for (c, k) in kids.iter().enumerate().skip(1) {
                if k.before(&best_e) {
                    best = c;
                    best_e = *k;
                }
            }
            if !best_e.before(&e) {
                break;
            }
            v[i] = best_e;
            i = first + best;
        }
        v[i] = e;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn pops_in_order(keys in proptest::collection::vec((0u64..50, any::<u32>()), 0..200), drop_odd in any::<bool>()) {
            let mut h = QuadHeap::default();
            for (i, (k, s)) in keys.iter().enumerate() {
                h.push(Entry { key: *k, seq: *s, id: i as u32 });
            }
            if drop_odd {
                h.retain(|e| e.id % 2 == 0);
            }
            let mut expect: Vec<(u64, u32)> = keys
                .iter()
                .enumerate()
                .filter(|(i, _)| !drop_odd || i % 2 == 0)
                .map(|(_, &(k, s))| (k, s))
                .collect();
            expect.sort();
            let mut got = Vec::new();
            if let Some(&top) = h.peek() {
                // Replacing the top with itself changes nothing.
                h.replace_top(top);
            }
            while let Some(e) = h.pop() {
                got.push((e.key, e.seq));
            }
            prop_assert_eq!(got, expect);
        }
    }
}
