//! A connection's pending output: a queue of segments written with `send`/`sendmsg`, or `sendfile`.
//!
//! Response heads (and anything generated) go into owned buffers; file bodies from the cache
//! are shared `Bytes` slices, so a cache hit is sent without copying its body; large file
//! bodies are file segments (an `Arc`'d open file, an offset and a length), sent from the page
//! cache with `sendfile(2)` without passing through user space. Pipelined responses simply
//! queue up in order: memory segments up to the next file segment go out in one `writev`, a
//! file segment in one `sendfile`.
//!
//! The queue and the head buffers come from this thread's pool (`pool.rs`) and go back to it
//! when they are written out, so an idle connection's `Output` holds no allocation.

use super::pool;
use bytes::Bytes;
use std::collections::VecDeque;
use std::fs::File;
use std::io::{IoSlice, Write};
use std::sync::Arc;

/// Most slices handed to one `writev` (the kernel allows 1024; a few cover a response).
const IOVECS_MAX: usize = 16;

pub(super) enum Seg {
    Own(Vec<u8>),
    Shared(Bytes),
    /// `len` bytes of `file` from `offset`, sent with `sendfile`. The `Arc` keeps the
    /// descriptor open until the segment is written (or taken back), whatever the file cache
    /// does with its entry meanwhile.
    File {
        file: Arc<File>,
        offset: u64,
        len: usize,
    },
}

impl Seg {
    /// The bytes of a memory segment (empty for a file segment).
    fn bytes(&self) -> &[u8] {
        match self {
            Seg::Own(v) => v,
            Seg::Shared(b) => b,
            Seg::File { .. } => &[],
        }
    }

    fn len(&self) -> usize {
        match self {
            Seg::Own(v) => v.len(),
            Seg::Shared(b) => b.len(),
            Seg::File { len, .. } => *len,
        }
    }
}

/// Where output goes: a writer that can also send a range of a file.
pub(super) trait Sink: Write {
    /// Sends up to `len` bytes of `file` from `offset`; returns how many were sent (0 when
    /// the file ends at `offset`).
    fn send_file(&mut self, file: &File, offset: u64, len: usize) -> std::io::Result<usize>;

    /// Writes `bufs` saying that more follows at once (a response head before its file
    /// body), so that the head does not leave as a packet of its own.
    fn write_vectored_more(&mut self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
        self.write_vectored(bufs)
    }

    /// Writes `bufs` (what [`Output::write_to`] calls for memory segments). A socket sends
    /// them with `send`/`sendmsg` and `MSG_NOSIGNAL` rather than `writev`, so on this path a
    /// peer that reset the connection is an `EPIPE` error, not a SIGPIPE, in a program
    /// embedding the server that does not ignore the signal (Rust's runtime ignores it only in
    /// binaries it starts; `sendfile`, TLS and the proxy's writes can still raise it there),
    /// and the call skips the file layer `writev` goes through. (Cost: see
    /// `examples/send_cost.rs`; no difference showed at the server's level.)
    fn write_vectored_now(&mut self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
        self.write_vectored(bufs)
    }
}

impl Sink for mio::net::TcpStream {
    fn send_file(&mut self, file: &File, offset: u64, len: usize) -> std::io::Result<usize> {
        let mut off = offset;
        // Linux sends at most this much per call anyway.
        let len = len.min(0x7fff_f000);
        rustix::fs::sendfile(&*self, file, Some(&mut off), len).map_err(std::io::Error::from)
    }

    fn write_vectored_more(&mut self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
        use rustix::net::{SendAncillaryBuffer, SendFlags};
        rustix::net::sendmsg(
            &*self,
            bufs,
            &mut SendAncillaryBuffer::default(),
            SendFlags::MORE | SendFlags::NOSIGNAL,
        )
        .map_err(std::io::Error::from)
    }

    fn write_vectored_now(&mut self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
        use rustix::net::{SendAncillaryBuffer, SendFlags};
        match bufs {
            [one] => rustix::net::send(&*self, one, SendFlags::NOSIGNAL),
            _ => rustix::net::sendmsg(
                &*self,
                bufs,
                &mut SendAncillaryBuffer::default(),
                SendFlags::NOSIGNAL,
            ),
        }
        .map_err(std::io::Error::from)
    }
}

/// Pending output of one connection.
#[derive(Default)]
pub(super) struct Output {
    segs: VecDeque<Seg>,
    /// Bytes of the front segment already written.
    front_pos: usize,
    /// Bytes not yet written, over all segments.
    pending: usize,
    /// Bytes ever queued (a position in the stream, for marks).
    queued_total: u64,
}

/// A position in the output stream to roll back to (a failed response takes back only its
/// own bytes, as far as they are not written yet).
#[derive(Clone, Copy)]
pub(super) struct Mark(u64);

impl Output {
    pub(super) fn is_empty(&self) -> bool {
        self.pending == 0
    }

    pub(super) fn pending(&self) -> usize {
        self.pending
    }

    /// Whether the next bytes to write come from a file segment.
    pub(super) fn front_is_file(&self) -> bool {
        matches!(self.segs.front(), Some(Seg::File { .. }))
    }

    /// Runs `f` on the owned buffer at the end of the queue (response heads are written
    /// there) and accounts for what it added. `f` may truncate only what it added itself.
    pub(super) fn with_head<R>(&mut self, f: impl FnOnce(&mut Vec<u8>) -> R) -> R {
        if !matches!(self.segs.back(), Some(Seg::Own(_))) {
            let head = pool::take_buf();
            self.push_seg(Seg::Own(head));
        }
        let Some(Seg::Own(v)) = self.segs.back_mut() else {
            unreachable!("pushed above")
        };
        let before = v.len();
        let r = f(v);
        assert!(
            v.len() >= before,
            "a head writer truncated bytes it did not add"
        );
        let added = v.len() - before;
        self.pending += added;
        self.queued_total += added as u64;
        r
    }

    /// Queues an owned buffer.
    pub(super) fn push_owned(&mut self, v: Vec<u8>) {
        if v.is_empty() {
            return;
        }
        self.pending += v.len();
        self.queued_total += v.len() as u64;
        self.push_seg(Seg::Own(v));
    }

    /// Queues shared bytes (no copy).
    pub(super) fn push_shared(&mut self, b: Bytes) {
        if b.is_empty() {
            return;
        }
        self.pending += b.len();
        self.queued_total += b.len() as u64;
        self.push_seg(Seg::Shared(b));
    }

    /// Queues `len` bytes of `file` from `offset`, to be sent with `sendfile` (no copy).
    pub(super) fn push_file(&mut self, file: Arc<File>, offset: u64, len: usize) {
        if len == 0 {
            return;
        }
        self.pending += len;
        self.queued_total += len as u64;
        self.push_seg(Seg::File { file, offset, len });
    }

    /// Appends a segment, taking a queue from the pool if this output holds none.
    fn push_seg(&mut self, seg: Seg) {
        if self.segs.capacity() == 0 {
            self.segs = pool::take_queue();
        }
        self.segs.push_back(seg);
    }

    /// Everything is written (or taken back): the buffers and the queue go back to the pool.
    fn release(&mut self) {
        for seg in self.segs.drain(..) {
            if let Seg::Own(v) = seg {
                pool::give_buf(v);
            }
        }
        pool::give_queue(std::mem::take(&mut self.segs));
        self.front_pos = 0;
    }

    /// Whether this output holds an allocation (for tests: an idle one should not).
    #[cfg(test)]
    pub(super) fn holds_memory(&self) -> bool {
        self.segs.capacity() > 0
    }

    pub(super) fn mark(&self) -> Mark {
        Mark(self.queued_total)
    }

    /// Drops what was queued after `m` and is not written yet.
    pub(super) fn rollback(&mut self, m: Mark) {
        let written_total = self.queued_total - self.pending as u64;
        let keep_total = m.0.max(written_total);
        let mut remove = (self.queued_total - keep_total) as usize;
        while remove > 0 {
            let only_front = self.segs.len() == 1;
            let back = self.segs.back_mut().expect("pending bytes are queued");
            let unwritten = back.len() - if only_front { self.front_pos } else { 0 };
            if remove >= unwritten && !(only_front && self.front_pos > 0) {
                if let Some(Seg::Own(v)) = self.segs.pop_back() {
                    pool::give_buf(v);
                }
                self.pending -= unwritten;
                remove -= unwritten;
                continue;
            }
            let cut = remove.min(unwritten);
            match back {
                Seg::Own(v) => v.truncate(v.len() - cut),
                Seg::Shared(b) => b.truncate(b.len() - cut),
                Seg::File { len, .. } => *len -= cut,
            }
            self.pending -= cut;
            remove -= cut;
        }
        self.queued_total = keep_total;
        if self.pending == 0 {
            self.release();
        }
    }

    /// Writes up to `max` bytes with one `writev` (the memory segments up to the next file
    /// segment) or one `sendfile` (a file segment at the front); returns how many were
    /// written. A file that ends before its segment does is an `UnexpectedEof` error: the
    /// response's length is promised, so the connection must close.
    pub(super) fn write_to(&mut self, w: &mut impl Sink, max: usize) -> std::io::Result<usize> {
        if let Some(Seg::File { file, offset, len }) = self.segs.front() {
            let want = (len - self.front_pos).min(max);
            if want == 0 {
                return Ok(0);
            }
            let sent = w.send_file(file, offset + self.front_pos as u64, want)?;
            if sent == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the file is shorter than the response promised",
                ));
            }
            self.consume(sent);
            return Ok(sent);
        }
        let mut slices: [IoSlice<'_>; IOVECS_MAX] = [IoSlice::new(&[]); IOVECS_MAX];
        let mut n = 0;
        let mut total = 0;
        // A file segment right after these bytes, to be sent next.
        let mut file_follows = false;
        for (i, s) in self.segs.iter().enumerate() {
            if n == IOVECS_MAX || total >= max {
                break;
            }
            if matches!(s, Seg::File { .. }) {
                file_follows = true;
                break;
            }
            let b = if i == 0 {
                &s.bytes()[self.front_pos..]
            } else {
                s.bytes()
            };
            let b = &b[..b.len().min(max - total)];
            slices[n] = IoSlice::new(b);
            n += 1;
            total += b.len();
        }
        if total == 0 {
            return Ok(0);
        }
        // Only when the caller's budget leaves room for the file: otherwise the head would
        // wait in the kernel until this connection's next turn.
        let written = if file_follows && total < max {
            w.write_vectored_more(&slices[..n])?
        } else {
            w.write_vectored_now(&slices[..n])?
        };
        self.consume(written);
        Ok(written)
    }

    fn consume(&mut self, mut n: usize) {
        self.pending -= n;
        while n > 0 {
            let front_len = self.segs.front().expect("pending bytes are queued").len();
            let left = front_len - self.front_pos;
            if n < left {
                self.front_pos += n;
                return;
            }
            n -= left;
            if let Some(Seg::Own(v)) = self.segs.pop_front() {
                pool::give_buf(v);
            }
            self.front_pos = 0;
        }
        if self.pending == 0 {
            self.release();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer that accepts at most `cap` bytes per call and records everything.
    struct Trickle {
        cap: usize,
        got: Vec<u8>,
    }
    impl Write for Trickle {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            let n = b.len().min(self.cap);
            self.got.extend_from_slice(&b[..n]);
            Ok(n)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    impl Sink for Trickle {
        fn send_file(&mut self, file: &File, offset: u64, len: usize) -> std::io::Result<usize> {
            use std::os::unix::fs::FileExt;
            let mut b = vec![0; len.min(self.cap)];
            let n = file.read_at(&mut b, offset)?;
            self.got.extend_from_slice(&b[..n]);
            Ok(n)
        }
    }

    /// A temporary file holding `bytes`.
    fn temp_file(name: &str, bytes: &[u8]) -> Arc<File> {
        let p = std::env::temp_dir().join(format!("omnistage-out-{}-{name}", std::process::id()));
        std::fs::write(&p, bytes).unwrap();
        let f = File::open(&p).unwrap();
        let _ = std::fs::remove_file(&p);
        Arc::new(f)
    }

    #[test]
    fn file_segments_go_out_in_order_with_the_memory_ones() {
        let f = temp_file("order", b"0123456789abcdef");
        let mut o = Output::default();
        o.with_head(|v| v.extend_from_slice(b"H1 "));
        o.push_file(f.clone(), 2, 10);
        o.with_head(|v| v.extend_from_slice(b" H2 "));
        o.push_shared(Bytes::from_static(b"small"));
        o.with_head(|v| v.extend_from_slice(b" H3 "));
        o.push_file(f, 0, 4);
        assert_eq!(o.pending(), 3 + 10 + 4 + 5 + 4 + 4);
        let mut w = Trickle {
            cap: 3,
            got: Vec::new(),
        };
        // Bounded: each call writes at least one byte.
        for _ in 0..100 {
            if o.is_empty() {
                break;
            }
            assert!(o.write_to(&mut w, 7).unwrap() > 0);
        }
        assert_eq!(w.got, b"H1 23456789ab H2 small H3 0123");
        assert!(!o.holds_memory());
    }

    /// Records whether each write said that more follows.
    struct MoreRecorder {
        inner: Trickle,
        more: Vec<bool>,
    }
    impl Write for MoreRecorder {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.more.push(false);
            self.inner.write(b)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    impl Sink for MoreRecorder {
        fn send_file(&mut self, file: &File, offset: u64, len: usize) -> std::io::Result<usize> {
            self.inner.send_file(file, offset, len)
        }
        fn write_vectored_more(&mut self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
            let n = self.inner.write_vectored(bufs)?;
            self.more.push(true);
            Ok(n)
        }
    }

    #[test]
    fn a_head_before_a_file_body_says_more_follows() {
        let f = temp_file("more", b"body");
        let mut o = Output::default();
        o.with_head(|v| v.extend_from_slice(b"H1 "));
        o.push_file(f, 0, 4);
        o.with_head(|v| v.extend_from_slice(b" H2"));
        let mut w = MoreRecorder {
            inner: Trickle {
                cap: 100,
                got: Vec::new(),
            },
            more: Vec::new(),
        };
        for _ in 0..3 {
            o.write_to(&mut w, usize::MAX).unwrap();
        }
        assert!(o.is_empty());
        assert_eq!(w.inner.got, b"H1 body H2");
        // The head before the file: more follows; the last head: nothing follows.
        assert_eq!(w.more, [true, false]);
        // A budget that ends with the head: the file is not sent now, so nothing is held back.
        let mut o = Output::default();
        o.with_head(|v| v.extend_from_slice(b"H1 "));
        o.push_file(temp_file("more2", b"body"), 0, 4);
        w.more.clear();
        assert_eq!(o.write_to(&mut w, 3).unwrap(), 3);
        assert_eq!(w.more, [false]);
    }

    #[test]
    fn a_file_shorter_than_its_segment_is_an_error() {
        let f = temp_file("short", b"0123");
        let mut o = Output::default();
        o.push_file(f, 0, 10);
        let mut w = Trickle {
            cap: 100,
            got: Vec::new(),
        };
        assert_eq!(o.write_to(&mut w, usize::MAX).unwrap(), 4);
        let e = o.write_to(&mut w, usize::MAX).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn rollback_takes_back_a_file_segment() {
        let f = temp_file("rollback", b"0123456789");
        let mut o = Output::default();
        o.with_head(|v| v.extend_from_slice(b"keep "));
        let m = o.mark();
        o.with_head(|v| v.extend_from_slice(b"drop "));
        o.push_file(f.clone(), 0, 10);
        o.rollback(m);
        assert_eq!(o.pending(), 5);
        // A partly written file segment keeps what is written and loses the rest.
        let mut o = Output::default();
        o.push_file(f, 0, 10);
        let m = o.mark();
        let mut w = Trickle {
            cap: 4,
            got: Vec::new(),
        };
        o.write_to(&mut w, usize::MAX).unwrap();
        o.with_head(|v| v.extend_from_slice(b"x"));
        o.rollback(m);
        assert_eq!(o.pending(), 6);
    }

    #[test]
    fn segments_go_out_in_order_across_partial_writes() {
        let mut o = Output::default();
        o.with_head(|v| v.extend_from_slice(b"HEAD1 "));
        o.push_shared(Bytes::from_static(b"body-one "));
        o.with_head(|v| v.extend_from_slice(b"HEAD2 "));
        o.push_owned(b"body-two".to_vec());
        assert_eq!(o.pending(), 29);
        let mut w = Trickle {
            cap: 4,
            got: Vec::new(),
        };
        while !o.is_empty() {
            o.write_to(&mut w, 5).unwrap();
        }
        assert_eq!(w.got, b"HEAD1 body-one HEAD2 body-two");
        assert_eq!(o.pending(), 0);
    }

    #[test]
    fn a_written_output_gives_its_buffers_back() {
        let before = pool::held();
        let mut o = Output::default();
        assert!(!o.holds_memory());
        o.with_head(|v| v.extend_from_slice(b"HEAD "));
        o.push_shared(Bytes::from_static(b"body"));
        o.with_head(|v| v.extend_from_slice(b"HEAD2"));
        assert!(o.holds_memory());
        let mut w = Trickle {
            cap: 3,
            got: Vec::new(),
        };
        while !o.is_empty() {
            o.write_to(&mut w, usize::MAX).unwrap();
        }
        assert_eq!(w.got, b"HEAD bodyHEAD2");
        assert!(!o.holds_memory(), "an idle output holds no allocation");
        let after = pool::held();
        assert_eq!(
            after,
            (before.0 + 2, before.1 + 1),
            "two heads and the queue"
        );
        // The next response reuses them.
        o.with_head(|v| v.extend_from_slice(b"again"));
        assert_eq!(pool::held(), (before.0 + 1, before.1));
        o.rollback(Mark(0));
        assert!(!o.holds_memory());
        assert_eq!(pool::held(), after);
    }

    #[test]
    fn head_truncation_is_accounted() {
        let mut o = Output::default();
        o.with_head(|v| {
            v.extend_from_slice(b"0123456789");
            v.truncate(4);
        });
        assert_eq!(o.pending(), 4);
    }

    #[test]
    fn rollback_takes_back_only_what_followed_the_mark() {
        let mut o = Output::default();
        o.with_head(|v| v.extend_from_slice(b"first "));
        let m = o.mark();
        o.with_head(|v| v.extend_from_slice(b"second "));
        o.push_shared(Bytes::from_static(b"body"));
        o.rollback(m);
        assert_eq!(o.pending(), 6);
        let mut w = Trickle {
            cap: 100,
            got: Vec::new(),
        };
        o.write_to(&mut w, usize::MAX).unwrap();
        assert_eq!(w.got, b"first ");
        // From an empty output.
        let mut o = Output::default();
        let m = o.mark();
        o.push_shared(Bytes::from_static(b"x"));
        o.with_head(|v| v.extend_from_slice(b"y"));
        o.rollback(m);
        assert!(o.is_empty());
    }
}
