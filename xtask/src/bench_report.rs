//! The report `cargo xtask bench all` writes: one Markdown file with every
//! bench's table, and an SVG of grouped bar charts drawn with `plotters`.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use anyhow::Context as _;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// The chart's file name, beside the report.
pub(crate) const CHART: &str = "throughput.svg";

/// One bench's part of the report.
#[derive(Debug)]
pub(crate) struct Section {
    /// A heading, e.g. "Transports".
    pub(crate) title: String,
    /// The command that runs this bench alone.
    pub(crate) command: String,
    /// How long it ran.
    pub(crate) elapsed: Duration,
    /// Its Markdown tables and notes (or why it failed).
    pub(crate) body: String,
}

/// A grouped bar chart: in each group one bar per series.
#[derive(Debug)]
pub(crate) struct Bars {
    /// The chart's caption.
    pub(crate) title: String,
    /// What the y axis counts, e.g. "msg/s".
    pub(crate) unit: String,
    /// The groups along the x axis.
    pub(crate) groups: Vec<String>,
    /// The series: a name and one value per group (`None`: not measured).
    pub(crate) series: Vec<(String, Vec<Option<f64>>)>,
}

/// Everything `bench all` writes.
#[derive(Debug)]
pub(crate) struct Report {
    /// The command that produced it, e.g. "cargo xtask bench all --quick".
    pub(crate) command: String,
    /// When it ran (UTC).
    pub(crate) date: String,
    /// The machine: CPUs, memory, kernel, load.
    pub(crate) machine: Vec<(String, String)>,
    /// Notes printed above the tables (how noisy the numbers are).
    pub(crate) notes: Vec<String>,
    /// The benches, in the order they ran.
    pub(crate) sections: Vec<Section>,
    /// The charts, drawn into [`CHART`] as a grid of panels.
    pub(crate) charts: Vec<Bars>,
}

/// Writes `report.md` and [`CHART`] into `dir` (created if missing).
pub(crate) fn write(dir: &Path, report: &Report) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    draw(&dir.join(CHART), &report.charts)?;
    std::fs::write(dir.join("report.md"), markdown(report)?)?;
    Ok(())
}

/// 83s → "1 min 23 s".
fn minutes(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 60 {
        format!("{} min {} s", s / 60, s % 60)
    } else {
        format!("{s} s")
    }
}

/// The report's Markdown.
fn markdown(r: &Report) -> anyhow::Result<String> {
    let mut m = String::new();
    writeln!(m, "# Warren benchmark report\n")?;
    writeln!(m, "Written by `{}` on {}.\n", r.command, r.date)?;
    writeln!(m, "| machine | |\n|---|---|")?;
    for (k, v) in &r.machine {
        writeln!(m, "| {k} | {v} |")?;
    }
    writeln!(m)?;
    for n in &r.notes {
        writeln!(m, "- {n}")?;
    }
    writeln!(
        m,
        "\n![Throughput by transport and by cluster size]({CHART})\n"
    )?;
    writeln!(m, "| bench | command | took |\n|---|---|---:|")?;
    for s in &r.sections {
        writeln!(
            m,
            "| {} | `{}` | {} |",
            s.title,
            s.command,
            minutes(s.elapsed)
        )?;
    }
    for s in &r.sections {
        writeln!(m, "\n## {}\n", s.title)?;
        writeln!(m, "`{}` ({})\n", s.command, minutes(s.elapsed))?;
        writeln!(m, "{}", s.body.trim_end())?;
    }
    Ok(m)
}

/// Draws the charts as a grid of panels, two per row, into one SVG.
fn draw(path: &Path, charts: &[Bars]) -> anyhow::Result<()> {
    let rows = charts.len().div_ceil(2).max(1);
    let root = SVGBackend::new(path, (1400, 460 * rows as u32)).into_drawing_area();
    root.fill(&WHITE)?;
    for (bars, area) in charts.iter().zip(root.split_evenly((rows, 2))) {
        panel(&area, bars)?;
    }
    root.present()?;
    Ok(())
}

/// 1234567.0 → "1.2M", 12345.0 → "12k".
fn short(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if v >= 1e4 {
        format!("{:.0}k", v / 1e3)
    } else if v >= 1e3 {
        format!("{:.1}k", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}

/// One grouped bar chart, with the value above each bar and a legend.
fn panel(area: &DrawingArea<SVGBackend<'_>, Shift>, bars: &Bars) -> anyhow::Result<()> {
    let top = bars
        .series
        .iter()
        .flat_map(|(_, v)| v.iter().flatten())
        .fold(0.0f64, |a, &b| a.max(b));
    // Head room for the value labels and the legend.
    let top = if top > 0.0 { top * 1.35 } else { 1.0 };
    // Group i spans [i·STEP − STEP/2, i·STEP + STEP/2), its label at i·STEP.
    const STEP: i32 = 100;
    let n = bars.groups.len().max(1) as i32;
    let x = (-STEP / 2..n * STEP - STEP / 2).with_key_points((0..n).map(|i| i * STEP).collect());
    let mut chart = ChartBuilder::on(area)
        .caption(&bars.title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(32)
        .y_label_area_size(64)
        .build_cartesian_2d(x, 0.0..top)?;
    let group = |v: &i32| {
        usize::try_from(v / STEP)
            .ok()
            .and_then(|i| bars.groups.get(i))
            .cloned()
            .unwrap_or_default()
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_label_formatter(&group)
        .y_label_formatter(&|v| short(*v))
        .y_desc(&bars.unit)
        .draw()?;
    let width = STEP * 8 / 10 / bars.series.len().max(1) as i32;
    for (j, (name, values)) in bars.series.iter().enumerate() {
        let color = Palette99::pick(j).to_rgba();
        let left = |i: usize| i as i32 * STEP - STEP * 4 / 10 + j as i32 * width;
        let measured: Vec<(usize, f64)> = values
            .iter()
            .enumerate()
            .filter_map(|(i, v)| v.map(|v| (i, v)))
            .collect();
        chart
            .draw_series(measured.iter().map(|&(i, v)| {
                Rectangle::new([(left(i), 0.0), (left(i) + width - 2, v)], color.filled())
            }))?
            .label(name.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
        let label = ("sans-serif", 12)
            .into_font()
            .color(&BLACK)
            .pos(Pos::new(HPos::Center, VPos::Bottom));
        chart.draw_series(
            measured
                .iter()
                .map(|&(i, v)| Text::new(short(v), (left(i) + width / 2 - 1, v), label.clone())),
        )?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> Report {
        Report {
            command: "cargo xtask bench all --quick".to_owned(),
            date: "2025-01-01 00:00 UTC".to_owned(),
            machine: vec![("CPUs".to_owned(), "2".to_owned())],
            notes: vec!["runs shared 2 cores".to_owned()],
            sections: vec![Section {
                title: "Transports".to_owned(),
                command: "cargo xtask bench transports --quick".to_owned(),
                elapsed: Duration::from_secs(83),
                body: "| transport | 64 B frames/s |\n|---|---:|\n| tcp | 1.20 M |\n".to_owned(),
            }],
            charts: vec![
                Bars {
                    title: "Throughput by transport".to_owned(),
                    unit: "frames/s".to_owned(),
                    groups: vec!["mem".to_owned(), "TCP".to_owned(), "QUIC".to_owned()],
                    series: vec![
                        ("64 B frames".to_owned(), vec![Some(3e6), Some(1.2e6), None]),
                        (
                            "1 KiB frames".to_owned(),
                            vec![Some(1e6), Some(4e5), Some(1e5)],
                        ),
                    ],
                },
                Bars {
                    title: "Throughput by cluster size".to_owned(),
                    unit: "msg/s".to_owned(),
                    groups: vec!["1 node".to_owned(), "3 nodes".to_owned()],
                    series: vec![
                        ("Warren TCP".to_owned(), vec![Some(20e3), Some(9e3)]),
                        ("RabbitMQ".to_owned(), vec![Some(15e3), Some(5e3)]),
                    ],
                },
            ],
        }
    }

    #[test]
    fn writes_the_markdown_and_the_chart() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &report()).unwrap();
        let svg = std::fs::read_to_string(dir.path().join(CHART)).unwrap();
        assert!(svg.starts_with("<svg"), "{svg}");
        for name in [
            "64 B frames",
            "1 KiB frames",
            "Warren TCP",
            "RabbitMQ",
            "Throughput by cluster size",
            "3 nodes",
            "1.2M",
        ] {
            assert!(svg.contains(name), "{name} missing from the SVG");
        }
        let md = std::fs::read_to_string(dir.path().join("report.md")).unwrap();
        for part in [
            "# Warren benchmark report",
            "`cargo xtask bench all --quick`",
            "| CPUs | 2 |",
            "- runs shared 2 cores",
            "![Throughput by transport and by cluster size](throughput.svg)",
            "## Transports",
            "`cargo xtask bench transports --quick` (1 min 23 s)",
            "| tcp | 1.20 M |",
        ] {
            assert!(md.contains(part), "{part:?} missing from:\n{md}");
        }
    }
}
