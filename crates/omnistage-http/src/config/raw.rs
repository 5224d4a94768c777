//! The configuration as written in the file: serde's form, every value with its span (for
//! error messages that point at the line and column), before any check.

use serde::Deserialize;
use toml::Spanned;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    pub(super) server: Option<Spanned<RawServer>>,
    pub(super) tenant: Option<Spanned<Vec<Spanned<RawTenant>>>>,
    pub(super) cluster: Option<Spanned<RawCluster>>,
    pub(super) upstream: Option<Spanned<Vec<Spanned<RawUpstream>>>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCluster {
    pub(super) redis: Spanned<String>,
    pub(super) node: Option<Spanned<String>>,
    pub(super) sync_ms: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawUpstream {
    pub(super) name: Spanned<String>,
    pub(super) servers: Spanned<Vec<Spanned<String>>>,
    pub(super) concurrency_max: Option<Spanned<i64>>,
    pub(super) connect_timeout_ms: Option<Spanned<i64>>,
    pub(super) response_timeout_ms: Option<Spanned<i64>>,
    pub(super) idle_connections_max: Option<Spanned<i64>>,
    pub(super) fair: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServer {
    pub(super) listen: Option<Spanned<Vec<Spanned<String>>>>,
    pub(super) workers: Option<Spanned<i64>>,
    pub(super) connections_max: Option<Spanned<i64>>,
    pub(super) header_timeout_ms: Option<Spanned<i64>>,
    pub(super) keepalive_timeout_ms: Option<Spanned<i64>>,
    pub(super) pipeline_depth_max: Option<Spanned<i64>>,
    pub(super) access_log: Option<Spanned<String>>,
    pub(super) cache_bytes_max: Option<Spanned<i64>>,
    pub(super) net_link_cap: Option<Spanned<String>>,
    pub(super) disk_threads: Option<Spanned<i64>>,
    pub(super) disk_direct: Option<bool>,
    pub(super) disk_cap: Option<Spanned<String>>,
    pub(super) sendfile: Option<bool>,
    pub(super) sendfile_min_bytes: Option<Spanned<i64>>,
    pub(super) listen_tls: Option<Spanned<Vec<Spanned<String>>>>,
    pub(super) tls_cert: Option<Spanned<String>>,
    pub(super) tls_key: Option<Spanned<String>>,
    pub(super) body_bytes_max: Option<Spanned<i64>>,
    pub(super) wake_credit_us: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTenant {
    pub(super) name: Spanned<String>,
    pub(super) hosts: Option<Spanned<Vec<Spanned<String>>>>,
    pub(super) listen: Option<Spanned<Vec<Spanned<String>>>>,
    pub(super) weight: Option<Spanned<i64>>,
    pub(super) docroot: Option<Spanned<String>>,
    pub(super) index: Option<Spanned<Vec<Spanned<String>>>>,
    pub(super) cpu_cap: Option<Spanned<NumberOrString>>,
    pub(super) net_cap: Option<Spanned<String>>,
    pub(super) disk_cap: Option<Spanned<String>>,
    pub(super) cap_kind: Option<Spanned<String>>,
    pub(super) send_order: Option<Spanned<String>>,
    pub(super) cache_bytes: Option<Spanned<i64>>,
    pub(super) p90_target_ms: Option<Spanned<i64>>,
    pub(super) connections_max: Option<Spanned<i64>>,
    pub(super) synthetic: Option<bool>,
    pub(super) class: Option<Vec<Spanned<RawClass>>>,
    pub(super) tls_cert: Option<Spanned<String>>,
    pub(super) tls_key: Option<Spanned<String>>,
    pub(super) fleet_rate_per_s: Option<Spanned<i64>>,
    pub(super) fleet_net_cap: Option<Spanned<String>>,
    pub(super) upstream: Option<Spanned<String>>,
    pub(super) upstream_prefix: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawClass {
    pub(super) name: Spanned<String>,
    pub(super) header: Option<Spanned<String>>,
    pub(super) prefix: Option<Spanned<String>>,
    pub(super) weight: Option<Spanned<i64>>,
    pub(super) priority: Option<Spanned<i64>>,
    pub(super) p90_target_ms: Option<Spanned<i64>>,
}

#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum NumberOrString {
    Number(f64),
    String(String),
}
