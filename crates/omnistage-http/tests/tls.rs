//! TLS end to end: a real `Server` with a TLS listener on 127.0.0.2:0 beside a plaintext one on
//! 127.0.0.1:0, certificates made in the test with rcgen, a rustls client (and raw bytes for
//! the bad handshakes).
//!
//! Assertions are on what the client sees (the version and ALPN protocol negotiated, the
//! certificate served, statuses and bodies, whether the server closed) and on the server's TLS
//! counters; timeouts are tested by waiting for the server to close, never by measuring time.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use omnistage_http::config::parse_config;
use omnistage_http::server::{Server, ServerOptions};
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore, StreamOwned};
use tempfile::TempDir;

/// Read timeout on every client socket: a server that fails to answer or to close fails the
/// test instead of hanging it.
const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a polled counter may take to move.
const POLL_DEADLINE: Duration = Duration::from_secs(5);
const HELLO: &[u8] = b"hello over tls\n";

/// 3 MiB of bytes that do not repeat (an offset mistake cannot go unnoticed): more than the
/// TLS send window and the server's inline limit, so it streams through both.
fn big_content() -> Vec<u8> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut out = Vec::with_capacity(3 << 20);
    while out.len() < 3 << 20 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

/// A certificate and key made for the test, written as PEM files.
struct Cert {
    der: CertificateDer<'static>,
    cert_path: PathBuf,
    key_path: PathBuf,
}

fn make_cert(dir: &Path, name: &str, sans: &[&str]) -> Cert {
    let ck =
        rcgen::generate_simple_self_signed(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())
            .expect("rcgen");
    let cert_path = dir.join(format!("{name}-cert.pem"));
    let key_path = dir.join(format!("{name}-key.pem"));
    std::fs::write(&cert_path, ck.cert.pem()).unwrap();
    std::fs::write(&key_path, ck.key_pair.serialize_pem()).unwrap();
    Cert {
        der: ck.cert.der().clone(),
        cert_path,
        key_path,
    }
}

/// A docroot, the default certificate (for default.test, unknown.test and 127.0.0.2) and
/// tenant a's own (for a.test).
struct Fixture {
    dir: TempDir,
    default: Cert,
    a: Cert,
}

impl Fixture {
    fn new() -> Fixture {
        let dir = tempfile::tempdir().expect("tempdir");
        let www = dir.path().join("www");
        std::fs::create_dir_all(&www).unwrap();
        std::fs::write(www.join("hello.txt"), HELLO).unwrap();
        std::fs::write(www.join("big.bin"), big_content()).unwrap();
        let default = make_cert(
            dir.path(),
            "default",
            &["default.test", "unknown.test", "127.0.0.2"],
        );
        let a = make_cert(dir.path(), "a", &["a.test"]);
        Fixture { dir, default, a }
    }

    fn www(&self) -> PathBuf {
        self.dir.path().join("www")
    }

    /// Plaintext on 127.0.0.1:0, TLS on 127.0.0.2:0; tenant a (a.test, own certificate) and
    /// the catch-all b; `server_extra` adds `[server]` keys; `default_cert` replaces the
    /// default certificate's path.
    fn config(&self, server_extra: &str, default_cert: Option<&Path>) -> String {
        let cert = default_cert.unwrap_or(&self.default.cert_path);
        format!(
            "[server]\nlisten = [\"127.0.0.1:0\"]\nlisten_tls = [\"127.0.0.2:0\"]\n\
             tls_cert = '{}'\ntls_key = '{}'\n{server_extra}\n\
             [[tenant]]\nname = \"a\"\nhosts = [\"a.test\"]\ndocroot = '{}'\n\
             tls_cert = '{}'\ntls_key = '{}'\n\
             [[tenant]]\nname = \"b\"\ndocroot = '{}'\n",
            cert.display(),
            self.default.key_path.display(),
            self.www().display(),
            self.a.cert_path.display(),
            self.a.key_path.display(),
            self.www().display(),
        )
    }
}

/// A running server, drained when dropped (also when a test fails).
struct TestServer {
    server: Option<Server>,
    plain: SocketAddr,
    tls: SocketAddr,
}

impl TestServer {
    fn start(toml: &str) -> TestServer {
        let config = parse_config(toml).unwrap_or_else(|e| panic!("bad test config: {e}\n{toml}"));
        let opts = ServerOptions {
            workers: Some(2),
            ..Default::default()
        };
        let server = Server::start(config, opts).expect("server starts");
        let (plain, tls) = (server.local_addrs()[0], server.local_addrs()[1]);
        TestServer {
            server: Some(server),
            plain,
            tls,
        }
    }

    fn server(&self) -> &Server {
        self.server.as_ref().expect("running")
    }

    /// Waits until `counter` of the server's stats reaches `at_least`.
    fn wait_counter(&self, name: &str, at_least: u64) {
        let deadline = Instant::now() + POLL_DEADLINE;
        loop {
            let s = self.server().stats();
            let v = match name {
                "errors" => s.tls_handshake_errors.load(Ordering::Relaxed),
                "eof" => s.tls_handshake_eof.load(Ordering::Relaxed),
                "timeouts" => s.tls_handshake_timeouts.load(Ordering::Relaxed),
                "record_errors" => s.tls_record_errors.load(Ordering::Relaxed),
                "handshakes" => s.tls_handshakes.load(Ordering::Relaxed),
                _ => unreachable!("a counter of this test"),
            };
            if v >= at_least {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "counter {name} stayed at {v} (< {at_least})"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(s) = self.server.take() {
            s.drain(Duration::from_millis(100));
        }
    }
}

/// A client config trusting `roots`, speaking only `versions`, offering `alpn`.
fn client_config(
    roots: &[&Cert],
    versions: &[&'static rustls::SupportedProtocolVersion],
    alpn: &[&[u8]],
) -> Arc<ClientConfig> {
    let mut store = RootCertStore::empty();
    for c in roots {
        store.add(c.der.clone()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(versions)
        .unwrap()
        .with_root_certificates(store)
        .with_no_client_auth();
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(cfg)
}

type Tls = StreamOwned<ClientConnection, TcpStream>;

fn tls_connect(addr: SocketAddr, cfg: Arc<ClientConfig>, name: &str) -> std::io::Result<Tls> {
    let sock = TcpStream::connect(addr)?;
    sock.set_read_timeout(Some(IO_TIMEOUT))?;
    sock.set_write_timeout(Some(IO_TIMEOUT))?;
    let name = ServerName::try_from(name.to_string()).expect("server name");
    let conn = ClientConnection::new(cfg, name).expect("client connection");
    let mut s = StreamOwned::new(conn, sock);
    // Drive the handshake to its end (or its failure).
    while s.conn.is_handshaking() {
        s.conn.complete_io(&mut s.sock)?;
    }
    Ok(s)
}

/// Sends a GET and reads one response: (status, body).
fn get<S: Read + Write>(s: &mut S, host: &str, path: &str) -> (u16, Vec<u8>) {
    write!(s, "GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n").unwrap();
    s.flush().unwrap();
    read_response(s, &mut Vec::new())
}

/// Reads one response; `buf` carries bytes already read past the previous one (pipelining).
fn read_response<S: Read>(s: &mut S, buf: &mut Vec<u8>) -> (u16, Vec<u8>) {
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = s.read(&mut chunk).expect("read response");
        assert!(n > 0, "closed before a response head: {buf:?}");
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let status: u16 = head[9..12].parse().expect("status");
    let len: usize = head
        .lines()
        .find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().expect("length"))
        })
        .unwrap_or(0);
    while buf.len() < head_end + len {
        let n = s.read(&mut chunk).expect("read body");
        assert!(n > 0, "closed mid-body");
        buf.extend_from_slice(&chunk[..n]);
    }
    let body = buf[head_end..head_end + len].to_vec();
    buf.drain(..head_end + len);
    (status, body)
}

/// Whether the server closes `s` (EOF or reset) within the read timeout.
fn closed_by_server(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 4096];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            // An alert may come first.
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return false
            }
            Err(_) => return true,
        }
    }
}

/// The first bytes a real client sends: its ClientHello record(s).
fn client_hello(fx: &Fixture) -> Vec<u8> {
    let cfg = client_config(&[&fx.default], rustls::ALL_VERSIONS, &[b"http/1.1"]);
    let mut c = ClientConnection::new(cfg, ServerName::try_from("a.test").unwrap()).unwrap();
    let mut out = Vec::new();
    while c.wants_write() {
        c.write_tls(&mut out).unwrap();
    }
    out
}

/// The plaintext listener still serves (and the TLS one, for good measure).
fn assert_still_serves(ts: &TestServer, fx: &Fixture) {
    let mut plain = TcpStream::connect(ts.plain).unwrap();
    plain.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    assert_eq!(get(&mut plain, "x", "/hello.txt"), (200, HELLO.to_vec()));
    let cfg = client_config(&[&fx.a], rustls::ALL_VERSIONS, &[b"http/1.1"]);
    let mut s = tls_connect(ts.tls, cfg, "a.test").expect("handshake");
    assert_eq!(get(&mut s, "a.test", "/hello.txt"), (200, HELLO.to_vec()));
}

#[test]
fn keep_alive_requests_over_tls_1_3_and_1_2_with_alpn() {
    let fx = Fixture::new();
    let ts = TestServer::start(&fx.config("", None));
    for (version, want) in [
        (&rustls::version::TLS13, rustls::ProtocolVersion::TLSv1_3),
        (&rustls::version::TLS12, rustls::ProtocolVersion::TLSv1_2),
    ] {
        let cfg = client_config(&[&fx.a], &[version], &[b"h2", b"http/1.1"]);
        let mut s = tls_connect(ts.tls, cfg, "a.test").expect("handshake");
        assert_eq!(s.conn.protocol_version(), Some(want));
        assert_eq!(s.conn.alpn_protocol(), Some(&b"http/1.1"[..]));
        // Several requests on one connection, then a pipelined pair in one record.
        for _ in 0..3 {
            assert_eq!(get(&mut s, "a.test", "/hello.txt"), (200, HELLO.to_vec()));
        }
        s.write_all(b"GET /hello.txt HTTP/1.1\r\nHost: a.test\r\n\r\nGET /nope HTTP/1.1\r\nHost: a.test\r\n\r\n")
            .unwrap();
        let mut carry = Vec::new();
        assert_eq!(read_response(&mut s, &mut carry), (200, HELLO.to_vec()));
        assert_eq!(read_response(&mut s, &mut carry).0, 404);
        // A large body streams through the TLS send window intact, and the connection
        // goes on.
        assert_eq!(get(&mut s, "a.test", "/big.bin"), (200, big_content()));
        assert_eq!(get(&mut s, "a.test", "/hello.txt"), (200, HELLO.to_vec()));
    }
    ts.wait_counter("handshakes", 2);
    // A client offering no ALPN at all is served too.
    let cfg = client_config(&[&fx.a], rustls::ALL_VERSIONS, &[]);
    let mut s = tls_connect(ts.tls, cfg, "a.test").expect("handshake");
    assert_eq!(s.conn.alpn_protocol(), None);
    assert_eq!(get(&mut s, "a.test", "/hello.txt"), (200, HELLO.to_vec()));
}

/// A TLS client that sends close_notify and shuts its side right after its requests still gets
/// every answer (a large file that needs many writes, then a small one), and then the server's
/// close_notify and close.
#[test]
fn a_half_closed_tls_client_gets_its_answers() {
    let fx = Fixture::new();
    let ts = TestServer::start(&fx.config("", None));
    let cfg = client_config(&[&fx.a], &[&rustls::version::TLS13], &[b"http/1.1"]);
    let mut s = tls_connect(ts.tls, cfg, "a.test").expect("handshake");
    s.write_all(b"GET /big.bin HTTP/1.1\r\nHost: a.test\r\n\r\nGET /hello.txt HTTP/1.1\r\nHost: a.test\r\n\r\n")
        .unwrap();
    s.conn.send_close_notify();
    s.flush().unwrap();
    s.sock.shutdown(std::net::Shutdown::Write).unwrap();
    let mut buf = Vec::new();
    assert_eq!(read_response(&mut s, &mut buf), (200, big_content()));
    assert_eq!(read_response(&mut s, &mut buf), (200, HELLO.to_vec()));
    let mut rest = Vec::new();
    let n = s
        .read_to_end(&mut rest)
        .expect("a clean close: the server's close_notify");
    assert_eq!(n, 0, "nothing after the answers");
}

#[test]
fn a_client_offering_only_other_protocols_is_refused() {
    let fx = Fixture::new();
    let ts = TestServer::start(&fx.config("", None));
    let cfg = client_config(&[&fx.a], rustls::ALL_VERSIONS, &[b"h2"]);
    let e = tls_connect(ts.tls, cfg, "a.test").expect_err("no common protocol");
    assert!(
        e.to_string().contains("NoApplicationProtocol"),
        "the server's alert: {e}"
    );
    ts.wait_counter("errors", 1);
    assert_still_serves(&ts, &fx);
}

#[test]
fn sni_picks_the_tenants_certificate_and_an_unknown_name_gets_the_default() {
    let fx = Fixture::new();
    let ts = TestServer::start(&fx.config("", None));
    let both = client_config(&[&fx.a, &fx.default], rustls::ALL_VERSIONS, &[b"http/1.1"]);
    let served = |name: &str| {
        let s = tls_connect(ts.tls, both.clone(), name).expect("handshake");
        s.conn.peer_certificates().expect("a certificate")[0].clone()
    };
    assert_eq!(served("a.test"), fx.a.der);
    assert_eq!(served("unknown.test"), fx.default.der);
    // An IP address sends no SNI: the default.
    assert_eq!(served("127.0.0.2"), fx.default.der);
    // The Host decides the tenant of each request, as on a plaintext connection.
    let mut s = tls_connect(ts.tls, both, "unknown.test").unwrap();
    assert_eq!(get(&mut s, "unknown.test", "/hello.txt").0, 200);
}

#[test]
fn garbage_bytes_are_counted_and_closed() {
    let fx = Fixture::new();
    let ts = TestServer::start(&fx.config("", None));
    // Plain HTTP on the TLS port, and random bytes.
    for bytes in [
        &b"GET / HTTP/1.1\r\nHost: a.test\r\n\r\n"[..],
        &[0x16, 0x03, 0x01, 0x00, 0x05, 1, 2, 3, 4, 5][..],
        &[0xff; 300][..],
    ] {
        let mut s = TcpStream::connect(ts.tls).unwrap();
        s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        s.write_all(bytes).unwrap();
        assert!(closed_by_server(&mut s), "garbage {bytes:?} left open");
    }
    ts.wait_counter("errors", 3);
    assert_still_serves(&ts, &fx);
}

#[test]
fn a_truncated_handshake_is_counted() {
    let fx = Fixture::new();
    let ts = TestServer::start(&fx.config("", None));
    let hello = client_hello(&fx);
    let mut s = TcpStream::connect(ts.tls).unwrap();
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    s.write_all(&hello[..hello.len() / 2]).unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    assert!(closed_by_server(&mut s));
    ts.wait_counter("eof", 1);
    assert_still_serves(&ts, &fx);
}

#[test]
fn a_slow_handshake_is_closed_by_the_header_timeout() {
    let fx = Fixture::new();
    let ts = TestServer::start(&fx.config("header_timeout_ms = 200", None));
    let hello = client_hello(&fx);
    // Half a ClientHello, then nothing: the server closes it.
    let mut s = TcpStream::connect(ts.tls).unwrap();
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    s.write_all(&hello[..hello.len() / 2]).unwrap();
    assert!(closed_by_server(&mut s), "a stalled handshake stays open");
    // A connection that never sends a byte, the same.
    let mut idle = TcpStream::connect(ts.tls).unwrap();
    idle.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    assert!(closed_by_server(&mut idle));
    ts.wait_counter("timeouts", 2);
    assert_still_serves(&ts, &fx);
}

#[test]
fn a_reload_with_a_bad_certificate_is_refused_and_the_old_one_keeps_serving() {
    let fx = Fixture::new();
    let ts = TestServer::start(&fx.config("", None));
    let cfg = client_config(&[&fx.default], rustls::ALL_VERSIONS, &[b"http/1.1"]);
    let bad = fx.dir.path().join("bad.pem");
    std::fs::write(
        &bad,
        "-----BEGIN CERTIFICATE-----\nnot base64 at all!\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    let missing = fx.dir.path().join("missing.pem");
    // A key that is not the certificate's: refused too.
    let other = make_cert(fx.dir.path(), "other", &["default.test"]);
    for (path, want) in [
        (&bad, "tls_cert"),
        (&missing, "cannot read tls_cert"),
        (&other.cert_path, "tls_cert"),
    ] {
        let config = parse_config(&fx.config("", Some(path))).unwrap();
        let e = ts
            .server()
            .reload(config)
            .expect_err("a bad certificate is refused");
        assert!(
            e.contains(want) && e.contains(&path.display().to_string()),
            "{e}"
        );
        let s = tls_connect(ts.tls, cfg.clone(), "default.test").expect("the old one serves");
        assert_eq!(s.conn.peer_certificates().unwrap()[0], fx.default.der);
    }
    // A good new certificate is taken by the next handshakes.
    let new = make_cert(fx.dir.path(), "new", &["default.test"]);
    let text = fx.config("", Some(&new.cert_path)).replace(
        &fx.default.key_path.display().to_string(),
        &new.key_path.display().to_string(),
    );
    ts.server()
        .reload(parse_config(&text).unwrap())
        .expect("reload");
    let cfg = client_config(&[&new], rustls::ALL_VERSIONS, &[b"http/1.1"]);
    let mut s = tls_connect(ts.tls, cfg, "default.test").expect("the new one serves");
    assert_eq!(s.conn.peer_certificates().unwrap()[0], new.der);
    assert_eq!(
        get(&mut s, "default.test", "/hello.txt"),
        (200, HELLO.to_vec())
    );
}

#[test]
fn a_server_with_a_bad_certificate_does_not_start() {
    let fx = Fixture::new();
    let missing = fx.dir.path().join("missing.pem");
    let config = parse_config(&fx.config("", Some(&missing))).unwrap();
    let e = Server::start(config, ServerOptions::default())
        .err()
        .expect("refused");
    assert!(e.contains("missing.pem"), "{e}");
}

#[test]
fn the_plaintext_listener_is_unaffected() {
    let fx = Fixture::new();
    let ts = TestServer::start(&fx.config("", None));
    // TLS bytes on the plaintext port are a bad request there, nothing more.
    let mut s = TcpStream::connect(ts.plain).unwrap();
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    s.write_all(&client_hello(&fx)).unwrap();
    let mut b = Vec::new();
    let _ = s.read_to_end(&mut b);
    assert!(
        b.starts_with(b"HTTP/1.1 400"),
        "{:?}",
        String::from_utf8_lossy(&b)
    );
    assert_still_serves(&ts, &fx);
    let stats = ts.server().stats();
    assert_eq!(stats.tls_handshake_errors.load(Ordering::Relaxed), 0);
}

#[test]
fn the_handshake_is_charged_to_the_tenant_sni_names() {
    let fx = Fixture::new();
    let ts = TestServer::start(&fx.config("", None));
    let rt = ts.server().runtime();
    let a = rt.activity_id("/tenants/a").expect("tenant a");
    let b = rt.activity_id("/tenants/b").expect("tenant b");
    let messages = |id| {
        rt.snapshot()
            .by_activity()
            .into_iter()
            .find(|(x, _)| *x == id)
            .map_or((0, 0), |(_, row)| (row.messages, row.cpu_ns))
    };
    const HANDSHAKES: u64 = 10;
    let both = client_config(&[&fx.a, &fx.default], rustls::ALL_VERSIONS, &[b"http/1.1"]);
    // Handshakes only, no request: no Host ever names a tenant. The connections stay open
    // until the server has seen each client's Finished.
    let open: Vec<Tls> = (0..HANDSHAKES)
        .map(|_| tls_connect(ts.tls, both.clone(), "a.test").expect("handshake"))
        .collect();
    ts.wait_counter("handshakes", HANDSHAKES);
    drop(open);
    let deadline = Instant::now() + POLL_DEADLINE;
    // The ledger is updated when a dispatch ends, which may be just after the reply left.
    while messages(a).0 < HANDSHAKES && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let (msgs_a, cpu_a) = messages(a);
    assert!(
        msgs_a >= HANDSHAKES && cpu_a > 0,
        "a: {msgs_a} messages, {cpu_a} ns"
    );
    assert_eq!(messages(b), (0, 0), "the catch-all b did nothing");
    // No SNI (an address): the listener's tenant, here the catch-all b, pays.
    for _ in 0..HANDSHAKES {
        tls_connect(ts.tls, both.clone(), "127.0.0.2").expect("handshake");
    }
    let deadline = Instant::now() + POLL_DEADLINE;
    while messages(b).0 < HANDSHAKES && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(messages(b).0 >= HANDSHAKES, "b: {:?}", messages(b));
}

/// A backend for the proxy tests: one thread accepting connections one at a time, each
/// request's head sent to the test, each answered 200 with `body` (Content-Length), keep-alive
/// until the proxy closes.
fn backend(body: Vec<u8>) -> (SocketAddr, std::sync::mpsc::Receiver<String>) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let body = std::sync::Arc::new(body);
    std::thread::spawn(move || {
        // One thread per connection: each of the server's workers keeps its own pooled
        // keep-alive connection to us, and a backend serving one connection at a time left the
        // second worker's request waiting until the first connection closed (the test then
        // timed out whenever the requests landed on different workers: 8 runs in 15).
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            let (tx, body) = (tx.clone(), body.clone());
            std::thread::spawn(move || {
                s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                        match s.read(&mut chunk) {
                            Ok(n) if n > 0 => {
                                buf.extend_from_slice(&chunk[..n]);
                                continue;
                            }
                            _ => break,
                        }
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                    buf.drain(..end + 4);
                    if tx.send(head).is_err() {
                        return;
                    }
                    let out = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len());
                    if s.write_all(out.as_bytes()).is_err() || s.write_all(&body).is_err() {
                        break;
                    }
                }
            });
        }
    });
    (addr, rx)
}

/// Fixture's config with tenant a proxied whole to `upstream` (its docroot stays, unused), and
/// `a_extra` more keys of tenant a.
fn proxied_config(fx: &Fixture, upstream: SocketAddr, a_extra: &str) -> String {
    fx.config("", None).replacen(
        "[[tenant]]\nname = \"a\"\n",
        &format!(
            "[[upstream]]\nname = \"app\"\nservers = [\"{upstream}\"]\n\n\
             [[tenant]]\nname = \"a\"\nupstream = \"app\"\n{a_extra}\n"
        ),
        1,
    )
}

/// A client on the TLS listener, to a tenant proxied to a backend: the response (3 MiB, larger
/// than the TLS send window and the proxy's credit window) arrives intact, twice on one
/// connection, and the backend sees `X-Forwarded-Proto: https`, the client's Host and no
/// hop-by-hop field the client sent.
#[test]
fn a_request_over_tls_is_proxied_with_forwarded_proto_https() {
    let fx = Fixture::new();
    let (up, heads) = backend(big_content());
    let ts = TestServer::start(&proxied_config(&fx, up, ""));
    let cfg = client_config(&[&fx.a], rustls::ALL_VERSIONS, &[b"http/1.1"]);
    let mut s = tls_connect(ts.tls, cfg, "a.test").expect("handshake");
    for _ in 0..2 {
        write!(
            s,
            "GET /app/x?y=1 HTTP/1.1\r\nHost: a.test\r\nConnection: keep-alive, X-Hop\r\nX-Hop: 1\r\n\r\n"
        )
        .unwrap();
        s.flush().unwrap();
        assert_eq!(read_response(&mut s, &mut Vec::new()), (200, big_content()));
        let head = heads.recv_timeout(IO_TIMEOUT).expect("the backend saw it");
        let lower = head.to_ascii_lowercase();
        assert!(head.starts_with("GET /app/x?y=1 HTTP/1.1\r\n"), "{head}");
        assert!(lower.contains("\r\nx-forwarded-proto: https"), "{head}");
        assert!(lower.contains("\r\nhost: a.test"), "{head}");
        assert!(lower.contains("\r\nx-forwarded-host: a.test"), "{head}");
        assert!(!lower.contains("x-hop"), "{head}");
    }
    // The plaintext listener proxies the same tenant with X-Forwarded-Proto: http.
    let mut plain = TcpStream::connect(ts.plain).unwrap();
    plain.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    assert_eq!(get(&mut plain, "a.test", "/p"), (200, big_content()));
    let head = heads.recv_timeout(IO_TIMEOUT).unwrap().to_ascii_lowercase();
    assert!(head.contains("\r\nx-forwarded-proto: http\r\n"), "{head}");
}

/// TLS under a tenant's net cap (a leaky bucket: no burst): a 3 MiB file and a 3 MiB proxied
/// response arrive intact, and neither faster than the cap allows (a lower bound on time, which
/// a busy machine can only make longer); the tenant is charged at least the body's bytes.
#[test]
fn tls_under_a_net_cap_is_shaped_and_intact() {
    const CAP_BYTES_PER_S: f64 = 8e6;
    let fx = Fixture::new();
    let (up, _heads) = backend(big_content());
    let text = proxied_config(
        &fx,
        up,
        &format!(
            "net_cap = \"{}MB/s\"\ncap_kind = \"leaky\"",
            CAP_BYTES_PER_S / 1e6
        ),
    )
    // Tenant a's docroot served under /static/, the rest proxied.
    .replace(
        "upstream = \"app\"\n",
        "upstream = \"app\"\nupstream_prefix = \"/api/\"\n",
    );
    let ts = TestServer::start(&text);
    let rt = ts.server().runtime();
    let a = rt.activity_id("/tenants/a").expect("tenant a");
    let bytes_out = || -> u64 {
        rt.snapshot()
            .rows
            .iter()
            .filter(|r| r.activity == a)
            .map(|r| r.bytes_out)
            .sum()
    };
    let before = bytes_out();
    let cfg = client_config(&[&fx.a], rustls::ALL_VERSIONS, &[b"http/1.1"]);
    let mut s = tls_connect(ts.tls, cfg, "a.test").expect("handshake");
    let want = big_content();
    // Half the ideal time: a margin for the bucket's start, never met without shaping (a
    // loopback transfer of 3 MiB takes milliseconds).
    let floor = Duration::from_secs_f64(0.5 * want.len() as f64 / CAP_BYTES_PER_S);
    for path in ["/big.bin", "/api/big"] {
        let t0 = Instant::now();
        assert_eq!(get(&mut s, "a.test", path), (200, want.clone()), "{path}");
        let took = t0.elapsed();
        assert!(took >= floor, "{path}: {took:?} < {floor:?}: not shaped");
    }
    let deadline = Instant::now() + POLL_DEADLINE;
    while bytes_out() - before < 2 * want.len() as u64 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(bytes_out() - before >= 2 * want.len() as u64);
}

/// A TLS client that reads nothing for a while (a small receive buffer): its answer, handed
/// whole to rustls, waits there for the socket. When the client then sends close_notify and
/// its FIN, the records rustls still holds, and the server's close_notify after them, go out
/// before the close: the client gets every byte and a clean end.
#[test]
fn a_client_that_half_closes_while_its_answer_waits_in_rustls_gets_every_byte() {
    const ANSWER_BYTES: usize = 60_000;
    let fx = Fixture::new();
    let want: Vec<u8> = (0..ANSWER_BYTES).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(fx.www().join("sixty.bin"), &want).unwrap();
    let ts = TestServer::start(&fx.config("", None));
    let cfg = client_config(&[&fx.a], &[&rustls::version::TLS13], &[b"http/1.1"]);
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    // Small, so that the server's socket fills long before the answer is out.
    sock.set_recv_buffer_size(4096).unwrap();
    sock.connect(&ts.tls.into()).unwrap();
    let sock: TcpStream = sock.into();
    sock.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    let name = ServerName::try_from("a.test".to_string()).unwrap();
    let mut s = StreamOwned::new(ClientConnection::new(cfg, name).unwrap(), sock);
    while s.conn.is_handshaking() {
        s.conn.complete_io(&mut s.sock).unwrap();
    }
    s.write_all(b"GET /sixty.bin HTTP/1.1\r\nHost: a.test\r\n\r\n")
        .unwrap();
    s.flush().unwrap();
    // The server hands the answer to rustls and blocks on the full socket.
    std::thread::sleep(Duration::from_millis(200));
    s.conn.send_close_notify();
    s.flush().unwrap();
    s.sock.shutdown(std::net::Shutdown::Write).unwrap();
    // The server reads the FIN while records wait in rustls.
    std::thread::sleep(Duration::from_millis(200));
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let end = loop {
        match s.read(&mut chunk) {
            Ok(0) => break Ok(()),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) => break Err(e),
        }
    };
    let got = buf.len();
    assert!(end.is_ok(), "after {got} bytes: {end:?}");
    let (status, body) = read_response(&mut &[][..], &mut buf);
    assert_eq!(status, 200);
    assert!(body == want, "the body differs ({} bytes)", body.len());
}

/// A `Connection: close` answer over TLS from a tenant with a net cap (its bytes go out through
/// the send scheduler) ends with the server's close_notify, and nothing of it is lost.
#[test]
fn a_closing_tls_answer_under_a_net_cap_ends_with_close_notify() {
    let fx = Fixture::new();
    let text = fx
        .config("", None)
        .replace("name = \"a\"\n", "name = \"a\"\nnet_cap = \"200MB/s\"\n");
    let ts = TestServer::start(&text);
    let cfg = client_config(&[&fx.a], &[&rustls::version::TLS13], &[b"http/1.1"]);
    for path in ["/hello.txt", "/big.bin"] {
        let mut s = tls_connect(ts.tls, cfg.clone(), "a.test").expect("handshake");
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        s.flush().unwrap();
        let mut buf = Vec::new();
        let (status, body) = read_response(&mut s, &mut buf);
        assert_eq!(status, 200, "{path}");
        let want = if path == "/big.bin" {
            big_content()
        } else {
            HELLO.to_vec()
        };
        assert!(body == want, "{path}: the body differs");
        let mut rest = Vec::new();
        let end = s.read_to_end(&mut rest);
        assert!(
            matches!(end, Ok(0)),
            "{path}: {end:?}: no close_notify after the answer"
        );
    }
}

/// A backend that answers every connection's first request with `head_and_part` and then
/// resets the connection (SO_LINGER 0): a response cut mid-body.
fn cutting_backend(head_and_part: &'static [u8]) -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            std::thread::spawn(move || {
                s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut chunk) {
                        Ok(n) if n > 0 => buf.extend_from_slice(&chunk[..n]),
                        _ => return,
                    }
                }
                let _ = s.write_all(head_and_part);
                std::thread::sleep(Duration::from_millis(50));
                let _ = socket2::SockRef::from(&s).set_linger(Some(Duration::ZERO));
            });
        }
    });
    addr
}

/// A proxied response whose end is marked only by the close (no length, no chunks) and whose
/// backend resets mid-body: over TLS, the missing close_notify is the only way the client can
/// tell it was cut. The server took the reset for the end of the body and ended the
/// connection with close_notify, so the cut response read as complete.
#[test]
fn a_proxied_response_cut_by_a_reset_ends_without_close_notify() {
    let fx = Fixture::new();
    let up = cutting_backend(b"HTTP/1.0 200 OK\r\n\r\npartial");
    let ts = TestServer::start(&proxied_config(&fx, up, ""));
    let cfg = client_config(&[&fx.a], rustls::ALL_VERSIONS, &[b"http/1.1"]);
    let mut s = tls_connect(ts.tls, cfg, "a.test").expect("handshake");
    write!(s, "GET /x HTTP/1.0\r\nHost: a.test\r\n\r\n").unwrap();
    s.flush().unwrap();
    let mut got = Vec::new();
    let end = s.read_to_end(&mut got);
    let text = String::from_utf8_lossy(&got).into_owned();
    assert!(
        text.starts_with("HTTP/1.1 200") || text.starts_with("HTTP/1.0 200"),
        "{text}"
    );
    assert!(
        matches!(&end, Err(e) if e.kind() == ErrorKind::UnexpectedEof),
        "{end:?}: the cut response ended as if complete"
    );
}

/// A client resumes its TLS session (no full handshake: no certificate signature, no key
/// exchange of the server's) on a new connection, and still after a reload of the same
/// certificates: the reload built new rustls configs, each with a session store of its own,
/// and every client's next handshake was a full one again.
#[test]
fn a_tls_session_is_resumed_across_a_reload() {
    let fx = Fixture::new();
    let text = fx.config("", None);
    let ts = TestServer::start(&text);
    for versions in [
        &[&rustls::version::TLS13][..],
        &[&rustls::version::TLS12][..],
    ] {
        // One client config: its session cache carries the session to the next connection.
        let cfg = client_config(&[&fx.a], versions, &[b"http/1.1"]);
        let kind = |reload: bool| {
            if reload {
                ts.server()
                    .reload(parse_config(&text).unwrap())
                    .expect("reload");
            }
            let mut s = tls_connect(ts.tls, cfg.clone(), "a.test").expect("handshake");
            // Reading the answer also takes in the server's session tickets (TLS 1.3).
            assert_eq!(get(&mut s, "a.test", "/hello.txt"), (200, HELLO.to_vec()));
            s.conn.handshake_kind()
        };
        assert_eq!(kind(false), Some(rustls::HandshakeKind::Full));
        assert_eq!(
            kind(false),
            Some(rustls::HandshakeKind::Resumed),
            "{versions:?}"
        );
        assert_eq!(
            kind(true),
            Some(rustls::HandshakeKind::Resumed),
            "after a reload, {versions:?}"
        );
    }
}

/// A reload of a file without the TLS listener and its certificates is refused (the listener
/// changes only on restart, and it keeps serving with the certificates it has); it was applied,
/// and every handshake on the running TLS listener was closed for want of a certificate.
#[test]
fn a_reload_without_the_tls_listener_keeps_it_serving() {
    let fx = Fixture::new();
    let ts = TestServer::start(&fx.config("", None));
    let text = format!(
        "[server]\nlisten = [\"127.0.0.1:0\"]\n\n[[tenant]]\nname = \"a\"\nhosts = [\"a.test\"]\ndocroot = '{}'\n",
        fx.www().display()
    );
    let e = ts
        .server()
        .reload(parse_config(&text).unwrap())
        .expect_err("no certificate for the running TLS listener");
    assert!(e.contains("tls_cert"), "{e}");
    let cfg = client_config(&[&fx.a], rustls::ALL_VERSIONS, &[b"http/1.1"]);
    let mut s = tls_connect(ts.tls, cfg, "a.test").expect("the TLS listener still serves");
    assert_eq!(get(&mut s, "a.test", "/hello.txt"), (200, HELLO.to_vec()));
}

/// A record that fails to decrypt after the handshake closes the connection and is counted as
/// a record error, not as a refused handshake (it was counted among the handshake errors).
#[test]
fn a_bad_record_after_the_handshake_is_counted_apart() {
    let fx = Fixture::new();
    let ts = TestServer::start(&fx.config("", None));
    let cfg = client_config(&[&fx.a], &[&rustls::version::TLS13], &[b"http/1.1"]);
    let mut s = tls_connect(ts.tls, cfg, "a.test").expect("handshake");
    assert_eq!(get(&mut s, "a.test", "/hello.txt"), (200, HELLO.to_vec()));
    ts.wait_counter("handshakes", 1);
    // An application-data record of 32 bytes that no key made: its tag cannot match.
    let mut record = vec![0x17, 0x03, 0x03, 0x00, 0x20];
    record.extend_from_slice(&[0x5a; 32]);
    s.sock.write_all(&record).unwrap();
    assert!(closed_by_server(&mut s.sock), "the server closes it");
    ts.wait_counter("record_errors", 1);
    let stats = ts.server().stats();
    assert_eq!(stats.tls_handshake_errors.load(Ordering::Relaxed), 0);
}
