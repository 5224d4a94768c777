//! The heap of ready fair-queue clients: a 4-ary min-heap of 16-byte entries laid out so that
//! the four children of a node fill exactly one cache line.
//!
//! Why not std's binary heap: at 10,000 active leaves a decision's cost is its cache misses, and
//! a sift through a binary heap of 100 entries touches about six lines one after the other (each
//! load depends on the comparison before it). Here a level is one line, the tree is half as deep
//! (four levels for 100 entries), and the layout makes "the children of node `i`" a single line:
//! logical node `i` lives at physical slot `i + 3`, so its children `4i+1..=4i+4` are the four
//! slots of line `i + 1`, and the root is the last slot of line 0. (A 4-ary heap without the
//! alignment was tried earlier and measured slower than std's: its children straddled lines.)

/// One queued client: ordered by smallest key, then by smallest sequence number (so equal keys
/// are served in the order they were queued), then by id (which only matters if sequence
/// numbers wrapped). Packed into one `u128` (key in the high 64 bits, then seq, then id), so
/// that the order is one integer comparison: two instructions and no branch. 16 bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Entry(u128);

impl Entry {
    /// Fills the unused slots of the last line, so that a sift compares all four children
    /// without a branch on how many there are. It orders after every real entry (ids are
    /// client slots or, in a tree, node ids: below `NODES_MAX`, far below `u32::MAX`).
    const SENTINEL: Entry = Entry(u128::MAX);

    #[inline(always)]
    pub(crate) fn new(key: u64, seq: u32, id: u32) -> Entry {
        Entry(u128::from(key) << 64 | u128::from(seq) << 32 | u128::from(id))
    }
    #[inline(always)]
    pub(crate) fn key(self) -> u64 {
        (self.0 >> 64) as u64
    }
    #[inline(always)]
    pub(crate) fn seq(self) -> u32 {
        (self.0 >> 32) as u32
    }
    #[inline(always)]
    pub(crate) fn id(self) -> u32 {
        self.0 as u32
    }
    /// The same entry with another key.
    #[inline(always)]
    pub(crate) fn with_key(self, key: u64) -> Entry {
        Entry(u128::from(key) << 64 | (self.0 & u128::from(u64::MAX)))
    }
    /// `self` goes before `other` (a `u128` comparison compiles to flags and a conditional
    /// move, not to branches the predictor cannot guess: heap order is random).
    #[inline(always)]
    fn before(&self, other: &Entry) -> bool {
        self.0 < other.0
    }
}

/// Four entries, one cache line.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
struct Line([Entry; 4]);

impl Default for Line {
    fn default() -> Self {
        Line([Entry::SENTINEL; 4])
    }
}

/// Physical slots before logical node 0 (which is the last slot of line 0).
const OFFSET: usize = 3;

#[derive(Debug)]
pub(crate) struct TagHeap {
    lines: Vec<Line>,
    len: usize,
    /// A copy of the top entry (the sentinel when empty), refreshed after every change: a
    /// decision reads the top from here, beside the heap's other fields, instead of following
    /// the vector's pointer to line 0 (at thousands of clients, one dependent miss less on the
    /// decision's path; line 0 is then only written there, which does not stall).
    top: Entry,
}

impl Default for TagHeap {
    fn default() -> Self {
        TagHeap {
            lines: Vec::new(),
            len: 0,
            top: Entry::SENTINEL,
        }
    }
}

impl TagHeap {
    #[inline(always)]
    fn get(&self, i: usize) -> Entry {
        let p = i + OFFSET;
        self.lines[p / 4].0[p % 4]
    }
    #[inline(always)]
    fn set(&mut self, i: usize, e: Entry) {
        let p = i + OFFSET;
        self.lines[p / 4].0[p % 4] = e;
    }

    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }
    #[inline]
    pub(crate) fn peek(&self) -> Option<&Entry> {
        if self.len == 0 {
            return None;
        }
        Some(&self.top)
    }
    /// Copies the top entry into [`TagHeap::top`] (after every change of the heap).
    #[inline(always)]
    fn sync_top(&mut self) {
        self.top = self.lines.first().map_or(Entry::SENTINEL, |l| l.0[OFFSET]);
    }
    #[inline]
    pub(crate) fn push(&mut self, e: Entry) {
        let i = self.len;
        let line = (i + OFFSET) / 4;
        if line >= self.lines.len() {
            self.lines.push(Line::default());
        }
        self.len += 1;
        self.sift_up(i, e);
        self.sync_top();
    }
    #[inline]
    pub(crate) fn pop(&mut self) -> Option<Entry> {
        let top = *self.peek()?;
        self.len -= 1;
        let last = self.get(self.len);
        self.set(self.len, Entry::SENTINEL);
        if self.len > 0 {
            self.sift_down(0, last);
        }
        self.sync_top();
        Some(top)
    }
    /// Replaces the top entry (which must exist) and restores the order (one sift-down
    /// instead of a pop and a push).
    #[inline]
    pub(crate) fn replace_top(&mut self, e: Entry) {
        assert!(self.len > 0, "replace_top on an empty heap");
        self.sift_down(0, e);
        self.sync_top();
    }
    /// Keeps the entries for which `keep` is true (order rebuilt in O(n)).
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(&Entry) -> bool) {
        let mut n = 0;
        for i in 0..self.len {
            let e = self.get(i);
            if keep(&e) {
                self.set(n, e);
                n += 1;
            }
        }
        for i in n..self.len {
            self.set(i, Entry::SENTINEL);
        }
        self.len = n;
        self.lines.truncate((n + OFFSET).div_ceil(4).max(1));
        if n > 1 {
            // Floyd's heapify: sift down every parent, last first.
            for i in (0..=(n - 2) / 4).rev() {
                let e = self.get(i);
                self.sift_down(i, e);
            }
        }
        self.sync_top();
    }

    /// Hints the cache with the two levels below the top (lines 1 to 5) of a heap that has
    /// them: what a sift-down from the top reads first, one dependent line after the other.
    /// (Hinted from the tree's look-ahead, an event before the sift; hinting every level's
    /// grandchildren during the sift itself measured slower than nothing.)
    #[inline(always)]
    pub(crate) fn prefetch_below_top(&self) {
        if self.lines.len() >= 6 {
            let first = self.lines.as_ptr();
            for k in 1..6 {
                super::prefetch(first.wrapping_add(k));
            }
        }
    }

    /// Places `e` at `i` or above it.
    #[inline(always)]
    fn sift_up(&mut self, mut i: usize, e: Entry) {
        while i > 0 {
            let parent = (i - 1) / 4;
            let p = self.get(parent);
            if !e.before(&p) {
                break;
            }
            self.set(i, p);
            i = parent;
        }
        self.set(i, e);
    }

    /// Places `e` at `i` or below it (the slot at `i` is a hole).
    ///
    /// The hole is tracked as (line, slot), and the walk as the line of the hole's children:
    /// when child `best` of that line moves up, the hole becomes that very slot, so no level
    /// re-derives a position (a division and a bounds check per level before).
    ///
    /// No prefetch: hinting the four lines of grandchildren at each level (the previous
    /// version) measured slower here than none, alternating binaries in one session.
    #[inline(always)]
    fn sift_down(&mut self, i: usize, e: Entry) {
        let p = i + OFFSET;
        let (mut hole_line, mut hole_slot) = (p / 4, p % 4);
        // The line of the hole's children: logical node `i`'s are line `i + 1`. Only the line
        // is carried from level to level (child `best` of line `l` is logical node
        // `4 (l - 1) + 1 + best`, whose children are line `4 l - 2 + best`): one address
        // computation per level instead of the logical index and its line both (measured:
        // 1,063 → 1,049 instructions per event, `exp sched-cost --tree-only` at 10,000 leaves).
        let mut line = i + 1;
        // Every slot at or past `len` holds a sentinel, so a line of children that exists but
        // is past the end stops the loop by comparison: one check per level, not two.
        while let Some(Line(kids)) = self.lines.get(line) {
            // A tournament of three comparisons, each a conditional move.
            let a = usize::from(kids[1].before(&kids[0]));
            let b = 2 + usize::from(kids[3].before(&kids[2]));
            let best = if kids[b].before(&kids[a]) { b } else { a };
            let child = kids[best];
            if !child.before(&e) {
                break;
            }
            self.lines[hole_line].0[hole_slot] = child;
            (hole_line, hole_slot) = (line, best);
            // `line >= 1`, and it stays below the vector's length (≤ isize::MAX / 64), so
            // neither the subtraction nor the product can wrap.
            line = 4 * line + best - 2;
        }
        self.lines[hole_line].0[hole_slot] = e;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn children_share_a_line() {
        assert_eq!(std::mem::size_of::<Line>(), 64);
        assert_eq!(std::mem::align_of::<Line>(), 64);
        for i in 0..50usize {
            let lines: Vec<usize> = (4 * i + 1..=4 * i + 4).map(|c| (c + OFFSET) / 4).collect();
            assert!(lines.iter().all(|&l| l == i + 1), "node {i}: {lines:?}");
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Push(u64, u32),
        Pop,
        Replace(u64, u32),
        Retain(u32),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u64..40, any::<u32>()).prop_map(|(k, s)| Op::Push(k, s)),
            3 => Just(Op::Pop),
            2 => (0u64..40, any::<u32>()).prop_map(|(k, s)| Op::Replace(k, s)),
            1 => (2u32..5).prop_map(Op::Retain),
        ]
    }

    proptest! {
        /// Every operation against a sorted vector: the top is always the smallest (key, seq),
        /// and the whole content pops out in order.
        #[test]
        fn matches_a_sorted_model(ops in proptest::collection::vec(op(), 0..400)) {
            let mut h = TagHeap::default();
            let mut model: Vec<(u64, u32, u32)> = Vec::new();
            for (n, op) in ops.into_iter().enumerate() {
                let id = n as u32;
                match op {
                    Op::Push(k, s) => {
                        h.push(Entry::new(k, s, id));
                        model.push((k, s, id));
                    }
                    Op::Pop => {
                        let min = model.iter().map(|m| (m.0, m.1)).min();
                        let got = h.pop().map(|e| (e.key(), e.seq(), e.id()));
                        prop_assert_eq!(got.map(|g| (g.0, g.1)), min);
                        if let Some(g) = got {
                            // Equal (key, seq) pairs may come out in either order.
                            let at = model.iter().position(|m| *m == g).expect("popped was queued");
                            model.remove(at);
                        }
                    }
                    Op::Replace(k, s) => {
                        if h.len() > 0 {
                            let top = *h.peek().unwrap();
                            let at = model
                                .iter()
                                .position(|m| *m == (top.key(), top.seq(), top.id()))
                                .expect("top is queued");
                            model[at] = (k, s, id);
                            h.replace_top(Entry::new(k, s, id));
                        }
                    }
                    Op::Retain(m) => {
                        h.retain(|e| e.id() % m != 0);
                        model.retain(|e| e.2 % m != 0);
                    }
                }
                prop_assert_eq!(h.len(), model.len());
                let min = model.iter().map(|m| (m.0, m.1)).min();
                prop_assert_eq!(h.peek().map(|e| (e.key(), e.seq())), min);
            }
            let mut rest: Vec<(u64, u32)> = model.iter().map(|m| (m.0, m.1)).collect();
            rest.sort();
            let mut got = Vec::new();
            while let Some(e) = h.pop() {
                got.push((e.key(), e.seq()));
            }
            prop_assert_eq!(got, rest);
        }

        /// Deep heaps (up to five levels below the top) against a `BTreeSet` of the packed
        /// triples: the scheduler's hot path is `replace_top` with a key that sinks, so every
        /// step replaces the top (mostly with a larger key, as a charged client's tag grows) or
        /// pops it, and the heap must hand out exactly the set's first element each time, ties
        /// included (equal key and seq are ordered by id).
        #[test]
        fn deep_replace_top_matches_an_ordered_set(
            initial in proptest::collection::vec((0u64..1_000, 0u32..8), 1..2_000),
            steps in proptest::collection::vec((0u64..300, 0u32..8, 0u8..10), 1..3_000),
        ) {
            use std::collections::BTreeSet;
            let mut h = TagHeap::default();
            let mut model = BTreeSet::new();
            for (n, &(k, s)) in initial.iter().enumerate() {
                h.push(Entry::new(k, s, n as u32));
                model.insert((k, s, n as u32));
            }
            for (n, &(grow, s, action)) in steps.iter().enumerate() {
                let top = h.peek().map(|e| (e.key(), e.seq(), e.id()));
                prop_assert_eq!(top, model.first().copied());
                let Some((k, _, id)) = top else { break };
                // A new id for the replacement, so that ties are resolved by id as well.
                let e = (k + grow, s, id.wrapping_add(n as u32 + 1) % 4_096);
                if action == 0 || model.contains(&e) {
                    prop_assert_eq!(h.pop().map(|e| (e.key(), e.seq(), e.id())), top);
                    model.pop_first();
                } else {
                    h.replace_top(Entry::new(e.0, e.1, e.2));
                    model.pop_first();
                    model.insert(e);
                }
                prop_assert_eq!(h.len(), model.len());
            }
            let mut got = Vec::new();
            while let Some(e) = h.pop() {
                got.push((e.key(), e.seq(), e.id()));
            }
            prop_assert_eq!(got, model.into_iter().collect::<Vec<_>>());
        }
    }
}
