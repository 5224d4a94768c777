//! The heap of ready fair-queue clients: std's binary heap of 16-byte entries.
//!
//! A 4-ary heap (shallower, one cache line per level) was tried and measured slower than std's
//! binary heap on the 10,000-leaf benchmark (`omnistage exp sched-cost`, same machine,
//! alternating runs), so this stays a thin wrapper: the policy only needs push, pop, peek,
//! replace-the-top and retain.

use std::collections::BinaryHeap;

/// One queued client: ordered by smallest key, then by smallest sequence number (so equal keys
/// are served in the order they were queued). 16 bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) key: u64,
    pub(crate) seq: u32,
    pub(crate) id: u32,
}

impl Ord for Entry {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        // Reversed: std's BinaryHeap is a max-heap and we want the smallest key first.
        (other.key, other.seq).cmp(&(self.key, self.seq))
    }
}
impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

#[derive(Debug, Default)]
pub(crate) struct TagHeap {
    v: BinaryHeap<Entry>,
}

impl TagHeap {
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.v.len()
    }
    #[inline]
    pub(crate) fn peek(&self) -> Option<&Entry> {
        self.v.peek()
    }
    #[inline]
    pub(crate) fn push(&mut self, e: Entry) {
        self.v.push(e);
    }
    #[inline]
    pub(crate) fn pop(&mut self) -> Option<Entry> {
        self.v.pop()
    }
    /// Replaces the top entry (which must exist) and restores the order (one sift-down
    /// instead of a pop and a push).
    #[inline]
    pub(crate) fn replace_top(&mut self, e: Entry) {
        *self.v.peek_mut().expect("top exists") = e;
    }
    pub(crate) fn retain(&mut self, keep: impl FnMut(&Entry) -> bool) {
        self.v.retain(keep);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn pops_in_order(keys in proptest::collection::vec((0u64..50, any::<u32>()), 0..200), drop_odd in any::<bool>()) {
            let mut h = TagHeap::default();
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
