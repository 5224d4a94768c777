//! Writing an experiment's results: `<out>/<name>.json` (pretty), `<out>/<name>.md` (title,
//! command, machine, tables, notes, and a link to the chart `<name>.svg`), and the charts
//! themselves, drawn with plotters' SVG backend.

use plotters::prelude::*;
use serde::Serialize;
use std::path::Path;

/// A markdown table: a header and rows of cells.
#[derive(Clone, Debug, Default)]
pub struct Table {
    pub header: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(header: &[&str]) -> Self {
        Table {
            header: header.iter().map(|s| s.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// The table as GitHub markdown (`|` in cells escaped).
    pub fn markdown(&self) -> String {
        let esc = |s: &String| s.replace('|', "\\|");
        let mut out = format!(
            "| {} |\n|{}\n",
            self.header.iter().map(esc).collect::<Vec<_>>().join(" | "),
            "---|".repeat(self.header.len())
        );
        for r in &self.rows {
            out.push_str(&format!(
                "| {} |\n",
                r.iter().map(esc).collect::<Vec<_>>().join(" | ")
            ));
        }
        out
    }

    /// The table as aligned plain text for the terminal.
    pub fn text(&self) -> String {
        let n = self.header.len();
        let mut w = vec![0usize; n];
        for r in std::iter::once(&self.header).chain(&self.rows) {
            for (i, c) in r.iter().enumerate().take(n) {
                w[i] = w[i].max(c.chars().count());
            }
        }
        let mut out = String::new();
        for r in std::iter::once(&self.header).chain(&self.rows) {
            let cells: Vec<String> = r
                .iter()
                .enumerate()
                .take(n)
                .map(|(i, c)| format!("{c:>width$}", width = w[i]))
                .collect();
            out.push_str(cells.join("  ").trim_end());
            out.push('\n');
        }
        out
    }
}

/// What an experiment's markdown page says.
pub struct Doc {
    pub title: String,
    pub command: String,
    pub machine: String,
    /// Paragraphs before the tables.
    pub intro: Vec<String>,
    pub tables: Vec<(String, Table)>,
    /// Paragraphs after the tables (findings, caveats).
    pub notes: Vec<String>,
}

impl Doc {
    pub fn markdown(&self, name: &str, has_chart: bool) -> String {
        let mut s = format!(
            "# {}\n\n`{}`\n\nMachine: **{}**. Raw results: [`{name}.json`]({name}.json).\n\n",
            self.title, self.command, self.machine
        );
        for p in &self.intro {
            s.push_str(p);
            s.push_str("\n\n");
        }
        for (caption, t) in &self.tables {
            if !caption.is_empty() {
                s.push_str(&format!("{caption}\n\n"));
            }
            s.push_str(&t.markdown());
            s.push('\n');
        }
        if has_chart {
            s.push_str(&format!("![{}]({name}.svg)\n\n", self.title));
        }
        for p in &self.notes {
            s.push_str(p);
            s.push_str("\n\n");
        }
        s
    }

    /// The page for the terminal: title, machine, tables, notes.
    pub fn text(&self) -> String {
        let mut s = format!("{}; {}\n", self.title, self.machine);
        for p in &self.intro {
            s.push_str(&format!("{p}\n"));
        }
        for (caption, t) in &self.tables {
            if !caption.is_empty() {
                s.push_str(&format!("{caption}\n"));
            }
            s.push_str(&t.text());
        }
        for p in &self.notes {
            s.push_str(&format!("{p}\n"));
        }
        s
    }
}

/// Writes `<out>/<name>.json` and `<out>/<name>.md` (and leaves the chart, if any, to the
/// caller, which draws it at [`chart_path`] before or after).
pub fn write<T: Serialize>(
    out: &Path,
    name: &str,
    value: &T,
    doc: &Doc,
    has_chart: bool,
) -> Result<(), String> {
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    let json = serde_json::to_string_pretty(value).map_err(|e| e.to_string())?;
    let p = out.join(format!("{name}.json"));
    std::fs::write(&p, json + "\n").map_err(|e| format!("{}: {e}", p.display()))?;
    let p = out.join(format!("{name}.md"));
    std::fs::write(&p, doc.markdown(name, has_chart)).map_err(|e| format!("{}: {e}", p.display()))
}

pub fn chart_path(out: &Path, name: &str) -> std::path::PathBuf {
    out.join(format!("{name}.svg"))
}

/// Prints the result (JSON or the text page) and, with `out`, writes the files and the chart
/// (drawn by `chart`, which gets the path to draw to).
pub fn emit<T: Serialize>(
    name: &str,
    value: &T,
    doc: &Doc,
    json: bool,
    out: Option<&Path>,
    chart: impl FnOnce(&Path) -> Result<(), String>,
) -> Result<(), String> {
    if json {
        println!(
            "{}",
            serde_json::to_string(value).map_err(|e| e.to_string())?
        );
    } else {
        print!("{}", doc.text());
    }
    if let Some(out) = out {
        std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
        chart(&chart_path(out, name))?;
        write(out, name, value, doc, true)?;
    }
    Ok(())
}

const SIZE: (u32, u32) = (800, 480);

fn palette(i: usize) -> RGBColor {
    const C: [RGBColor; 8] = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
    ];
    C[i % C.len()]
}

/// Range covering `vals` with a margin, never empty; includes 0 when `zero`.
pub fn span(vals: impl Iterator<Item = f64>, zero: bool) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in vals.filter(|v| v.is_finite()) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    if zero {
        lo = lo.min(0.0);
        hi = hi.max(0.0);
    }
    let pad = ((hi - lo) * 0.08)
        .max(hi.abs().max(lo.abs()) * 0.01)
        .max(1e-9);
    (if zero && lo >= 0.0 { 0.0 } else { lo - pad }, hi + pad)
}

type Series = (String, Vec<(f64, f64)>);

/// A line chart: one line (with points) per series.
pub fn svg_lines(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
) -> Result<(), String> {
    let e = |e: &dyn std::fmt::Display| format!("chart {}: {e}", path.display());
    let (x0, x1) = span(series.iter().flat_map(|s| s.1.iter().map(|p| p.0)), false);
    let (y0, y1) = span(series.iter().flat_map(|s| s.1.iter().map(|p| p.1)), true);
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .draw()
        .map_err(|x| e(&x))?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let c = palette(i);
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))
            .map_err(|x| e(&x))?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 3, c.filled())))
            .map_err(|x| e(&x))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(|x| e(&x))?;
    root.present().map_err(|x| e(&x))
}

/// A grouped bar chart: `categories` along x, one bar per series in each, values in order.
pub fn svg_bars(
    path: &Path,
    title: &str,
    y_label: &str,
    categories: &[String],
    series: &[(String, Vec<f64>)],
) -> Result<(), String> {
    let e = |e: &dyn std::fmt::Display| format!("chart {}: {e}", path.display());
    let n = categories.len().max(1);
    let (y0, y1) = span(series.iter().flat_map(|s| s.1.iter().copied()), true);
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d((0..n as i32).into_segmented(), y0..y1)
        .map_err(|x| e(&x))?;
    let cats = categories.to_vec();
    let fmt = move |v: &SegmentValue<i32>| match v {
        SegmentValue::CenterOf(i) | SegmentValue::Exact(i) => {
            cats.get(*i as usize).cloned().unwrap_or_default()
        }
        SegmentValue::Last => String::new(),
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n)
        .x_label_formatter(&fmt)
        .y_desc(y_label)
        .draw()
        .map_err(|x| e(&x))?;
    // Bars are drawn in pixel space inside each category's segment.
    let k = series.len().max(1);
    let area = chart.plotting_area();
    for (si, (name, vals)) in series.iter().enumerate() {
        let c = palette(si);
        for (ci, &v) in vals.iter().enumerate().take(n) {
            let (l, _) = area.map_coordinate(&(SegmentValue::Exact(ci as i32), 0.0));
            let (r, _) = area.map_coordinate(&(SegmentValue::Exact(ci as i32 + 1), 0.0));
            let w = (r - l) as f64;
            let bw = w * 0.8 / k as f64;
            let x0 = l + (w * 0.1 + bw * si as f64) as i32;
            let x1 = x0 + bw.max(1.0) as i32;
            let (_, ytop) = area.map_coordinate(&(SegmentValue::Exact(0), v));
            let (_, ybase) = area.map_coordinate(&(SegmentValue::Exact(0), 0.0f64.max(y0)));
            root.draw(&Rectangle::new(
                [(x0, ytop.min(ybase)), (x1, ytop.max(ybase))],
                c.filled(),
            ))
            .map_err(|x| e(&x))?;
        }
        // Legend: one swatch per series, top right.
        let (lx, ly) = (SIZE.0 as i32 - 220, 40 + 20 * si as i32);
        root.draw(&Rectangle::new([(lx, ly), (lx + 14, ly + 12)], c.filled()))
            .map_err(|x| e(&x))?;
        root.draw(&Text::new(
            name.clone(),
            (lx + 20, ly),
            ("sans-serif", 14).into_font(),
        ))
        .map_err(|x| e(&x))?;
    }
    root.present().map_err(|x| e(&x))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_markdown_and_text() {
        let mut t = Table::new(&["a", "b|c"]);
        t.row(vec!["1".into(), "22".into()]);
        assert_eq!(t.markdown(), "| a | b\\|c |\n|---|---|\n| 1 | 22 |\n");
        assert_eq!(t.text(), "a  b|c\n1   22\n");
    }

    #[test]
    fn span_pads_and_includes_zero() {
        let (lo, hi) = span([2.0, 4.0].into_iter(), true);
        assert_eq!(lo, 0.0);
        assert!(hi > 4.0);
        assert_eq!(span(std::iter::empty(), true), (0.0, 1.0));
    }

    #[test]
    fn writes_json_md_and_svgs() {
        let dir = std::env::temp_dir().join(format!("omnistage-report-{}", std::process::id()));
        let doc = Doc {
            title: "t".into(),
            command: "omnistage exp t".into(),
            machine: "m".into(),
            intro: vec![],
            tables: vec![(String::new(), Table::new(&["x"]))],
            notes: vec![],
        };
        write(&dir, "t", &serde_json::json!({"k": 1}), &doc, true).unwrap();
        let md = std::fs::read_to_string(dir.join("t.md")).unwrap();
        assert!(md.contains("![t](t.svg)") && md.contains("`omnistage exp t`"));
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("t.json")).unwrap()).unwrap();
        assert_eq!(v["k"], 1);
        let p = chart_path(&dir, "l");
        svg_lines(
            &p,
            "l",
            "x",
            "y",
            &[("s".into(), vec![(1.0, 2.0), (2.0, 3.0)])],
        )
        .unwrap();
        assert!(std::fs::read_to_string(&p).unwrap().starts_with("<svg"));
        let p = chart_path(&dir, "b");
        svg_bars(
            &p,
            "b",
            "y",
            &["c0".into(), "c1".into()],
            &[("s".into(), vec![1.0, 2.0])],
        )
        .unwrap();
        let svg = std::fs::read_to_string(&p).unwrap();
        assert!(svg.contains("<rect") && svg.contains("c1"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
