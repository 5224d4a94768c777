//! Kernel receive timestamps (`--kernel-stamps`): the time the kernel took in a response's
//! bytes, read with each `recvmsg` as `SO_TIMESTAMPNS` control data.
//!
//! Why: a generator's latency runs from a request's intended send to the moment its thread
//! reads the response, so it also counts the generator's own delays (sending late, waking
//! late after the bytes arrived), which on a shared machine can be the larger part of a tail.
//! From the request's actual send (the wall clock just before its first `write`) to the
//! kernel's stamp on the response's bytes is what the server and the network took: an
//! instrument neither the server's scheduler nor the generator's thread controls. On
//! loopback the stamp is taken when the server's `send` hands the bytes to the receiving
//! socket. Both clocks are `CLOCK_REALTIME` (what `SO_TIMESTAMPNS` stamps with).
//!
//! Linux only; elsewhere [`enable`] fails and the generator reports no kernel figures.

use std::io;
use std::os::fd::AsRawFd;

/// Turns on receive timestamps for `sock`.
pub(crate) fn enable(sock: &impl AsRawFd) -> io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        let on: libc::c_int = 1;
        // SAFETY: a valid descriptor (borrowed for the call), and a pointer to a live c_int
        // whose size is passed with it.
        let rc = unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_TIMESTAMPNS,
                (&on as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = sock;
        Err(io::Error::new(io::ErrorKind::Unsupported, "Linux only"))
    }
}

/// The wall clock (`CLOCK_REALTIME`) in ns since the epoch, as the kernel stamps.
pub(crate) fn realtime_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// Reads into `buf` like `read`, and returns the kernel's receive stamp of the data read (ns
/// since the epoch; for TCP, the last segment the read took), if the kernel gave one.
pub(crate) fn read_stamped(
    sock: &impl AsRawFd,
    buf: &mut [u8],
) -> io::Result<(usize, Option<u64>)> {
    #[cfg(target_os = "linux")]
    {
        // Room for one SCM_TIMESTAMPNS message (a timespec) with its header, aligned.
        let mut control = [0u64; 8];
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: msghdr is plain data; all-zero is a valid empty header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&control) as _;
        // SAFETY: `msg` points at `iov` (which points at `buf`, with its length) and at
        // `control` (with its length), all live and exclusively borrowed for the call.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut stamp = None;
        // SAFETY: the CMSG_* macros walk the control buffer the kernel filled, within the
        // `msg_controllen` it set; a header is read only where CMSG_NXTHDR/FIRSTHDR put it.
        unsafe {
            let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
            while !cmsg.is_null() {
                if (*cmsg).cmsg_level == libc::SOL_SOCKET
                    && (*cmsg).cmsg_type == libc::SCM_TIMESTAMPNS
                {
                    let ts: libc::timespec = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast());
                    let ns = u64::try_from(ts.tv_sec)
                        .ok()
                        .and_then(|s| s.checked_mul(1_000_000_000))
                        .and_then(|s| s.checked_add(u64::try_from(ts.tv_nsec).ok()?));
                    stamp = ns.filter(|&ns| ns > 0);
                }
                cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
            }
        }
        Ok((n as usize, stamp))
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (sock, buf);
        Err(io::Error::new(io::ErrorKind::Unsupported, "Linux only"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};

    /// Over loopback, a stamped read returns the bytes and a stamp between the send and the
    /// read (the clocks are the same wall clock). The kernel turns stamping on for the whole
    /// stack through a deferred work item when the first socket asks, so the first segments
    /// after `enable` may come unstamped: the test sends until one is (at most 200 tries).
    #[test]
    fn a_loopback_read_is_stamped_between_send_and_read() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (server, _) = l.accept().unwrap();
        enable(&server).unwrap();
        for _ in 0..200 {
            let before = realtime_ns();
            client.write_all(b"hello").unwrap();
            let mut buf = [0u8; 16];
            let (n, stamp) = read_stamped(&server, &mut buf).unwrap();
            let after = realtime_ns();
            assert_eq!(&buf[..n], b"hello");
            if let Some(stamp) = stamp {
                assert!(
                    before <= stamp && stamp <= after,
                    "{before} {stamp} {after}"
                );
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        panic!("no read was stamped");
    }

    /// Without `enable`, reads carry no stamp.
    #[test]
    fn no_stamp_unless_enabled() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (server, _) = l.accept().unwrap();
        client.write_all(b"x").unwrap();
        let mut buf = [0u8; 4];
        let (n, stamp) = read_stamped(&server, &mut buf).unwrap();
        assert_eq!((n, stamp), (1, None));
    }
}
