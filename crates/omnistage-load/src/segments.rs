//! The TCP segments the server sent to this generator's connections during the measured
//! window, with and without data, read from each socket's `TCP_INFO` (`tcpi_segs_in`,
//! `tcpi_data_segs_in`).
//!
//! Why: a segment without data is a pure ACK (or a SYN-ACK or FIN), and on loopback every
//! segment a server sends is also received, in the server's own system call or timer, on the
//! client's socket: its cost is in the server's system time. A server that answers a request
//! within the kernel's delayed-ACK timeout carries the ACK on the response; one that answers
//! later sends a pure ACK first. Counted on the client's sockets, it is an instrument the
//! server does not control, and it tells a rise in the server's CPU per request that is
//! the kernel's (more segments) from one that is the server's own code.
//!
//! Linux only; elsewhere [`read`] answers `None` and the report has no figure.

use std::os::fd::AsRawFd;

/// Segments received on one socket so far: (all, those carrying data).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct SegmentsIn {
    pub all: u32,
    pub data: u32,
}

impl SegmentsIn {
    /// What was received since `base` (the kernel's counters are 32-bit and wrap).
    pub fn since(self, base: SegmentsIn) -> SegmentsIn {
        SegmentsIn {
            all: self.all.wrapping_sub(base.all),
            data: self.data.wrapping_sub(base.data),
        }
    }
}

/// The socket's segment counters, or `None` where the kernel does not give them.
pub(crate) fn read(sock: &impl AsRawFd) -> Option<SegmentsIn> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: `tcp_info` is plain integers, for which all zeros is a valid value.
        let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
        // SAFETY: a valid descriptor (borrowed for the call), and a pointer to a live
        // `tcp_info` whose size is passed with it; the kernel writes at most `len` bytes.
        let rc = unsafe {
            libc::getsockopt(
                sock.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_INFO,
                (&mut info as *mut libc::tcp_info).cast(),
                &mut len,
            )
        };
        // Kernels before 4.6 fill less of the struct, without these two counters.
        let end =
            std::mem::offset_of!(libc::tcp_info, tcpi_data_segs_in) + std::mem::size_of::<u32>();
        if rc != 0 || (len as usize) < end {
            return None;
        }
        Some(SegmentsIn {
            all: info.tcpi_segs_in,
            data: info.tcpi_data_segs_in,
        })
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = sock;
        None
    }
}

/// Whether this platform gives the counters at all (else the report carries no figure).
pub(crate) fn read_anywhere() -> bool {
    cfg!(target_os = "linux")
}

/// Sums over a thread's connections.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SegmentTotals {
    /// Segments with data received in the window.
    pub data: u64,
    /// Segments without data (pure ACKs, SYN-ACKs, FINs) received in the window.
    pub without_data: u64,
    /// Sockets whose counters could not be read.
    pub unread: u64,
}

impl SegmentTotals {
    pub fn add(&mut self, d: SegmentsIn) {
        self.data += u64::from(d.data);
        // `all` counts every segment, so it is at least `data` (saturating in case a read
        // straddled a wrap of one counter and not the other).
        self.without_data += u64::from(d.all.saturating_sub(d.data));
    }
    pub fn merge(&mut self, o: &SegmentTotals) {
        self.data += o.data;
        self.without_data += o.without_data;
        self.unread += o.unread;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn since_takes_the_counters_wrap_into_account() {
        let base = SegmentsIn {
            all: u32::MAX - 1,
            data: u32::MAX,
        };
        let now = SegmentsIn { all: 3, data: 1 };
        assert_eq!(now.since(base), SegmentsIn { all: 5, data: 2 });
    }

    #[test]
    fn totals_count_segments_without_data() {
        let mut t = SegmentTotals::default();
        t.add(SegmentsIn { all: 7, data: 4 });
        t.add(SegmentsIn { all: 2, data: 3 });
        assert_eq!((t.data, t.without_data), (7, 3));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_loopback_socket_counts_the_data_segments_it_received() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        server.set_nodelay(true).unwrap();
        let base = read(&client).expect("TCP_INFO on Linux");
        for _ in 0..3 {
            server.write_all(b"x").unwrap();
            let mut b = [0u8; 1];
            client.read_exact(&mut b).unwrap();
        }
        let d = read(&client).unwrap().since(base);
        assert_eq!(d.data, 3);
        assert!(d.all >= 3);
    }
}
