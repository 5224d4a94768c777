//! conn: a connection to Redis in which every call has a deadline for the whole exchange.
//!
//! The `redis` crate's synchronous `Connection` takes read and write timeouts, which the
//! kernel applies per system call: a server (or a proxy, or a half-broken network path) that
//! sends one byte per timeout keeps a call going for ever, and with it the fleet thread (leases
//! not renewed, weights frozen, a stop that never returns). This connection implements the
//! crate's [`ConnectionLike`] itself, so commands, pipelines and scripts are built and decoded
//! by the crate as before, but it owns the socket: before every read and write it sets the
//! socket's timeout to what is left of the call's deadline, and once none is left it takes
//! only what has already arrived, for at most [`LATE_TIMEOUTS`] more deadlines, then fails the
//! call. A call (connect and its handshake, one command, one pipeline) thus waits for the
//! server at most its `timeout`, and returns within `(1 + LATE_TIMEOUTS) × timeout` whatever
//! the server sends.
//!
//! What it does of the crate's handshake: `AUTH` (with the URL's user and password) and
//! `SELECT` (the URL's database); it speaks RESP2 only and does not send `CLIENT SETINFO`.
//! TCP and Unix sockets (the crate is built without TLS). The TCP host must be an IP address:
//! the system's resolver (`getaddrinfo`) cannot be given a deadline, so a name is refused
//! (by the config and by [`crate::store::Store::new`]) rather than resolved on the fleet
//! thread without a bound. One step has no deadline of ours (a known limit): the connect of a
//! Unix socket (it waits while the server's backlog is full; the config takes `redis://` only).

use redis::{ConnectionAddr, ConnectionLike, ErrorKind, RedisError, RedisResult, Value};
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn set_timeouts(&self, left: Duration) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => {
                s.set_read_timeout(Some(left))?;
                s.set_write_timeout(Some(left))
            }
            Stream::Unix(s) => {
                s.set_read_timeout(Some(left))?;
                s.set_write_timeout(Some(left))
            }
        }
    }
}

/// Past its deadline a call still takes what has already arrived (a read or a write that need
/// not wait), for up to this many more deadlines. A fleet thread descheduled past its deadline
/// (a busy node, a stalled VM) would otherwise fail a call whose reply was already in the
/// socket, and start a fallback episode for nothing; the end bounds a server that floods its
/// reply faster than it is read.
pub const LATE_TIMEOUTS: u32 = 1;
/// The wait of a read or write past the deadline: it takes what is there (the kernel rounds
/// it up to a clock tick, a few ms at most).
const LATE_WAIT: Duration = Duration::from_micros(1);

/// `host` as an IP address (an IPv6 one with or without its URL brackets), or `None` for a
/// name: names are not resolved (module doc).
pub fn ip_literal(host: &str) -> Option<IpAddr> {
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    bare.parse().ok()
}

/// What is left until `deadline`, or a timed-out error when nothing is.
fn left(deadline: Instant) -> io::Result<Duration> {
    match deadline.checked_duration_since(Instant::now()) {
        Some(d) if !d.is_zero() => Ok(d),
        _ => Err(timed_out()),
    }
}

fn timed_out() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "redis call past its deadline")
}

/// The socket seen through one call's deadline (waits end there) and end (late reads and
/// writes of what is there end there).
struct Bounded<'a> {
    stream: &'a mut Stream,
    deadline: Instant,
    end: Instant,
}

impl Bounded<'_> {
    /// The socket timeout of the next read or write.
    fn wait(&self) -> io::Result<Duration> {
        let now = Instant::now();
        if now < self.deadline {
            Ok(self.deadline - now)
        } else if now < self.end {
            Ok(LATE_WAIT)
        } else {
            Err(timed_out())
        }
    }
}

impl Read for Bounded<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.stream.set_timeouts(self.wait()?)?;
        match self.stream {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Bounded<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.set_timeouts(self.wait()?)?;
        match self.stream {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A connection whose every call ends within `timeout` (module doc).
pub struct DeadlineConnection {
    stream: Stream,
    parser: redis::Parser,
    timeout: Duration,
    db: i64,
    open: bool,
}

impl DeadlineConnection {
    /// Connects to `info`'s address and runs the handshake, all within `timeout`.
    pub fn connect(info: &redis::ConnectionInfo, timeout: Duration) -> RedisResult<Self> {
        let deadline = Instant::now() + timeout;
        let stream = match info.addr() {
            ConnectionAddr::Tcp(host, port) => {
                // An IP literal only (`Store::new` refuses a name): the system's resolver
                // has no deadline, and this thread must not wait without one.
                let Some(ip) = ip_literal(host) else {
                    return Err(RedisError::from((
                        ErrorKind::InvalidClientConfig,
                        "the redis host must be an IP address (names are not resolved)",
                    )));
                };
                let addr = SocketAddr::new(ip, *port);
                let s = TcpStream::connect_timeout(&addr, left(deadline)?)?;
                s.set_nodelay(true)?;
                Stream::Tcp(s)
            }
            ConnectionAddr::Unix(path) => Stream::Unix(UnixStream::connect(path)?),
            _ => {
                return Err(RedisError::from((
                    ErrorKind::InvalidClientConfig,
                    "only redis:// and redis+unix:// are supported (no TLS)",
                )))
            }
        };
        let settings = info.redis_settings();
        let mut con = DeadlineConnection {
            stream,
            parser: redis::Parser::new(),
            timeout,
            db: settings.db(),
            open: true,
        };
        if let Some(password) = settings.password() {
            let mut auth = redis::cmd("AUTH");
            if let Some(user) = settings.username() {
                auth.arg(user);
            }
            auth.arg(password);
            con.call(&auth.get_packed_command(), 0, 1, deadline)?
                .pop()
                .unwrap_or(Value::Nil)
                .extract_error()?;
        }
        if settings.db() != 0 {
            let select = redis::cmd("SELECT").arg(settings.db()).get_packed_command();
            con.call(&select, 0, 1, deadline)?
                .pop()
                .unwrap_or(Value::Nil)
                .extract_error()?;
        }
        Ok(con)
    }

    /// Writes `cmd` and reads `offset + count` replies, all before `deadline`; returns the
    /// last `count`. Any error leaves the connection closed (its state is unknown).
    fn call(
        &mut self,
        cmd: &[u8],
        offset: usize,
        count: usize,
        deadline: Instant,
    ) -> RedisResult<Vec<Value>> {
        if !self.open {
            return Err(io::Error::new(io::ErrorKind::NotConnected, "connection closed").into());
        }
        let r = self.exchange(cmd, offset, count, deadline);
        if r.is_err() {
            self.open = false;
        }
        r
    }

    fn exchange(
        &mut self,
        cmd: &[u8],
        offset: usize,
        count: usize,
        deadline: Instant,
    ) -> RedisResult<Vec<Value>> {
        let mut io = Bounded {
            stream: &mut self.stream,
            deadline,
            end: deadline + self.timeout * LATE_TIMEOUTS,
        };
        io.write_all(cmd)?;
        let mut out = Vec::with_capacity(count);
        let mut seen = 0;
        while seen < offset + count {
            let v = self.parser.parse_value(&mut io)?;
            // Push messages (RESP3 only, which this connection does not ask for) are no reply.
            if matches!(v, Value::Push { .. }) {
                continue;
            }
            if seen >= offset {
                out.push(v);
            }
            seen += 1;
        }
        Ok(out)
    }
}

impl ConnectionLike for DeadlineConnection {
    fn req_packed_command(&mut self, cmd: &[u8]) -> RedisResult<Value> {
        let deadline = Instant::now() + self.timeout;
        Ok(self
            .call(cmd, 0, 1, deadline)?
            .pop()
            .expect("one reply read"))
    }

    fn req_packed_commands(
        &mut self,
        cmd: &[u8],
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        let deadline = Instant::now() + self.timeout;
        self.call(cmd, offset, count, deadline)
    }

    fn get_db(&self) -> i64 {
        self.db
    }

    fn check_connection(&mut self) -> bool {
        redis::cmd("PING").query::<String>(self).is_ok()
    }

    fn is_open(&self) -> bool {
        self.open
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection on one end of a socket pair, the other end for the test to play the server.
    fn pair(timeout: Duration) -> (DeadlineConnection, UnixStream) {
        let (a, b) = UnixStream::pair().expect("socket pair");
        let con = DeadlineConnection {
            stream: Stream::Unix(a),
            parser: redis::Parser::new(),
            timeout,
            db: 0,
            open: true,
        };
        (con, b)
    }

    const PING: &[u8] = b"*1\r\n$4\r\nPING\r\n";

    #[test]
    fn a_reply_already_there_is_taken_past_the_deadline_until_its_end() {
        let timeout = Duration::from_secs(2);
        let ago = |ms| {
            Instant::now()
                .checked_sub(Duration::from_millis(ms))
                .unwrap()
        };
        // The reply arrived while the thread was held past its deadline: taken.
        let (mut con, mut server) = pair(timeout);
        server.write_all(b"+PONG\r\n").unwrap();
        let r = con.call(PING, 0, 1, ago(1000));
        assert_eq!(r.unwrap(), vec![Value::SimpleString("PONG".into())]);
        // Past the deadline and its late part (one more timeout): failed, though it is there.
        let (mut con, mut server) = pair(timeout);
        server.write_all(b"+PONG\r\n").unwrap();
        let e = con.call(PING, 0, 1, ago(3000)).unwrap_err();
        assert!(e.is_timeout(), "{e}");
        assert!(!con.is_open());
        // Past the deadline with nothing there: failed without waiting for the server (a
        // clock tick at most; the bound here is generous).
        let (mut con, _server) = pair(timeout);
        let t = Instant::now();
        let e = con.call(PING, 0, 1, ago(1000)).unwrap_err();
        assert!(e.is_timeout() || e.is_io_error(), "{e}");
        assert!(t.elapsed() < timeout, "{:?}", t.elapsed());
    }

    #[test]
    fn a_reply_that_comes_in_time_is_read_across_several_reads() {
        let (mut con, mut server) = pair(Duration::from_secs(5));
        let t = std::thread::spawn(move || {
            for part in [&b"*2\r\n:1"[..], b"\r\n$2\r", b"\nok\r\n"] {
                std::thread::sleep(Duration::from_millis(5));
                server.write_all(part).unwrap();
            }
            server
        });
        let deadline = Instant::now() + con.timeout;
        let r = con.call(PING, 0, 1, deadline).unwrap();
        assert_eq!(
            r,
            vec![Value::Array(vec![
                Value::Int(1),
                Value::BulkString(b"ok".to_vec())
            ])]
        );
        let _server = t.join().unwrap();
    }
}
