//! Checking the raw form: every key against its limits, with an error that names the line and
//! column; the whole file, the `[server]`, `[cluster]` and `[[upstream]]` tables. A tenant's
//! table is checked in `tenant.rs`.

use super::raw::*;
use super::tenant::tenant_config;
use super::*;
use toml::Spanned;

pub(super) struct Checker<'a> {
    pub(super) text: &'a str,
}

impl Checker<'_> {
    pub(super) fn err(&self, span: Range<usize>, message: impl Into<String>) -> ConfigError {
        let (line, column) = line_col(self.text, span.start);
        ConfigError {
            path: None,
            line: Some(line),
            column: Some(column),
            message: message.into(),
        }
    }

    pub(super) fn int_in(
        &self,
        v: &Spanned<i64>,
        key: &str,
        min: i64,
        max: i64,
    ) -> Result<i64, ConfigError> {
        let n = *v.get_ref();
        if n < min || n > max {
            return Err(self.err(v.span(), format!("{key} {n} is outside {min}..={max}")));
        }
        Ok(n)
    }

    pub(super) fn opt_int_in(
        &self,
        v: &Option<Spanned<i64>>,
        key: &str,
        min: i64,
        max: i64,
    ) -> Result<Option<i64>, ConfigError> {
        v.as_ref()
            .map(|v| self.int_in(v, key, min, max))
            .transpose()
    }

    pub(super) fn name(&self, v: &Spanned<String>, what: &str) -> Result<String, ConfigError> {
        let s = v.get_ref();
        let ok = !s.is_empty()
            && s.len() <= NAME_BYTES_MAX
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
        if !ok {
            return Err(self.err(
                v.span(),
                format!("{what} name {s:?} must be 1..={NAME_BYTES_MAX} characters of [a-z0-9_-]"),
            ));
        }
        Ok(s.clone())
    }

    pub(super) fn addr(&self, v: &Spanned<String>) -> Result<SocketAddr, ConfigError> {
        v.get_ref().parse().map_err(|_| {
            self.err(
                v.span(),
                format!(
                    "{:?} is not an address like 127.0.0.1:8080 or [::1]:8080",
                    v.get_ref()
                ),
            )
        })
    }

    /// `tls_cert` and `tls_key`: both or neither, non-empty, relative to the config's directory.
    pub(super) fn cert_pair(
        &self,
        cert: &Option<Spanned<String>>,
        key: &Option<Spanned<String>>,
        base: Option<&Path>,
    ) -> Result<(Option<PathBuf>, Option<PathBuf>), ConfigError> {
        match (cert, key) {
            (None, None) => Ok((None, None)),
            (Some(c), Some(k)) => {
                for v in [c, k] {
                    if v.get_ref().trim().is_empty() {
                        return Err(self.err(v.span(), "a TLS file path is empty"));
                    }
                }
                Ok((
                    Some(rebase(base, Path::new(c.get_ref()))),
                    Some(rebase(base, Path::new(k.get_ref()))),
                ))
            }
            (Some(v), None) => Err(self.err(v.span(), "tls_cert needs tls_key")),
            (None, Some(v)) => Err(self.err(v.span(), "tls_key needs tls_cert")),
        }
    }

    pub(super) fn rate(
        &self,
        v: &Option<Spanned<String>>,
        key: &str,
    ) -> Result<Option<u64>, ConfigError> {
        v.as_ref()
            .map(|v| parse_rate(v.get_ref()).map_err(|m| self.err(v.span(), format!("{key}: {m}"))))
            .transpose()
    }
}

pub(super) fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(text.len());
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = before[line_start..].chars().count() + 1;
    (line, column)
}

/// Parses a rate such as `10MB/s`, `1.5 GiB/s`, `500B/s` into bytes per second.
pub fn parse_rate(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let Some(amount) = s.strip_suffix("/s") else {
        return Err(format!("rate {s:?} must end in /s, like \"10MB/s\""));
    };
    let split = amount
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(amount.len());
    let (number, unit) = (&amount[..split], amount[split..].trim());
    let multiplier: u64 = match unit {
        "B" => 1,
        "kB" | "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => {
            return Err(format!(
                "rate {s:?} has unit {unit:?}; use B, kB, KB, MB, GB, KiB, MiB or GiB"
            ))
        }
    };
    let value: f64 = number
        .parse()
        .map_err(|_| format!("rate {s:?} does not start with a number"))?;
    let bytes = (value * multiplier as f64).round();
    if !(bytes >= 1.0 && bytes <= RATE_BYTES_PER_S_MAX as f64) {
        return Err(format!("rate {s:?} is outside 1 B/s..=1 TB/s"));
    }
    Ok(bytes as u64)
}

/// Normalizes a configured host: lowercase, no trailing dot, no port.
pub(super) fn normalize_config_host(raw: &str) -> Result<String, String> {
    let lower = raw.trim().to_ascii_lowercase();
    let name = lower.strip_suffix('.').unwrap_or(&lower);
    if name.is_empty() || name.len() > HOST_BYTES_MAX {
        return Err(format!(
            "host {raw:?} must be 1..={HOST_BYTES_MAX} characters"
        ));
    }
    if let Some(inner) = name.strip_prefix('[') {
        let Some(inner) = inner.strip_suffix(']') else {
            return Err(format!(
                "host {raw:?}: an IPv6 literal is written [::1], without a port"
            ));
        };
        if inner.is_empty()
            || !inner
                .bytes()
                .all(|b| b.is_ascii_hexdigit() || b == b':' || b == b'.')
        {
            return Err(format!("host {raw:?} is not a valid IPv6 literal"));
        }
        return Ok(name.to_string());
    }
    if name.contains(':') {
        return Err(format!(
            "host {raw:?}: hosts are matched without their port; drop it"
        ));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=%".contains(&b))
    {
        return Err(format!(
            "host {raw:?} has characters a host name cannot have"
        ));
    }
    Ok(name.to_string())
}

pub(super) fn parse_with_base(text: &str, base: Option<&Path>) -> Result<Config, ConfigError> {
    let c = Checker { text };
    let raw: RawConfig = toml::from_str(text).map_err(|e| {
        let (line, column) = match e.span() {
            Some(span) => {
                let (l, col) = line_col(text, span.start);
                (Some(l), Some(col))
            }
            None => (None, None),
        };
        ConfigError {
            path: None,
            line,
            column,
            message: e.message().trim().to_string(),
        }
    })?;

    let server = match &raw.server {
        Some(s) => server_config(&c, s.get_ref(), base)?,
        None => ServerConfig::default(),
    };

    let Some(raw_tenants) = &raw.tenant else {
        return Err(ConfigError {
            path: None,
            line: None,
            column: None,
            message: "no [[tenant]]: at least one tenant is required".into(),
        });
    };
    if raw_tenants.get_ref().is_empty() {
        return Err(c.err(
            raw_tenants.span(),
            "no [[tenant]]: at least one tenant is required",
        ));
    }
    if raw_tenants.get_ref().len() > TENANTS_MAX {
        return Err(c.err(
            raw_tenants.span(),
            format!("more than {TENANTS_MAX} tenants"),
        ));
    }

    let cluster = raw
        .cluster
        .as_ref()
        .map(|r| cluster_config(&c, r.get_ref()))
        .transpose()?;
    let mut upstreams: Vec<UpstreamConfig> = Vec::new();
    if let Some(list) = &raw.upstream {
        if list.get_ref().len() > UPSTREAMS_MAX {
            return Err(c.err(list.span(), format!("more than {UPSTREAMS_MAX} upstreams")));
        }
        for ru in list.get_ref() {
            let u = upstream_config(&c, ru.get_ref())?;
            if upstreams.iter().any(|x| x.name == u.name) {
                return Err(c.err(
                    ru.get_ref().name.span(),
                    format!("upstream name {:?} is used twice", u.name),
                ));
            }
            upstreams.push(u);
        }
    }

    let mut tenants = Vec::with_capacity(raw_tenants.get_ref().len());
    let mut names = HashSet::new();
    let mut hosts_seen: HashSet<String> = HashSet::new();
    let mut listeners_taken: HashSet<SocketAddr> = HashSet::new();
    let mut catch_all_seen = false;
    let mut activities = 0;
    for raw_tenant in raw_tenants.get_ref() {
        let t = tenant_config(&c, raw_tenant, &server, &upstreams, base)?;
        let rt = raw_tenant.get_ref();
        activities += 1 + t.classes.len();
        if activities > TENANT_ACTIVITIES_MAX {
            return Err(c.err(
                raw_tenant.span(),
                format!(
                    "tenants and classes together are more than {TENANT_ACTIVITIES_MAX} \
                     activities (the runtime holds {}, and a reload needs room for the old \
                     and the new classes at once)",
                    omnistage::activity::ACTIVITIES_MAX
                ),
            ));
        }
        if cluster.is_none() {
            let key = (rt
                .fleet_rate_per_s
                .as_ref()
                .map(|v| (v.span(), "fleet_rate_per_s")))
            .or(rt
                .fleet_net_cap
                .as_ref()
                .map(|v| (v.span(), "fleet_net_cap")));
            if let Some((span, key)) = key {
                return Err(c.err(
                    span,
                    format!("{key} needs a [cluster] section (a fleet to share it)"),
                ));
            }
        }
        if !names.insert(t.name.clone()) {
            return Err(c.err(
                rt.name.span(),
                format!("tenant name {:?} is used twice", t.name),
            ));
        }
        for (host, raw_host) in t
            .hosts
            .iter()
            .zip(rt.hosts.iter().flat_map(|h| h.get_ref()))
        {
            if !hosts_seen.insert(host.clone()) {
                return Err(c.err(
                    raw_host.span(),
                    format!("host {host:?} belongs to two tenants"),
                ));
            }
        }
        for (addr, raw_addr) in t
            .listen
            .iter()
            .zip(rt.listen.iter().flat_map(|l| l.get_ref()))
        {
            if !listeners_taken.insert(*addr) {
                return Err(c.err(
                    raw_addr.span(),
                    format!("listener {addr} is bound to two tenants"),
                ));
            }
        }
        if t.is_catch_all() {
            if catch_all_seen {
                return Err(c.err(
                    raw_tenant.span(),
                    format!(
                        "tenant {:?} has neither hosts nor listen, and another tenant is already the catch-all",
                        t.name
                    ),
                ));
            }
            catch_all_seen = true;
        }
        tenants.push(t);
    }
    Ok(Config {
        server,
        tenants,
        cluster,
        upstreams,
    })
}

pub(super) fn cluster_config(
    c: &Checker<'_>,
    r: &RawCluster,
) -> Result<ClusterConfig, ConfigError> {
    let redis = r.redis.get_ref().trim();
    if !redis.starts_with("redis://")
        || redis.len() <= "redis://".len()
        || redis.len() > REDIS_URL_BYTES_MAX
        || redis
            .bytes()
            .any(|b| b.is_ascii_whitespace() || b.is_ascii_control())
    {
        return Err(c.err(
            r.redis.span(),
            format!(
                "redis {:?} must be a URL like \"redis://127.0.0.1:6379\" of at most {REDIS_URL_BYTES_MAX} bytes",
                r.redis.get_ref()
            ),
        ));
    }
    if redis_host_ip(redis).is_none() {
        return Err(c.err(
            r.redis.span(),
            format!(
                "redis {:?}: the host must be an IP address (like \"redis://10.0.0.5:6379\" or \"redis://[::1]:6379\"); \
                 host names are not resolved, as the system's resolver has no deadline",
                r.redis.get_ref()
            ),
        ));
    }
    let node = match &r.node {
        None => None,
        Some(v) => {
            let s = v.get_ref();
            let ok = !s.is_empty()
                && s.len() <= NODE_NAME_BYTES_MAX
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
            if !ok {
                return Err(c.err(
                    v.span(),
                    format!(
                        "node {s:?} must be 1..={NODE_NAME_BYTES_MAX} characters of [A-Za-z0-9_.-]"
                    ),
                ));
            }
            Some(s.clone())
        }
    };
    let sync_ms = c
        .opt_int_in(&r.sync_ms, "sync_ms", SYNC_MS_MIN, SYNC_MS_MAX)?
        .map_or(SYNC_MS_DEFAULT, |n| n as u64);
    Ok(ClusterConfig {
        redis: redis.to_string(),
        node,
        sync: Duration::from_millis(sync_ms),
    })
}

pub(super) fn server_config(
    c: &Checker<'_>,
    s: &RawServer,
    base: Option<&Path>,
) -> Result<ServerConfig, ConfigError> {
    let d = ServerConfig::default();
    let tls_listeners = s.listen_tls.as_ref().map_or(0, |l| l.get_ref().len());
    let listen = match &s.listen {
        Some(list) => {
            let n = list.get_ref().len();
            if (n == 0 && tls_listeners == 0) || n + tls_listeners > LISTENERS_MAX {
                return Err(c.err(
                    list.span(),
                    format!(
                        "listen must have 1..={LISTENERS_MAX} addresses (with listen_tls: 0..={LISTENERS_MAX} in all)"
                    ),
                ));
            }
            let mut out = Vec::new();
            for a in list.get_ref() {
                let addr = c.addr(a)?;
                if out.contains(&addr) {
                    return Err(c.err(a.span(), format!("listener {addr} is given twice")));
                }
                out.push(addr);
            }
            out
        }
        None => d.listen,
    };
    let mut listen_tls = Vec::new();
    if let Some(list) = &s.listen_tls {
        if listen.len() + list.get_ref().len() > LISTENERS_MAX {
            return Err(c.err(
                list.span(),
                format!("listen and listen_tls have more than {LISTENERS_MAX} addresses"),
            ));
        }
        for a in list.get_ref() {
            let addr = c.addr(a)?;
            if listen.contains(&addr) || listen_tls.contains(&addr) {
                return Err(c.err(a.span(), format!("listener {addr} is given twice")));
            }
            listen_tls.push(addr);
        }
    }
    let (tls_cert, tls_key) = c.cert_pair(&s.tls_cert, &s.tls_key, base)?;
    if !listen_tls.is_empty() && tls_cert.is_none() {
        let span = s.listen_tls.as_ref().map_or(0..0, |l| l.span());
        return Err(c.err(
            span,
            "listen_tls needs the default certificate: set tls_cert and tls_key in [server]",
        ));
    }
    let ms =
        |v: &Option<Spanned<i64>>, key: &str, default: Duration| -> Result<Duration, ConfigError> {
            Ok(c.opt_int_in(v, key, 1, TIMEOUT_MS_MAX)?
                .map_or(default, |n| Duration::from_millis(n as u64)))
        };
    let access_log = match &s.access_log {
        None => AccessLog::Off,
        Some(v) if v.get_ref() == "-" => AccessLog::Stdout,
        Some(v) if v.get_ref().trim().is_empty() => {
            return Err(c.err(
                v.span(),
                "access_log is empty: use \"-\" for stdout or omit it",
            ))
        }
        Some(v) => AccessLog::File(rebase(base, Path::new(v.get_ref()))),
    };
    Ok(ServerConfig {
        listen,
        workers: c
            .opt_int_in(&s.workers, "workers", 1, WORKERS_MAX)?
            .map(|n| n as usize),
        connections_max: c
            .opt_int_in(&s.connections_max, "connections_max", 1, CONNECTIONS_MAX)?
            .map_or(d.connections_max, |n| n as usize),
        header_timeout: ms(&s.header_timeout_ms, "header_timeout_ms", d.header_timeout)?,
        keepalive_timeout: ms(
            &s.keepalive_timeout_ms,
            "keepalive_timeout_ms",
            d.keepalive_timeout,
        )?,
        pipeline_depth_max: c
            .opt_int_in(
                &s.pipeline_depth_max,
                "pipeline_depth_max",
                1,
                PIPELINE_DEPTH_MAX,
            )?
            .map_or(d.pipeline_depth_max, |n| n as usize),
        access_log,
        cache_bytes_max: c
            .opt_int_in(&s.cache_bytes_max, "cache_bytes_max", 0, CACHE_BYTES_MAX)?
            .map_or(d.cache_bytes_max, |n| n as u64),
        net_link_cap_bytes_per_s: c.rate(&s.net_link_cap, "net_link_cap")?,
        disk_threads: c
            .opt_int_in(&s.disk_threads, "disk_threads", 0, DISK_THREADS_MAX)?
            .map_or(d.disk_threads, |n| n as usize),
        disk_direct: s.disk_direct.unwrap_or(d.disk_direct),
        disk_cap_bytes_per_s: c.rate(&s.disk_cap, "disk_cap")?,
        sendfile: s.sendfile.unwrap_or(d.sendfile),
        sendfile_min_bytes: c
            .opt_int_in(
                &s.sendfile_min_bytes,
                "sendfile_min_bytes",
                1,
                SENDFILE_MIN_BYTES_MAX,
            )?
            .map_or(d.sendfile_min_bytes, |n| n as u64),
        listen_tls,
        tls_cert,
        tls_key,
        body_bytes_max: c
            .opt_int_in(&s.body_bytes_max, "body_bytes_max", 0, BODY_BYTES_MAX)?
            .map_or(d.body_bytes_max, |n| n as u64),
        wake_credit_us: c
            .opt_int_in(&s.wake_credit_us, "wake_credit_us", 0, WAKE_CREDIT_US_MAX)?
            .map_or(d.wake_credit_us, |n| n as u64),
    })
}

pub(super) fn upstream_config(
    c: &Checker<'_>,
    u: &RawUpstream,
) -> Result<UpstreamConfig, ConfigError> {
    let name = c.name(&u.name, "upstream")?;
    let list = &u.servers;
    if list.get_ref().is_empty() || list.get_ref().len() > UPSTREAM_SERVERS_MAX {
        return Err(c.err(
            list.span(),
            format!("servers must have 1..={UPSTREAM_SERVERS_MAX} addresses"),
        ));
    }
    let mut servers = Vec::new();
    for a in list.get_ref() {
        let addr = c.addr(a)?;
        if servers.contains(&addr) {
            return Err(c.err(a.span(), format!("server {addr} is given twice")));
        }
        servers.push(addr);
    }
    let ms =
        |v: &Option<Spanned<i64>>, key: &str, default_ms: u64| -> Result<Duration, ConfigError> {
            Ok(Duration::from_millis(
                c.opt_int_in(v, key, 1, TIMEOUT_MS_MAX)?
                    .map_or(default_ms, |n| n as u64),
            ))
        };
    Ok(UpstreamConfig {
        servers,
        concurrency_max: c
            .opt_int_in(
                &u.concurrency_max,
                "concurrency_max",
                1,
                UPSTREAM_CONCURRENCY_MAX,
            )?
            .map_or(256, |n| n as usize),
        connect_timeout: ms(&u.connect_timeout_ms, "connect_timeout_ms", 1000)?,
        response_timeout: ms(&u.response_timeout_ms, "response_timeout_ms", 30_000)?,
        idle_connections_max: c
            .opt_int_in(
                &u.idle_connections_max,
                "idle_connections_max",
                0,
                UPSTREAM_IDLE_CONNECTIONS_MAX,
            )?
            .map_or(64, |n| n as usize),
        fair: u.fair.unwrap_or(true),
        name,
    })
}

pub(super) fn rebase(base: Option<&Path>, p: &Path) -> PathBuf {
    match base {
        Some(b) if p.is_relative() => b.join(p),
        _ => p.to_path_buf(),
    }
}

/// The host of a `redis://[user:password@]host[:port][/db]` URL when it is an IP literal
/// (IPv6 in brackets). The fleet connects to Redis from its own thread with a deadline for
/// each call, and the system's resolver (`getaddrinfo`) has none: a name is refused here
/// rather than resolved without a bound.
pub fn redis_host_ip(url: &str) -> Option<std::net::IpAddr> {
    let rest = url.strip_prefix("redis://")?;
    let authority = rest.split(['/', '?', '#']).next()?;
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    if let Some(v6) = host_port.strip_prefix('[') {
        let (host, after) = v6.split_once(']')?;
        if !(after.is_empty() || after.starts_with(':')) {
            return None;
        }
        return host.parse::<std::net::Ipv6Addr>().ok().map(Into::into);
    }
    let host = host_port.rsplit_once(':').map_or(host_port, |(h, _)| h);
    host.parse::<std::net::Ipv4Addr>().ok().map(Into::into)
}
