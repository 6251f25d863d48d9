//! `dctl plot`: a job's loss, throughput or per-rank step time over its steps, with every
//! generation as a labelled vertical marker, drawn to SVG or PNG (plotters; the PNG's text
//! uses an embedded DejaVu Sans, so no system font is needed).

use std::path::Path;

use anyhow::{anyhow, bail};
use ductile_cluster::api::SeriesView;
use ductile_cluster::records::Reason;
use plotters::coord::Shift;
use plotters::prelude::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Metric {
    Loss,
    Throughput,
    #[value(name = "step_time", alias = "step-time")]
    StepTime,
    /// The held-out eval loss, one point per eval (at the step it was computed), with the
    /// training loss beside it.
    #[value(name = "eval_loss", alias = "eval-loss")]
    EvalLoss,
}

impl Metric {
    fn label(self) -> &'static str {
        match self {
            Metric::Loss => "loss",
            Metric::Throughput => "samples/s",
            Metric::StepTime => "step time per rank (ms)",
            Metric::EvalLoss => "eval loss",
        }
    }
}

/// The curves to draw: (name, points (step, value)).
pub fn curves(s: &SeriesView, metric: Metric) -> Vec<(String, Vec<(f64, f64)>)> {
    let one = |f: &dyn Fn(&ductile_cluster::series::Point) -> Option<f32>| {
        s.points
            .iter()
            .filter_map(|p| f(p).map(|v| (p.step as f64, v as f64)))
            .filter(|(_, v)| v.is_finite())
            .collect::<Vec<_>>()
    };
    match metric {
        Metric::Loss => vec![("loss".into(), one(&|p| p.loss))],
        Metric::Throughput => vec![("samples/s".into(), one(&|p| p.sps))],
        Metric::StepTime => {
            let ranks = s.points.iter().map(|p| p.rank_ms.len()).max().unwrap_or(0);
            (0..ranks)
                .map(|r| (format!("rank {r}"), one(&|p| p.rank_ms.get(r).copied())))
                .filter(|(_, c)| !c.is_empty())
                .collect()
        }
        Metric::EvalLoss => {
            // each eval once, at its own step (later reports carry it on)
            let mut evals: Vec<(f64, f64)> = Vec::new();
            for p in &s.points {
                if let (Some(at), Some(l)) = (p.eval_step, p.eval_loss) {
                    if evals.last().is_none_or(|e| e.0 != at as f64) && l.is_finite() {
                        evals.push((at as f64, l as f64));
                    }
                }
            }
            if evals.is_empty() {
                return vec![];
            }
            vec![
                ("eval loss".into(), evals),
                ("loss".into(), one(&|p| p.loss)),
            ]
        }
    }
}

fn marker_color(r: Reason) -> RGBColor {
    match r {
        Reason::Failure => RGBColor(192, 57, 43),
        Reason::Scale | Reason::Join => RGBColor(44, 123, 229),
        Reason::Drain => RGBColor(230, 126, 34),
        Reason::Start => RGBColor(127, 140, 141),
    }
}

const PALETTE: [RGBColor; 6] = [
    RGBColor(22, 160, 133),
    RGBColor(142, 68, 173),
    RGBColor(211, 84, 0),
    RGBColor(41, 128, 185),
    RGBColor(192, 57, 43),
    RGBColor(39, 174, 96),
];

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    s: &SeriesView,
    metric: Metric,
    lines: &[(String, Vec<(f64, f64)>)],
) -> Result<(), String> {
    let e = |x: DrawingAreaErrorKind<DB::ErrorType>| x.to_string();
    root.fill(&WHITE).map_err(e)?;
    let steps = s
        .points
        .iter()
        .map(|p| p.step as f64)
        .chain(s.marks.iter().map(|m| m.step as f64))
        .chain(s.quorums.iter().map(|q| q.step as f64));
    let (x0, x1) = steps.fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
    let x1 = if x1 <= x0 { x0 + 1.0 } else { x1 };
    let vals = lines.iter().flat_map(|(_, c)| c.iter().map(|(_, v)| *v));
    let (mut y0, mut y1) = vals.fold((f64::MAX, f64::MIN), |(a, b), y| (a.min(y), b.max(y)));
    if y1 - y0 < 1e-9 {
        (y0, y1) = (y0 - 0.5, y1 + 0.5);
    }
    let pad = (y1 - y0) * 0.08;
    let (y0, y1) = (y0 - pad, y1 + pad);
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("{}: {}", s.job, metric.label()), ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc(metric.label())
        .light_line_style(RGBColor(238, 238, 246))
        .draw()
        .map_err(e)?;
    for (i, m) in s.marks.iter().enumerate() {
        let x = m.step as f64;
        let c = marker_color(m.reason);
        chart
            .draw_series(DashedLineSeries::new(
                [(x, y0), (x, y1)],
                6,
                4,
                c.stroke_width(1),
            ))
            .map_err(e)?;
        let reform = m.reform_s.map(|r| format!(" {r:.2} s")).unwrap_or_default();
        let y = y1 - (y1 - y0) * (0.04 + 0.06 * (i % 3) as f64);
        chart
            .draw_series(std::iter::once(Text::new(
                format!("g{} {}{reform}", m.generation, m.reason),
                (x, y),
                ("sans-serif", 13).into_font().color(&c),
            )))
            .map_err(e)?;
    }
    // a torchft job's quorums: dotted, labelled at the bottom
    for (i, q) in s.quorums.iter().enumerate() {
        let x = q.step as f64;
        let c = RGBColor(110, 110, 130);
        chart
            .draw_series(DashedLineSeries::new(
                [(x, y0), (x, y1)],
                2,
                4,
                c.stroke_width(1),
            ))
            .map_err(e)?;
        let healing = if q.healing > 0 {
            format!(" ({} healing)", q.healing)
        } else {
            String::new()
        };
        let y = y0 + (y1 - y0) * (0.04 + 0.06 * (i % 3) as f64);
        chart
            .draw_series(std::iter::once(Text::new(
                format!("q{} ×{}{healing}", q.quorum_id, q.members),
                (x, y),
                ("sans-serif", 12).into_font().color(&c),
            )))
            .map_err(e)?;
    }
    for (i, (name, pts)) in lines.iter().enumerate() {
        let c = PALETTE[i % PALETTE.len()];
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))
            .map_err(e)?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], c.stroke_width(2)));
    }
    if lines.len() > 1 {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .draw()
            .map_err(e)?;
    }
    root.present().map_err(e)?;
    Ok(())
}

/// What `dctl plot --out` writes, by the file name's extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Svg,
    Png,
}

impl Format {
    /// The format `out` names (`.svg` or `.png`, any case), or an error naming the rule:
    /// checked before anything is fetched.
    pub fn of(out: &Path) -> anyhow::Result<Format> {
        match out
            .extension()
            .and_then(|e| e.to_str())
            .map(|e| e.to_ascii_lowercase())
            .as_deref()
        {
            Some("svg") => Ok(Format::Svg),
            Some("png") => Ok(Format::Png),
            _ => bail!(
                "--out {}: the file name must end in .svg or .png",
                out.display()
            ),
        }
    }
}

/// Draw `metric` of the series to `out` in `format` ([`Format::of`] it); the number of
/// points drawn.
pub fn plot(s: &SeriesView, metric: Metric, out: &Path, format: Format) -> anyhow::Result<usize> {
    let lines = curves(s, metric);
    let n: usize = lines.iter().map(|(_, c)| c.len()).sum();
    if n == 0 {
        bail!(
            "job {} has no {} figures yet (its series holds {} points)",
            s.job,
            metric.label(),
            s.points.len()
        );
    }
    let size = (1200, 600);
    // text is laid out (and, in a PNG, drawn) with the embedded font
    plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
        .map_err(|_| anyhow!("the embedded font cannot be read"))?;
    let r = match format {
        Format::Svg => draw(
            SVGBackend::new(out, size).into_drawing_area(),
            s,
            metric,
            &lines,
        ),
        Format::Png => draw(
            BitMapBackend::new(out, size).into_drawing_area(),
            s,
            metric,
            &lines,
        ),
    };
    r.map_err(|e| anyhow!("cannot write {}: {e}", out.display()))?;
    Ok(n)
}

/// `dctl plot --term`: the chart as text, `width` × `height` cells of plot area (each curve
/// in its own character, every generation a `│` at its step where no point is), the value
/// range on the left, the step range below, then a legend and the generations. What an
/// operator reads over SSH, where no file can be opened.
pub fn term(s: &SeriesView, metric: Metric, width: usize, height: usize) -> anyhow::Result<String> {
    const MARKS: [char; 6] = ['*', '+', 'o', 'x', '#', '%'];
    let curves = curves(s, metric);
    let pts = curves.iter().flat_map(|(_, c)| c.iter());
    let (x0, x1, y0, y1) = pts.fold(
        (f64::MAX, f64::MIN, f64::MAX, f64::MIN),
        |(a, b, c, d), (x, y)| (a.min(*x), b.max(*x), c.min(*y), d.max(*y)),
    );
    if x0 > x1 {
        bail!("no {} points to draw yet", metric.label());
    }
    let (w, h) = (width.max(10), height.max(3));
    let col = |x: f64| {
        if x1 > x0 {
            (((x - x0) / (x1 - x0)) * (w - 1) as f64).round() as usize
        } else {
            0
        }
    };
    let row = |y: f64| {
        if y1 > y0 {
            (h - 1) - (((y - y0) / (y1 - y0)) * (h - 1) as f64).round() as usize
        } else {
            h / 2
        }
    };
    let mut grid = vec![vec![' '; w]; h];
    for (i, (_, c)) in curves.iter().enumerate() {
        for (x, y) in c {
            grid[row(*y)][col(*x)] = MARKS[i % MARKS.len()];
        }
    }
    let marks: Vec<_> = s
        .marks
        .iter()
        .filter(|m| (m.step as f64) >= x0 && (m.step as f64) <= x1 && m.generation > 1)
        .collect();
    for m in &marks {
        let c = col(m.step as f64);
        for r in grid.iter_mut() {
            if r[c] == ' ' {
                r[c] = '│';
            }
        }
    }
    let label = |y: f64| format!("{y:>10.4}");
    let mut out = format!("{} over steps\n", metric.label());
    for (i, r) in grid.iter().enumerate() {
        let axis = match i {
            0 => label(y1),
            i if i == h - 1 => label(y0),
            i if i == h / 2 => label((y0 + y1) / 2.0),
            _ => " ".repeat(10),
        };
        out.push_str(&format!("{axis} ┤{}\n", r.iter().collect::<String>()));
    }
    out.push_str(&format!("{} └{}\n", " ".repeat(10), "─".repeat(w)));
    let (from, to) = (format!("step {x0}"), format!("{x1}"));
    out.push_str(&format!(
        "{}  {from}{}{to}\n",
        " ".repeat(10),
        " ".repeat(w.saturating_sub(from.len() + to.len()))
    ));
    let legend: Vec<String> = curves
        .iter()
        .enumerate()
        .map(|(i, (name, _))| format!("{} {name}", MARKS[i % MARKS.len()]))
        .collect();
    out.push_str(&format!("{}  {}\n", " ".repeat(10), legend.join("   ")));
    for m in marks {
        out.push_str(&format!(
            "{}  │ step {}: generation {} ({}), world {}\n",
            " ".repeat(10),
            m.step,
            m.generation,
            m.reason,
            m.world_size
        ));
    }
    Ok(out)
}

/// A sparkline of `xs` (at most its last `width` values), lowest ▁ to highest █.
pub fn sparkline(xs: &[f64], width: usize) -> String {
    const BARS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
    let xs: Vec<f64> = xs.iter().copied().filter(|x| x.is_finite()).collect();
    let xs = &xs[xs.len().saturating_sub(width)..];
    let (lo, hi) = xs
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(*x), b.max(*x)));
    xs.iter()
        .map(|x| {
            if hi - lo < 1e-12 {
                BARS[3]
            } else {
                BARS[(((x - lo) / (hi - lo)) * 7.0).round() as usize]
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ductile_cluster::records::Layout;
    use ductile_cluster::series::{Mark, Point};

    fn series() -> SeriesView {
        let p = |step: u64, generation, ranks: usize| Point {
            step,
            t_ms: step,
            loss: Some(5.0 / (1.0 + step as f32)),
            sps: Some(100.0 + step as f32),
            // an eval at steps 10 and 20, carried by the later reports
            eval_step: (step >= 10).then_some(step.min(20) / 10 * 10),
            eval_loss: (step >= 10).then(|| 6.0 / (1.0 + step.min(20) as f32)),
            lr: None,
            grad_norm: None,
            generation,
            world: ranks as u32,
            rank_ms: (0..ranks).map(|r| 10.0 + r as f32).collect(),
            merged: 1,
        };
        let m = |g, reason, step| Mark {
            generation: g,
            reason,
            detail: String::new(),
            step,
            at_ms: 0,
            world_size: 2,
            layout: Layout::data_parallel(2),
            reform_s: Some(0.25),
        };
        SeriesView {
            job: "j".into(),
            points: vec![p(0, 1, 3), p(10, 1, 3), p(20, 2, 2), p(30, 2, 2)],
            marks: vec![m(1, Reason::Start, 0), m(2, Reason::Failure, 15)],
            stored_points: 4,
            quorums: vec![ductile_cluster::series::QuorumMark {
                quorum_id: 7,
                at_ms: 0,
                step: 25,
                members: 2,
                healing: 1,
            }],
        }
    }

    #[test]
    fn the_terminal_chart_puts_each_point_in_its_cell_with_axes_legend_and_generations() {
        let t = term(&series(), Metric::Loss, 31, 5).unwrap();
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "loss over steps");
        // loss 5/(1+step): the highest value at step 0 (top left), the lowest at 30 (bottom right)
        assert!(lines[1].starts_with("    5.0000 ┤*"), "{t}");
        assert!(
            lines[5].starts_with("    0.1613 ┤") && lines[5].ends_with('*'),
            "{t}"
        );
        // generation 2 at step 15: a bar in the middle column where no point is
        assert_eq!(lines[3].chars().nth(12 + 15), Some('│'), "{t}");
        assert!(
            lines[7].contains("step 0") && lines[7].ends_with("30"),
            "{t}"
        );
        assert!(lines[8].contains("* loss"), "{t}");
        assert!(
            lines[9].contains("step 15: generation 2 (failure), world 2"),
            "{t}"
        );
        // one character per curve: the step time's ranks
        let t = term(&series(), Metric::StepTime, 31, 5).unwrap();
        assert!(
            t.contains("* rank 0") && t.contains("+ rank 1") && t.contains("o rank 2"),
            "{t}"
        );
        // nothing to draw is said
        let mut empty = series();
        empty.points.clear();
        assert!(term(&empty, Metric::Loss, 31, 5).is_err());
    }

    #[test]
    fn charts_carry_the_curve_and_every_generation_marker() {
        let dir = std::env::temp_dir().join(format!("dctl-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let s = series();
        let svg = dir.join("loss.svg");
        assert_eq!(plot(&s, Metric::Loss, &svg, Format::Svg).unwrap(), 4);
        let text = std::fs::read_to_string(&svg).unwrap();
        assert!(text.contains("g1 start 0.25 s") && text.contains("g2 failure 0.25 s"));
        // a torchft job's quorums are markers too
        assert!(text.contains("q7 ×2 (1 healing)"), "{text}");
        assert!(text.contains("j: loss"));
        let png = dir.join("steps.png");
        assert_eq!(
            plot(&s, Metric::StepTime, &png, Format::Png).unwrap(),
            4 + 4 + 2
        );
        assert!(std::fs::read(&png).unwrap().starts_with(b"\x89PNG"));
        // each eval once, at its step, with the training loss beside it
        let curves = curves(&s, Metric::EvalLoss);
        assert_eq!(curves[0].0, "eval loss");
        let f = |x: f32| x as f64;
        assert_eq!(
            curves[0].1,
            vec![(10.0, f(6.0 / 11.0)), (20.0, f(6.0 / 21.0))]
        );
        assert_eq!(curves[1].1.len(), 4);
        let eval = dir.join("eval.svg");
        assert_eq!(
            plot(&s, Metric::EvalLoss, &eval, Format::Svg).unwrap(),
            2 + 4
        );
        assert!(std::fs::read_to_string(&eval)
            .unwrap()
            .contains("j: eval loss"));
        let none = SeriesView {
            points: s
                .points
                .iter()
                .map(|p| Point {
                    eval_loss: None,
                    eval_step: None,
                    ..p.clone()
                })
                .collect(),
            ..s.clone()
        };
        assert!(plot(&none, Metric::EvalLoss, &eval, Format::Svg).is_err());
        let err = Format::of(&dir.join("x.jpg")).unwrap_err();
        assert!(err.to_string().contains(".svg or .png"), "{err}");
        let empty = SeriesView {
            points: vec![],
            ..s
        };
        assert!(plot(&empty, Metric::Throughput, &svg, Format::Svg).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_sparkline_runs_from_the_lowest_to_the_highest_bar() {
        assert_eq!(sparkline(&[3.0, 2.0, 1.0], 10), "█▅▁");
        assert_eq!(sparkline(&[1.0, 2.0, 3.0, 4.0], 2), "▁█");
        assert_eq!(sparkline(&[2.0, 2.0], 10), "▄▄");
        assert_eq!(sparkline(&[], 10), "");
    }
}
