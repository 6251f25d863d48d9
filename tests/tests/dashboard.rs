//! The job's chart history and the dashboard: real etcd, daemons, agents and tch workers, and
//! the page loaded in a real browser (Debian's headless Chromium, installed by
//! scripts/setup.sh).

use std::path::{Path, PathBuf};
use std::time::Duration;

use ductile_cluster::api::SeriesView;
use ductile_cluster::records::Reason;
use ductile_tests::*;

const S: fn(u64) -> Duration = Duration::from_secs;

/// The page in headless Chromium at the size the screenshot is taken at; its stdout.
fn load(profile: &Path, url: &str, arg: &str) -> String {
    let args = ["--hide-scrollbars", "--window-size=1280,1900", arg];
    chromium(profile, 15_000, &args, url).unwrap_or_else(|e| panic!("{e}"))
}

/// The value of `attr` on the page's `<body>` in a serialized DOM.
fn body_attr(dom: &str, attr: &str) -> String {
    let at = dom.find("<body").expect("a body");
    let tag = &dom[at..at + dom[at..].find('>').unwrap()];
    let k = format!("{attr}=\"");
    let v = tag
        .find(&k)
        .unwrap_or_else(|| panic!("body has no {attr}: {tag}"));
    tag[v + k.len()..][..tag[v + k.len()..].find('"').unwrap()].to_string()
}

/// The value of `attr` on the element with id `id` in a serialized DOM.
fn attr(dom: &str, id: &str, attr: &str) -> String {
    let at = dom
        .find(&format!("id=\"{id}\""))
        .unwrap_or_else(|| panic!("no #{id} in the page"));
    let tag_start = dom[..at].rfind('<').unwrap();
    let tag = &dom[tag_start..tag_start + dom[tag_start..].find('>').unwrap()];
    let k = format!("{attr}=\"");
    let v = tag
        .find(&k)
        .unwrap_or_else(|| panic!("#{id} has no {attr}: {tag}"));
    tag[v + k.len()..][..tag[v + k.len()..].find('"').unwrap()].to_string()
}

fn generation_numbers(marks: &str) -> Vec<u64> {
    marks
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect()
}

#[test]
fn training_the_dashboard_draws_curves_with_every_generation_through_a_kill_a_resize_and_a_failover(
) {
    let mut c = Cluster::start(Spec {
        daemons: 2,
        ..Spec::default().agents(2, 2)
    });
    let data = synth(c.dir.path(), "tokens", 60_000);
    c.submit(&format!(
        "{}max_steps = 100000\neval_fraction = 0.05\neval_every = 20\neval_samples = 32\n[checkpoint]\nurl = \"file://{}/ck-d1\"\ninterval = 25\nkeep = 100\n",
        training_toml("d1", 1, 4, 4, "gpt", &data, "restart_budget = 0"),
        c.dir.path().display()
    ));
    let v = c.wait_world("d1", 4, S(30));
    c.wait_step("d1", 20, S(60));
    let victim = v.members.iter().find(|m| m.rank == 3).unwrap().clone();
    kill_and_reform(&c, "d1", victim.pid.unwrap(), 3);
    let at = c.status("d1").step;
    c.wait_step("d1", at + 20, S(60));
    // the victim's node is drained (its other worker leaves), then the job is scaled down,
    // each through dctl's --wait
    let out = c.dctl_ok(&["drain", &victim.node, "--wait", "--timeout", "60"]);
    assert!(out.contains("drained (no workers left)"), "{out}");
    assert_eq!(c.status("d1").world_size, 2);
    let at = c.status("d1").step;
    c.wait_step("d1", at + 20, S(60));
    let out = c.dctl_ok(&["scale", "d1", "1", "--wait", "--timeout", "60"]);
    assert!(out.contains("formed at world 1"), "{out}");
    let at = c.status("d1").step;
    c.wait_step("d1", at + 30, S(60));

    // the series: points in step order, every generation a marker with its reason
    let history = c.history("d1");
    let numbers: Vec<u64> = history.iter().map(|g| g.number).collect();
    let reasons: Vec<Reason> = history.iter().map(|g| g.reason).collect();
    assert_eq!(
        reasons,
        [Reason::Start, Reason::Failure, Reason::Drain, Reason::Scale],
        "{history:?}"
    );
    let s: SeriesView = c.wait_for(S(20), "the series to hold every generation", || {
        let s: SeriesView = c.get_json("/v1/jobs/d1/series");
        let marked: Vec<u64> = s.marks.iter().map(|m| m.generation).collect();
        let reformed = s.marks.iter().skip(1).all(|m| m.reform_s.is_some());
        // each rank reports its step time every 2 s
        let timed = s
            .points
            .last()
            .is_some_and(|p| p.generation == 4 && p.rank_ms.len() == 1);
        (marked == numbers && reformed && timed).then_some(s)
    });
    assert!(s.points.len() >= 5, "{} points", s.points.len());
    assert!(s.points.windows(2).all(|w| w[0].step < w[1].step));
    for g in &numbers {
        assert!(
            s.points.iter().any(|p| p.generation == *g),
            "no point of generation {g}"
        );
    }
    let last = s.points.last().unwrap();
    assert_eq!((last.world, last.rank_ms.len()), (1, 1), "{last:?}");
    assert!(last.loss.unwrap() < s.points[0].loss.unwrap());
    // thinning: one point per 50 steps at most
    let thin: SeriesView = c.get_json("/v1/jobs/d1/series?from=10&every=50");
    assert!(thin.points.iter().all(|p| p.step >= 10));
    assert!(thin.points.len() < s.points.len());
    assert!(thin
        .points
        .windows(2)
        .rev()
        .skip(1)
        .all(|w| w[1].step >= w[0].step + 50));

    // the leader fails over: the next one reads the series back and goes on with it
    let old_points = |s: &SeriesView| s.points.iter().filter(|p| p.generation < 4).count();
    let before = old_points(&s);
    c.kill_leader();
    let at = c.status("d1").step;
    c.wait_step("d1", at + 20, S(60));
    let after: SeriesView = c.wait_for(S(20), "the new leader to extend the series", || {
        let a: SeriesView = c.get_json("/v1/jobs/d1/series");
        (a.stored_points > s.stored_points).then_some(a)
    });
    assert_eq!(
        old_points(&after),
        before,
        "the points before the failover are kept"
    );
    assert_eq!(
        after.marks.iter().map(|m| m.generation).collect::<Vec<_>>(),
        numbers
    );

    // the page, in a real browser, with the read-only token
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dashboard");
    std::fs::create_dir_all(&out).unwrap();
    let profile = TempDir::new("chromium");
    let url = format!("{}/#token={READ_TOKEN}&job=d1", c.endpoint());
    let dom = load(profile.path(), &url, "--dump-dom");
    assert!(
        dom.contains("<span id=\"error\"></span>"),
        "the page shows an error: {dom}"
    );
    let points: usize = attr(&dom, "loss-chart", "data-points").parse().unwrap();
    assert!(points >= after.points.len().min(5), "{points} points drawn");
    let sps: usize = attr(&dom, "sps-chart", "data-points").parse().unwrap();
    assert!(sps > 0);
    // the learning rate of every reported step beside them, and in the job's title
    let lr: usize = attr(&dom, "lr-chart", "data-points").parse().unwrap();
    assert!(lr >= points.min(5), "{lr} learning-rate points drawn");
    assert!(
        dom.contains(", lr "),
        "the job's title shows its learning rate"
    );
    assert_eq!(
        generation_numbers(&attr(&dom, "loss-chart", "data-markers")),
        numbers
    );
    assert_eq!(
        generation_numbers(&attr(&dom, "sps-chart", "data-markers")),
        numbers
    );
    assert!(dom.contains("g2 failure"), "the failure marker is labelled");
    assert!(dom.contains("g3 drain"), "the drain marker is labelled");
    assert!(dom.contains("g4 scale"), "the scale marker is labelled");
    for m in c.status("d1").members {
        assert!(
            dom.contains(&format!("data-rank=\"{}\"", m.rank)),
            "rank {} listed",
            m.rank
        );
    }
    assert!(
        dom.contains("node1") && dom.contains("node2"),
        "nodes listed"
    );
    // the held-out loss beside the training loss
    let evals: usize = attr(&dom, "loss-chart", "data-eval-points")
        .parse()
        .unwrap();
    assert!(evals >= 2, "{evals} eval points drawn");
    // each rank's step time, a curve per rank (4 at the start); the commits on the step axis
    let ranks: usize = attr(&dom, "ranks-chart", "data-curves").parse().unwrap();
    let held = after
        .points
        .iter()
        .map(|p| p.rank_ms.len())
        .max()
        .unwrap_or(0);
    assert!(
        held >= 1 && ranks >= held,
        "{ranks} rank curves drawn for a series holding {held} ranks' times"
    );
    let commits: usize = attr(&dom, "loss-chart", "data-checkpoints")
        .parse()
        .unwrap();
    assert!(commits >= 2, "{commits} checkpoints drawn");
    assert!(dom.contains("class=\"ckpt-marker\""), "checkpoint markers");
    assert!(
        dom.contains(", checkpoint at step "),
        "the title shows the last commit"
    );
    // hover and zoom: a step range and a step in the address do what a drag across a chart
    // and the pointer do (the same functions): every chart shows that range, with only the
    // generations in it, and the values at that step
    let g2 = history[1].resume_step;
    let (from, to) = (g2.saturating_sub(5), g2 + 15);
    let at = g2 + 5;
    let zoomed = load(
        profile.path(),
        &format!("{url}&zoom={from}-{to}&hover={at}"),
        "--dump-dom",
    );
    assert_eq!(body_attr(&zoomed, "data-zoom"), format!("{from}-{to}"));
    for chart in ["loss-chart", "sps-chart", "lr-chart", "ranks-chart"] {
        assert_eq!(
            attr(&zoomed, chart, "data-range"),
            format!("{from}-{to}"),
            "{chart}"
        );
    }
    for chart in ["loss-chart", "sps-chart", "lr-chart"] {
        let hover = attr(&zoomed, chart, "data-hover");
        assert!(
            hover.starts_with(&format!("step {at}; ")),
            "{chart}: {hover}"
        );
    }
    assert!(
        attr(&zoomed, "loss-chart", "data-hover").contains("training "),
        "the loss at the hovered step"
    );
    assert!(
        zoomed.contains("class=\"hover-text\""),
        "the hover box is drawn"
    );
    assert_eq!(
        generation_numbers(&attr(&zoomed, "loss-chart", "data-markers")),
        [2],
        "only the generation inside the range"
    );
    let zpoints: usize = attr(&zoomed, "loss-chart", "data-points").parse().unwrap();
    assert!(
        zpoints >= 1 && zpoints < points,
        "{zpoints} of {points} points in the range"
    );
    assert!(zoomed.contains("show the whole run"), "a way back");
    let zshot = out.join("dashboard-zoomed.png");
    let _ = std::fs::remove_file(&zshot);
    load(
        profile.path(),
        &format!("{url}&zoom={from}-{to}&hover={at}"),
        &format!("--screenshot={}", zshot.display()),
    );
    assert!(std::fs::read(&zshot).is_ok_and(|b| b.starts_with(b"\x89PNG")));
    // at 1400 × 1000 the page fits the window, and every generation's label is drawn where
    // no other covers it (the browser's own boxes)
    let fit = chromium(
        profile.path(),
        15_000,
        &["--hide-scrollbars", "--window-size=1400,1000", "--dump-dom"],
        &url,
    )
    .unwrap();
    let (page, window): (u32, u32) = (
        body_attr(&fit, "data-page-width").parse().unwrap(),
        body_attr(&fit, "data-window-width").parse().unwrap(),
    );
    assert!(
        page <= window,
        "the page is {page} px wide in a window of {window}"
    );
    for chart in ["loss-chart", "sps-chart"] {
        assert_eq!(attr(&fit, chart, "data-label-overlaps"), "0", "{chart}");
        let labels: usize = attr(&fit, chart, "data-labels").parse().unwrap();
        assert_eq!(labels, numbers.len(), "{chart}: every generation labelled");
    }
    // without a token the page asks for one and shows no job
    let bare = load(profile.path(), &format!("{}/", c.endpoint()), "--dump-dom");
    assert!(bare.contains("needs the read-only token"), "{bare}");
    let shot = out.join("dashboard.png");
    let _ = std::fs::remove_file(&shot);
    load(
        profile.path(),
        &url,
        &format!("--screenshot={}", shot.display()),
    );
    let png = std::fs::read(&shot).expect("a screenshot");
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "{} bytes",
        png.len()
    );
    eprintln!("dashboard screenshot: {}", shot.display());

    // the same chart from the command line, for reports
    for (metric, file) in [
        ("loss", "loss.svg"),
        ("throughput", "throughput.png"),
        ("step_time", "step_time.png"),
        ("eval_loss", "eval_loss.svg"),
    ] {
        let path = out.join(file);
        let _ = std::fs::remove_file(&path);
        let p = path.to_str().unwrap();
        let o = c.dctl_ok(&["plot", "d1", "--out", p, "--metric", metric]);
        assert!(o.contains("4 generation marker(s)"), "{o}");
        let bytes = std::fs::read(&path).unwrap();
        assert!(bytes.len() > 5_000, "{file}: {} bytes", bytes.len());
    }
    let svg = std::fs::read_to_string(out.join("loss.svg")).unwrap();
    for label in ["g1 start", "g2 failure", "g3 drain", "g4 scale", "d1: loss"] {
        assert!(svg.contains(label), "{label} missing from the SVG");
    }
    let svg = std::fs::read_to_string(out.join("eval_loss.svg")).unwrap();
    assert!(svg.contains("eval loss"), "the eval curve is named");
    let (ok, _, err) = c.dctl(&["plot", "d1", "--out", "/tmp/x.gif"]);
    assert!(!ok && err.contains(".svg or .png"), "{err}");
}

/// Every `expr` (and variable query) in a Grafana dashboard, recursively.
fn queries(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                match (k.as_str(), x) {
                    ("expr" | "definition", serde_json::Value::String(s)) => out.push(s.clone()),
                    _ => queries(x, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| queries(x, out)),
        _ => {}
    }
}

#[test]
fn training_every_metric_the_grafana_dashboard_queries_is_exported() {
    let path = repo_root().join("systemd/grafana/ductile.json");
    let dash: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let mut exprs = Vec::new();
    queries(&dash, &mut exprs);
    let mut names = std::collections::BTreeSet::new();
    for e in &exprs {
        let mut rest = e.as_str();
        while let Some(i) = rest.find("ductile_") {
            let end = rest[i..]
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .map_or(rest.len(), |n| i + n);
            names.insert(rest[i..end].to_string());
            rest = &rest[end..];
        }
    }
    assert!(names.len() >= 15, "{names:?}");
    for n in &names {
        assert!(
            !n.ends_with("_ms"),
            "{n}: Prometheus names carry base units (_seconds)"
        );
    }

    // a job that re-formed and committed a checkpoint exports every family
    let c = Cluster::start(Spec::default().agents(1, 2));
    let data = synth(c.dir.path(), "tokens", 60_000);
    let url = format!("file://{}/ckpt", c.dir.path().display());
    let spec = format!(
        "{}max_steps = 100000\neval_fraction = 0.05\neval_every = 10\neval_samples = 16\nmax_grad_norm = 1.0\n[checkpoint]\nurl = \"{url}\"\ninterval = 10\nkeep = 2\n",
        training_toml(
            "m1",
            1,
            2,
            2,
            "gpt",
            &data,
            "allow_fault_injection = true\nenv = { DUCTILE_SLOWDOWN = \"1:4\" }"
        )
    );
    c.submit(&spec);
    c.wait_world("m1", 2, S(30));
    let scrape = |what: &str, f: &dyn Fn(&str) -> bool| {
        c.wait_for(S(90), what, || {
            let (code, body) = http("GET", &format!("{}/metrics", c.endpoint()), &[], b"").ok()?;
            (code == 200 && f(&body)).then_some(body)
        })
    };
    scrape("a committed checkpoint", &|b| {
        b.contains("ductile_checkpoint_last_step{job=\"m1\"}")
    });
    // stopped and submitted again, it restores from the checkpoint
    c.dctl_ok(&["stop", "m1"]);
    c.wait_for(S(60), "the job to stop", || {
        c.status("m1").state.is_terminal().then_some(())
    });
    c.submit(&spec);
    let body = scrape("a restore and rank figures", &|b| {
        b.contains("ductile_checkpoint_restore_seconds{job=\"m1\"}")
            && b.contains("ductile_rank_step_seconds{")
            && b.contains("ductile_job_eval_loss{job=\"m1\"}")
    });
    let exported = |n: &str| {
        body.lines().any(|l| {
            l.strip_prefix(n)
                .is_some_and(|r| r.starts_with('{') || r.starts_with(' '))
        })
    };
    let missing: Vec<&String> = names.iter().filter(|n| !exported(n)).collect();
    assert!(
        missing.is_empty(),
        "queried but not exported: {missing:?}\n{body}"
    );
    assert!(body.contains("# TYPE ductile_job_reformation_seconds histogram"));
    assert!(
        body.contains("ductile_job_reformation_seconds_count{job=\"m1\"} 1")
            && body.contains("ductile_job_reformation_seconds_bucket{le=\"+Inf\",job=\"m1\"} 1"),
        "this run's start is counted once (a resubmission starts a new status): {body}"
    );

    // rank 1 computes 4× slower: the dashboard marks it
    c.wait_for(S(30), "both ranks' figures", || {
        let v = c.status("m1");
        v.members
            .iter()
            .all(|m| m.compute_ms.is_some())
            .then_some(())
    });
    let profile = TempDir::new("chromium");
    let url = format!("{}/#token={READ_TOKEN}&job=m1", c.endpoint());
    let dom = load(profile.path(), &url, "--dump-dom");
    assert!(
        dom.contains("<tr class=\"slow\" data-rank=\"1\">"),
        "rank 1 is not marked slow: {dom}"
    );
    assert!(dom.contains("<tr class=\"\" data-rank=\"0\">"), "{dom}");
    // the job's committed checkpoints are listed, from its store
    assert!(
        dom.contains("<td>committed</td>"),
        "no committed checkpoint listed: {dom}"
    );
}
