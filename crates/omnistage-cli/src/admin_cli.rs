//! `omnistage tree`, `omnistage set` and `omnistage graph`: the admin API of a running server
//! from the command line (see `omnistage top` for the live view).
//!
//! ```text
//! omnistage tree [--json]                         the activity tree, one line per activity
//! omnistage set /tenants/a weight=70 cap_cpu=0.5  create or change an activity
//! omnistage graph > g.dot                         the stage graph as measured (dot; --json)
//! ```
//!
//! All take `--admin URL` (default http://127.0.0.1:9090) and `--token` (default: the
//! OMNISTAGE_ADMIN_TOKEN environment variable).

use clap::Args;
use omnistage_admin::client::Client;
use omnistage_admin::model::{ActivityChange, AdmissionChange, CapChange, Changed, Node, Tree};
use omnistage_admin::TOKEN_ENV;

/// Where the admin API is.
#[derive(Args, Clone, Debug)]
pub struct AdminArgs {
    /// Admin API URL.
    #[arg(long, default_value = "http://127.0.0.1:9090")]
    admin: String,
    /// Bearer token (default: the OMNISTAGE_ADMIN_TOKEN environment variable).
    #[arg(long)]
    token: Option<String>,
}

impl AdminArgs {
    pub fn client(&self) -> Result<Client, String> {
        let token = self
            .token
            .clone()
            .or_else(|| std::env::var(TOKEN_ENV).ok().filter(|t| !t.is_empty()));
        Client::new(&self.admin, token)
    }
    pub fn url(&self) -> String {
        self.admin.clone()
    }
}

pub fn fmt_ns(ns: Option<u64>) -> String {
    match ns {
        None => "–".into(),
        Some(n) if n < 1_000 => format!("{n} ns"),
        Some(n) if n < 1_000_000 => format!("{:.1} µs", n as f64 / 1e3),
        Some(n) if n < 1_000_000_000 => format!("{:.1} ms", n as f64 / 1e6),
        Some(n) => format!("{:.2} s", n as f64 / 1e9),
    }
}

pub fn fmt_rate(v: f64) -> String {
    if v >= 1e9 {
        format!("{:.1}G", v / 1e9)
    } else if v >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.1}k", v / 1e3)
    } else if v < 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.0}")
    }
}

pub fn fmt_pct(f: Option<f64>) -> String {
    f.map(|f| format!("{:.1}%", f * 100.0))
        .unwrap_or_else(|| "–".into())
}

/// `s` with each control character written as a JSON-style escape (`\u001b`): what the server
/// sends (names, policies, the dot text, error reasons) goes to the operator's terminal, where
/// an escape sequence would retitle or clear it, or worse. C0 controls, DEL and the C1 range
/// (U+0080..U+009F: U+009B is an 8-bit CSI) are escaped; `keep_lines` keeps newlines and tabs
/// (whole documents), else they are escaped too (a name in the tree's table cannot forge a
/// line). The escape is valid inside a JSON string, so `--json` output stays JSON.
pub fn escape_controls(s: &str, keep_lines: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if c.is_control() && !(keep_lines && (c == '\n' || c == '\t')) {
            out.push_str(&format!("\\u{:04x}", u32::from(c)));
        } else {
            out.push(c);
        }
    }
    out
}

/// The reason of a refused request, escaped for the terminal.
fn refusal(r: &omnistage_admin::client::Reply) -> String {
    format!(
        "{} {}",
        r.status,
        escape_controls(&r.error_message(), false)
    )
}

#[derive(Args)]
pub struct TreeArgs {
    #[command(flatten)]
    admin: AdminArgs,
    /// Print the API's JSON.
    #[arg(long)]
    json: bool,
}

fn tree_lines(t: &Tree) -> Vec<String> {
    let mut out = vec![format!(
        "{:<32} {:>6} {:<8} {:<12} {:>6} {:>7} {:>7} {:>8} {:>8} {:>6} {:>9}",
        "ACTIVITY",
        "WEIGHT",
        "POLICY",
        "CAP",
        "CPU%",
        "SHARE",
        "TARGET",
        "MSG/S",
        "BYTES/S",
        "QUEUE",
        "P90"
    )];
    fn walk(n: &Node, depth: usize, out: &mut Vec<String>) {
        let label = if depth == 0 {
            "/".to_string()
        } else {
            format!(
                "{}{}",
                "  ".repeat(depth - 1),
                escape_controls(&n.name, false)
            )
        };
        out.push(format!(
            "{:<32} {:>6} {:<8} {:<12} {:>6} {:>7} {:>7} {:>8} {:>8} {:>6} {:>9}",
            label,
            n.weight,
            escape_controls(&n.policy, false),
            n.cap
                .as_ref()
                .map(|c| format!("{:.2} cores", c.cores))
                .unwrap_or_default(),
            n.cpu_percent
                .map(|c| format!("{c:.1}"))
                .unwrap_or_else(|| "–".into()),
            fmt_pct(n.share),
            fmt_pct(n.target_share),
            n.rate
                .as_ref()
                .map(|r| fmt_rate(r.messages))
                .unwrap_or_else(|| "–".into()),
            // Network in and out and disk read and written, as `omnistage top` counts them.
            n.rate
                .as_ref()
                .map(|r| fmt_rate(crate::top::bytes_per_s(r)))
                .unwrap_or_else(|| "–".into()),
            n.queued,
            fmt_ns(n.latency_1s.as_ref().and_then(|l| l.response_ns.p90)),
        ));
        for c in &n.children {
            walk(c, depth + 1, out);
        }
    }
    walk(&t.root, 0, &mut out);
    out
}

pub fn tree(a: TreeArgs) -> Result<(), String> {
    let c = a.admin.client()?;
    if a.json {
        let r = c.request("GET", "/api/v1/tree", None)?;
        if r.status != 200 {
            return Err(refusal(&r));
        }
        crate::print_stdout(&escape_controls(&r.text(), true));
        return Ok(());
    }
    let t: Tree = c.get_json("/api/v1/tree")?;
    let mut text = String::new();
    for l in tree_lines(&t) {
        text.push_str(l.trim_end());
        text.push('\n');
    }
    if t.truncation.truncated {
        text.push_str(&format!(
            "({} more activities left out: the admin API lists at most {})\n",
            t.truncation.omitted,
            omnistage_admin::LIST_ENTRIES_MAX
        ));
    }
    crate::print_stdout(&text);
    Ok(())
}

#[derive(Args)]
pub struct SetArgs {
    #[command(flatten)]
    admin: AdminArgs,
    /// The activity (created if it does not exist; its parent must).
    path: String,
    /// KEY=VALUE settings: weight=N, policy=fifo|rr|priority|wfq|sfq|drr, priority=N,
    /// cap_cpu=CORES|none (cores of the whole machine, split evenly between the workers, as
    /// the config file's cpu_cap), cap_kind=token|leaky, cap_burst_ms=MS, p90_ms=MS, admission=
    /// threshold|inherit|token:RATE:BURST, stage=NAME (for p90_ms and admission; default
    /// http.work), cap_net=RATE|none, cap_disk=RATE|none, budget=BYTES|none,
    /// send_order=fair|fifo|shortest_first|longest_first (the last four change an HTTP
    /// server's tenant, or cap_net/cap_disk a group attached by `omnistage shape --admin`:
    /// an admin server with neither refuses them).
    settings: Vec<String>,
    /// Also write the change to the config file (tenants and classes of the file only; refused
    /// on the embedded default and when the file changed on disk since it was loaded).
    #[arg(long)]
    persist: bool,
}

/// A rate or size setting: `none` removes it.
fn bytes_or_none(v: &str) -> serde_json::Value {
    if v == "none" {
        serde_json::Value::Null
    } else {
        serde_json::Value::String(v.into())
    }
}

fn num<T: std::str::FromStr>(k: &str, v: &str) -> Result<T, String> {
    v.parse().map_err(|_| format!("{k}={v}: want a number"))
}

/// Builds the API's change from `KEY=VALUE` settings.
pub fn change_of(settings: &[String]) -> Result<ActivityChange, String> {
    let mut ch = ActivityChange::default();
    let mut cap: Option<CapChange> = None;
    let mut cap_none = false;
    let mut cap_kind = None;
    let mut cap_burst = None;
    let mut stage = "http.work".to_string();
    let mut admission: Option<AdmissionChange> = None;
    for s in settings {
        let (k, v) = s
            .split_once('=')
            .ok_or_else(|| format!("{s:?}: want KEY=VALUE"))?;
        match k {
            "weight" => ch.weight = Some(num(k, v)?),
            "policy" => ch.policy = Some(v.to_string()),
            "priority" => ch.priority = Some(num(k, v)?),
            "cap_cpu" if v == "none" => cap_none = true,
            "cap_cpu" => {
                cap = Some(CapChange {
                    cores: num(k, v)?,
                    kind: None,
                    burst_ms: None,
                })
            }
            "cap_kind" => cap_kind = Some(v.to_string()),
            "cap_burst_ms" => cap_burst = Some(num::<f64>(k, v)?),
            "cap_net" => ch.cap_net = Some(bytes_or_none(v)),
            "cap_disk" => ch.cap_disk = Some(bytes_or_none(v)),
            "budget" => ch.budget = Some(bytes_or_none(v)),
            "send_order" => ch.send_order = Some(v.into()),
            "stage" => stage = v.to_string(),
            "p90_ms" => {
                admission = Some(AdmissionChange {
                    stage: String::new(),
                    predicate: "p90".into(),
                    rate_per_s: None,
                    burst: None,
                    target_ms: Some(num(k, v)?),
                })
            }
            "admission" => {
                let mut parts = v.split(':');
                let pred = parts.next().unwrap_or("");
                let a = match pred {
                    "threshold" | "inherit" => AdmissionChange {
                        stage: String::new(),
                        predicate: pred.into(),
                        rate_per_s: None,
                        burst: None,
                        target_ms: None,
                    },
                    "token" => {
                        let (Some(r), Some(b)) = (parts.next(), parts.next()) else {
                            return Err(format!("{s}: want admission=token:RATE:BURST"));
                        };
                        AdmissionChange {
                            stage: String::new(),
                            predicate: "token".into(),
                            rate_per_s: Some(num(k, r)?),
                            burst: Some(num(k, b)?),
                            target_ms: None,
                        }
                    }
                    _ => {
                        return Err(format!(
                            "{s}: want admission=threshold, inherit or token:RATE:BURST"
                        ))
                    }
                };
                admission = Some(a);
            }
            _ => {
                return Err(format!(
                    "unknown setting {k:?}: want weight, policy, priority, cap_cpu, cap_kind, \
                     cap_burst_ms, p90_ms, admission, stage, cap_net, cap_disk, budget or \
                     send_order"
                ))
            }
        }
    }
    if cap_none {
        ch.cap = Some(None);
    } else if let Some(mut c) = cap {
        c.kind = cap_kind;
        c.burst_ms = cap_burst;
        ch.cap = Some(Some(c));
    } else if cap_kind.is_some() || cap_burst.is_some() {
        return Err("cap_kind and cap_burst_ms need cap_cpu=CORES".into());
    }
    if let Some(mut a) = admission {
        a.stage = stage;
        ch.admission = Some(a);
    }
    Ok(ch)
}

pub fn set(a: SetArgs) -> Result<(), String> {
    if !a.path.starts_with('/') {
        return Err(format!("{:?}: an activity path starts with /", a.path));
    }
    let change = change_of(&a.settings)?;
    if change == ActivityChange::default() {
        return Err("nothing to set: give KEY=VALUE settings (e.g. weight=50)".into());
    }
    let body = serde_json::to_vec(&change).expect("serializes");
    let url = format!(
        "/api/v1/activities{}{}",
        if a.path == "/" { "" } else { &a.path },
        if a.persist { "?persist=true" } else { "" }
    );
    let r = a.admin.client()?.request("PUT", &url, Some(&body))?;
    if r.status != 200 && r.status != 201 {
        return Err(refusal(&r));
    }
    let c: Changed = serde_json::from_slice(&r.body).map_err(|e| e.to_string())?;
    crate::print_stdout(&format!(
        "{} {} (activity table version {})\n",
        escape_controls(&c.action, false),
        escape_controls(&c.path, false),
        c.version
    ));
    Ok(())
}

#[derive(Args)]
pub struct GraphArgs {
    #[command(flatten)]
    admin: AdminArgs,
    /// Print the API's JSON instead of Graphviz dot.
    #[arg(long)]
    json: bool,
}

pub fn graph(a: GraphArgs) -> Result<(), String> {
    let path = if a.json {
        "/api/v1/graph"
    } else {
        "/api/v1/graph.dot"
    };
    let r = a.admin.client()?.request("GET", path, None)?;
    if r.status != 200 {
        return Err(refusal(&r));
    }
    crate::print_stdout(&escape_controls(&r.text(), true));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use omnistage_admin::model::{Counters, Latency};

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn settings_become_a_change() {
        let c = change_of(&s(&[
            "weight=70",
            "cap_cpu=0.5",
            "cap_kind=leaky",
            "p90_ms=50",
            "stage=back",
        ]))
        .unwrap();
        assert_eq!(c.weight, Some(70));
        let cap = c.cap.unwrap().unwrap();
        assert_eq!((cap.cores, cap.kind.as_deref()), (0.5, Some("leaky")));
        let a = c.admission.unwrap();
        assert_eq!(
            (a.stage.as_str(), a.predicate.as_str(), a.target_ms),
            ("back", "p90", Some(50.0))
        );
        assert_eq!(change_of(&s(&["cap_cpu=none"])).unwrap().cap, Some(None));
        let t = change_of(&s(&["admission=token:100:10"]))
            .unwrap()
            .admission
            .unwrap();
        assert_eq!(
            (t.stage.as_str(), t.rate_per_s, t.burst),
            ("http.work", Some(100.0), Some(10))
        );
        assert!(change_of(&s(&["cap_net=10MB/s"]))
            .unwrap()
            .cap_net
            .is_some());
        let ch = change_of(&s(&["cap_net=none", "cap_disk=none", "budget=none"])).unwrap();
        assert_eq!(
            (ch.cap_net, ch.cap_disk, ch.budget),
            (
                Some(serde_json::Value::Null),
                Some(serde_json::Value::Null),
                Some(serde_json::Value::Null)
            )
        );
        assert_eq!(
            change_of(&s(&["send_order=longest_first"]))
                .unwrap()
                .send_order
                .as_deref(),
            Some("longest_first")
        );
        assert!(change_of(&s(&["weight=heavy"])).is_err());
        assert!(change_of(&s(&["colour=red"])).is_err());
        assert!(change_of(&s(&["weight"])).is_err());
        assert!(change_of(&s(&["cap_kind=token"])).is_err());
        assert!(change_of(&s(&["admission=token:1"])).is_err());
    }

    /// The text tree shows each activity's bytes per second (network and disk, as `top`
    /// counts them): a shaped program's copy under its activity is visible there, not only in
    /// `tree --json`.
    #[test]
    fn the_tree_shows_bytes_per_second() {
        let node = |path: &str, name: &str, rate: serde_json::Value, children| {
            serde_json::json!({
                "id": 0, "path": path, "name": name, "weight": 100, "policy": "sfq",
                "priority": 0, "cap": null, "queued": 0, "delayed": 0, "share": null,
                "target_share": null, "cpu_percent": null,
                "total": Counters::default(), "own": Counters::default(),
                "rate": rate, "latency": Latency::default(), "latency_1s": null,
                "children": children,
            })
        };
        let rate = serde_json::json!({
            "cpu_ns": 0.0, "dispatches": 0.0, "messages": 0.0, "queue_wait_ns": 0.0,
            "panics": 0.0, "bytes_in": 1000.0, "bytes_out": 500.0, "disk_bytes": 250_000.0,
            "disk_write_bytes": 2_000_000.0, "rejected": 0.0,
        });
        let shaped = node("/copy", "copy", rate, serde_json::json!([]));
        let root = node(
            "/",
            "",
            serde_json::Value::Null,
            serde_json::json!([shaped]),
        );
        let tree: Tree = serde_json::from_value(serde_json::json!({
            "version": 1, "uptime_s": 1.0, "workers": 1, "interval_s": null,
            "cpu_ns_per_s": null, "root": root, "cores": [],
        }))
        .unwrap();
        let lines = tree_lines(&tree);
        assert!(lines[0].contains("BYTES/S"), "{}", lines[0]);
        let copy = lines.iter().find(|l| l.starts_with("copy")).unwrap();
        assert!(copy.contains(" 2.3M "), "{copy}");
    }
}
