//! A small blocking HTTP/1.1 client for the admin API (what `omnistage top`, `tree`, `set`
//! and `graph` use): `http://host:port` URLs only, one request per connection, a bearer token
//! if given, bounded answer size, timeouts and an overall deadline.

use serde::de::DeserializeOwned;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Largest answer read.
pub const RESPONSE_BYTES_MAX: usize = 64 << 20;
/// Connect, read and write timeout (each call).
pub const TIMEOUT: Duration = Duration::from_secs(5);
/// Time allowed for a whole request, connect to last byte (unless [`Client::with_deadline`]
/// says otherwise): per-call timeouts alone let a server that trickles its answer (a byte every
/// few seconds) hold a command, or `top`'s fetcher, for as long as it likes. Twice the server's
/// own 5 s to write an answer.
pub const DEADLINE: Duration = Duration::from_secs(10);

/// Where the admin API is, and how to authenticate.
#[derive(Clone, Debug)]
pub struct Client {
    /// `host:port`.
    authority: String,
    token: Option<String>,
    /// Time allowed for one whole request.
    deadline: Duration,
}

/// An answer.
#[derive(Clone, Debug)]
pub struct Reply {
    pub status: u16,
    pub body: Vec<u8>,
}

impl Reply {
    /// The body as text (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The error message of a JSON error body, or the body itself.
    pub fn error_message(&self) -> String {
        serde_json::from_slice::<crate::model::ErrorBody>(&self.body)
            .map(|e| e.error)
            .unwrap_or_else(|_| self.text().trim().to_string())
    }
}

impl Client {
    /// `url`: `http://host:port` (a trailing `/` is allowed; a bare `host:port` too).
    pub fn new(url: &str, token: Option<String>) -> Result<Client, String> {
        let rest = match url.split_once("://") {
            Some(("http", r)) => r,
            Some((scheme, _)) => {
                return Err(format!(
                    "admin URL {url:?}: only http:// is supported (got {scheme}://)"
                ))
            }
            None => url,
        };
        let authority = rest.trim_end_matches('/');
        if authority.is_empty() || authority.contains('/') || !authority.contains(':') {
            return Err(format!("admin URL {url:?}: want http://host:port"));
        }
        Ok(Client {
            authority: authority.to_string(),
            token,
            deadline: DEADLINE,
        })
    }

    /// The same client with `deadline` for each whole request instead of [`DEADLINE`].
    pub fn with_deadline(mut self, deadline: Duration) -> Client {
        self.deadline = deadline;
        self
    }

    /// Sends one request and reads the whole answer, within the client's deadline.
    pub fn request(&self, method: &str, path: &str, body: Option<&[u8]>) -> Result<Reply, String> {
        let deadline = Instant::now() + self.deadline;
        let addr = self
            .authority
            .to_socket_addrs()
            .map_err(|e| format!("{}: {e}", self.authority))?
            .next()
            .ok_or_else(|| format!("{}: no address", self.authority))?;
        // What is left of the deadline, at most one call's timeout.
        let late = || {
            format!(
                "no whole answer from the admin API at http://{addr} within {:.1} s",
                self.deadline.as_secs_f64()
            )
        };
        let left = || match deadline.saturating_duration_since(Instant::now()) {
            d if d.is_zero() => Err(late()),
            d => Ok(d.min(TIMEOUT)),
        };
        let mut s = TcpStream::connect_timeout(&addr, left()?)
            .map_err(|e| format!("cannot reach the admin API at http://{addr}: {e}"))?;
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nAccept: */*\r\n",
            self.authority
        );
        if let Some(t) = &self.token {
            head.push_str(&format!("Authorization: Bearer {t}\r\n"));
        }
        if let Some(b) = body {
            head.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                b.len()
            ));
        }
        head.push_str("\r\n");
        let mut out = head.into_bytes();
        out.extend_from_slice(body.unwrap_or_default());
        let mut rest = &out[..];
        while !rest.is_empty() {
            s.set_write_timeout(Some(left()?))
                .map_err(|e| e.to_string())?;
            match s.write(rest) {
                Ok(0) => return Err("the admin API closed the connection".into()),
                Ok(n) => rest = &rest[n..],
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if is_timeout(&e) => return Err(late()),
                Err(e) => return Err(e.to_string()),
            }
        }
        let mut buf = Vec::new();
        let mut chunk = vec![0u8; 64 * 1024];
        loop {
            s.set_read_timeout(Some(left()?))
                .map_err(|e| e.to_string())?;
            match s.read(&mut chunk) {
                Ok(0) => break,
                Ok(n) => {
                    buf.extend_from_slice(&chunk[..n]);
                    if buf.len() > RESPONSE_BYTES_MAX {
                        return Err("answer larger than 64 MiB".into());
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if is_timeout(&e) && left().is_err() => return Err(late()),
                Err(e) => return Err(format!("reading the answer: {e}")),
            }
        }
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut resp = httparse::Response::new(&mut headers);
        let n = match resp.parse(&buf) {
            Ok(httparse::Status::Complete(n)) => n,
            Ok(httparse::Status::Partial) => return Err("truncated answer".into()),
            Err(e) => return Err(format!("malformed answer: {e}")),
        };
        let status = resp.code.unwrap_or(0);
        let len = resp
            .headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case("content-length"))
            .and_then(|h| {
                std::str::from_utf8(h.value)
                    .ok()?
                    .trim()
                    .parse::<usize>()
                    .ok()
            });
        let body = &buf[n..];
        let body = match len {
            Some(l) if l <= body.len() => &body[..l],
            Some(_) => return Err("truncated answer body".into()),
            None => body,
        };
        Ok(Reply {
            status,
            body: body.to_vec(),
        })
    }

    /// GETs `path` and decodes its JSON, or says why not.
    pub fn get_json<T: DeserializeOwned>(&self, path: &str) -> Result<T, String> {
        let r = self.request("GET", path, None)?;
        if r.status != 200 {
            return Err(format!("GET {path}: {} {}", r.status, r.error_message()));
        }
        serde_json::from_slice(&r.body).map_err(|e| format!("GET {path}: {e}"))
    }
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that sends its answer a byte every 100 ms (each read well within the per-read
    /// timeout) cannot hold a request past its deadline: `Err` by then, not a wait as long as
    /// the server likes.
    #[test]
    fn a_dripping_server_is_given_up_on_at_the_deadline() {
        use std::net::TcpListener;
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::{mpsc, Arc};
        use std::time::Instant;
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let server = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let (mut s, _) = listener.accept().unwrap();
                let mut req = [0u8; 1024];
                let _ = s.read(&mut req);
                for b in b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n"
                    .iter()
                    .cycle()
                {
                    if stop.load(Ordering::Relaxed) || s.write_all(&[*b]).is_err() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
        };
        let deadline = Duration::from_millis(500);
        let c = Client::new(&format!("http://{addr}"), None)
            .unwrap()
            .with_deadline(deadline);
        let (tx, rx) = mpsc::channel();
        let client = std::thread::spawn(move || {
            let t = Instant::now();
            let r = c.request("GET", "/api/v1/tree", None);
            let _ = tx.send((r.map(|r| r.status), t.elapsed()));
        });
        let got = rx.recv_timeout(deadline + Duration::from_secs(2));
        stop.store(true, Ordering::Relaxed);
        server.join().unwrap();
        let (r, took) = got.expect("the request ended by its deadline and a margin");
        client.join().unwrap();
        let e = r.expect_err("no whole answer was sent");
        assert!(e.contains("within"), "{e}");
        assert!(took >= deadline, "{took:?}");
    }

    #[test]
    fn urls() {
        assert_eq!(
            Client::new("http://127.0.0.1:9090/", None)
                .unwrap()
                .authority,
            "127.0.0.1:9090"
        );
        assert_eq!(
            Client::new("localhost:1", None).unwrap().authority,
            "localhost:1"
        );
        assert!(Client::new("https://x:1", None).is_err());
        assert!(Client::new("http://x", None).is_err());
        assert!(Client::new("http://x:1/api", None).is_err());
    }
}
