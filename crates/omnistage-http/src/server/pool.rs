//! Per-thread pools of idle buffers: a connection holds a read buffer, a response-head buffer
//! and a segment queue only while it has bytes in them, and gives them back here when they
//! empty, so an idle keep-alive connection holds none of them (nginx frees its request buffers
//! on keep-alive the same way) and a busy one takes them without a `malloc`.
//!
//! The pools live in a thread-local (each worker serves its own connections only), so taking
//! and giving back is a few loads and stores: no lock, no syscall. Both are bounded: at most
//! [`BUFS_POOLED_MAX`] byte buffers of at most [`BUF_POOLED_BYTES_MAX`] capacity and
//! [`QUEUES_POOLED_MAX`] queues; what does not fit is freed.

use super::output::Seg;
use std::cell::RefCell;
use std::collections::VecDeque;

/// Capacity of a byte buffer made fresh for the pool: a request head or a response head
/// usually fits, so a pooled buffer seldom grows.
pub(super) const BUF_FRESH_BYTES: usize = 1024;
/// Largest byte buffer kept when given back (larger ones, e.g. a buffer that held a 16 KiB
/// header, are freed rather than pinned in the pool).
pub(super) const BUF_POOLED_BYTES_MAX: usize = 4 * 1024;
/// Most idle byte buffers kept per thread.
pub(super) const BUFS_POOLED_MAX: usize = 256;
/// Most idle segment queues kept per thread.
pub(super) const QUEUES_POOLED_MAX: usize = 256;
/// Largest segment queue (in segments) kept when given back.
const QUEUE_POOLED_SEGS_MAX: usize = 64;

struct Pools {
    bufs: Vec<Vec<u8>>,
    queues: Vec<VecDeque<Seg>>,
}

thread_local! {
    static POOLS: RefCell<Pools> = const {
        RefCell::new(Pools {
            bufs: Vec::new(),
            queues: Vec::new(),
        })
    };
}

/// An empty byte buffer with room for at least [`BUF_FRESH_BYTES`] (or less if a pooled one is
/// smaller: it grows as any `Vec` does).
pub(super) fn take_buf() -> Vec<u8> {
    POOLS
        .with(|p| p.borrow_mut().bufs.pop())
        .unwrap_or_else(|| Vec::with_capacity(BUF_FRESH_BYTES))
}

/// Gives a buffer back (emptied); freed if it is large or the pool is full.
pub(super) fn give_buf(mut b: Vec<u8>) {
    if b.capacity() == 0 || b.capacity() > BUF_POOLED_BYTES_MAX {
        return;
    }
    b.clear();
    POOLS.with(|p| {
        let mut p = p.borrow_mut();
        if p.bufs.len() < BUFS_POOLED_MAX {
            p.bufs.push(b);
        }
    });
}

/// An empty segment queue (a pooled one keeps its capacity).
pub(super) fn take_queue() -> VecDeque<Seg> {
    POOLS
        .with(|p| p.borrow_mut().queues.pop())
        .unwrap_or_default()
}

/// Gives a segment queue back (emptied); freed if it is large or the pool is full.
pub(super) fn give_queue(mut q: VecDeque<Seg>) {
    if q.capacity() == 0 || q.capacity() > QUEUE_POOLED_SEGS_MAX {
        return;
    }
    q.clear();
    POOLS.with(|p| {
        let mut p = p.borrow_mut();
        if p.queues.len() < QUEUES_POOLED_MAX {
            p.queues.push(q);
        }
    });
}

/// Idle byte buffers and queues held by this thread's pool.
#[cfg(test)]
pub(super) fn held() -> (usize, usize) {
    POOLS.with(|p| {
        let p = p.borrow();
        (p.bufs.len(), p.queues.len())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_back_empty_and_are_reused() {
        let mut b = take_buf();
        assert!(b.capacity() >= BUF_FRESH_BYTES);
        b.extend_from_slice(b"hello");
        let ptr = b.as_ptr();
        give_buf(b);
        assert_eq!(held().0, 1);
        let b = take_buf();
        assert!(b.is_empty());
        assert_eq!(b.as_ptr(), ptr, "the same allocation is handed out again");
        assert_eq!(held().0, 0);
    }

    #[test]
    fn large_buffers_and_queues_are_not_kept() {
        give_buf(Vec::with_capacity(BUF_POOLED_BYTES_MAX + 1));
        give_buf(Vec::new());
        give_queue(VecDeque::with_capacity(QUEUE_POOLED_SEGS_MAX + 1));
        assert_eq!(held(), (0, 0));
    }

    #[test]
    fn the_pool_is_bounded() {
        for _ in 0..BUFS_POOLED_MAX + 10 {
            give_buf(Vec::with_capacity(16));
        }
        for _ in 0..QUEUES_POOLED_MAX + 10 {
            give_queue(VecDeque::with_capacity(4));
        }
        assert_eq!(held(), (BUFS_POOLED_MAX, QUEUES_POOLED_MAX));
        assert!(take_queue().is_empty());
    }
}
