//! Preemption notices from the cloud's instance metadata service (`spot_notice`), as each cloud
//! documents its protocol:
//! - **AWS** (IMDSv2): a session token by `PUT /latest/api/token`, then
//!   `/latest/meta-data/spot/instance-action` (an interruption: `terminate`, `stop` or
//!   `hibernate` at `time`) and `/latest/meta-data/events/recommendations/rebalance` (an
//!   advisory) with it; 404 is no notice, 401 an expired token (a new one is fetched).
//! - **GCP**: `instance/preempted` (`TRUE`: about 30 s left) and `instance/maintenance-event`
//!   (`TERMINATE_ON_HOST_MAINTENANCE`: about 60 s; `MIGRATE_ON_HOST_MAINTENANCE` is an advisory)
//!   with `Metadata-Flavor: Google`, held open with `wait_for_change` and the last ETag.
//! - **Azure** Scheduled Events: `Preempt`, `Terminate`, `Reboot` and `Redeploy` of this VM
//!   drain it (`Freeze` is an advisory); each is acknowledged (`StartRequests`) once drained.
//!
//! `auto` asks the three once, together, which answers; a node off any cloud probes nothing
//! after that. Interruptions drain the node; advisories are recorded on the node (and drain it
//! where `spot_rebalance = "drain"`).

use std::time::{Duration, Instant};

use ductile_cluster::records::now_ms;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// The link-local address of every cloud's instance metadata service.
pub const DEFAULT_ENDPOINT: &str = "http://169.254.169.254";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cloud {
    Aws,
    Gcp,
    Azure,
}

impl Cloud {
    pub fn name(self) -> &'static str {
        match self {
            Cloud::Aws => "aws",
            Cloud::Gcp => "gcp",
            Cloud::Azure => "azure",
        }
    }
}

/// Where notices come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    Off,
    /// Find the cloud once at start.
    Auto,
    Cloud(Cloud),
    /// A plain URL polled with GET: a 200 answer is a notice (any other source of one).
    Url(String),
}

impl Source {
    /// `spot_notice`: auto, aws, gcp, azure or off.
    pub fn parse(s: &str) -> anyhow::Result<Source> {
        Ok(match s.trim() {
            "" | "off" => Source::Off,
            "auto" => Source::Auto,
            "aws" => Source::Cloud(Cloud::Aws),
            "gcp" => Source::Cloud(Cloud::Gcp),
            "azure" => Source::Cloud(Cloud::Azure),
            other => anyhow::bail!(
                "invalid spot_notice: {other:?} is not auto, aws, gcp, azure or off (a URL of your own goes in spot_notice_url)"
            ),
        })
    }
}

/// How the agent watches for notices.
#[derive(Clone, Debug)]
pub struct SpotConfig {
    pub source: Source,
    /// The metadata service's base URL (default [`DEFAULT_ENDPOINT`]).
    pub endpoint: String,
    /// How often AWS's and Azure's paths are read, and the pause after a failed read.
    pub poll: Duration,
    /// Advisories (a rebalance recommendation, a live migration, a freeze) drain the node too.
    pub advisories_drain: bool,
}

/// An Azure event to acknowledge once the node has drained.
#[derive(Clone, Debug)]
pub struct Ack {
    client: reqwest::Client,
    url: String,
    event_ids: Vec<String>,
}

impl Ack {
    /// Tell Azure the VM is ready for its events (`StartRequests`): they may start at once,
    /// not at `NotBefore`. Bounded by the client's timeout.
    pub async fn send(&self) -> Result<(), String> {
        let body = serde_json::json!({
            "StartRequests": self.event_ids.iter().map(|id| serde_json::json!({"EventId": id})).collect::<Vec<_>>()
        });
        let r = self
            .client
            .post(&self.url)
            .header("Metadata", "true")
            .json(&body)
            .send()
            .await
            .map_err(|e| format!("POST {}: {e}", self.url))?;
        if r.status().is_success() {
            Ok(())
        } else {
            Err(format!("POST {}: HTTP {}", self.url, r.status()))
        }
    }
    pub fn event_ids(&self) -> &[String] {
        &self.event_ids
    }
}

/// What a cloud said.
#[derive(Clone, Debug)]
pub struct Notice {
    pub cloud: &'static str,
    pub what: String,
    pub deadline_ms: Option<u64>,
    /// An interruption (the node goes): drain. Else an advisory.
    pub interruption: bool,
    pub ack: Option<Ack>,
}

impl Notice {
    pub fn record(&self, advisories_drain: bool) -> ductile_cluster::records::PreemptionNotice {
        ductile_cluster::records::PreemptionNotice {
            cloud: self.cloud.to_string(),
            what: self.what.clone(),
            deadline_ms: self.deadline_ms,
            received_ms: now_ms(),
            drains: self.interruption || advisories_drain,
        }
    }
}

fn client(timeout: Duration) -> Result<reqwest::Client, String> {
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(2))
        .timeout(timeout)
        // the metadata service is link-local: a proxy in the agent's environment is not for it
        .no_proxy()
        .build()
        .map_err(|e| format!("cannot build the HTTP client for preemption notices: {e}"))
}

/// Watch for notices until `cancel`, sending each to `tx`; returns after an interruption
/// (the node goes), or at once where there is nothing to watch.
pub async fn watch(cfg: SpotConfig, tx: mpsc::Sender<Notice>, cancel: CancellationToken) {
    let base = cfg.endpoint.trim_end_matches('/').to_string();
    let cloud = match &cfg.source {
        Source::Off => return,
        Source::Url(url) => return poll_url(url, cfg.poll, tx, cancel).await,
        Source::Cloud(c) => *c,
        Source::Auto => match tokio::select! {
            c = detect(&base) => c,
            _ = cancel.cancelled() => return,
        } {
            Ok(c) => {
                tracing::info!(cloud = c.name(), endpoint = %base, "spot_notice = auto: watching this cloud's preemption notices");
                c
            }
            Err(why) => {
                tracing::info!(endpoint = %base, %why, "spot_notice = auto: no cloud metadata service here; preemption notices are off on this node");
                return;
            }
        },
    };
    match cloud {
        Cloud::Aws => aws(&base, cfg.poll, tx, cancel).await,
        Cloud::Gcp => gcp(&base, cfg.poll, tx, cancel).await,
        Cloud::Azure => azure(&base, cfg.poll, tx, cancel).await,
    }
}

/// Which cloud's metadata service answers at `base`: the three asked together, once, each
/// the way its cloud identifies itself (AWS hands out an IMDSv2 token, GCP answers with
/// `Metadata-Flavor: Google`, Azure answers its `Metadata: true` instance path).
pub async fn detect(base: &str) -> Result<Cloud, String> {
    let c = client(Duration::from_secs(2))?;
    let aws = async {
        let r = c
            .put(format!("{base}/latest/api/token"))
            .header("X-aws-ec2-metadata-token-ttl-seconds", "60")
            .send()
            .await
            .map_err(|e| format!("aws: {e}"))?;
        if r.status().is_success() {
            Ok(Cloud::Aws)
        } else {
            Err(format!("aws: HTTP {}", r.status()))
        }
    };
    let gcp = async {
        let r = c
            .get(format!("{base}/computeMetadata/v1/instance/id"))
            .header("Metadata-Flavor", "Google")
            .send()
            .await
            .map_err(|e| format!("gcp: {e}"))?;
        let flavor = r
            .headers()
            .get("Metadata-Flavor")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if r.status().is_success() && flavor == "Google" {
            Ok(Cloud::Gcp)
        } else {
            Err(format!("gcp: HTTP {}", r.status()))
        }
    };
    let azure = async {
        let r = c
            .get(format!(
                "{base}/metadata/instance/compute/name?api-version=2021-02-01&format=text"
            ))
            .header("Metadata", "true")
            .send()
            .await
            .map_err(|e| format!("azure: {e}"))?;
        if r.status().is_success() {
            Ok(Cloud::Azure)
        } else {
            Err(format!("azure: HTTP {}", r.status()))
        }
    };
    let (a, g, z) = tokio::join!(aws, gcp, azure);
    match (a, g, z) {
        (Ok(c), _, _) | (_, Ok(c), _) | (_, _, Ok(c)) => Ok(c),
        (Err(a), Err(g), Err(z)) => Err(format!("{a}; {g}; {z}")),
    }
}

/// A metadata service's failures: the first is logged, the rest are quiet until it answers
/// again (a node polls every few seconds).
#[derive(Default)]
struct Quiet(bool);

impl Quiet {
    fn warn(&mut self, log: impl FnOnce()) {
        if !self.0 {
            log();
            self.0 = true;
        }
    }
    fn answered(&mut self) {
        self.0 = false;
    }
}

/// Sleep `d`, or return false when cancelled.
async fn pause(d: Duration, cancel: &CancellationToken) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(d) => true,
        _ = cancel.cancelled() => false,
    }
}

/// Unix ms of an RFC 3339 time (`2026-11-21T12:00:00Z`), as AWS writes them.
pub fn rfc3339_ms(s: &str) -> Option<u64> {
    humantime::parse_rfc3339_weak(s.trim())
        .ok()?
        .duration_since(std::time::UNIX_EPOCH)
        .ok()
        .map(|d| d.as_millis() as u64)
}

/// Unix ms of an HTTP date (`Mon, 19 Sep 2016 18:29:47 GMT`), as Azure writes `NotBefore`.
pub fn http_date_ms(s: &str) -> Option<u64> {
    httpdate::parse_http_date(s.trim())
        .ok()?
        .duration_since(std::time::UNIX_EPOCH)
        .ok()
        .map(|d| d.as_millis() as u64)
}

/// What AWS's instance-action document says: an interruption at its time.
pub fn aws_instance_action(body: &str) -> Result<Notice, String> {
    #[derive(serde::Deserialize)]
    struct Action {
        action: String,
        #[serde(default)]
        time: String,
    }
    let a: Action = serde_json::from_str(body)
        .map_err(|e| format!("the instance-action document is not what AWS documents: {e}"))?;
    Ok(Notice {
        cloud: "aws",
        what: format!("spot instance-action {}", a.action),
        deadline_ms: rfc3339_ms(&a.time),
        interruption: true,
        ack: None,
    })
}

/// AWS over IMDSv2.
async fn aws(base: &str, poll: Duration, tx: mpsc::Sender<Notice>, cancel: CancellationToken) {
    const TTL_S: u64 = 21_600;
    let c = match client(Duration::from_secs(2)) {
        Ok(c) => c,
        Err(e) => return tracing::error!(error = %e),
    };
    let mut token: Option<(String, Instant)> = None;
    let mut rebalance_seen = false;
    let mut quiet = Quiet::default();
    loop {
        // a token refreshed well before its TTL; a 401 below drops it at once
        if token
            .as_ref()
            .is_none_or(|(_, t)| t.elapsed() > Duration::from_secs(TTL_S / 2))
        {
            token = match c
                .put(format!("{base}/latest/api/token"))
                .header("X-aws-ec2-metadata-token-ttl-seconds", TTL_S.to_string())
                .send()
                .await
            {
                Ok(r) if r.status().is_success() => match r.text().await {
                    Ok(t) if !t.trim().is_empty() => Some((t.trim().to_string(), Instant::now())),
                    _ => None,
                },
                Ok(r) => {
                    quiet.warn(|| tracing::warn!(status = %r.status(), "IMDSv2 refused a session token: spot notices are not read until it gives one"));
                    None
                }
                Err(e) => {
                    quiet.warn(|| tracing::warn!(error = %e, "IMDSv2 unreachable: spot notices are not read until it answers"));
                    None
                }
            };
        }
        if let Some((t, _)) = token.clone() {
            let mut expired = false;
            let paths: &[&str] = if rebalance_seen {
                &["spot/instance-action"]
            } else {
                &["spot/instance-action", "events/recommendations/rebalance"]
            };
            for path in paths {
                let url = format!("{base}/latest/meta-data/{path}");
                match c
                    .get(&url)
                    .header("X-aws-ec2-metadata-token", &t)
                    .send()
                    .await
                {
                    Ok(r) if r.status().is_success() => {
                        quiet.answered();
                        let body = r.text().await.unwrap_or_default();
                        let notice = if *path == "spot/instance-action" {
                            match aws_instance_action(&body) {
                                Ok(n) => n,
                                Err(why) => {
                                    // a notice we cannot read is still a notice
                                    tracing::warn!(%why, %body, "draining on an unreadable spot notice");
                                    Notice {
                                        cloud: "aws",
                                        what: format!(
                                            "spot instance-action {}",
                                            body.trim().chars().take(120).collect::<String>()
                                        ),
                                        deadline_ms: None,
                                        interruption: true,
                                        ack: None,
                                    }
                                }
                            }
                        } else {
                            rebalance_seen = true;
                            #[derive(serde::Deserialize)]
                            struct Rebalance {
                                #[serde(default, rename = "noticeTime")]
                                notice_time: String,
                            }
                            let at = serde_json::from_str::<Rebalance>(&body)
                                .ok()
                                .and_then(|r| rfc3339_ms(&r.notice_time));
                            Notice {
                                cloud: "aws",
                                what: format!(
                                    "rebalance recommendation{}",
                                    at.map(|a| format!(
                                        " (sent {} UTC)",
                                        ductile_cluster::records::utc(a)
                                    ))
                                    .unwrap_or_default()
                                ),
                                deadline_ms: None,
                                interruption: false,
                                ack: None,
                            }
                        };
                        let last = notice.interruption;
                        if tx.send(notice).await.is_err() || last {
                            return;
                        }
                    }
                    Ok(r) if r.status() == reqwest::StatusCode::NOT_FOUND => {}
                    Ok(r) if r.status() == reqwest::StatusCode::UNAUTHORIZED => expired = true,
                    Ok(r) => {
                        quiet.warn(|| tracing::warn!(%url, status = %r.status(), "IMDSv2 answered an error"));
                    }
                    Err(e) => {
                        quiet.warn(|| tracing::warn!(%url, error = %e, "IMDSv2 unreachable"));
                    }
                }
                if expired {
                    break;
                }
            }
            if expired {
                // the token expired (or the service restarted): a new one now, not after a poll
                token = None;
                continue;
            }
        }
        if !pause(poll, &cancel).await {
            return;
        }
    }
}

/// How long a GCP read waits for a change before it is asked again.
const GCP_WAIT_S: u64 = 30;

/// GCP: both keys watched with `wait_for_change`, each in a loop of its own.
async fn gcp(base: &str, poll: Duration, tx: mpsc::Sender<Notice>, cancel: CancellationToken) {
    let c = match client(Duration::from_secs(GCP_WAIT_S + 10)) {
        Ok(c) => c,
        Err(e) => return tracing::error!(error = %e),
    };
    let stop = cancel.child_token();
    let one = |key: &'static str| {
        let (c, tx, stop) = (c.clone(), tx.clone(), stop.clone());
        let url = format!("{base}/computeMetadata/v1/instance/{key}");
        async move {
            let mut etag: Option<String> = None;
            let mut quiet = Quiet::default();
            loop {
                let target = match &etag {
                    // (GCP's ETags are hex; anything else in one is dropped, not sent raw)
                    Some(e) => format!(
                        "{url}?wait_for_change=true&last_etag={}&timeout_sec={GCP_WAIT_S}",
                        e.chars()
                            .filter(char::is_ascii_alphanumeric)
                            .collect::<String>()
                    ),
                    None => url.clone(),
                };
                let req = c.get(&target).header("Metadata-Flavor", "Google");
                let r = tokio::select! {
                    r = req.send() => r,
                    _ = stop.cancelled() => return,
                };
                match r {
                    Ok(r) if r.status().is_success() => {
                        quiet.answered();
                        etag = r
                            .headers()
                            .get("ETag")
                            .and_then(|v| v.to_str().ok())
                            .map(str::to_string);
                        let value = r.text().await.unwrap_or_default();
                        if let Some(n) = gcp_notice(key, &value) {
                            let last = n.interruption;
                            if tx.send(n).await.is_err() || last {
                                stop.cancel();
                                return;
                            }
                        }
                        if etag.is_none() && !pause(poll, &stop).await {
                            return;
                        }
                    }
                    Ok(r) => {
                        quiet.warn(|| tracing::warn!(%url, status = %r.status(), "GCP's metadata server answered an error"));
                        etag = None;
                        if !pause(poll, &stop).await {
                            return;
                        }
                    }
                    Err(e) => {
                        quiet.warn(|| tracing::warn!(%url, error = %e, "GCP's metadata server unreachable"));
                        etag = None;
                        if !pause(poll, &stop).await {
                            return;
                        }
                    }
                }
            }
        }
    };
    tokio::join!(one("preempted"), one("maintenance-event"));
}

/// What a GCP key's value means: `preempted` TRUE (about 30 s left, as GCP documents),
/// `maintenance-event` TERMINATE_ON_HOST_MAINTENANCE (about 60 s) or a migration (advisory).
pub fn gcp_notice(key: &str, value: &str) -> Option<Notice> {
    let v = value.trim();
    let (interruption, left_s) = match (key, v) {
        ("preempted", "TRUE") => (true, 30),
        ("maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE") => (true, 60),
        ("maintenance-event", "NONE") | ("preempted", _) => return None,
        ("maintenance-event", _) => (false, 60),
        _ => return None,
    };
    Some(Notice {
        cloud: "gcp",
        what: if key == "preempted" {
            "preempted".into()
        } else {
            format!("maintenance-event {v}")
        },
        deadline_ms: Some(now_ms() + left_s * 1000),
        interruption,
        ack: None,
    })
}

/// Azure's Scheduled Events document: the events for this VM (`vm`; all where the VM's name
/// is unknown), as notices.
pub fn azure_events(body: &str, vm: Option<&str>) -> Result<Vec<(Notice, String)>, String> {
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "PascalCase")]
    struct Doc {
        #[serde(default)]
        events: Vec<Event>,
    }
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "PascalCase")]
    struct Event {
        event_id: String,
        event_type: String,
        #[serde(default)]
        resources: Vec<String>,
        #[serde(default)]
        not_before: String,
        #[serde(default)]
        event_status: String,
    }
    let doc: Doc = serde_json::from_str(body)
        .map_err(|e| format!("the Scheduled Events document is not what Azure documents: {e}"))?;
    Ok(doc
        .events
        .into_iter()
        .filter(|e| match vm {
            Some(vm) => e.resources.is_empty() || e.resources.iter().any(|r| r == vm),
            None => true,
        })
        .filter_map(|e| {
            let interruption = match e.event_type.as_str() {
                "Preempt" | "Terminate" | "Reboot" | "Redeploy" => true,
                "Freeze" => false,
                _ => return None,
            };
            Some((
                Notice {
                    cloud: "azure",
                    what: format!(
                        "{}{}",
                        e.event_type,
                        if e.event_status.is_empty() {
                            String::new()
                        } else {
                            format!(" ({})", e.event_status)
                        }
                    ),
                    deadline_ms: http_date_ms(&e.not_before),
                    interruption,
                    ack: None,
                },
                e.event_id,
            ))
        })
        .collect())
}

/// Azure Scheduled Events.
async fn azure(base: &str, poll: Duration, tx: mpsc::Sender<Notice>, cancel: CancellationToken) {
    let c = match client(Duration::from_secs(5)) {
        Ok(c) => c,
        Err(e) => return tracing::error!(error = %e),
    };
    let url = format!("{base}/metadata/scheduledevents?api-version=2020-07-01");
    // this VM's name, to pick its events out of a scale set's document
    let vm = match c
        .get(format!(
            "{base}/metadata/instance/compute/name?api-version=2021-02-01&format=text"
        ))
        .header("Metadata", "true")
        .send()
        .await
    {
        Ok(r) if r.status().is_success() => r.text().await.ok().map(|t| t.trim().to_string()),
        _ => None,
    };
    if vm.is_none() {
        tracing::warn!("Azure's instance metadata did not give this VM's name: every scheduled event in the document is taken as this VM's");
    }
    let mut seen = std::collections::BTreeSet::new();
    let mut quiet = Quiet::default();
    loop {
        match c.get(&url).header("Metadata", "true").send().await {
            Ok(r) if r.status().is_success() => {
                quiet.answered();
                let body = r.text().await.unwrap_or_default();
                match azure_events(&body, vm.as_deref()) {
                    Ok(events) => {
                        let (drain, advise): (Vec<_>, Vec<_>) =
                            events.into_iter().partition(|(n, _)| n.interruption);
                        for (n, id) in advise {
                            if seen.insert(id) && tx.send(n).await.is_err() {
                                return;
                            }
                        }
                        if let Some((first, _)) = drain.first() {
                            // one drain for every interruption of this VM, acknowledged together
                            let mut n = first.clone();
                            n.deadline_ms = drain.iter().filter_map(|(n, _)| n.deadline_ms).min();
                            n.ack = Some(Ack {
                                client: c.clone(),
                                url: url.clone(),
                                event_ids: drain.into_iter().map(|(_, id)| id).collect(),
                            });
                            let _ = tx.send(n).await;
                            return;
                        }
                    }
                    Err(why) => {
                        quiet.warn(|| tracing::warn!(%why, "Azure's Scheduled Events answered a document we cannot read"));
                    }
                }
            }
            Ok(r) => {
                quiet.warn(|| tracing::warn!(%url, status = %r.status(), "Azure's Scheduled Events answered an error"));
            }
            Err(e) => {
                quiet.warn(
                    || tracing::warn!(%url, error = %e, "Azure's Scheduled Events unreachable"),
                );
            }
        }
        if !pause(poll, &cancel).await {
            return;
        }
    }
}

/// A URL of the operator's own: a 200 answer is a notice (its body, cut short, says what).
async fn poll_url(url: &str, every: Duration, tx: mpsc::Sender<Notice>, cancel: CancellationToken) {
    let c = match client(Duration::from_secs(2)) {
        Ok(c) => c,
        Err(e) => return tracing::error!(error = %e),
    };
    loop {
        if !pause(every, &cancel).await {
            return;
        }
        if let Ok(resp) = c.get(url).send().await {
            if resp.status().is_success() {
                let body = resp.text().await.unwrap_or_default();
                // AWS's document, where that is what the URL serves
                let n = aws_instance_action(&body)
                    .map(|n| Notice { cloud: "url", ..n })
                    .unwrap_or_else(|_| Notice {
                        cloud: "url",
                        what: body.trim().chars().take(200).collect(),
                        deadline_ms: None,
                        interruption: true,
                        ack: None,
                    });
                let _ = tx.send(n).await;
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_of_each_cloud_parse_as_their_docs_show_them() {
        let n = aws_instance_action(r#"{"action": "terminate", "time": "2017-09-18T08:22:00Z"}"#)
            .unwrap();
        assert!(n.interruption);
        assert_eq!(n.what, "spot instance-action terminate");
        assert_eq!(n.deadline_ms, Some(1_505_722_920_000));
        assert!(aws_instance_action("<html>").is_err());

        assert!(gcp_notice("preempted", "FALSE").is_none());
        assert!(gcp_notice("preempted", "TRUE").unwrap().interruption);
        assert!(gcp_notice("maintenance-event", "NONE").is_none());
        let m = gcp_notice("maintenance-event", "MIGRATE_ON_HOST_MAINTENANCE").unwrap();
        assert!(!m.interruption);
        let t = gcp_notice("maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE").unwrap();
        assert!(t.interruption && t.deadline_ms.unwrap() > now_ms() + 50_000);

        let doc = r#"{"DocumentIncarnation": 2, "Events": [
          {"EventId": "A", "EventType": "Preempt", "ResourceType": "VirtualMachine",
           "Resources": ["vm1"], "EventStatus": "Scheduled", "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT",
           "Description": "", "EventSource": "Platform", "DurationInSeconds": -1},
          {"EventId": "B", "EventType": "Freeze", "Resources": ["vm2"], "EventStatus": "Scheduled", "NotBefore": ""},
          {"EventId": "C", "EventType": "Freeze", "Resources": ["vm1"], "EventStatus": "Scheduled", "NotBefore": ""}]}"#;
        let ev = azure_events(doc, Some("vm1")).unwrap();
        assert_eq!(ev.len(), 2, "vm2's event is not this VM's");
        assert_eq!(ev[0].1, "A");
        assert!(ev[0].0.interruption);
        assert_eq!(ev[0].0.deadline_ms, Some(1_474_309_787_000));
        assert!(!ev[1].0.interruption);
        assert_eq!(azure_events(doc, None).unwrap().len(), 3);
        assert!(
            azure_events(r#"{"DocumentIncarnation": 0, "Events": []}"#, None)
                .unwrap()
                .is_empty()
        );
        assert!(azure_events("nope", None).is_err());
    }

    #[test]
    fn spot_notice_values() {
        assert_eq!(Source::parse("auto").unwrap(), Source::Auto);
        assert_eq!(Source::parse("off").unwrap(), Source::Off);
        assert_eq!(Source::parse("gcp").unwrap(), Source::Cloud(Cloud::Gcp));
        let e = Source::parse("ec2").unwrap_err().to_string();
        assert!(e.contains("spot_notice") && e.contains("ec2"), "{e}");
    }
}
