//! `ductile-bench dashboard`: the dashboard against a job with a long history. A real etcd and
//! `ductiled` (plain HTTP on loopback, reads without a token); the job's chart history is built
//! the way the leader builds it (a point per progress report, a marker per generation) and
//! stored; then the figures: the stored series' size, the page's weight (the page and the API
//! answers of its first render), the series endpoint's latency, and headless Chromium's time
//! to the first full render (a load of the page less a load of a blank page).

use std::time::{Duration, Instant};

use ductile_cluster::records::{JobSpec, Layout, Reason};
use ductile_cluster::series::{round4, Mark, Point, Series};
use ductile_cluster::{Keys, Store};

pub struct Args {
    pub steps: u64,
    pub report_every: u64,
    pub generations: u64,
    pub ranks: u32,
    pub json: bool,
}

fn get(url: &str) -> anyhow::Result<(u16, String)> {
    Ok(ductile_tests::http("GET", url, &[], b"")?)
}

pub async fn run(a: Args) -> anyhow::Result<()> {
    let dir = ductile_tests::TempDir::new("bench-dash");
    let etcd = ductile_tests::Etcd::start(dir.path());
    let raw = ductile_cluster::connect_etcd(&etcd.endpoint, Duration::from_secs(10)).await?;
    let store = Store::new(raw.clone(), Keys::new("/ductile/v1"));
    let job = "history";
    store
        .submit(&JobSpec::from_toml(&ductile_tests::job_toml(job, 1, 8, 8))?)
        .await?;

    // the history, as the leader keeps it
    let t0 = Instant::now();
    let mut s = Series::new(job);
    let per_gen = (a.steps / a.generations.max(1)).max(1);
    let reasons = [Reason::Failure, Reason::Scale, Reason::Join, Reason::Drain];
    let mut reports = 0u64;
    for step in (0..a.steps).step_by(a.report_every.max(1) as usize) {
        let generation = 1 + step / per_gen;
        if s.marks.last().map(|m| m.generation) != Some(generation) {
            s.mark(Mark {
                generation,
                reason: if generation == 1 {
                    Reason::Start
                } else {
                    reasons[(generation as usize) % reasons.len()]
                },
                detail: format!("generation {generation}"),
                step,
                at_ms: 1_795_000_000_000 + step * 40,
                world_size: a.ranks,
                layout: Layout::data_parallel(a.ranks),
                reform_s: Some(0.3),
            });
        }
        s.push(Point {
            step,
            t_ms: 1_795_000_000_000 + step * 40,
            loss: Some(round4(1.5 + 4.0 / (1.0 + step as f64 / 1000.0))),
            sps: Some(round4(1000.0 + (step % 97) as f64)),
            // an eval every 500 steps, carried by the reports after it
            eval_step: (step >= 500).then_some(step / 500 * 500),
            eval_loss: (step >= 500)
                .then(|| round4(1.7 + 4.0 / (1.0 + (step / 500 * 500) as f64 / 1000.0))),
            lr: Some(round4(3e-4 * (1.0 - step as f64 / 1e5))),
            grad_norm: Some(round4(1.0 + (step % 13) as f64 / 10.0)),
            generation,
            world: a.ranks,
            rank_ms: (0..a.ranks)
                .map(|r| round4(30.0 + r as f64 * 0.1))
                .collect(),
            merged: 1,
        });
        reports += 1;
    }
    let build = t0.elapsed();
    let stored = serde_json::to_vec(&s)?;
    raw.put(&store.keys.series(job), stored.clone(), None)
        .await?;

    // ductiled serving it
    let port = ductile_tests::free_port();
    let token = dir.path().join("token");
    std::fs::write(&token, "bench-token-0123456789")?;
    let _daemon = ductile_tests::Proc::start(
        "ductiled",
        &ductile_tests::bin("ductiled"),
        &[
            "--etcd".into(),
            etcd.endpoint.clone(),
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--token-file".into(),
            token.display().to_string(),
            "--insecure-http".into(),
            "--reads-without-token".into(),
            "true".into(),
        ],
        &[],
        dir.path().join("daemon.log"),
    );
    let base = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok((200, body)) = get(&format!("{base}/v1/jobs/{job}/series")) {
            if body.len() > 100 {
                break;
            }
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "ductiled did not serve the series in 20 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut weight = Vec::new();
    for path in [
        "/".to_string(),
        "/v1/jobs".into(),
        "/v1/nodes".into(),
        format!("/v1/jobs/{job}"),
        format!("/v1/jobs/{job}/series"),
        format!("/v1/jobs/{job}/events"),
    ] {
        let (code, body) = get(&format!("{base}{path}"))?;
        anyhow::ensure!(code == 200, "GET {path}: {code} {body}");
        weight.push((path, body.len()));
    }
    let mut lat = Vec::new();
    for _ in 0..20 {
        let t = Instant::now();
        get(&format!("{base}/v1/jobs/{job}/series"))?;
        lat.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let lat_median = crate::median(&mut lat);

    // headless Chromium: a load that ends once the page rendered (virtual time runs only
    // while nothing is pending, so the 500 ms budget passes after the API answers and the
    // render), less a load of a blank page with the same flags
    let load = |i: usize, url: &str| -> anyhow::Result<(f64, String)> {
        let profile = dir.path().join(format!("chromium-{i}"));
        let t = Instant::now();
        let dom = ductile_tests::chromium(&profile, 500, &["--dump-dom"], url)?;
        Ok((t.elapsed().as_secs_f64() * 1e3, dom))
    };
    let mut renders = Vec::new();
    let mut blanks = Vec::new();
    for i in 0..5 {
        let (blank, _) = load(100 + i, "about:blank")?;
        let (ms, dom) = load(i, &format!("{base}/"))?;
        anyhow::ensure!(
            dom.contains("data-rendered=\"1\"") && dom.contains("gen-marker"),
            "chromium load {i}: the page did not render its charts"
        );
        blanks.push(blank);
        renders.push(ms - blank);
    }
    let blank_median = crate::median(&mut blanks);
    let render_median = crate::median(&mut renders); // sorted: the last is the max
    let render_max = renders[renders.len() - 1];
    let page: usize = weight.iter().map(|(_, b)| b).sum();
    let series_kb = stored.len() as f64 / 1024.0;
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "steps": a.steps, "reports": reports, "generations": s.marks.len(),
                "ranks": a.ranks, "stored_points": s.points.len(),
                "series_bytes": stored.len(), "build_ms": build.as_secs_f64() * 1e3,
                "page_bytes": page, "weights": weight,
                "series_get_ms_median": lat_median,
                "first_render_ms_median": render_median,
                "first_render_ms_max": render_max,
            })
        );
    } else {
        println!(
            "history: {} steps, {reports} reports, {} generations, {} ranks",
            a.steps,
            s.marks.len(),
            a.ranks
        );
        println!(
            "stored series: {} points, {:.1} KiB ({:.1} KiB per 100k steps), built in {:.0} ms ({:.2} µs per report)",
            s.points.len(),
            series_kb,
            series_kb * 100_000.0 / a.steps.max(1) as f64,
            build.as_secs_f64() * 1e3,
            build.as_secs_f64() * 1e6 / reports.max(1) as f64
        );
        for (p, b) in &weight {
            println!("  GET {p:<28} {b:>9} B");
        }
        println!(
            "page weight (the page and its first render's API answers): {:.1} KiB; GET series median {:.1} ms",
            page as f64 / 1024.0,
            lat_median
        );
        println!(
            "headless Chromium, to the first full render (a load of the page less one of a blank page): median {:.0} ms, max {:.0} ms over {} loads (blank page median {:.0} ms)",
            render_median,
            render_max,
            renders.len(),
            blank_median
        );
    }
    Ok(())
}
