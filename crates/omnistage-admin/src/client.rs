//! A small blocking HTTP/1.1 client for the admin API (what `omnistage top`, `tree`, `set`
//! and `graph` use): `http://host:port` URLs only, one request per connection, a bearer token
//! if given, bounded answer size and timeouts.

use serde::de::DeserializeOwned;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

/// Largest answer read.
pub const RESPONSE_BYTES_MAX: usize = 64 << 20;
/// Connect, read and write timeout.
pub const TIMEOUT: Duration = Duration::from_secs(5);

/// Where the admin API is, and how to authenticate.
#[derive(Clone, Debug)]
pub struct Client {
    /// `host:port`.
    authority: String,
    token: Option<String>,
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
        })
    }

    /// Sends one request and reads the whole answer.
    pub fn request(&self, method: &str, path: &str, body: Option<&[u8]>) -> Result<Reply, String> {
        let addr = self
            .authority
            .to_socket_addrs()
            .map_err(|e| format!("{}: {e}", self.authority))?
            .next()
            .ok_or_else(|| format!("{}: no address", self.authority))?;
        let mut s = TcpStream::connect_timeout(&addr, TIMEOUT)
            .map_err(|e| format!("cannot reach the admin API at http://{addr}: {e}"))?;
        s.set_read_timeout(Some(TIMEOUT))
            .map_err(|e| e.to_string())?;
        s.set_write_timeout(Some(TIMEOUT))
            .map_err(|e| e.to_string())?;
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
        s.write_all(head.as_bytes()).map_err(|e| e.to_string())?;
        if let Some(b) = body {
            s.write_all(b).map_err(|e| e.to_string())?;
        }
        let mut buf = Vec::new();
        Read::by_ref(&mut s)
            .take(RESPONSE_BYTES_MAX as u64 + 1)
            .read_to_end(&mut buf)
            .map_err(|e| format!("reading the answer: {e}"))?;
        if buf.len() > RESPONSE_BYTES_MAX {
            return Err("answer larger than 64 MiB".into());
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

#[cfg(test)]
mod tests {
    use super::*;

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
