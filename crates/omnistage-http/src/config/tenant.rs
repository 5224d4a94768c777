//! Checking a `[[tenant]]` table and its classes.

use super::check::{normalize_config_host, rebase, Checker};
use super::raw::*;
use super::*;
use toml::Spanned;

pub(super) fn tenant_config(
    c: &Checker<'_>,
    table: &Spanned<RawTenant>,
    server: &ServerConfig,
    upstreams: &[UpstreamConfig],
    base: Option<&Path>,
) -> Result<TenantConfig, ConfigError> {
    let t = table.get_ref();
    let name = c.name(&t.name, "tenant")?;

    let mut hosts = Vec::new();
    if let Some(list) = &t.hosts {
        if list.get_ref().len() > HOSTS_PER_TENANT_MAX {
            return Err(c.err(
                list.span(),
                format!("more than {HOSTS_PER_TENANT_MAX} hosts"),
            ));
        }
        for h in list.get_ref() {
            let host = normalize_config_host(h.get_ref()).map_err(|m| c.err(h.span(), m))?;
            if hosts.contains(&host) {
                return Err(c.err(h.span(), format!("host {host:?} is given twice")));
            }
            hosts.push(host);
        }
    }

    let mut listen = Vec::new();
    for a in t.listen.iter().flat_map(|l| l.get_ref()) {
        let addr = c.addr(a)?;
        if !server.listen.contains(&addr) && !server.listen_tls.contains(&addr) {
            return Err(c.err(
                a.span(),
                format!("listener {addr} is not in server.listen or server.listen_tls"),
            ));
        }
        if listen.contains(&addr) {
            return Err(c.err(a.span(), format!("listener {addr} is given twice")));
        }
        listen.push(addr);
    }

    let weight = c
        .opt_int_in(&t.weight, "weight", WEIGHT_MIN, WEIGHT_MAX)?
        .map_or(WEIGHT_DEFAULT, |n| n as u32);

    let upstream = match &t.upstream {
        None => None,
        Some(v) => Some(
            upstreams
                .iter()
                .position(|u| &u.name == v.get_ref())
                .ok_or_else(|| {
                    c.err(v.span(), format!("no [[upstream]] named {:?}", v.get_ref()))
                })?,
        ),
    };
    let upstream_prefix = match &t.upstream_prefix {
        None => None,
        Some(v) if upstream.is_none() => {
            return Err(c.err(v.span(), "upstream_prefix needs an upstream"));
        }
        Some(v) if !v.get_ref().starts_with('/') => {
            return Err(c.err(v.span(), "upstream_prefix must start with \"/\""));
        }
        Some(v) => Some(v.get_ref().clone()),
    };
    // A tenant proxied whole needs no docroot; any other does.
    let docroot = match &t.docroot {
        None if upstream.is_some() && upstream_prefix.is_none() => PathBuf::new(),
        None => {
            return Err(c.err(
                table.span(),
                format!("tenant {name:?} has no docroot (only a tenant proxied whole may omit it)"),
            ))
        }
        Some(d) => {
            let docroot_raw = d.get_ref();
            if docroot_raw.trim().is_empty() {
                return Err(c.err(d.span(), "docroot is empty"));
            }
            let mut docroot = rebase(base, Path::new(docroot_raw));
            if base.is_some() {
                let canonical = docroot
                    .canonicalize()
                    .ok()
                    .filter(|p| p.is_dir())
                    .ok_or_else(|| {
                        c.err(
                            d.span(),
                            format!("docroot {} is not a directory", docroot.display()),
                        )
                    })?;
                docroot = canonical;
            }
            docroot
        }
    };

    let index = match &t.index {
        None => vec!["index.html".to_string()],
        Some(list) => {
            if list.get_ref().len() > INDEX_FILES_MAX {
                return Err(c.err(
                    list.span(),
                    format!("more than {INDEX_FILES_MAX} index files"),
                ));
            }
            let mut out = Vec::new();
            for f in list.get_ref() {
                let s = f.get_ref();
                if s.is_empty() || s == "." || s == ".." || s.contains(['/', '\\', '\0']) {
                    return Err(c.err(f.span(), format!("index {s:?} must be a plain file name")));
                }
                out.push(s.clone());
            }
            out
        }
    };

    let cpu_cap = match &t.cpu_cap {
        None => None,
        Some(v) => {
            let n = match v.get_ref() {
                NumberOrString::Number(n) => Some(*n),
                NumberOrString::String(s) => s.trim().parse::<f64>().ok(),
            };
            match n {
                Some(n) if n.is_finite() && n > 0.0 && n <= CPU_CAP_MAX => Some(n),
                _ => {
                    return Err(c.err(
                        v.span(),
                        format!(
                            "cpu_cap must be a number of cores in (0, {CPU_CAP_MAX}], like \"0.5\""
                        ),
                    ))
                }
            }
        }
    };

    let cap_kind = match &t.cap_kind {
        None => CapKind::Token,
        Some(v) => match v.get_ref().as_str() {
            "token" => CapKind::Token,
            "leaky" => CapKind::Leaky,
            other => {
                return Err(c.err(
                    v.span(),
                    format!("cap_kind {other:?} must be \"token\" or \"leaky\""),
                ))
            }
        },
    };

    let send_order = match &t.send_order {
        None => SendOrder::Fair,
        Some(v) => SendOrder::parse(v.get_ref()).map_err(|e| c.err(v.span(), e))?,
    };

    let cache_max = i64::try_from(server.cache_bytes_max).unwrap_or(CACHE_BYTES_MAX);
    let conn_max = i64::try_from(server.connections_max).unwrap_or(CONNECTIONS_MAX);

    let mut classes: Vec<ClassConfig> = Vec::new();
    if let Some(list) = &t.class {
        if list.len() > CLASSES_MAX {
            return Err(c.err(
                list[CLASSES_MAX].span(),
                format!("more than {CLASSES_MAX} classes"),
            ));
        }
        for rc in list {
            let class = class_config(c, rc)?;
            if classes.iter().any(|k| k.name == class.name) {
                return Err(c.err(
                    rc.get_ref().name.span(),
                    format!(
                        "class name {:?} is used twice in tenant {name:?}",
                        class.name
                    ),
                ));
            }
            classes.push(class);
        }
    }
    let p90_target = c
        .opt_int_in(&t.p90_target_ms, "p90_target_ms", 1, TIMEOUT_MS_MAX)?
        .map(|n| Duration::from_millis(n as u64));
    if let (Some(list), None) = (&t.class, p90_target) {
        for (rc, class) in list.iter().zip(&classes) {
            if class.priority.is_some() && class.p90_target.is_none() {
                return Err(c.err(
                    rc.span(),
                    format!(
                        "class {:?} has a priority but no target: set its p90_target_ms or the tenant's",
                        class.name
                    ),
                ));
            }
        }
    }

    let (tls_cert, tls_key) = c.cert_pair(&t.tls_cert, &t.tls_key, base)?;
    if let (Some(v), true) = (&t.tls_cert, server.listen_tls.is_empty()) {
        return Err(c.err(
            v.span(),
            "tls_cert is set but the server has no listen_tls to serve it on",
        ));
    }

    Ok(TenantConfig {
        tls_cert,
        tls_key,
        hosts,
        listen,
        weight,
        docroot,
        index,
        cpu_cap,
        net_cap_bytes_per_s: c.rate(&t.net_cap, "net_cap")?,
        disk_cap_bytes_per_s: c.rate(&t.disk_cap, "disk_cap")?,
        cap_kind,
        send_order,
        cache_bytes: c
            .opt_int_in(&t.cache_bytes, "cache_bytes", 0, cache_max)?
            .map(|n| n as u64),
        p90_target,
        connections_max: c
            .opt_int_in(&t.connections_max, "connections_max", 1, conn_max)?
            .map(|n| n as usize),
        synthetic: t.synthetic.unwrap_or(false),
        classes,
        upstream,
        upstream_prefix,
        name,
        fleet: TenantFleet {
            rate_per_s: c
                .opt_int_in(
                    &t.fleet_rate_per_s,
                    "fleet_rate_per_s",
                    1,
                    FLEET_RATE_PER_S_MAX,
                )?
                .map(|n| n as u64),
            net_cap_bytes_per_s: c.rate(&t.fleet_net_cap, "fleet_net_cap")?,
        },
    })
}

fn class_config(c: &Checker<'_>, rc: &Spanned<RawClass>) -> Result<ClassConfig, ConfigError> {
    let r = rc.get_ref();
    let name = c.name(&r.name, "class")?;
    let selector = match (&r.header, &r.prefix) {
        (Some(h), None) => {
            let Some((n, v)) = h.get_ref().split_once(':') else {
                return Err(c.err(h.span(), "header must be \"name: value\""));
            };
            let (n, v) = (n.trim(), v.trim());
            let token = !n.is_empty()
                && n.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
            if !token || v.is_empty() {
                return Err(c.err(
                    h.span(),
                    "header must be \"name: value\" with a token name and a value",
                ));
            }
            ClassSelector::Header {
                name: n.to_ascii_lowercase(),
                value: v.to_string(),
            }
        }
        (None, Some(p)) => {
            if !p.get_ref().starts_with('/') {
                return Err(c.err(p.span(), "prefix must start with /"));
            }
            ClassSelector::Prefix(p.get_ref().clone())
        }
        _ => {
            return Err(c.err(
                rc.span(),
                format!("class {name:?} needs exactly one of header or prefix"),
            ))
        }
    };
    let weight = c
        .opt_int_in(&r.weight, "weight", WEIGHT_MIN, WEIGHT_MAX)?
        .map_or(WEIGHT_DEFAULT, |n| n as u32);
    Ok(ClassConfig {
        name,
        selector,
        weight,
        priority: c
            .opt_int_in(&r.priority, "priority", 0, i64::from(CLASS_PRIORITY_MAX))?
            .map(|n| n as u32),
        p90_target: c
            .opt_int_in(&r.p90_target_ms, "p90_target_ms", 1, TIMEOUT_MS_MAX)?
            .map(|n| Duration::from_millis(n as u64)),
    })
}
