//! omnistage-http: the pure pieces of omnistage's multi-tenant static HTTP/1.1 server.
//!
//! All modules but `server` are pure: nothing there owns a socket, a thread or a clock; every
//! function takes bytes, paths and times as arguments, so each rule is tested by feeding it
//! input. `server` is the glue: the stages, connections and sockets on the omnistage runtime.
//!
//! ```text
//! ascii ────── byte-safe prefix checks on untrusted strs (no slicing inside a character)
//! request ──── request heads: bytes → Request | Partial | HttpError (httparse)
//! path ─────── request target → decoded, normalized path → a file inside the docroot
//! mime ─────── file extension → Content-Type
//! cond ─────── ETag, Last-Modified, If-None-Match/If-Modified-Since, Range/If-Range
//! response ─── status lines and headers, error responses, the cached Date header
//! config ───── the server and its tenants from TOML; Host/listener → tenant
//! synthetic ── the /_burn and /_bytes test endpoints
//! proxy ────── the reverse proxy's intermediary rules: upstream response heads (httparse),
//!              chunked bodies, the heads forwarded each way
//! fair_slots ─ an upstream's concurrency slots shared by tenants: per-tenant queues, SFQ by weight
//! log ──────── access log lines (Common Log Format plus the activity)
//! error ────── HttpError: status, reason, and whether the connection must close
//! server ───── the running server: listeners, connections, stages (uses all of the above)
//! ```

#![forbid(unsafe_code)]

pub mod ascii;
pub mod cond;
pub mod config;
pub mod error;
pub mod fair_slots;
pub mod log;
pub mod mime;
pub mod path;
pub mod proxy;
pub mod request;
pub mod response;
pub mod server;
pub mod synthetic;

pub use error::HttpError;
