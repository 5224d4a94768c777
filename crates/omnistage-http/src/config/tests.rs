//! The configuration's parser and checks, on whole files and on each limit.

use super::check::line_col;
use super::*;

const FULL: &str = r#"
[server]
listen = ["127.0.0.1:8080", "127.0.0.1:8081"]
workers = 2
connections_max = 10000
header_timeout_ms = 10000
keepalive_timeout_ms = 5000
pipeline_depth_max = 16
access_log = "-"
cache_bytes_max = 268435456

[[tenant]]
name = "a"
hosts = ["A.Example", "localhost."]
weight = 50
docroot = "./www/a"
index = ["index.html", "index.htm"]
cpu_cap = "0.5"
net_cap = "10MB/s"
disk_cap = "50MB/s"
cap_kind = "leaky"
send_order = "shortest_first"
cache_bytes = 67108864
p90_target_ms = 50
connections_max = 2000
synthetic = true
[[tenant.class]]
name = "gold"
header = "X-Class: gold"
weight = 80
priority = 0
p90_target_ms = 20
[[tenant.class]]
name = "api"
prefix = "/api/"

[[tenant]]
name = "b"
listen = ["127.0.0.1:8081"]
docroot = "/srv/b"
cpu_cap = 1.5

[[tenant]]
name = "c"
docroot = "www/c"
cpu_cap = 2
"#;

fn err(text: &str) -> ConfigError {
    parse_config(text).expect_err("should be refused")
}

#[test]
fn send_order_names_round_trip() {
    for o in SendOrder::ALL {
        assert_eq!(SendOrder::parse(o.name()), Ok(o));
    }
    assert!(SendOrder::parse("").is_err());
}

#[test]
fn full_example() {
    let cfg = parse_config(FULL).unwrap();
    let s = &cfg.server;
    assert_eq!(
        s.listen,
        vec![
            "127.0.0.1:8080".parse().unwrap(),
            "127.0.0.1:8081".parse().unwrap()
        ]
    );
    assert_eq!(s.workers, Some(2));
    assert_eq!(s.connections_max, 10_000);
    assert_eq!(s.header_timeout, Duration::from_secs(10));
    assert_eq!(s.keepalive_timeout, Duration::from_secs(5));
    assert_eq!(s.pipeline_depth_max, 16);
    assert_eq!(s.access_log, AccessLog::Stdout);
    assert_eq!(s.cache_bytes_max, 268_435_456);
    assert!(!s.sendfile, "sendfile is off by default");
    assert_eq!(s.sendfile_min_bytes, 16 * 1024);
    let a = &cfg.tenants[0];
    assert_eq!(a.name, "a");
    assert_eq!(a.activity(), "/tenants/a");
    assert_eq!(a.hosts, vec!["a.example", "localhost"]);
    assert_eq!(a.weight, 50);
    assert_eq!(a.docroot, PathBuf::from("./www/a"));
    assert_eq!(a.index, vec!["index.html", "index.htm"]);
    assert_eq!(a.cpu_cap, Some(0.5));
    assert_eq!(a.net_cap_bytes_per_s, Some(10_000_000));
    assert_eq!(a.disk_cap_bytes_per_s, Some(50_000_000));
    assert_eq!(a.cap_kind, CapKind::Leaky);
    assert_eq!(a.send_order, SendOrder::ShortestFirst);
    assert_eq!(a.cache_bytes, Some(67_108_864));
    assert_eq!(a.p90_target, Some(Duration::from_millis(50)));
    assert_eq!(a.connections_max, Some(2000));
    assert!(a.synthetic);
    assert_eq!(
        a.classes,
        vec![
            ClassConfig {
                name: "gold".into(),
                selector: ClassSelector::Header {
                    name: "x-class".into(),
                    value: "gold".into()
                },
                weight: 80,
                priority: Some(0),
                p90_target: Some(Duration::from_millis(20)),
            },
            ClassConfig {
                name: "api".into(),
                selector: ClassSelector::Prefix("/api/".into()),
                weight: 100,
                priority: None,
                p90_target: None,
            },
        ]
    );
    let b = &cfg.tenants[1];
    assert_eq!(b.weight, WEIGHT_DEFAULT);
    assert_eq!(b.send_order, SendOrder::Fair);
    assert_eq!(b.cpu_cap, Some(1.5));
    assert_eq!(b.cap_kind, CapKind::Token);
    assert!(!b.synthetic);
    assert_eq!(b.index, vec!["index.html"]);
    assert!(cfg.tenants[2].is_catch_all());
    assert_eq!(cfg.tenants[2].cpu_cap, Some(2.0));
}

#[test]
fn minimal_uses_defaults() {
    let cfg = parse_config("[[tenant]]\nname = \"x\"\ndocroot = \".\"\n").unwrap();
    assert_eq!(cfg.server, ServerConfig::default());
    assert_eq!(cfg.server.access_log, AccessLog::Off);
    assert_eq!(cfg.tenants.len(), 1);
}

#[test]
fn tenant_selection() {
    let cfg = parse_config(FULL).unwrap();
    let l0: SocketAddr = "127.0.0.1:8080".parse().unwrap();
    let l1: SocketAddr = "127.0.0.1:8081".parse().unwrap();
    assert_eq!(cfg.tenant_for(Some("a.example"), l0), Some(0));
    assert_eq!(
        cfg.tenant_for(Some("localhost"), l1),
        Some(0),
        "host beats listener"
    );
    assert_eq!(cfg.tenant_for(Some("other"), l1), Some(1));
    assert_eq!(cfg.tenant_for(None, l1), Some(1));
    assert_eq!(cfg.tenant_for(Some("other"), l0), Some(2), "catch-all");
    assert_eq!(cfg.tenant_for(None, l0), Some(2));

    let no_catch_all =
        parse_config("[[tenant]]\nname = \"a\"\nhosts = [\"a.test\"]\ndocroot = \".\"\n").unwrap();
    assert_eq!(no_catch_all.tenant_for(Some("a.test"), l0), Some(0));
    assert_eq!(no_catch_all.tenant_for(Some("b.test"), l0), None);
    assert_eq!(no_catch_all.tenant_for(None, l0), None);
}

#[test]
fn default_config_serves_cwd() {
    let cfg = default_config(Path::new("/tmp/site"));
    assert_eq!(
        cfg.server.listen,
        vec![SocketAddr::from(([127, 0, 0, 1], 8080))]
    );
    assert_eq!(cfg.tenants.len(), 1);
    let t = &cfg.tenants[0];
    assert_eq!(t.name, "default");
    assert_eq!(t.docroot, PathBuf::from("/tmp/site"));
    assert_eq!(t.weight, 100);
    assert!(!t.synthetic);
    assert!(t.hosts.is_empty());
    assert_eq!(
        cfg.tenant_for(Some("anything"), "10.0.0.1:1".parse().unwrap()),
        Some(0)
    );
}

#[test]
fn errors_name_the_line() {
    let text = "[[tenant]]\nname = \"a\"\ndocroot = \".\"\nweight = 0\n";
    let e = err(text);
    assert_eq!(e.line, Some(4));
    assert_eq!(e.column, Some(10));
    assert_eq!(
        e.to_string(),
        "line 4, column 10: weight 0 is outside 1..=10000"
    );
}

#[test]
fn unknown_keys_are_errors_with_lines() {
    let e = err("[server]\nlisten = [\"127.0.0.1:1\"]\nworkerz = 2\n[[tenant]]\nname = \"a\"\ndocroot = \".\"\n");
    assert_eq!(e.line, Some(3), "{e}");
    assert!(e.message.contains("workerz"), "{e}");
    let e = err("[[tenant]]\nname = \"a\"\ndocroot = \".\"\ncolour = \"red\"\n");
    assert_eq!(e.line, Some(4), "{e}");
    let e = err("[[tenant]]\nname = \"a\"\ndocroot = \".\"\n[[tenant.class]]\nname = \"g\"\nprefix = \"/\"\nx = 1\n");
    assert_eq!(e.line, Some(7), "{e}");
    let e = err("[serve]\n[[tenant]]\nname = \"a\"\ndocroot = \".\"\n");
    assert_eq!(e.line, Some(1), "{e}");
}

#[test]
fn syntax_and_type_errors_have_lines() {
    let e = err("[[tenant]]\nname = \"a\"\ndocroot = \".\"\nweight = \"heavy\"\n");
    assert_eq!(e.line, Some(4), "{e}");
    let e = err("[[tenant]]\nname = \"a\"\ndocroot = \n");
    assert_eq!(e.line, Some(3), "{e}");
    let e = err("[[tenant]]\nname = \"a\"\n");
    assert_eq!(e.line, Some(1), "{e}");
    assert!(e.message.contains("docroot"), "{e}");
}

#[test]
fn upstreams_defaults_and_rules() {
    let up = "[[upstream]]\nname = \"app\"\nservers = [\"127.0.0.1:9101\"]\n";
    let c = parse_config(&format!(
        "{up}[[tenant]]\nname = \"a\"\nupstream = \"app\"\n"
    ))
    .unwrap();
    let u = &c.upstreams[0];
    assert_eq!(
        (u.concurrency_max, u.idle_connections_max, u.fair),
        (256, 64, true)
    );
    assert_eq!(u.connect_timeout, Duration::from_millis(1000));
    assert_eq!(u.response_timeout, Duration::from_millis(30_000));
    assert_eq!(c.server.body_bytes_max, 10 << 20);
    assert_eq!(c.server.wake_credit_us, WAKE_CREDIT_US_DEFAULT);
    let t = &c.tenants[0];
    assert_eq!((t.upstream, t.upstream_for("/x")), (Some(0), Some(0)));
    let c = parse_config(&format!(
        "{up}[[tenant]]\nname = \"a\"\ndocroot = \".\"\nupstream = \"app\"\nupstream_prefix = \"/api/\"\n"
    ))
    .unwrap();
    assert_eq!(c.tenants[0].upstream_for("/api/x"), Some(0));
    assert_eq!(c.tenants[0].upstream_for("/x"), None);
    for (text, want) in [
        (
            format!("{up}[[tenant]]\nname = \"a\"\nupstream = \"nope\"\n"),
            "no [[upstream]] named",
        ),
        (
            format!("{up}[[tenant]]\nname = \"a\"\ndocroot = \".\"\nupstream_prefix = \"/a\"\n"),
            "needs an upstream",
        ),
        (
            format!("{up}[[tenant]]\nname = \"a\"\nupstream = \"app\"\nupstream_prefix = \"/a\"\n"),
            "no docroot",
        ),
        (
            format!("{up}[[tenant]]\nname = \"a\"\ndocroot = \".\"\nupstream = \"app\"\nupstream_prefix = \"a\"\n"),
            "must start with",
        ),
        (
            format!("{up}{up}[[tenant]]\nname = \"a\"\ndocroot = \".\"\n"),
            "used twice",
        ),
        (
            "[[upstream]]\nname = \"app\"\nservers = []\n[[tenant]]\nname = \"a\"\ndocroot = \".\"\n".into(),
            "servers must have",
        ),
        (
            "[[upstream]]\nname = \"app\"\nservers = [\"127.0.0.1:1\", \"127.0.0.1:1\"]\n[[tenant]]\nname = \"a\"\ndocroot = \".\"\n".into(),
            "given twice",
        ),
        (
            format!("{up}concurrency_max = 0\n[[tenant]]\nname = \"a\"\ndocroot = \".\"\n"),
            "concurrency_max 0 is outside",
        ),
        (
            format!("{up}response_timeout_ms = 0\n[[tenant]]\nname = \"a\"\ndocroot = \".\"\n"),
            "response_timeout_ms 0 is outside",
        ),
        (
            format!("{up}retries = 3\n[[tenant]]\nname = \"a\"\ndocroot = \".\"\n"),
            "unknown field",
        ),
        (
            "[server]\nbody_bytes_max = -1\n[[tenant]]\nname = \"a\"\ndocroot = \".\"\n".into(),
            "body_bytes_max -1 is outside",
        ),
        (
            "[server]\nwake_credit_us = 1000001\n[[tenant]]\nname = \"a\"\ndocroot = \".\"\n".into(),
            "wake_credit_us 1000001 is outside 0..=1000000",
        ),
        (
            "[server]\nwake_credit_us = -1\n[[tenant]]\nname = \"a\"\ndocroot = \".\"\n".into(),
            "wake_credit_us -1 is outside",
        ),
    ] {
        let e = err(&text);
        assert!(e.message.contains(want), "{e} for\n{text}");
        assert!(e.line.is_some(), "{e}");
    }
}

#[test]
fn validation_rules() {
    let tenant = |extra: &str| format!("[[tenant]]\nname = \"a\"\ndocroot = \".\"\n{extra}\n");
    let cases: Vec<(String, usize, &str)> = vec![
        ("".into(), 0, "at least one tenant"),
        ("[server]\nworkers = 2\n".into(), 0, "at least one tenant"),
        ("tenant = []\n".into(), 1, "at least one tenant"),
        ("[[tenant]]\nname = \"A\"\ndocroot = \".\"\n".into(), 2, "[a-z0-9_-]"),
        ("[[tenant]]\nname = \"\"\ndocroot = \".\"\n".into(), 2, "[a-z0-9_-]"),
        ("[[tenant]]\nname = \"a b\"\ndocroot = \".\"\n".into(), 2, "[a-z0-9_-]"),
        (format!("{}{}", tenant("hosts = [\"x\"]"), "[[tenant]]\nname = \"a\"\ndocroot = \".\"\n"), 6, "used twice"),
        (
            format!("{}{}", tenant("hosts = [\"x.test\"]"), "[[tenant]]\nname = \"b\"\nhosts = [\"X.TEST\"]\ndocroot = \".\"\n"),
            7,
            "two tenants",
        ),
        (tenant("hosts = [\"x.test\", \"x.test\"]"), 4, "twice"),
        (tenant("hosts = [\"x.test:8080\"]"), 4, "port"),
        (tenant("hosts = [\"x/y\"]"), 4, "characters"),
        (tenant("hosts = [\"\"]"), 4, "1..=255"),
        (tenant("weight = 10001"), 4, "weight 10001 is outside 1..=10000"),
        (tenant("weight = -1"), 4, "outside"),
        (tenant("net_cap = \"10MB\""), 4, "/s"),
        (tenant("net_cap = \"10Mb/s\""), 4, "unit"),
        (tenant("disk_cap = \"fast/s\""), 4, "unit"),
        (tenant("disk_cap = \".MB/s\""), 4, "number"),
        (tenant("disk_cap = \"0MB/s\""), 4, "outside"),
        (tenant("net_cap = \"2TB/s\""), 4, "unit"),
        (tenant("net_cap = \"2000GB/s\""), 4, "outside"),
        (tenant("cpu_cap = \"half\""), 4, "cpu_cap"),
        (tenant("cpu_cap = 0"), 4, "cpu_cap"),
        (tenant("cpu_cap = -0.5"), 4, "cpu_cap"),
        (tenant("cpu_cap = 2000"), 4, "cpu_cap"),
        (tenant("cap_kind = \"bucket\""), 4, "token"),
        (tenant("send_order = \"srpt\""), 4, "shortest_first"),
        (tenant("send_order = \"Shortest_First\""), 4, "send_order"),
        (tenant("cache_bytes = 999999999999"), 4, "outside"),
        (tenant("p90_target_ms = 0"), 4, "outside"),
        (tenant("connections_max = 10001"), 4, "outside"),
        (tenant("index = [\"../x\"]"), 4, "plain file name"),
        (tenant("index = [\"\"]"), 4, "plain file name"),
        (tenant("listen = [\"127.0.0.1:9999\"]"), 4, "not in server.listen"),
        (tenant("listen = [\"nonsense\"]"), 4, "not an address"),
        ("[[tenant]]\nname = \"a\"\ndocroot = \"\"\n".into(), 3, "docroot is empty"),
        (format!("[server]\nlisten = [\"localhost:80\"]\n{}", tenant("")), 2, "not an address"),
        (format!("[server]\nlisten = []\n{}", tenant("")), 2, "1..=64"),
        (format!("[server]\nlisten = [\"127.0.0.1:1\", \"127.0.0.1:1\"]\n{}", tenant("")), 2, "twice"),
        (format!("[server]\nconnections_max = 1000001\n{}", tenant("")), 2, "outside 1..=1000000"),
        (format!("[server]\nconnections_max = 0\n{}", tenant("")), 2, "outside"),
        (format!("[server]\npipeline_depth_max = 1025\n{}", tenant("")), 2, "outside 1..=1024"),
        (format!("[server]\nheader_timeout_ms = 0\n{}", tenant("")), 2, "outside 1..=3600000"),
        (format!("[server]\nkeepalive_timeout_ms = 3600001\n{}", tenant("")), 2, "outside"),
        (format!("[server]\nworkers = 0\n{}", tenant("")), 2, "outside"),
        (format!("[server]\ncache_bytes_max = -1\n{}", tenant("")), 2, "outside"),
        (format!("[server]\nsendfile_min_bytes = 0\n{}", tenant("")), 2, "outside 1..=1073741824"),
        (format!("[server]\nsendfile_min_bytes = 1073741825\n{}", tenant("")), 2, "outside"),
        (format!("[server]\nsendfile = \"yes\"\n{}", tenant("")), 2, "expected a boolean"),
        (format!("[server]\naccess_log = \"\"\n{}", tenant("")), 2, "empty"),
        (format!("{}{}", tenant(""), "[[tenant]]\nname = \"b\"\ndocroot = \".\"\n"), 5, "catch-all"),
        (tenant("[[tenant.class]]\nname = \"g\"\nweight = 5"), 4, "exactly one"),
        (tenant("[[tenant.class]]\nname = \"g\"\nheader = \"a: b\"\nprefix = \"/\""), 4, "exactly one"),
        (tenant("[[tenant.class]]\nname = \"g\"\nheader = \"nocolon\""), 6, "name: value"),
        (tenant("[[tenant.class]]\nname = \"g\"\nheader = \"x:\""), 6, "name: value"),
        (tenant("[[tenant.class]]\nname = \"g\"\nprefix = \"api\""), 6, "start with /"),
        (tenant("[[tenant.class]]\nname = \"g\"\nprefix = \"/\"\nweight = 0"), 7, "outside"),
        (tenant("[[tenant.class]]\nname = \"g\"\nprefix = \"/\"\npriority = 15"), 7, "outside 0..=14"),
        (tenant("[[tenant.class]]\nname = \"g\"\nprefix = \"/\"\np90_target_ms = 0"), 7, "outside"),
        (tenant("[[tenant.class]]\nname = \"g\"\nprefix = \"/\"\npriority = 1"), 4, "no target"),
        (
            tenant("[[tenant.class]]\nname = \"g\"\nprefix = \"/a\"\n[[tenant.class]]\nname = \"g\"\nprefix = \"/b\""),
            8,
            "used twice",
        ),
    ];
    for (text, line, needle) in cases {
        check_error(&text, line, needle);
    }
}

fn check_error(text: &str, line: usize, needle: &str) {
    let e = err(text);
    let want_line = (line != 0).then_some(line);
    assert_eq!(e.line, want_line, "{text}\n→ {e}");
    assert!(
        e.message.contains(needle),
        "{text}\n→ {e} (wanted {needle:?})"
    );
}

#[test]
fn tls_keys() {
    let t = |extra: &str| format!("[[tenant]]\nname = \"a\"\ndocroot = \".\"\n{extra}\n");
    let server = "[server]\nlisten = []\nlisten_tls = [\"127.0.0.1:8443\"]\ntls_cert = \"c.pem\"\ntls_key = \"k.pem\"\n";
    // A TLS-only server; a tenant bound to the TLS listener with its own certificate.
    let cfg = parse_config(&format!(
        "{server}{}",
        t("listen = [\"127.0.0.1:8443\"]\ntls_cert = \"a.pem\"\ntls_key = \"ak.pem\"")
    ))
    .unwrap();
    assert!(cfg.server.listen.is_empty());
    assert_eq!(
        cfg.server.listeners().collect::<Vec<_>>(),
        [("127.0.0.1:8443".parse().unwrap(), true)]
    );
    assert_eq!(cfg.server.tls_cert.as_deref(), Some(Path::new("c.pem")));
    assert_eq!(cfg.tenants[0].tls_key.as_deref(), Some(Path::new("ak.pem")));
    assert_eq!(
        cfg.tenant_for(None, "127.0.0.1:8443".parse().unwrap()),
        Some(0)
    );
    // Relative to the config file's directory when loaded from one.
    let dir = std::env::temp_dir().join(format!("omnistage-tls-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("c.toml");
    std::fs::write(&file, format!("{server}{}", t(""))).unwrap();
    let loaded = load_config(&file).unwrap();
    assert_eq!(loaded.server.tls_key, Some(dir.join("k.pem")));
    let _ = std::fs::remove_dir_all(&dir);
    let cases: Vec<(String, usize, &str)> = vec![
        (format!("[server]\nlisten_tls = [\"127.0.0.1:8443\"]\n{}", t("")), 2, "tls_cert and tls_key"),
        (format!("[server]\ntls_cert = \"c.pem\"\n{}", t("")), 2, "needs tls_key"),
        (format!("[server]\ntls_key = \"k.pem\"\n{}", t("")), 2, "needs tls_cert"),
        (format!("[server]\ntls_cert = \"\"\ntls_key = \"k\"\n{}", t("")), 2, "empty"),
        (
            format!("[server]\nlisten = [\"127.0.0.1:1\"]\nlisten_tls = [\"127.0.0.1:1\"]\ntls_cert = \"c\"\ntls_key = \"k\"\n{}", t("")),
            3,
            "twice",
        ),
        (format!("[server]\nlisten_tls = [\"x\"]\ntls_cert = \"c\"\ntls_key = \"k\"\n{}", t("")), 2, "not an address"),
        (format!("[server]\nlisten = []\n{}", t("")), 2, "1..=64"),
        (t("tls_cert = \"a.pem\"\ntls_key = \"k.pem\""), 4, "no listen_tls"),
        (format!("{server}{}", t("tls_cert = \"a.pem\"")), 9, "needs tls_key"),
        (format!("{server}{}", t("listen = [\"127.0.0.1:9\"]")), 9, "listen_tls"),
    ];
    for (text, line, needle) in cases {
        check_error(&text, line, needle);
    }
}

#[test]
fn listeners_bind_once() {
    let text = "[server]\nlisten = [\"127.0.0.1:1\", \"[::1]:2\"]\n\
        [[tenant]]\nname = \"a\"\nlisten = [\"127.0.0.1:1\"]\ndocroot = \".\"\n\
        [[tenant]]\nname = \"b\"\nlisten = [\"127.0.0.1:1\"]\ndocroot = \".\"\n";
    let e = err(text);
    assert_eq!(e.line, Some(9), "{e}");
    assert!(e.message.contains("two tenants"), "{e}");
    let ok = text.replace(
        "name = \"b\"\nlisten = [\"127.0.0.1:1\"]",
        "name = \"b\"\nlisten = [\"[::1]:2\"]",
    );
    let cfg = parse_config(&ok).unwrap();
    assert_eq!(cfg.tenant_for(None, "[::1]:2".parse().unwrap()), Some(1));
}

#[test]
fn rates() {
    assert_eq!(parse_rate("10MB/s"), Ok(10_000_000));
    assert_eq!(parse_rate("10 MB/s"), Ok(10_000_000));
    assert_eq!(parse_rate("1.5GiB/s"), Ok(1_610_612_736));
    assert_eq!(parse_rate("500B/s"), Ok(500));
    assert_eq!(parse_rate("64KiB/s"), Ok(65_536));
    assert_eq!(parse_rate("64kB/s"), Ok(64_000));
    assert_eq!(parse_rate("64KB/s"), Ok(64_000));
    assert_eq!(parse_rate("2MiB/s"), Ok(2_097_152));
    assert_eq!(parse_rate("1GB/s"), Ok(1_000_000_000));
    assert_eq!(parse_rate("1000GB/s"), Ok(RATE_BYTES_PER_S_MAX));
    for bad in [
        "",
        "/s",
        "MB/s",
        "10",
        "10MB",
        "10 mb/s",
        "0.1B/s",
        "1.2.3MB/s",
        "-1MB/s",
        "NaNMB/s",
    ] {
        assert!(parse_rate(bad).is_err(), "{bad}");
    }
}

#[test]
fn load_resolves_relative_paths() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().canonicalize().unwrap();
    std::fs::create_dir_all(root.join("www/a")).unwrap();
    let cfg_path = root.join("site.toml");
    std::fs::write(
        &cfg_path,
        "[server]\naccess_log = \"logs/access.log\"\n[[tenant]]\nname = \"a\"\ndocroot = \"./www/a\"\n",
    )
    .unwrap();
    let cfg = load_config(&cfg_path).unwrap();
    assert_eq!(cfg.tenants[0].docroot, root.join("www/a"));
    assert_eq!(
        cfg.server.access_log,
        AccessLog::File(root.join("logs/access.log"))
    );

    std::fs::write(
        &cfg_path,
        "[[tenant]]\nname = \"a\"\n\ndocroot = \"./www/missing\"\n",
    )
    .unwrap();
    let e = load_config(&cfg_path).unwrap_err();
    assert_eq!(e.line, Some(4));
    assert_eq!(e.path.as_deref(), Some(cfg_path.as_path()));
    assert!(
        e.to_string().starts_with(&format!(
            "{}: line 4, column 11: docroot",
            cfg_path.display()
        )),
        "{e}"
    );

    let e = load_config(&root.join("nope.toml")).unwrap_err();
    assert!(e.message.contains("cannot read"), "{e}");
}

#[test]
fn line_columns() {
    assert_eq!(line_col("abc", 0), (1, 1));
    assert_eq!(line_col("abc\ndef", 5), (2, 2));
    assert_eq!(line_col("é\nx", 2), (1, 2));
    assert_eq!(line_col("ab", 99), (1, 3));
}

const FLEET: &str = r#"
[cluster]
redis = "redis://127.0.0.1:6379"
node = "n1"
sync_ms = 100

[[tenant]]
name = "a"
docroot = "."
fleet_rate_per_s = 1000
fleet_net_cap = "50MB/s"

[[tenant]]
name = "b"
hosts = ["b.test"]
docroot = "."
"#;

#[test]
fn cluster_and_fleet_caps_are_read() {
    let c = parse_config(FLEET).expect("valid");
    assert_eq!(
        c.cluster,
        Some(ClusterConfig {
            redis: "redis://127.0.0.1:6379".into(),
            node: Some("n1".into()),
            sync: Duration::from_millis(100),
        })
    );
    assert_eq!(
        c.tenants[0].fleet,
        TenantFleet {
            rate_per_s: Some(1000),
            net_cap_bytes_per_s: Some(50_000_000),
        }
    );
    assert_eq!(c.tenants[1].fleet, TenantFleet::default());
    // Without [cluster]: a single node, no fleet caps.
    assert_eq!(parse_config(FULL).expect("valid").cluster, None);
    let c = parse_config(&FLEET.replace("node = \"n1\"\nsync_ms = 100\n", "")).expect("valid");
    let cl = c.cluster.expect("cluster");
    assert_eq!(
        (cl.node, cl.sync),
        (None, Duration::from_millis(SYNC_MS_DEFAULT))
    );
}

#[test]
fn cluster_limits_are_crossed_with_an_error_on_the_line() {
    let cases = [
        (
            "sync_ms = 100",
            "sync_ms = 9",
            "sync_ms 9 is outside 10..=60000",
        ),
        (
            "sync_ms = 100",
            "sync_ms = 60001",
            "sync_ms 60001 is outside",
        ),
        ("node = \"n1\"", "node = \"\"", "node \"\" must be"),
        (
            "node = \"n1\"",
            "node = \"a b\"",
            "must be 1..=64 characters",
        ),
        (
            "redis = \"redis://127.0.0.1:6379\"",
            "redis = \"http://x\"",
            "must be a URL",
        ),
        (
            "redis = \"redis://127.0.0.1:6379\"",
            "redis = \"redis://\"",
            "must be a URL",
        ),
        (
            "redis = \"redis://127.0.0.1:6379\"",
            "redis = \"redis://a b\"",
            "must be a URL",
        ),
        (
            "fleet_rate_per_s = 1000",
            "fleet_rate_per_s = 0",
            "fleet_rate_per_s 0 is outside",
        ),
        (
            "fleet_rate_per_s = 1000",
            "fleet_rate_per_s = 1000000001",
            "is outside 1..=1000000000",
        ),
        (
            "fleet_net_cap = \"50MB/s\"",
            "fleet_net_cap = \"50MB\"",
            "fleet_net_cap: rate",
        ),
        ("sync_ms = 100", "sync_ms = 100\nport = 1", "unknown field"),
    ];
    for (from, to, want) in cases {
        let text = FLEET.replace(from, to);
        let e = err(&text);
        assert!(e.message.contains(want), "{to}: {e}");
        assert!(e.line.is_some(), "{to}: {e}");
    }
    let node = format!("node = \"{}\"", "n".repeat(NODE_NAME_BYTES_MAX));
    assert!(parse_config(&FLEET.replace("node = \"n1\"", &node)).is_ok());
    let node = format!("node = \"{}\"", "n".repeat(NODE_NAME_BYTES_MAX + 1));
    assert!(parse_config(&FLEET.replace("node = \"n1\"", &node)).is_err());
    // Fleet caps need a fleet.
    let alone = FLEET.replace(
        "[cluster]\nredis = \"redis://127.0.0.1:6379\"\nnode = \"n1\"\nsync_ms = 100\n",
        "",
    );
    let e = err(&alone);
    assert!(
        e.message.contains("fleet_rate_per_s needs a [cluster]"),
        "{e}"
    );
    assert_eq!(e.line, Some(6));
    let e = err(&alone.replace("fleet_rate_per_s = 1000\n", ""));
    assert!(e.message.contains("fleet_net_cap needs a [cluster]"), "{e}");
}

#[test]
fn the_redis_host_must_be_an_ip_address_not_a_name() {
    // A name would be resolved by the system's resolver on the fleet thread, which has no
    // deadline: refused, with an error naming the field, on its line.
    for bad in [
        "redis://localhost:6379",
        "redis://redis.internal:6379/2",
        "redis://user:pw@cache:6379",
        "redis://[not-v6]:6379",
        "redis://10.0.0.256:6379",
    ] {
        let text = FLEET.replace("redis://127.0.0.1:6379", bad);
        let e = err(&text);
        assert!(
            e.message.contains("redis") && e.message.contains("must be an IP address"),
            "{bad}: {e}"
        );
        assert_eq!(e.line, Some(3), "{bad}: {e}");
    }
    for good in [
        "redis://10.0.0.5:6379",
        "redis://10.0.0.5",
        "redis://fleet:secret@10.0.0.5:6379/3",
        "redis://[::1]:6379",
        "redis://[fe80::1]",
    ] {
        let text = FLEET.replace("redis://127.0.0.1:6379", good);
        assert!(parse_config(&text).is_ok(), "{good}");
    }
}
