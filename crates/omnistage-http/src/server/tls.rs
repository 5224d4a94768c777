//! TLS on a connection (rustls with the `ring` provider), driven by the worker's own readiness
//! events: no thread, no blocking call. It owns the certificates ([`TlsConfigs`]: the default
//! one and each tenant's, chosen by SNI; loaded at start and on every reload, a file that does
//! not load refusing the reload), a TLS connection's state ([`TlsConn`]: accepting, accepted
//! and waiting for its tenant's turn, open), reading records into the connection's plaintext
//! input buffer, and the output side: a [`Sink`] that encrypts what `output.rs` writes.
//!
//! Who pays for a handshake: the ClientHello is read and parsed in `/infra` (nobody knows the
//! tenant before SNI); then the connection's readiness moves to the tenant SNI names (or the
//! listener's tenant) and the expensive half (key exchange, signature) runs in a continuation
//! in that tenant's activity. Encryption happens where the output is written, i.e. in the
//! activity of the tenant whose response it is.
//!
//! Once the handshake is done, plaintext goes into `Conn::inbuf` and from there through the
//! same parse, work and send path as a plaintext connection, under the same limits (the input
//! bound, the header timeout from the accept until the first request, the no-progress
//! deadline while output waits).

use super::conn::{close, Conn, READ_CHUNK_BYTES};
use super::cont::yield_conn;
use super::core_server::CoreServer;
use super::output::{Output, Sink};
use crate::config::Config;
use omnistage::activity::INFRA;
use omnistage::exec::Ctx;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{Accepted, Acceptor, ServerSessionMemoryCache, StoresServerSessions};
use rustls::{ServerConfig, ServerConnection};
use std::fs::File;
use std::io::{IoSlice, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Largest PEM file read (a chain of a few certificates is a few KiB).
const PEM_BYTES_MAX: u64 = 1 << 20;
/// Most `read_tls` calls per readiness event before the connection yields (a client sending
/// records that carry no plaintext must not hold the worker).
const TLS_READS_PER_EVENT_MAX: usize = 64;
/// Encrypted bytes rustls may hold for one connection before the sink says `WouldBlock`
/// (records waiting for the socket): the TLS side of the credit window.
const TLS_SENDABLE_BYTES_MAX: usize = 64 * 1024;
/// Plaintext of a file segment encrypted per call (one TLS record's worth).
const FILE_CHUNK_BYTES: usize = 16 * 1024;

/// TLS sessions the server remembers for resumption (all certificates together; rustls
/// resumes a session only for the same server name and cipher suite). An entry is a few
/// hundred bytes, so this is a few MiB at most; nginx's usual `ssl_session_cache
/// shared:SSL:10m` holds about 40,000. rustls's default, 256 per config, is gone in a moment
/// on a busy server.
const TLS_SESSIONS_MAX: usize = 20_480;

/// The certificates of a configuration, each as a rustls server config: the default one and,
/// per tenant (config order), its own or the default.
pub(super) struct TlsConfigs {
    default: Arc<ServerConfig>,
    tenants: Vec<Arc<ServerConfig>>,
    /// The session store every config here shares, handed on to the configs of the next
    /// reload: a reload that changed no certificate must not turn every client's next
    /// handshake into a full one (a burst of key exchanges and signatures).
    sessions: Arc<dyn StoresServerSessions>,
}

impl TlsConfigs {
    /// Loads the certificates `config` names; `None` when it has no TLS listener. An error names
    /// the file and what is wrong with it.
    /// `before`: the configs this replaces, whose session store the new ones keep.
    pub(super) fn load(
        config: &Config,
        before: Option<&TlsConfigs>,
    ) -> Result<Option<Arc<TlsConfigs>>, String> {
        let s = &config.server;
        if s.listen_tls.is_empty() {
            return Ok(None);
        }
        let (Some(cert), Some(key)) = (&s.tls_cert, &s.tls_key) else {
            return Err("listen_tls needs tls_cert and tls_key".into());
        };
        let sessions = before.map_or_else(
            || ServerSessionMemoryCache::new(TLS_SESSIONS_MAX) as Arc<dyn StoresServerSessions>,
            |b| b.sessions.clone(),
        );
        let default = server_config(cert, key, &sessions)?;
        let mut tenants = Vec::with_capacity(config.tenants.len());
        for t in &config.tenants {
            tenants.push(match (&t.tls_cert, &t.tls_key) {
                (Some(c), Some(k)) => server_config(c, k, &sessions)
                    .map_err(|e| format!("tenant {:?}: {e}", t.name))?,
                _ => default.clone(),
            });
        }
        Ok(Some(Arc::new(TlsConfigs {
            default,
            tenants,
            sessions,
        })))
    }

    fn for_tenant(&self, tenant: Option<usize>) -> Arc<ServerConfig> {
        tenant
            .and_then(|t| self.tenants.get(t))
            .unwrap_or(&self.default)
            .clone()
    }
}

fn read_pem(path: &Path, what: &str) -> Result<Vec<u8>, String> {
    let f = File::open(path).map_err(|e| format!("cannot read {what} {}: {e}", path.display()))?;
    let mut v = Vec::new();
    f.take(PEM_BYTES_MAX + 1)
        .read_to_end(&mut v)
        .map_err(|e| format!("cannot read {what} {}: {e}", path.display()))?;
    if v.len() as u64 > PEM_BYTES_MAX {
        return Err(format!(
            "{what} {} is larger than {PEM_BYTES_MAX} bytes",
            path.display()
        ));
    }
    Ok(v)
}

/// One certificate chain and key as a rustls server config: TLS 1.3 and 1.2, ALPN `http/1.1`,
/// resuming sessions from `sessions`.
fn server_config(
    cert: &Path,
    key: &Path,
    sessions: &Arc<dyn StoresServerSessions>,
) -> Result<Arc<ServerConfig>, String> {
    let cert_pem = read_pem(cert, "tls_cert")?;
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("tls_cert {}: not a PEM certificate: {e}", cert.display()))?;
    if chain.is_empty() {
        return Err(format!(
            "tls_cert {}: no CERTIFICATE block in the file",
            cert.display()
        ));
    }
    let key_pem = read_pem(key, "tls_key")?;
    let key_der = PrivateKeyDer::from_pem_slice(&key_pem)
        .map_err(|e| format!("tls_key {}: no PEM private key: {e}", key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut sc = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| format!("TLS versions: {e}"))?
        .with_no_client_auth()
        .with_single_cert(chain, key_der)
        .map_err(|e| {
            format!(
                "tls_cert {} with tls_key {}: {e}",
                cert.display(),
                key.display()
            )
        })?;
    sc.alpn_protocols = vec![b"http/1.1".to_vec()];
    sc.session_storage = sessions.clone();
    Ok(Arc::new(sc))
}

/// A TLS connection's state.
enum State {
    /// Reading the ClientHello (in `/infra`).
    Accepting(Acceptor),
    /// The ClientHello is in and the certificate chosen; the handshake goes on in a
    /// continuation in the tenant's activity.
    Accepted(Box<(Accepted, Arc<ServerConfig>)>),
    Open(ServerConnection),
    /// The handshake failed; the connection is being closed.
    Failed,
}

/// The TLS side of a connection.
pub(super) struct TlsConn {
    state: State,
    /// A read stopped at its per-event bound with records maybe left in the socket: the
    /// continuation reads on (the socket will not signal again for bytes it already holds).
    reread: bool,
}

impl TlsConn {
    pub(super) fn accepting() -> TlsConn {
        TlsConn {
            state: State::Accepting(Acceptor::default()),
            reread: false,
        }
    }

    /// Whether the handshake is not finished.
    pub(super) fn handshaking(&self) -> bool {
        match &self.state {
            State::Open(c) => c.is_handshaking(),
            _ => true,
        }
    }

    /// Whether encrypted bytes wait for the socket.
    pub(super) fn wants_write(&self) -> bool {
        matches!(&self.state, State::Open(c) if c.wants_write())
    }

    /// Writes the encrypted bytes rustls holds. `Ok(true)`: all written; `Ok(false)`: the
    /// socket is full (a writable event comes when it drains).
    pub(super) fn push(&mut self, sock: &mut mio::net::TcpStream) -> std::io::Result<bool> {
        let State::Open(c) = &mut self.state else {
            return Ok(true);
        };
        push(c, sock)
    }

    /// Queues a close_notify alert (sent by the next `push`).
    pub(super) fn close_notify(&mut self) {
        if let State::Open(c) = &mut self.state {
            c.send_close_notify();
        }
    }

    /// Encrypts up to `max` bytes of `out` and writes what the socket takes: `write_to` through
    /// the TLS sink.
    pub(super) fn write_out(
        &mut self,
        out: &mut Output,
        sock: &mut mio::net::TcpStream,
        max: usize,
    ) -> std::io::Result<usize> {
        let State::Open(conn) = &mut self.state else {
            // No response is written before the handshake is done.
            return Err(std::io::ErrorKind::WouldBlock.into());
        };
        out.write_to(&mut TlsSink { conn, sock }, max)
    }
}

fn push(c: &mut ServerConnection, sock: &mut mio::net::TcpStream) -> std::io::Result<bool> {
    // Bounded: each round writes at least one byte or ends.
    while c.wants_write() {
        match c.write_tls(sock) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Plaintext in, records out: the output queue writes into this as into a socket.
struct TlsSink<'a> {
    conn: &'a mut ServerConnection,
    sock: &'a mut mio::net::TcpStream,
}

impl Write for TlsSink<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
        // Records from before go first: rustls holds at most one window of them.
        if !push(self.conn, self.sock)? {
            return Err(std::io::ErrorKind::WouldBlock.into());
        }
        let n = self.conn.writer().write_vectored(bufs)?;
        // What the socket does not take now goes on its next writable event (`flush`).
        push(self.conn, self.sock)?;
        if n == 0 && bufs.iter().any(|b| !b.is_empty()) {
            return Err(std::io::ErrorKind::WouldBlock.into());
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Sink for TlsSink<'_> {
    fn send_file(&mut self, file: &File, offset: u64, len: usize) -> std::io::Result<usize> {
        // No sendfile through TLS: the file's bytes are read here and encrypted.
        let mut chunk = [0u8; FILE_CHUNK_BYTES];
        let want = len.min(FILE_CHUNK_BYTES);
        let got = file.read_at(&mut chunk[..want], offset)?;
        if got == 0 {
            return Ok(0);
        }
        self.write(&chunk[..got])
    }
}

/// What became of a handshake, for the counters.
enum Outcome {
    Garbage,
    Truncated,
    /// A bad record after the handshake (a decrypt or MAC failure, a protocol error).
    BadRecord,
}

fn count(cs: &CoreServer, o: Outcome) {
    let stats = &cs.shared.stats;
    match o {
        Outcome::Garbage => stats.tls_handshake_errors.fetch_add(1, Ordering::Relaxed),
        Outcome::Truncated => stats.tls_handshake_eof.fetch_add(1, Ordering::Relaxed),
        Outcome::BadRecord => stats.tls_record_errors.fetch_add(1, Ordering::Relaxed),
    };
}

/// Reads what the socket holds through TLS: the ClientHello (choosing the certificate and the
/// tenant), the rest of the handshake, then records whose plaintext goes into the input buffer
/// (up to the same bound as a plaintext connection). Returns false when the connection closed.
pub(super) fn read(ctx: &mut Ctx<'_>, cs: &mut CoreServer, key: u64) -> bool {
    let limit = cs.limits.header_bytes_max + READ_CHUNK_BYTES;
    let now = ctx.now_ns();
    let tls_configs = cs.live.tls.clone();
    let Some(c) = cs.conn(key) else { return false };
    let Some(t) = c.tls.as_mut() else {
        return false;
    };
    t.reread = false;
    if let State::Accepting(acc) = &mut t.state {
        let accepted = loop {
            match acc.read_tls(&mut c.stream) {
                Ok(0) => {
                    count(cs, Outcome::Truncated);
                    close(ctx, cs, key);
                    return false;
                }
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => {
                    // Includes a ClientHello larger than rustls buffers.
                    count(cs, Outcome::Garbage);
                    close(ctx, cs, key);
                    return false;
                }
            }
            match acc.accept() {
                Ok(None) => {}
                Ok(Some(a)) => break a,
                Err((_, mut alert)) => {
                    let _ = alert.write(&mut c.stream);
                    count(cs, Outcome::Garbage);
                    close(ctx, cs, key);
                    return false;
                }
            }
        };
        let Some(configs) = tls_configs else {
            // TLS was configured away by a reload; nothing to serve this with.
            close(ctx, cs, key);
            return false;
        };
        let sni = accepted
            .client_hello()
            .server_name()
            .map(|s| s.trim_end_matches('.').to_ascii_lowercase());
        let local = c.local;
        let cfg = &cs.live.config;
        let tenant = cfg.tenant_for(sni.as_deref(), local);
        // The tenant's own certificate when SNI names one of its hosts or the listener is its
        // own; the catch-all and unknown names get the default.
        let own = tenant.filter(|&i| {
            let t = &cfg.tenants[i];
            t.listen.contains(&local) || sni.as_ref().is_some_and(|s| t.hosts.contains(s))
        });
        let config = configs.for_tenant(own);
        // The key exchange and signature are the tenant's work once SNI (or the listener)
        // names it.
        let activity = tenant.map_or(INFRA, |i| cs.live.tenants[i].activity);
        let c = cs.conn(key).expect("live");
        c.tls.as_mut().expect("tls").state = State::Accepted(Box::new((accepted, config)));
        if activity != c.activity {
            c.activity = activity;
            let _ = ctx.io_set_activity(c.handle, activity);
        }
        yield_conn(ctx, cs, key, activity);
        return true;
    }
    if matches!(t.state, State::Accepted(_)) {
        let State::Accepted(b) = std::mem::replace(&mut t.state, State::Failed) else {
            unreachable!("matched above")
        };
        let (accepted, config) = *b;
        match accepted.into_connection(config) {
            Ok(mut conn) => {
                conn.set_buffer_limit(Some(TLS_SENDABLE_BYTES_MAX));
                t.state = State::Open(conn);
            }
            Err((_, mut alert)) => {
                let _ = alert.write(&mut c.stream);
                count(cs, Outcome::Garbage);
                close(ctx, cs, key);
                return false;
            }
        }
    }
    let State::Open(conn) = &mut t.state else {
        close(ctx, cs, key);
        return false;
    };
    let was_handshaking = conn.is_handshaking();
    let scratch = &mut cs.scratch;
    let c = cs.conns[(key & 0xFFFF_FFFF) as usize]
        .as_mut()
        .expect("live");
    // Out of the connection while its input buffer fills; back before anything else.
    let mut tls = c.tls.take().expect("tls above");
    let State::Open(conn) = &mut tls.state else {
        unreachable!("open above")
    };
    c.read_stalled = false;
    let mut failed: Option<Outcome> = None;
    let mut closed = false;
    // The client finished sending (close_notify, or a FIN after the handshake): what it sent
    // before is still answered ([`Conn::read_eof`]).
    let mut eof = false;
    let mut more = true;
    'reads: for _ in 0..TLS_READS_PER_EVENT_MAX {
        // Plaintext rustls holds goes to the input buffer first (rustls refuses to read more
        // records while it holds a full buffer of it).
        loop {
            if c.inbuf.len() >= limit {
                c.read_stalled = true;
                more = false;
                break 'reads;
            }
            let room = (limit - c.inbuf.len()).min(scratch.len());
            match conn.reader().read(&mut scratch[..room]) {
                Ok(0) => {
                    // close_notify: the client sends nothing more.
                    eof = true;
                    more = false;
                    break 'reads;
                }
                Ok(n) => c.take_input(&scratch[..n], now),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    closed = true;
                    break 'reads;
                }
            }
        }
        match conn.read_tls(&mut c.stream) {
            Ok(0) => {
                if conn.is_handshaking() {
                    failed = Some(Outcome::Truncated);
                    closed = true;
                } else {
                    eof = true;
                    more = false;
                }
                break;
            }
            Ok(_) => {
                if conn.process_new_packets().is_err() {
                    failed = Some(if conn.is_handshaking() {
                        Outcome::Garbage
                    } else {
                        Outcome::BadRecord
                    });
                    // The alert rustls queued goes out, as far as the socket takes it.
                    let _ = push(conn, &mut c.stream);
                    closed = true;
                    break;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                more = false;
                break;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => {
                closed = true;
                break;
            }
        }
    }
    let done_handshake = was_handshaking && !conn.is_handshaking();
    // Handshake flights and alerts; the rest waits for a writable event.
    if !closed && push(conn, &mut c.stream).is_err() {
        closed = true;
    }
    c.tls = Some(tls);
    if done_handshake {
        cs.shared
            .stats
            .tls_handshakes
            .fetch_add(1, Ordering::Relaxed);
    }
    if let Some(o) = failed {
        count(cs, o);
    }
    if closed {
        close(ctx, cs, key);
        return false;
    }
    if eof {
        let c = cs.conn(key).expect("live");
        c.read_eof = true;
        // As on plaintext (`read_more_then`): a proxied request is abandoned.
        if c.proxy.is_some() {
            close(ctx, cs, key);
            return false;
        }
        if c.answered_all_after_eof() {
            // Records rustls still holds, then its close_notify, go out before the close.
            return super::conn::flush(ctx, cs, key);
        }
        return true;
    }
    if more {
        // Records may remain in the socket: come back after the others had their turn.
        let c = cs.conn(key).expect("live");
        let activity = c.activity;
        if let Some(t) = c.tls.as_mut() {
            t.reread = true;
        }
        yield_conn(ctx, cs, key, activity);
    }
    true
}

/// Whether the connection is TLS and its continuation must read: the handshake waits for it
/// (the ClientHello is in), or a read stopped at its bound.
pub(super) fn awaiting(c: &Conn) -> bool {
    c.tls
        .as_ref()
        .is_some_and(|t| t.reread || matches!(t.state, State::Accepted(_)))
}
