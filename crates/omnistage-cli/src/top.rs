//! `omnistage top`: a live terminal view of a running server over its admin API, like `top`:
//! one row per activity with CPU %, share against its target, bytes/s (network and disk),
//! queue, p90 response time and rejects/s; sort keys and a tree view. Drawn with ratatui on
//! crossterm.
//!
//! Keys: `c` CPU, `s` share, `b` bytes/s, `u` queue, `p` p90, `r` rejects/s, `n` name (sort);
//! `t` tree/flat view; `q` or Esc quits. `--once` prints one frame as text and exits (for
//! scripts and terminals without a TTY).

use crate::admin_cli::{fmt_ns, fmt_pct, fmt_rate, AdminArgs};
use clap::Args;
use omnistage_admin::model::{Node, Tree};
use ratatui::backend::TestBackend;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Cell, Paragraph, Row, Table};
use ratatui::{Frame, Terminal};
use std::io::IsTerminal;
use std::sync::mpsc;
use std::time::Duration;

/// How often the view looks for a fetched tree while no key is pressed.
const UI_TICK: Duration = Duration::from_millis(50);

#[derive(Args)]
pub struct TopArgs {
    #[command(flatten)]
    admin: AdminArgs,
    /// Refresh interval, ms (100..=60000).
    #[arg(long, default_value_t = 1000)]
    interval_ms: u64,
    /// Start sorted by: cpu, share, bytes, queue, p90, rejects, name.
    #[arg(long, default_value = "cpu")]
    sort: String,
    /// Start in the flat view (default: the tree view).
    #[arg(long)]
    flat: bool,
    /// Print one frame as text and exit.
    #[arg(long)]
    once: bool,
    /// Width and height of the `--once` frame.
    #[arg(long, default_value_t = 120)]
    width: u16,
    #[arg(long, default_value_t = 40)]
    height: u16,
}

/// What the rows are ordered by (descending, except by name).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SortKey {
    Cpu,
    Share,
    Bytes,
    Queue,
    P90,
    Rejects,
    Name,
}

impl SortKey {
    fn parse(s: &str) -> Option<SortKey> {
        Some(match s {
            "cpu" => SortKey::Cpu,
            "share" => SortKey::Share,
            "bytes" => SortKey::Bytes,
            "queue" => SortKey::Queue,
            "p90" => SortKey::P90,
            "rejects" => SortKey::Rejects,
            "name" => SortKey::Name,
            _ => return None,
        })
    }
    fn name(self) -> &'static str {
        match self {
            SortKey::Cpu => "cpu",
            SortKey::Share => "share",
            SortKey::Bytes => "bytes",
            SortKey::Queue => "queue",
            SortKey::P90 => "p90",
            SortKey::Rejects => "rejects",
            SortKey::Name => "name",
        }
    }
    fn of_key(c: char) -> Option<SortKey> {
        Some(match c {
            'c' => SortKey::Cpu,
            's' => SortKey::Share,
            'b' => SortKey::Bytes,
            'u' => SortKey::Queue,
            'p' => SortKey::P90,
            'r' => SortKey::Rejects,
            'n' => SortKey::Name,
            _ => return None,
        })
    }
    /// The value sorted on (larger first).
    fn value(self, n: &Node) -> f64 {
        let rate = n.rate.as_ref();
        match self {
            SortKey::Cpu | SortKey::Name => n.cpu_percent.unwrap_or(0.0),
            SortKey::Share => n.share.unwrap_or(0.0),
            SortKey::Bytes => rate.map(bytes_per_s).unwrap_or(0.0),
            SortKey::Queue => n.queued as f64,
            SortKey::P90 => p90(n).unwrap_or(0) as f64,
            SortKey::Rejects => rate.map(|r| r.rejected).unwrap_or(0.0),
        }
    }
}

/// Bytes the activity moved per second: network in and out, disk read and written (a group
/// attached by `omnistage shape --admin` reports all four; the HTTP server's tenants move no
/// disk writes).
pub(crate) fn bytes_per_s(r: &omnistage_admin::model::Rates) -> f64 {
    r.bytes_in + r.bytes_out + r.disk_bytes + r.disk_write_bytes
}

fn p90(n: &Node) -> Option<u64> {
    n.latency_1s.as_ref().and_then(|l| l.response_ns.p90)
}

/// One row of the view.
#[derive(Clone, Debug, PartialEq)]
pub struct RowView {
    /// The name as shown (indented in the tree view, the full path in the flat view).
    pub label: String,
    pub path: String,
    pub weight: u32,
    pub cpu: String,
    pub share: String,
    pub target: String,
    pub bytes: String,
    pub queue: String,
    pub p90: String,
    pub rejects: String,
    /// The share is more than 5 points below its target.
    pub starved: bool,
}

/// `s` without control characters: text from the server (names, paths, errors) is drawn on
/// the operator's terminal, where an escape sequence would clear it, retitle it, or worse
/// (ratatui passes them through).
pub(crate) fn printable(s: &str) -> String {
    s.chars().filter(|c| !c.is_control()).collect()
}

fn row_of(n: &Node, label: String) -> RowView {
    let label = printable(&label);
    let rate = n.rate.as_ref();
    let starved = matches!((n.share, n.target_share), (Some(s), Some(t)) if t - s > 0.05);
    RowView {
        label,
        path: n.path.clone(),
        weight: n.weight,
        cpu: n
            .cpu_percent
            .map(|c| format!("{c:.1}"))
            .unwrap_or_else(|| "–".into()),
        share: fmt_pct(n.share),
        target: fmt_pct(n.target_share),
        bytes: rate
            .map(|r| fmt_rate(bytes_per_s(r)))
            .unwrap_or_else(|| "–".into()),
        queue: n.queued.to_string(),
        p90: fmt_ns(p90(n)),
        rejects: rate
            .map(|r| fmt_rate(r.rejected))
            .unwrap_or_else(|| "–".into()),
        starved,
    }
}

fn sorted<'a>(nodes: impl Iterator<Item = &'a Node>, key: SortKey) -> Vec<&'a Node> {
    let mut v: Vec<&Node> = nodes.collect();
    if key == SortKey::Name {
        v.sort_by(|a, b| a.path.cmp(&b.path));
    } else {
        v.sort_by(|a, b| {
            key.value(b)
                .total_cmp(&key.value(a))
                .then_with(|| a.path.cmp(&b.path))
        });
    }
    v
}

/// The rows of a tree: every activity but the root, in tree order (children sorted) or flat.
pub fn rows(t: &Tree, key: SortKey, tree_view: bool) -> Vec<RowView> {
    let mut out = Vec::new();
    if tree_view {
        fn walk(n: &Node, depth: usize, key: SortKey, out: &mut Vec<RowView>) {
            for c in sorted(n.children.iter(), key) {
                out.push(row_of(c, format!("{}{}", "  ".repeat(depth), c.name)));
                walk(c, depth + 1, key, out);
            }
        }
        walk(&t.root, 0, key, &mut out);
    } else {
        fn all<'a>(n: &'a Node, out: &mut Vec<&'a Node>) {
            for c in &n.children {
                out.push(c);
                all(c, out);
            }
        }
        let mut v = Vec::new();
        all(&t.root, &mut v);
        for n in sorted(v.into_iter(), key) {
            out.push(row_of(n, n.path.clone()));
        }
    }
    out
}

/// What the view shows now.
pub struct App {
    pub tree: Option<Tree>,
    pub error: Option<String>,
    pub key: SortKey,
    pub tree_view: bool,
    pub source: String,
}

/// Draws one frame.
pub fn draw(f: &mut Frame<'_>, app: &App) {
    let [head, body, foot] = Layout::vertical([
        Constraint::Length(2),
        Constraint::Min(3),
        Constraint::Length(1),
    ])
    .areas(f.area());
    let summary = match &app.tree {
        Some(t) => format!(
            "omnistage top — {} — up {:.0} s, {} workers, {} CPU charged, tree v{}{}",
            printable(&app.source),
            t.uptime_s,
            t.workers,
            t.cpu_ns_per_s
                .map(|c| format!("{:.0}%", c / 1e7))
                .unwrap_or_else(|| "–".into()),
            t.version,
            fleet_mark(t.fleet.as_ref())
        ),
        None => format!("omnistage top — {} — connecting…", printable(&app.source)),
    };
    let status = match &app.error {
        Some(e) => Line::styled(printable(e), Style::default().fg(Color::Red)),
        None => Line::from(format!(
            "sort: {}   view: {}   (rates and p90 over the last second)",
            app.key.name(),
            if app.tree_view { "tree" } else { "flat" }
        )),
    };
    f.render_widget(
        Paragraph::new(vec![
            Line::styled(summary, Style::default().add_modifier(Modifier::BOLD)),
            status,
        ]),
        head,
    );
    let header = Row::new(
        [
            "ACTIVITY", "WEIGHT", "CPU%", "SHARE", "TARGET", "BYTES/S", "QUEUE", "P90", "REJ/S",
        ]
        .map(Cell::from),
    )
    .style(Style::default().add_modifier(Modifier::REVERSED));
    let rows: Vec<Row> = app
        .tree
        .as_ref()
        .map(|t| rows(t, app.key, app.tree_view))
        .unwrap_or_default()
        .into_iter()
        .map(|r| {
            let style = if r.starved {
                Style::default().fg(Color::Yellow)
            } else {
                Style::default()
            };
            Row::new(vec![
                Cell::from(r.label),
                Cell::from(Line::from(r.weight.to_string()).right_aligned()),
                Cell::from(Line::from(r.cpu).right_aligned()),
                Cell::from(Line::from(r.share).right_aligned()),
                Cell::from(Line::from(r.target).right_aligned()),
                Cell::from(Line::from(r.bytes).right_aligned()),
                Cell::from(Line::from(r.queue).right_aligned()),
                Cell::from(Line::from(r.p90).right_aligned()),
                Cell::from(Line::from(r.rejects).right_aligned()),
            ])
            .style(style)
        })
        .collect();
    let widths = [
        Constraint::Min(20),
        Constraint::Length(7),
        Constraint::Length(7),
        Constraint::Length(7),
        Constraint::Length(7),
        Constraint::Length(9),
        Constraint::Length(7),
        Constraint::Length(9),
        Constraint::Length(7),
    ];
    f.render_widget(
        Table::new(rows, widths)
            .header(header)
            .block(Block::bordered()),
        body,
    );
    f.render_widget(
        Paragraph::new(
            "c cpu  s share  b bytes  u queue  p p90  r rejects  n name  t tree/flat  q quit",
        )
        .style(Style::default().fg(Color::DarkGray)),
        foot,
    );
}

/// What the title says of a node in a fleet: its name and how many nodes it sees, or that it
/// runs on local shares because Redis is unreachable.
fn fleet_mark(fleet: Option<&omnistage_admin::model::Fleet>) -> String {
    match fleet {
        None => String::new(),
        Some(f) if f.connected => {
            format!(" — fleet node {} of {}", printable(&f.node), f.nodes_seen)
        }
        Some(f) => format!(
            " — fleet node {}: Redis unreachable, local shares (episode {})",
            printable(&f.node),
            f.episodes
        ),
    }
}

/// Renders one frame into text (what `--once` prints).
pub fn frame_text(app: &App, width: u16, height: u16) -> String {
    let mut term = Terminal::new(TestBackend::new(width, height)).expect("test backend");
    term.draw(|f| draw(f, app)).expect("draw");
    let buf = term.backend().buffer();
    let mut out = String::new();
    for y in 0..buf.area.height {
        let mut line = String::new();
        for x in 0..buf.area.width {
            line.push_str(buf[(x, y)].symbol());
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// Why the live view cannot start, and what to use instead.
fn no_terminal(why: &str) -> String {
    format!(
        "top draws on a terminal and cannot start here ({why}): use --once to print one frame \
         as text"
    )
}

pub fn run(a: TopArgs) -> Result<(), String> {
    if !(100..=60_000).contains(&a.interval_ms) {
        return Err("--interval-ms must be in 100..=60000".into());
    }
    let key = SortKey::parse(&a.sort).ok_or_else(|| {
        format!(
            "--sort {:?}: want cpu, share, bytes, queue, p90, rejects or name",
            a.sort
        )
    })?;
    let client = a.admin.client()?;
    let mut app = App {
        tree: None,
        error: None,
        key,
        tree_view: !a.flat,
        source: a.admin.url(),
    };
    if a.once {
        match client.get_json::<Tree>("/api/v1/tree") {
            Ok(t) => app.tree = Some(t),
            Err(e) => return Err(e),
        }
        crate::print_stdout(&frame_text(&app, a.width.max(40), a.height.max(8)));
        return Ok(());
    }
    if !std::io::stdout().is_terminal() {
        return Err(no_terminal("its output is not a terminal"));
    }
    // A terminal on stdout may still not be one we can drive (no controlling terminal).
    let mut terminal = ratatui::try_init().map_err(|e| {
        // Whatever of it was set up (raw mode) is undone.
        ratatui::restore();
        no_terminal(&e.to_string())
    })?;
    let interval = Duration::from_millis(a.interval_ms);
    // The tree is fetched on a thread of its own, so the keys are answered while a fetch waits
    // on a slow server (each fetch is bounded by the client's deadline).
    let (results, fetched) = mpsc::sync_channel::<Result<Tree, String>>(1);
    let (stop, stopped) = mpsc::channel::<()>();
    std::thread::Builder::new()
        .name("omnistage-top-fetch".into())
        .spawn(move || loop {
            if results
                .send(client.get_json::<Tree>("/api/v1/tree"))
                .is_err()
            {
                return;
            }
            match stopped.recv_timeout(interval) {
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                _ => return,
            }
        })
        .map_err(|e| {
            ratatui::restore();
            format!("cannot start a thread: {e}")
        })?;
    let result = (|| -> Result<(), String> {
        let mut redraw = true;
        loop {
            match fetched.try_recv() {
                Ok(Ok(t)) => {
                    app.tree = Some(t);
                    app.error = None;
                    redraw = true;
                }
                Ok(Err(e)) => {
                    app.error = Some(e);
                    redraw = true;
                }
                Err(_) => {}
            }
            if redraw {
                terminal
                    .draw(|f| draw(f, &app))
                    .map_err(|e| e.to_string())?;
                redraw = false;
            }
            if !event::poll(UI_TICK).map_err(|e| e.to_string())? {
                continue;
            }
            redraw = true;
            if let Event::Key(k) = event::read().map_err(|e| e.to_string())? {
                if k.kind != KeyEventKind::Press {
                    continue;
                }
                match k.code {
                    KeyCode::Char('q') | KeyCode::Esc => return Ok(()),
                    KeyCode::Char('c') if k.modifiers.contains(KeyModifiers::CONTROL) => {
                        return Ok(())
                    }
                    KeyCode::Char('t') => app.tree_view = !app.tree_view,
                    KeyCode::Char(c) => {
                        if let Some(s) = SortKey::of_key(c) {
                            app.key = s;
                        }
                    }
                    _ => {}
                }
            }
        }
    })();
    ratatui::restore();
    // The fetcher ends at its next wait (or when its fetch in progress ends); not joined.
    drop(stop);
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use omnistage_admin::model::{Counters, Latency, Percentiles, Rates};

    fn node(
        path: &str,
        weight: u32,
        cpu: f64,
        share: f64,
        target: f64,
        children: Vec<Node>,
    ) -> Node {
        Node {
            id: 0,
            path: path.into(),
            name: path.rsplit('/').next().unwrap_or("/").to_string(),
            weight,
            policy: "sfq".into(),
            priority: 0,
            cap: None,
            queued: (cpu as u64) / 10,
            delayed: 0,
            share: Some(share),
            target_share: Some(target),
            cpu_percent: Some(cpu),
            total: Counters::default(),
            own: Counters::default(),
            rate: Some(Rates {
                bytes_out: cpu * 1000.0,
                rejected: 100.0 - cpu,
                ..Default::default()
            }),
            latency: Latency::default(),
            latency_1s: Some(Latency {
                queue_ns: Percentiles::default(),
                response_ns: Percentiles {
                    count: 1,
                    p50: Some(1_000),
                    p90: Some(2_500_000),
                    p99: Some(9_000),
                },
            }),
            cache_bytes: None,
            shaped: None,
            children,
        }
    }

    fn sample() -> Tree {
        Tree {
            version: 3,
            uptime_s: 12.0,
            workers: 2,
            interval_s: Some(1.0),
            cpu_ns_per_s: Some(1.5e9),
            fleet: None,
            sampler: Default::default(),
            truncation: Default::default(),
            root: node(
                "/",
                100,
                150.0,
                1.0,
                1.0,
                vec![
                    node("/infra", 100, 5.0, 0.03, 0.03, vec![]),
                    node(
                        "/t",
                        100,
                        145.0,
                        0.97,
                        0.97,
                        vec![
                            node("/t/a", 70, 60.0, 0.40, 0.66, vec![]),
                            node("/t/b", 30, 85.0, 0.57, 0.31, vec![]),
                        ],
                    ),
                ],
            ),
            cores: vec![],
        }
    }

    #[test]
    fn tree_view_sorts_siblings_and_indents() {
        let r = rows(&sample(), SortKey::Cpu, true);
        let labels: Vec<&str> = r.iter().map(|x| x.label.as_str()).collect();
        assert_eq!(labels, ["t", "  b", "  a", "infra"]);
        let a = r.iter().find(|x| x.path == "/t/a").unwrap();
        assert_eq!(
            (a.weight, a.cpu.as_str(), a.p90.as_str()),
            (70, "60.0", "2.5 ms")
        );
        assert!(a.starved, "40% against a 66% target");
        assert!(!r.iter().find(|x| x.path == "/t/b").unwrap().starved);
    }

    #[test]
    fn flat_view_sorts_by_each_key() {
        let t = sample();
        let first = |k| rows(&t, k, false)[0].path.clone();
        assert_eq!(first(SortKey::Cpu), "/t");
        assert_eq!(first(SortKey::Name), "/infra");
        assert_eq!(first(SortKey::Rejects), "/infra");
        assert_eq!(first(SortKey::Share), "/t");
        assert_eq!(rows(&t, SortKey::Name, false).len(), 4);
    }

    #[test]
    fn a_frame_shows_a_row_per_activity() {
        let app = App {
            tree: Some(sample()),
            error: None,
            key: SortKey::Cpu,
            tree_view: true,
            source: "http://127.0.0.1:9090".into(),
        };
        let text = frame_text(&app, 110, 14);
        assert!(text.contains("omnistage top"), "{text}");
        assert!(text.contains("ACTIVITY"), "{text}");
        let line_a = text
            .lines()
            .find(|l| l.contains(" a "))
            .expect("a row for a");
        assert!(
            line_a.contains("70") && line_a.contains("40.0%") && line_a.contains("66.0%"),
            "{line_a}"
        );
        assert!(text.contains("infra"));
        let none = App {
            tree: None,
            error: Some("cannot reach".into()),
            ..app
        };
        assert!(frame_text(&none, 80, 10).contains("cannot reach"));
    }

    /// Text from the server (an error, a node's name and path, a fleet node's name) reaches
    /// the terminal without its control characters: an escape sequence in an activity's name
    /// must not clear or retitle the operator's terminal.
    #[test]
    fn server_text_reaches_the_terminal_without_control_characters() {
        let mut t = sample();
        let n = &mut t.root.children[1];
        n.name = "t\x1b]0;retitled\x07".into();
        n.path = "/t\x1b[31m".into();
        t.fleet = Some(omnistage_admin::model::Fleet {
            node: "n\x1b[2J".into(),
            connected: true,
            nodes_seen: 2,
            ..Default::default()
        });
        for tree_view in [true, false] {
            let app = App {
                tree: Some(t.clone()),
                error: Some("x\x1b[2Jy\r\n\x7f\u{9b}z".into()),
                key: SortKey::Name,
                tree_view,
                source: "http://127.0.0.1:9090".into(),
            };
            let text = frame_text(&app, 160, 12);
            assert!(
                !text.chars().any(|c| c.is_control() && c != '\n'),
                "{text:?}"
            );
            assert!(text.contains("x[2Jyz"), "{text}");
        }
    }

    #[test]
    fn a_node_in_a_fleet_is_marked() {
        let mut t = sample();
        let mut fleet = omnistage_admin::model::Fleet {
            node: "n2".into(),
            connected: true,
            nodes_seen: 3,
            ..Default::default()
        };
        t.fleet = Some(fleet.clone());
        let app = App {
            tree: Some(t.clone()),
            error: None,
            key: SortKey::Cpu,
            tree_view: true,
            source: "x".into(),
        };
        assert!(frame_text(&app, 160, 10).contains("fleet node n2 of 3"));
        fleet.connected = false;
        fleet.episodes = 1;
        t.fleet = Some(fleet);
        let app = App {
            tree: Some(t),
            ..app
        };
        let text = frame_text(&app, 160, 10);
        assert!(text.contains("Redis unreachable, local shares"), "{text}");
        assert!(!frame_text(
            &App {
                tree: Some(sample()),
                ..app
            },
            160,
            10
        )
        .contains("fleet"));
    }
}
