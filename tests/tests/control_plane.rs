//! The control plane against a real etcd and real processes: agents, daemons, workers, dctl.

use std::time::{Duration, Instant};

use ductile_cluster::records::{now_ms, Generation, JobState, Reason};
use ductile_tests::*;

const S: fn(u64) -> Duration = Duration::from_secs;

fn assert_contiguous(h: &[Generation]) {
    let nums: Vec<u64> = h.iter().map(|g| g.number).collect();
    let want: Vec<u64> = (1..=h.len() as u64).collect();
    assert_eq!(
        nums, want,
        "generation numbers must be strictly increasing with no gap or duplicate"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_backend_conforms() {
    let dir = TempDir::new("conf");
    let etcd = Etcd::start(dir.path());
    let b = ductile_cluster::connect_etcd(&etcd.endpoint, S(10))
        .await
        .unwrap();
    ductile_cluster::conformance::run_all(b, "/conf").await;
}

#[test]
fn three_agents_joining_make_one_generation_with_all_their_slots() {
    let mut c = Cluster::start(Spec {
        debounce_ms: 1000,
        ..Spec::default()
    });
    c.submit(&job_toml("j1", 1, 6, 6));
    let v = c.wait_for(S(10), "the job waiting for slots", || {
        Some(c.status("j1")).filter(|v| v.state == JobState::Waiting)
    });
    assert!(v.message.contains("0 live slot(s)"), "{}", v.message);
    for i in 1..=3 {
        c.start_agent(&format!("node{i}"), 2, &[]);
    }
    let v = c.wait_world("j1", 6, S(20));
    assert_eq!(v.state, JobState::Running);
    assert_eq!(v.generation, 1, "a burst of joins must make one generation");
    let mut slots: Vec<(String, u32)> =
        v.members.iter().map(|m| (m.node.clone(), m.slot)).collect();
    slots.sort();
    let want: Vec<(String, u32)> = (1..=3)
        .flat_map(|i| (0..2).map(move |s| (format!("node{i}"), s)))
        .collect();
    assert_eq!(slots, want);
    let mut ranks: Vec<u32> = v.members.iter().map(|m| m.rank).collect();
    ranks.sort();
    assert_eq!(ranks, (0..6).collect::<Vec<_>>());
    // every worker joined: the re-formation is recorded with its duration
    let v = c.wait_for(S(10), "re-formation recorded", || {
        c.status("j1")
            .last_reformation
            .filter(|r| r.generation == 1)
            .map(|_| c.status("j1"))
    });
    assert_eq!(v.last_reformation.unwrap().reason, Reason::Start);
    assert_eq!(c.history("j1").len(), 1);
}

#[test]
fn sigkill_an_agent_reforms_without_it_once_its_lease_expires() {
    let mut c = Cluster::start(Spec::default().agents(3, 1));
    c.submit(&job_toml("j2", 1, 3, 3));
    c.wait_world("j2", 3, S(20));
    let killed_at = now_ms();
    c.agents.get_mut("node2").unwrap().kill();
    let g = c.wait_for(S(10), "a generation without node2", || {
        c.history("j2").into_iter().find(|g| g.number == 2)
    });
    assert_eq!(g.reason, Reason::Failure);
    assert!(g.members.iter().all(|m| m.node != "node2"));
    assert_eq!(g.world_size, 2);
    // a liveness bound: detection rides on the lease (TTL 2 s), not on a slower timeout; the
    // latency itself is measured by `ductile-bench control-plane` (a 2-core CI machine's etcd
    // once stalled 1.4 s on fsync and put this at 3.46 s)
    let took = g.published_at_ms.saturating_sub(killed_at);
    assert!(
        took <= (c.spec.lease_ttl as u64) * 1000 + 5000,
        "re-formed {took} ms after the kill; TTL is {} s",
        c.spec.lease_ttl
    );
    // the workers of the dead node died with it
    let v = c.wait_world("j2", 2, S(10));
    assert!(v.members.iter().all(|m| m.node != "node2"));
}

#[test]
fn sigkill_a_worker_reforms_within_one_second_then_it_rejoins() {
    let c = Cluster::start(Spec {
        restart_backoff_ms: 1500,
        ..Spec::default().agents(2, 2)
    });
    c.submit(&job_toml("j3", 1, 4, 4));
    let v = c.wait_world("j3", 4, S(20));
    let victim = v.members.iter().find(|m| m.rank == 1).unwrap().clone();
    let killed_at = now_ms();
    unsafe { libc::kill(victim.pid.unwrap() as i32, libc::SIGKILL) };
    let g = c.wait_for(S(5), "a generation without the killed worker", || {
        c.history("j3").into_iter().find(|g| g.number == 2)
    });
    let took = g.published_at_ms.saturating_sub(killed_at);
    assert!(
        took <= 1000,
        "re-formed {took} ms after the worker was killed"
    );
    assert_eq!(g.reason, Reason::Failure);
    assert!(g.detail.contains("killed by signal 9"), "{}", g.detail);
    assert!(g.member(&victim.node, victim.slot).is_none());
    assert_eq!(g.world_size, 3);
    // survivors were not restarted
    let survivors: Vec<u32> = v
        .members
        .iter()
        .filter(|m| m.rank != 1)
        .map(|m| m.pid.unwrap())
        .collect();
    // after the backoff the slot rejoins with a fresh worker (a join generation)
    let v2 = c.wait_world("j3", 4, S(15));
    let h = c.history("j3");
    assert_eq!(h.last().unwrap().reason, Reason::Join);
    let new_pid = v2
        .members
        .iter()
        .find(|m| m.node == victim.node && m.slot == victim.slot)
        .unwrap()
        .pid
        .unwrap();
    assert_ne!(new_pid, victim.pid.unwrap());
    for pid in survivors {
        assert!(
            v2.members.iter().any(|m| m.pid == Some(pid)),
            "survivor {pid} was restarted"
        );
        assert!(pid_alive(pid));
    }
    assert_contiguous(&h);
}

#[test]
fn dctl_scale_down_and_up_and_refuses_sizes_outside_min_max() {
    let c = Cluster::start(Spec::default().agents(2, 2));
    c.submit(&job_toml("j4", 2, 4, 4));
    c.wait_world("j4", 4, S(20));
    c.dctl_ok(&["scale", "j4", "2"]);
    let v = c.wait_world("j4", 2, S(10));
    assert_eq!(v.desired, 2);
    c.dctl_ok(&["scale", "j4", "3"]);
    c.wait_world("j4", 3, S(10));
    c.dctl_ok(&["scale", "j4", "4"]);
    let v = c.wait_world("j4", 4, S(10));
    let h = c.history("j4");
    let sizes: Vec<(u32, Reason)> = h.iter().map(|g| (g.world_size, g.reason)).collect();
    assert_eq!(
        sizes,
        vec![
            (4, Reason::Start),
            (2, Reason::Scale),
            (3, Reason::Scale),
            (4, Reason::Scale)
        ]
    );
    for bad in ["1", "5", "0"] {
        let (ok, _, err) = c.dctl(&["scale", "j4", bad]);
        assert!(!ok);
        assert!(
            err.contains(&format!("{bad} is outside [min, max] = [2, 4]")),
            "{err}"
        );
    }
    std::thread::sleep(Duration::from_millis(800));
    assert_eq!(
        c.status("j4").generation,
        v.generation,
        "a refused scale changes nothing"
    );
    assert_eq!(c.status("j4").desired, 4);
}

#[test]
fn sigkill_the_leader_and_the_standby_leads_with_generations_in_order() {
    let mut c = Cluster::start(Spec {
        daemons: 2,
        election_ttl: 2,
        ..Spec::default().agents(3, 1)
    });
    c.submit(&job_toml("j5", 1, 3, 3));
    c.wait_world("j5", 3, S(20));
    let (idx, second, took) = c.kill_leader();
    let first = format!("daemon{idx}");
    // etcd sweeps expired leases every 500 ms: a TTL, plus up to that sweep
    assert!(
        took <= Duration::from_millis(c.spec.election_ttl as u64 * 1000 + 1000),
        "standby led after {took:?}"
    );
    assert_ne!(second, first);
    // the new leader reconciles: lose a node, scale, and the generations stay in order
    c.agents.get_mut("node3").unwrap().kill();
    c.wait_world("j5", 2, S(10));
    c.dctl_ok(&["scale", "j5", "1"]);
    c.wait_world("j5", 1, S(10));
    // the old leader comes back as a standby: no duplicate generation
    c.restart_daemon(idx);
    c.dctl_ok(&["scale", "j5", "2"]);
    c.wait_world("j5", 2, S(10));
    let h = c.history("j5");
    assert!(h.len() >= 4, "{h:?}");
    assert_contiguous(&h);
}

#[test]
fn restarting_etcd_leaves_workers_running_and_the_control_plane_recovers() {
    let mut c = Cluster::start(Spec {
        lease_ttl: 5,
        election_ttl: 5,
        ..Spec::default().agents(2, 2)
    });
    c.submit(&job_toml("j6", 1, 4, 4));
    let v = c.wait_world("j6", 4, S(20));
    let pids: Vec<u32> = v.members.iter().map(|m| m.pid.unwrap()).collect();
    c.etcd.proc.kill();
    std::thread::sleep(Duration::from_millis(1500));
    for p in &pids {
        assert!(pid_alive(*p), "worker {p} died during the etcd outage");
    }
    c.etcd.restart();
    // same world, same processes
    let v2 = c.wait_world("j6", 4, S(15));
    assert_eq!(v2.generation, v.generation);
    let pids2: Vec<u32> = v2.members.iter().map(|m| m.pid.unwrap()).collect();
    assert_eq!(pids, pids2);
    // and it still reacts: a worker dies → a new generation
    unsafe { libc::kill(pids[3] as i32, libc::SIGKILL) };
    c.wait_for(S(10), "a failure generation after the etcd restart", || {
        c.history("j6")
            .into_iter()
            .find(|g| g.reason == Reason::Failure)
    });
    c.dctl_ok(&["scale", "j6", "2"]);
    c.wait_world("j6", 2, S(10));
    for a in c.agents.values_mut() {
        assert!(a.try_wait().is_none(), "agent {} exited", a.name);
    }
}

#[test]
fn an_agent_keeps_pinging_its_watchdog_while_etcd_hangs_and_its_writes_wait() {
    // the agent's systemd socket, stood in for by the test
    let dir = TempDir::new("notify");
    let path = dir.path().join("notify.sock");
    let sock = std::os::unix::net::UnixDatagram::bind(&path).unwrap();
    sock.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut c = Cluster::start(Spec {
        lease_ttl: 5,
        election_ttl: 5,
        agent_env: vec![
            ("NOTIFY_SOCKET".into(), path.display().to_string()),
            // pings every second (half of it, capped at 1 s)
            ("WATCHDOG_USEC".into(), "2000000".into()),
        ],
        ..Spec::default().agents(1, 2)
    });
    c.submit(&format!(
        "{}command = [\"sleep\", \"600\"]\n",
        job_toml("j12", 1, 2, 2)
    ));
    let v = c.wait_world("j12", 2, S(20));
    // etcd hangs (every request waits for its timeout) and a worker dies: the agent has an
    // exit record and a failure record to write
    c.etcd.proc.stop();
    unsafe { libc::kill(v.members[0].pid.unwrap() as i32, libc::SIGKILL) };
    let t0 = Instant::now();
    let mut last = Instant::now();
    let mut worst = Duration::ZERO;
    let mut pings = 0;
    let mut buf = [0u8; 256];
    while t0.elapsed() < S(12) {
        if let Ok(n) = sock.recv(&mut buf) {
            if String::from_utf8_lossy(&buf[..n]).contains("WATCHDOG=1") {
                worst = worst.max(last.elapsed());
                last = Instant::now();
                pings += 1;
            }
        }
    }
    worst = worst.max(last.elapsed());
    // the daemon still serves (/healthz) but says it is not ready, and why (/readyz): a load
    // balancer sends no one to it
    let api = c.endpoint();
    let (code, _) = http("GET", &format!("{api}/healthz"), &[], b"").unwrap();
    assert_eq!(code, 200);
    let (code, body) = http("GET", &format!("{api}/readyz"), &[], b"").unwrap();
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("etcd has not answered"), "{body}");
    c.etcd.proc.cont();
    c.wait_for(S(10), "/readyz 200 once etcd answers again", || {
        let r = http("GET", &format!("{api}/readyz"), &[], b"").ok()?;
        (r.0 == 200).then_some(())
    });
    assert!(pings >= 8, "{pings} pings in 12 s");
    assert!(
        worst < Duration::from_millis(2500),
        "the watchdog went {worst:?} without a ping (systemd would kill the agent)"
    );
    // and the writes that waited go through once etcd answers: the job re-forms without the
    // dead worker's slot (until the daemon hears from etcd again it answers 503, saying so)
    c.wait_for(S(30), "a failure generation after etcd came back", || {
        let (ok, out, err) = c.dctl(&["events", "j12", "--json"]);
        if !ok {
            assert!(err.contains("etcd has not answered"), "{err}");
            return None;
        }
        out.lines()
            .map(|l| serde_json::from_str::<Generation>(l).unwrap())
            .find(|g| g.reason == Reason::Failure)
    });
    assert!(c.agents.values_mut().all(|a| a.try_wait().is_none()));
}

#[test]
fn a_second_agent_with_a_taken_node_name_is_refused_and_a_restarted_one_takes_over() {
    let mut c = Cluster::start(Spec::default().agents(1, 2));
    c.submit(&format!(
        "{}command = [\"sleep\", \"600\"]\n",
        job_toml("j13", 1, 2, 2)
    ));
    let v = c.wait_world("j13", 2, S(20));
    // a second agent started with node1's name
    let mut twin = Proc::start(
        "twin",
        &bin("ductile-agent"),
        &[
            "--etcd".into(),
            c.etcd.endpoint.clone(),
            "--node".into(),
            "node1".into(),
            "--cpu-slots".into(),
            "4".into(),
            "--lease-ttl".into(),
            "2".into(),
            "--gpus".into(),
            "off".into(),
        ],
        &[],
        c.dir.path().join("twin.log"),
    );
    let st = twin.wait_exit(S(20)).expect("the twin gives up");
    assert!(!st.success());
    let log = twin.log_tail(20);
    assert!(log.contains("is held by another live agent"), "{log}");
    // node1 keeps its record, its slots and its workers
    let rt = tokio::runtime::Runtime::new().unwrap();
    let store = rt.block_on(c.store());
    let nodes = rt.block_on(store.nodes()).unwrap();
    let n1 = nodes.iter().find(|n| n.name == "node1").unwrap();
    assert_eq!(n1.agent_pid, c.agents["node1"].pid());
    assert_eq!(n1.slots(), 2);
    let v2 = c.status("j13");
    assert_eq!(v2.generation, v.generation, "no re-formation");
    // the real node1 agent crashes and is restarted: it takes its record back at once
    // (the old process is gone), without waiting for the old lease to expire
    let a = c.agents.get_mut("node1").unwrap();
    a.kill();
    let t0 = Instant::now();
    a.restart();
    c.wait_for(S(20), "node1 registered again", || {
        a_log_has(&c, "node1", "took over the record").then_some(())
    });
    assert!(t0.elapsed() < S(15));
    c.wait_world("j13", 2, S(30));
}

fn a_log_has(c: &Cluster, agent: &str, text: &str) -> bool {
    c.agents[agent].log_tail(400).contains(text)
}

#[test]
fn a_stopped_agent_past_its_ttl_is_removed_fences_its_workers_and_rejoins() {
    // `sleep` workers do not follow generations themselves: only the agent can fence them
    let c = Cluster::start(Spec {
        lease_ttl: 1,
        ..Spec::default().agents(2, 1)
    });
    c.submit(&format!(
        "{}command = [\"sleep\", \"600\"]\n",
        job_toml("j7", 1, 2, 2)
    ));
    let v = c.wait_world("j7", 2, S(20));
    let old = v
        .members
        .iter()
        .find(|m| m.node == "node2")
        .unwrap()
        .pid
        .unwrap();
    let agent = &c.agents["node2"];
    agent.stop();
    let g = c.wait_for(S(10), "node2 removed", || {
        c.history("j7")
            .into_iter()
            .find(|g| g.member("node2", 0).is_none())
    });
    assert_eq!(g.reason, Reason::Failure);
    assert!(
        pid_alive(old),
        "the stopped agent's worker still runs until the agent wakes"
    );
    agent.cont();
    // the agent learns its lease is gone, kills the fenced worker, registers again
    c.wait_for(S(10), "the old-generation worker stopped", || {
        (!pid_alive(old)).then_some(())
    });
    let v = c.wait_world("j7", 2, S(15));
    let new = v
        .members
        .iter()
        .find(|m| m.node == "node2")
        .unwrap()
        .pid
        .unwrap();
    assert_ne!(new, old);
    let nodes: serde_json::Value = serde_json::from_str(&c.dctl_ok(&["nodes", "--json"])).unwrap();
    let n2 = nodes
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["name"] == "node2")
        .unwrap();
    assert_eq!(n2["reregistrations"], 1);
    let h = c.history("j7");
    assert_eq!(h.last().unwrap().reason, Reason::Join);
    assert_contiguous(&h);
}

/// The node's record as `dctl nodes --json` shows it.
fn node_json(c: &Cluster, name: &str) -> Option<serde_json::Value> {
    let v: serde_json::Value = serde_json::from_str(&c.dctl_ok(&["nodes", "--json"])).unwrap();
    v.as_array()?.iter().find(|n| n["name"] == name).cloned()
}

/// A spot node (`spot1`, 2 slots, its agent given `flags`) beside node1 (2 slots) running a
/// job of 4.
fn spot_cluster_with(flags: &[&str], job: &str) -> Cluster {
    let mut c = Cluster::start(Spec::default().agents(1, 2));
    c.start_agent("spot1", 2, flags);
    c.submit(&job_toml(job, 1, 4, 4));
    c.wait_world(job, 4, S(20));
    c
}

/// [`spot_cluster_with`] whose agent reads its cloud's notices from `server`.
fn spot_cluster(server: &MetadataServer, notice: &str, job: &str) -> Cluster {
    spot_cluster_with(
        &[
            "--spot-notice",
            notice,
            "--spot-metadata-endpoint",
            &server.url,
            "--spot-poll-ms",
            "100",
        ],
        job,
    )
}

/// Every read of the cloud's own paths carried its metadata header: what lacked it were `auto`'s
/// probes for the other two clouds, once each.
fn assert_only_probes_lacked_the_header(server: &MetadataServer, probes: [&str; 2]) {
    let refused = server.with(|s| s.refused_header.clone());
    assert!(
        refused.len() <= 2 && refused.iter().all(|r| probes.contains(&r.as_str())),
        "a read of {:?}'s paths without its header: {refused:?}",
        server.kind
    );
}

/// The node drains for the notice: the agent exits 0, the job re-forms on node1 with a drain
/// (no failure), and `dctl events` names the cloud and what it said.
fn assert_drained_for(c: &mut Cluster, job: &str, says: &[&str]) {
    let status = c
        .agents
        .get_mut("spot1")
        .unwrap()
        .wait_exit(S(20))
        .expect("the agent drains and exits");
    assert!(status.success(), "drained agent exit status {status:?}");
    let v = c.wait_world(job, 2, S(10));
    assert!(v.members.iter().all(|m| m.node == "node1"));
    let h = c.history(job);
    let last = h.last().unwrap();
    assert_eq!(last.reason, Reason::Drain, "{h:?}");
    for s in says {
        assert!(
            last.detail.contains(s),
            "{s:?} not in the drain's event: {}",
            last.detail
        );
    }
    assert!(h.iter().all(|g| g.reason != Reason::Failure), "{h:?}");
}

/// AWS's IMDSv2, as current instances require it: the agent takes a token by PUT and reads
/// with it (the server refuses every tokenless read: the old plain GET never saw a notice),
/// takes a new token when one expires (401), records a rebalance recommendation on the node
/// without draining, and drains for the interruption with its deadline.
#[test]
fn aws_imdsv2_notices_drain_with_a_token_and_a_rebalance_is_recorded() {
    let aws = MetadataServer::start(CloudKind::Aws);
    let mut c = spot_cluster(&aws, "aws", "jaws");
    // the token expires (IMDSv2 answers 401): the agent takes a new one and goes on reading
    c.wait_for(S(10), "a first IMDSv2 token", || {
        aws.with(|s| s.tokens_issued >= 1).then_some(())
    });
    aws.set(|s| s.tokens.clear());
    c.wait_for(S(10), "a second token after the first expired", || {
        aws.with(|s| s.tokens_issued >= 2).then_some(())
    });
    aws.set(|s| s.rebalance = Some(r#"{"noticeTime": "2026-12-04T10:00:00Z"}"#.into()));
    let n = c.wait_for(
        S(10),
        "the rebalance recommendation on spot1's record",
        || node_json(&c, "spot1").filter(|n| !n["preemption"].is_null()),
    );
    assert_eq!(n["preemption"]["cloud"], "aws");
    assert_eq!(n["preemption"]["drains"], false, "{n}");
    assert!(
        n["preemption"]["what"]
            .as_str()
            .unwrap()
            .contains("rebalance recommendation"),
        "{n}"
    );
    assert_eq!(
        n["draining"], false,
        "a rebalance recommendation does not drain by default"
    );
    assert!(c
        .dctl_ok(&["nodes"])
        .contains("advisory notice from aws: rebalance recommendation"));
    assert_eq!(c.status("jaws").world_size, 4);
    // the interruption, two minutes out as AWS gives it
    let at = now_ms() + 120_000;
    let secs = at / 1000;
    let time = ductile_cluster::records::utc(secs * 1000).replace(' ', "T") + "Z";
    aws.set(|s| {
        s.instance_action = Some(format!(r#"{{"action": "terminate", "time": "{time}"}}"#))
    });
    assert_drained_for(
        &mut c,
        "jaws",
        &[
            "spot1",
            "aws",
            "spot instance-action terminate",
            &format!(
                "deadline {} UTC",
                ductile_cluster::records::utc(secs * 1000)
            ),
        ],
    );
    assert_eq!(
        aws.with(|s| s.tokenless),
        0,
        "every read carried an IMDSv2 token"
    );
    assert!(
        aws.with(|s| s.refused_unauthorized) >= 1,
        "the expired token was refused"
    );
}

/// GCP, found by `auto`: the agent holds its reads open (`wait_for_change` with the ETag), sends
/// `Metadata-Flavor: Google` on each, records a live migration, and drains when preempted.
#[test]
fn gcp_notices_found_by_auto_are_watched_for_changes_and_drain_when_preempted() {
    let gcp = MetadataServer::start(CloudKind::Gcp);
    let mut c = spot_cluster(&gcp, "auto", "jgcp");
    c.wait_for(S(10), "the agent holding a read open for a change", || {
        gcp.with(|s| s.waited >= 2).then_some(())
    });
    gcp.set(|s| s.maintenance = ("MIGRATE_ON_HOST_MAINTENANCE".into(), 2));
    let n = c.wait_for(S(10), "the migration on spot1's record", || {
        node_json(&c, "spot1").filter(|n| !n["preemption"].is_null())
    });
    assert_eq!(n["preemption"]["cloud"], "gcp");
    assert_eq!(n["preemption"]["drains"], false);
    assert_eq!(n["draining"], false);
    gcp.set(|s| s.preempted = ("TRUE".into(), 2));
    assert_drained_for(&mut c, "jgcp", &["spot1", "gcp", "preempted", "deadline"]);
    assert_only_probes_lacked_the_header(
        &gcp,
        [
            "PUT /latest/api/token",
            "GET /metadata/instance/compute/name",
        ],
    );
}

/// Azure's Scheduled Events, found by `auto`: another VM's event is ignored, this VM's Preempt
/// drains it by its NotBefore, and once drained the agent acknowledges the event.
#[test]
fn azure_scheduled_events_drain_this_vm_and_are_acknowledged() {
    let az = MetadataServer::start(CloudKind::Azure);
    let mut c = spot_cluster(&az, "auto", "jaz");
    let event = |id: &str, ty: &str, vm: &str| {
        serde_json::json!({
            "EventId": id, "EventType": ty, "ResourceType": "VirtualMachine",
            "Resources": [vm], "EventStatus": "Scheduled",
            "NotBefore": "Fri, 04 Dec 2026 18:00:00 GMT", "Description": "",
            "EventSource": "Platform", "DurationInSeconds": -1
        })
    };
    az.set(|s| s.azure_events.push(event("OTHER-VM", "Preempt", "vm7")));
    std::thread::sleep(S(1));
    assert_eq!(
        node_json(&c, "spot1").unwrap()["draining"],
        false,
        "another VM's event"
    );
    az.set(|s| s.azure_events.push(event("E-1", "Preempt", "vm1")));
    assert_drained_for(
        &mut c,
        "jaz",
        &[
            "spot1",
            "azure",
            "Preempt",
            "deadline 2026-12-04 18:00:00 UTC",
        ],
    );
    c.wait_for(S(5), "the event acknowledged", || {
        az.with(|s| s.azure_acked == ["E-1"]).then_some(())
    });
    assert_only_probes_lacked_the_header(
        &az,
        [
            "PUT /latest/api/token",
            "GET /computeMetadata/v1/instance/id",
        ],
    );
}

/// Off any cloud, `auto` asks once (one request per cloud) and never again.
#[test]
fn spot_notice_auto_off_any_cloud_probes_nothing_after_the_first_refusal() {
    let none = MetadataServer::start(CloudKind::None);
    let mut c = Cluster::start(Spec::default());
    c.start_agent(
        "node1",
        1,
        &[
            "--spot-notice",
            "auto",
            "--spot-metadata-endpoint",
            &none.url,
            "--spot-poll-ms",
            "50",
        ],
    );
    c.wait_for(S(10), "node1 registered", || node_json(&c, "node1"));
    c.wait_for(S(5), "the three probes", || {
        none.with(|s| s.requests.len() == 3).then_some(())
    });
    std::thread::sleep(S(2));
    assert_eq!(
        none.with(|s| s.requests.len()),
        3,
        "{:?}",
        none.with(|s| s.requests.clone())
    );
    c.wait_for(S(5), "the agent saying so in its log", || {
        c.agent_logs()
            .contains("no cloud metadata service here")
            .then_some(())
    });
}

fn sighup(pid: u32) {
    let st = std::process::Command::new("kill")
        .args(["-HUP", &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success());
}

/// `systemctl reload ductile-agent` (SIGHUP): the agent reads its config again and publishes the
/// new policy without a drain. A running job the new policy refuses keeps running (same
/// generation, same workers), named in the agent's log and in `dctl nodes`; a new job it refuses
/// is refused at submit; a config that does not load keeps the policy in force. The daemon's
/// SIGHUP rotates its tokens: the old one is refused, the new one works, nothing restarts.
#[test]
fn sighup_reloads_the_agent_policy_and_the_daemon_tokens_without_a_drain() {
    let mut c = Cluster::start(Spec::default());
    let cfg = c.dir.path().join("agent.toml");
    let tmp = std::env::temp_dir().display().to_string();
    let policy =
        |commands: &str| format!("allowed_commands = [{commands}]\nallowed_paths = [\"{tmp}\"]\n");
    std::fs::write(&cfg, policy("\"ductile-worker\", \"sleep\"")).unwrap();
    c.start_agent("node1", 2, &["--config", cfg.to_str().unwrap()]);
    c.submit(&job_toml("keep", 1, 2, 2));
    let before = c.wait_world("keep", 2, S(20));
    let pids: Vec<Option<u32>> = before.members.iter().map(|m| m.pid).collect();
    let agent_pid = c.agents["node1"].pid();

    // a config that does not load: logged, the policy in force stays
    std::fs::write(&cfg, "allowed_commands = [\"sleep\"]\ncolour = 1\n").unwrap();
    sighup(agent_pid);
    c.wait_for(S(10), "the refused reload in the agent's log", || {
        c.agent_logs()
            .contains("configuration reload refused")
            .then_some(())
    });
    assert!(node_json(&c, "node1").unwrap()["refused_running"].is_null());

    // the new policy refuses ductile-worker: the running job stays, named
    std::fs::write(&cfg, policy("\"sleep\"")).unwrap();
    sighup(agent_pid);
    let n = c.wait_for(S(10), "the refused running job on node1's record", || {
        node_json(&c, "node1").filter(|n| !n["refused_running"].is_null())
    });
    let why = n["refused_running"]["keep"].as_str().unwrap().to_string();
    assert!(why.contains("command"), "{why}");
    assert!(
        c.dctl_ok(&["nodes"])
            .contains("running job keep is refused by the agent's current policy"),
        "{}",
        c.dctl_ok(&["nodes"])
    );
    assert!(c
        .agent_logs()
        .contains("the new policy refuses this running job"));
    std::thread::sleep(S(2));
    let after = c.status("keep");
    assert_eq!(after.generation, before.generation, "no re-formation");
    assert_eq!(
        after.members.iter().map(|m| m.pid).collect::<Vec<_>>(),
        pids,
        "the same workers"
    );
    assert!(
        c.agents.get_mut("node1").unwrap().wait_exit(S(0)).is_none(),
        "the agent runs on"
    );
    // what the node now publishes is what the daemon checks a new job against
    let p = c.dir.path().join("refused.toml");
    std::fs::write(&p, job_toml("fresh", 1, 1, 1)).unwrap();
    let (ok, _, err) = c.dctl(&["submit", p.to_str().unwrap()]);
    assert!(!ok && err.contains("no agent's policy allows it"), "{err}");

    // the daemon's tokens, rotated
    let new_token = "rotated-token-0123456789";
    std::fs::write(c.dir.path().join("token"), new_token).unwrap();
    sighup(c.daemons[0].pid());
    c.wait_for(S(10), "the new token taken", || {
        c.dctl_as(new_token, &["nodes"]).0.then_some(())
    });
    let (ok, _, err) = c.dctl_as(TOKEN, &["nodes"]);
    assert!(
        !ok && err.contains("invalid token"),
        "the old token is refused: {err}"
    );
    let (ok, out, err) = c.dctl_as(new_token, &["status", "keep", "--json"]);
    assert!(ok, "{err}");
    let v: ductile_cluster::api::JobView = serde_json::from_str(&out).unwrap();
    assert_eq!(v.generation, before.generation);
}

#[test]
fn a_spot_notice_drains_the_node_without_a_failure() {
    let spot = SpotServer::start();
    let mut c = spot_cluster_with(
        &["--spot-notice-url", &spot.url, "--spot-poll-ms", "100"],
        "j8",
    );
    spot.notice("terminate");
    // a URL of the operator's own that serves AWS's document: read as AWS's
    assert_drained_for(
        &mut c,
        "j8",
        &["spot1", "url", "spot instance-action terminate"],
    );
    c.wait_for(S(5), "spot1 gone from the node list", || {
        (!c.dctl_ok(&["nodes"]).contains("spot1")).then_some(())
    });
    // dctl drain cordons a node the same way, and --undo lets it back
    c.start_agent("node2", 2, &[]);
    c.wait_world("j8", 4, S(15));
    c.dctl_ok(&["drain", "node2"]);
    c.wait_world("j8", 2, S(10));
    assert_eq!(c.history("j8").last().unwrap().reason, Reason::Drain);
    c.dctl_ok(&["drain", "node2", "--undo"]);
    c.wait_world("j8", 4, S(10));
    // SIGTERM (systemd stop) drains too: the job re-forms without the node, then the agent exits 0
    let before = c.history("j8").len();
    c.agents["node2"].terminate();
    let status = c
        .agents
        .get_mut("node2")
        .unwrap()
        .wait_exit(S(20))
        .expect("the agent drains and exits on SIGTERM");
    assert!(status.success(), "{status:?}");
    let h = c.history("j8");
    assert_eq!(h.len(), before + 1, "{h:?}");
    assert_eq!(h.last().unwrap().reason, Reason::Drain);
    assert!(h.last().unwrap().detail.contains("node2"));
    c.wait_world("j8", 2, S(10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_get_clear_errors_and_change_nothing() {
    let c = Cluster::start(Spec::default());
    c.submit(&job_toml("ok", 1, 2, 2));
    c.wait_for(S(10), "the job waiting for slots", || {
        (c.status("ok").state == JobState::Waiting).then_some(())
    });
    let store = c.store().await;
    let keys = |kvs: Vec<ductile_cluster::kv::KeyValue>| {
        kvs.into_iter()
            .map(|kv| (kv.key, kv.mod_revision))
            .collect::<Vec<_>>()
    };
    let before = keys(store.backend.list("/ductile/").await.unwrap().0);
    let dir = c.dir.path();
    let bad = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        c.dctl(&["submit", p.to_str().unwrap()])
    };
    let cases = [
        (
            "unknown.toml",
            format!("{}colour = \"red\"\n", job_toml("x", 1, 2, 2)),
            "unknown field `colour`",
        ),
        (
            "sizes.toml",
            job_toml("x", 3, 2, 2),
            "invalid max: 2 is below min 3",
        ),
        (
            "desired.toml",
            job_toml("x", 1, 2, 9),
            "invalid desired: 9 is outside [min, max] = [1, 2]",
        ),
        (
            "syntax.toml",
            "name = \"x\"\nmin = 1\nmax = [\n".to_string(),
            "job spec",
        ),
        (
            "model.toml",
            format!(
                "{}[training]\nmodel = \"resnet\"\ndataset = \"file:///d\"\nglobal_batch = 8\n",
                job_toml("x", 1, 2, 2)
            ),
            "invalid training.model",
        ),
    ];
    for (file, text, want) in &cases {
        let (ok, _, err) = bad(file, text);
        assert!(!ok, "{file} accepted");
        assert!(err.contains(want), "{file}: {err}");
    }
    // the daemon validates too (a client that skips dctl)
    let auth = format!("Bearer {TOKEN}");
    let (code, body) = http(
        "POST",
        &format!("{}/v1/jobs", c.endpoint()),
        &[
            ("Authorization", &auth),
            ("Content-Type", "application/json"),
        ],
        br#"{"name":"x","min":1,"max":2,"desired":2,"colour":1}"#,
    )
    .unwrap();
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("unknown field `colour`"), "{body}");
    let (code, body) = http(
        "POST",
        &format!("{}/v1/jobs", c.endpoint()),
        &[
            ("Authorization", &auth),
            ("Content-Type", "application/toml"),
        ],
        b"name = \"x\"\nmin = 0\nmax = 2\ndesired = 1\n",
    )
    .unwrap();
    assert_eq!(code, 400);
    assert!(body.contains("\"field\":\"min\""), "{body}");
    // a duplicate submit is refused
    let (ok, _, err) = bad("dup.toml", &job_toml("ok", 1, 2, 2));
    assert!(!ok && err.contains("already exists"), "{err}");
    // unknown job
    for args in [
        vec!["status", "nope"],
        vec!["scale", "nope", "1"],
        vec!["stop", "nope"],
        vec!["events", "nope"],
    ] {
        let (ok, _, err) = c.dctl(&args);
        assert!(!ok);
        assert!(err.contains("no job named \"nope\""), "{args:?}: {err}");
    }
    // missing and wrong tokens
    let (code, body) = http("GET", &format!("{}/v1/jobs", c.endpoint()), &[], b"").unwrap();
    assert_eq!(code, 401);
    assert!(body.contains("missing bearer token"), "{body}");
    let out = std::process::Command::new(bin("dctl"))
        .args([
            "--endpoint",
            &c.endpoint(),
            "--token",
            "wrong-token",
            "status",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("the daemon refused the token: invalid token"),
        "{err}"
    );
    // a token in argv works but is warned about (process list, shell history)
    assert!(
        err.contains("warning: --token puts the API token in the process list"),
        "{err}"
    );
    // the read-only token reads, and is refused every change, naming the call
    let bearer = format!("Bearer {READ_TOKEN}");
    let read = [("Authorization", bearer.as_str())];
    let (code, _) = http("GET", &format!("{}/v1/jobs", c.endpoint()), &read, b"").unwrap();
    assert_eq!(code, 200);
    for (method, path) in [
        ("POST", "/v1/jobs"),
        ("POST", "/v1/jobs/nope/scale"),
        ("POST", "/v1/jobs/nope/stop"),
        ("POST", "/v1/nodes/nope/drain"),
        ("DELETE", "/v1/nodes/nope/drain"),
    ] {
        let (code, body) = http(method, &format!("{}{path}", c.endpoint()), &read, b"{}").unwrap();
        assert_eq!(code, 403, "{method} {path}: {body}");
        assert!(
            body.contains(&format!("the read-only token cannot {method} {path}")),
            "{body}"
        );
    }
    let (ok, _, err) = c.dctl_as(READ_TOKEN, &["status"]);
    assert!(ok, "{err}");
    assert!(
        !err.contains("warning"),
        "DCTL_TOKEN is not warned about: {err}"
    );
    let (ok, _, err) = c.dctl_as(READ_TOKEN, &["scale", "nope", "1"]);
    assert!(!ok);
    assert!(
        err.contains("not allowed with this token: the read-only token cannot POST"),
        "{err}"
    );
    // the token from a file
    let tf = c.dir.path().join("dctl-token");
    std::fs::write(&tf, format!("{TOKEN}\n")).unwrap();
    let out = std::process::Command::new(bin("dctl"))
        .args(["--endpoint", &c.endpoint(), "--token-file"])
        .arg(&tf)
        .arg("nodes")
        .env_remove("DCTL_TOKEN")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // daemon unreachable
    let out = std::process::Command::new(bin("dctl"))
        .args([
            "--endpoint",
            &format!("http://127.0.0.1:{}", free_port()),
            "--token",
            TOKEN,
            "status",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cannot reach ductiled at http://127.0.0.1:"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // nothing changed in etcd: same keys, same revisions
    let after = keys(store.backend.list("/ductile/").await.unwrap().0);
    assert_eq!(before, after, "bad requests changed the stored state");
    // a daemon with no token refuses to start
    let daemon = |env: &[(&str, &str)]| {
        let mut cmd = std::process::Command::new(bin("ductiled"));
        cmd.args([
            "--etcd",
            &c.etcd.endpoint,
            "--listen",
            "127.0.0.1:0",
            "--insecure-http",
        ])
        .env_remove("DUCTILE_TOKEN")
        .env_remove("DUCTILE_READ_TOKEN");
        cmd.envs(env.iter().copied()).output().unwrap()
    };
    let out = daemon(&[]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no API token"));
    // a read-only token equal to the admin one is refused; a daemon whose /metrics needs a
    // token answers it with either token only
    let out = daemon(&[("DUCTILE_TOKEN", TOKEN), ("DUCTILE_READ_TOKEN", TOKEN)]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid read_token"));
    let port = free_port();
    let mut d = Proc::start(
        "metrics-daemon",
        &bin("ductiled"),
        &[
            "--etcd".into(),
            c.etcd.endpoint.clone(),
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--id".into(),
            "metrics-daemon".into(),
            "--metrics-need-token".into(),
            "true".into(),
            "--insecure-http".into(),
        ],
        &[
            ("DUCTILE_TOKEN".into(), TOKEN.into()),
            ("DUCTILE_READ_TOKEN".into(), READ_TOKEN.into()),
        ],
        c.dir.path().join("metrics-daemon.log"),
    );
    let url = format!("http://127.0.0.1:{port}/metrics");
    let got = c.wait_for(
        S(20),
        "the metrics daemon answers with the read token",
        || {
            http("GET", &url, &read, b"")
                .ok()
                .filter(|(code, _)| *code == 200)
        },
    );
    assert!(got.1.contains("ductile_"), "{}", got.1);
    let (code, _) = http("GET", &url, &[], b"").unwrap();
    assert_eq!(code, 401);
    d.kill();
    // an unreachable etcd is a clear error at start-up
    let out = std::process::Command::new(bin("ductile-agent"))
        .args([
            "--etcd",
            &format!("http://127.0.0.1:{}", free_port()),
            "--node",
            "n",
            "--etcd-wait",
            "1",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cannot reach etcd at"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn stop_ends_the_job_and_its_workers() {
    let c = Cluster::start(Spec::default().agents(1, 2));
    c.submit(&job_toml("j10", 1, 2, 2));
    let v = c.wait_world("j10", 2, S(20));
    c.dctl_ok(&["stop", "j10"]);
    c.wait_for(S(10), "job stopped", || {
        (c.status("j10").state == JobState::Stopped).then_some(())
    });
    for m in &v.members {
        let pid = m.pid.unwrap();
        c.wait_for(S(10), "worker stopped", || (!pid_alive(pid)).then_some(()));
    }
    // a stopped job can be submitted again; generation numbers continue
    c.submit(&job_toml("j10", 1, 2, 2));
    let v2 = c.wait_world("j10", 2, S(20));
    assert!(v2.generation > v.generation);
}

#[test]
fn the_harness_s3_server_stores_objects() {
    let dir = TempDir::new("s3");
    let s3 = S3::start(dir.path());
    let url = format!("{}/{}/probe/object", s3.endpoint, s3.bucket);
    // moto checks that requests are signed, not the signature (see the harness docs)
    let auth = [("Authorization", "AWS4-HMAC-SHA256 Credential=test/20261121/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=00")];
    let (code, _) = http("PUT", &url, &auth, b"hello ductile").unwrap();
    assert_eq!(code, 200);
    let (code, body) = http("GET", &url, &auth, b"").unwrap();
    assert_eq!((code, body.as_str()), (200, "hello ductile"));
}

#[test]
fn metrics_report_jobs_world_size_and_reformations() {
    let c = Cluster::start(Spec::default().agents(1, 2));
    c.submit(&job_toml("jm", 1, 2, 2));
    c.wait_world("jm", 2, S(20));
    c.wait_for(S(10), "re-formation recorded", || {
        c.status("jm").last_reformation
    });
    let (code, body) = http("GET", &format!("{}/metrics", c.endpoint()), &[], b"").unwrap();
    assert_eq!(code, 200);
    for want in [
        "ductile_job_world_size{job=\"jm\"} 2",
        "ductile_jobs{state=\"Running\"} 1",
        "ductile_reformations_total{job=\"jm\",reason=\"start\"} 1",
        "ductile_job_last_reformation_seconds{job=\"jm\",reason=\"start\"}",
        "ductile_daemon_is_leader 1",
        "ductile_nodes 1",
    ] {
        assert!(body.contains(want), "metrics lack {want}:\n{body}");
    }
    // served from the replica's own view: with etcd hung, a scrape still answers at once and
    // says how old its figures are, and `dctl status` refuses to pass an old view off as
    // current
    c.etcd.proc.stop();
    std::thread::sleep(S(4));
    let t = Instant::now();
    let (code, body) = http("GET", &format!("{}/metrics", c.endpoint()), &[], b"").unwrap();
    let took = t.elapsed();
    let (ok, _, err) = c.dctl(&["status", "jm"]);
    c.etcd.proc.cont();
    assert_eq!(code, 200);
    assert!(took < S(2), "a scrape took {took:?} with etcd hung");
    assert!(
        body.contains("ductile_job_world_size{job=\"jm\"} 2"),
        "{body}"
    );
    let age: f64 = body
        .lines()
        .find_map(|l| l.strip_prefix("ductile_daemon_etcd_last_answer_seconds "))
        .expect("the view's age")
        .parse()
        .unwrap();
    assert!(age >= 3.0, "etcd hung 4 s ago, the view says {age} s");
    assert!(
        !ok && err.contains("etcd has not answered this replica"),
        "{err}"
    );
    c.wait_for(S(20), "status again once etcd answers", || {
        let (ok, _, _) = c.dctl(&["status", "jm"]);
        ok.then_some(())
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rendezvous_over_real_etcd_gathers_every_rank() {
    let dir = TempDir::new("rdv");
    let etcd = Etcd::start(dir.path());
    let b = ductile_cluster::connect_etcd(&etcd.endpoint, S(10))
        .await
        .unwrap();
    let store = ductile_cluster::Store::new(b, ductile_cluster::Keys::default());
    let mut tasks = Vec::new();
    for rank in 0..3u32 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let r = ductile_comm::Rendezvous::new(store, "j", 3, 3, rank).unwrap();
            r.publish("addr", &[rank as u8]).await.unwrap();
            r.gather("addr", S(10)).await.unwrap()
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), vec![vec![0u8], vec![1], vec![2]]);
    }
}

#[test]
fn each_agent_watches_only_its_own_nodes_view_and_wakes_only_for_what_concerns_it() {
    use ductile_cluster::keys::KeyKind;
    use ductile_cluster::kv::WatchEvent;
    use ductile_cluster::records::{NodeAssignment, Progress};
    use ductile_cluster::store::decode;
    use std::sync::{Arc, Mutex};

    // three one-slot nodes, a job of two: one node runs nothing
    let c = Cluster::start(Spec::default().agents(3, 1));
    c.submit(&job_toml("ja", 1, 2, 2));
    let a = c.wait_world("ja", 2, S(20));
    let idle = (1..=3)
        .map(|i| format!("node{i}"))
        .find(|n| a.members.iter().all(|m| m.node != *n))
        .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let store = rt.block_on(c.store());
    let k = store.keys.clone();

    // each node's view names exactly its jobs, slots and ranks
    let view = |node: &str| -> Vec<NodeAssignment> {
        let (kvs, _) = rt
            .block_on(store.backend.list(&k.node_assignments(node)))
            .unwrap();
        kvs.iter().map(|kv| decode(kv, "view").unwrap()).collect()
    };
    for m in &a.members {
        let v = c.wait_for(S(10), "ja in its nodes' views", || {
            Some(view(&m.node)).filter(|v| v.iter().any(|x| x.generation == a.generation))
        });
        assert_eq!(v.len(), 1, "{} sees only ja: {v:?}", m.node);
        assert_eq!(v[0].slots[0].rank, m.rank);
        assert_eq!(v[0].spec.name, "ja");
    }

    // from now on: what each node's watch delivers
    // (node, job, the view's generation; None for a delete)
    type Seen = Vec<(String, String, Option<u64>)>;
    let events: Arc<Mutex<Seen>> = Arc::default();
    let (_, rev) = rt.block_on(store.backend.list(&k.election())).unwrap();
    for i in 1..=3 {
        let node = format!("node{i}");
        let mut w = rt
            .block_on(store.backend.watch(&k.node_assignments(&node), rev + 1))
            .unwrap();
        let (events, k) = (events.clone(), k.clone());
        rt.spawn(async move {
            while let Some(Ok(batch)) = w.recv().await {
                for e in batch {
                    let gen = match &e {
                        WatchEvent::Put(kv) => decode::<NodeAssignment>(kv, "view")
                            .ok()
                            .map(|v| v.generation),
                        WatchEvent::Delete { .. } => None,
                    };
                    if let KeyKind::Assignment { node: n, job } = k.parse(e.key()) {
                        assert_eq!(n, node, "a watch of one node's view saw another's");
                        events.lock().unwrap().push((n, job, gen));
                    }
                }
            }
        });
    }
    // progress wakes no one; a re-formation only the nodes it concerns
    for step in 1..=20 {
        let p = Progress {
            generation: a.generation,
            step,
            loss: Some(1.0),
            updated_at_ms: now_ms(),
            ..Default::default()
        };
        rt.block_on(store.put_json(&k.progress("ja"), &p, None))
            .unwrap();
    }
    c.dctl_ok(&["scale", "ja", "1"]);
    let a2 = c.wait_world("ja", 1, S(10));
    let kept = a2.members[0].node.clone();
    let dropped = a
        .members
        .iter()
        .map(|m| m.node.clone())
        .find(|n| *n != kept)
        .unwrap();
    c.wait_for(S(10), "the scale in the views", || {
        let ev = events.lock().unwrap();
        (ev.iter().any(|e| e.0 == kept && e.2 == Some(a2.generation))
            && ev.iter().any(|e| e.0 == dropped && e.2.is_none()))
        .then_some(())
    });
    std::thread::sleep(Duration::from_millis(1500));
    let ev = events.lock().unwrap().clone();
    assert!(
        ev.iter().all(|e| e.0 != idle),
        "{idle}, which runs nothing, woke for ja's progress or scale: {ev:?}"
    );
    assert!(view(&idle).is_empty());
    assert!(view(&dropped).is_empty(), "{dropped} still has ja in view");
    assert_eq!(view(&kept)[0].generation, a2.generation);
}

#[test]
fn two_jobs_never_share_a_slot_and_the_second_grows_into_what_the_first_leaves() {
    let c = Cluster::start(Spec::default().agents(3, 1));
    let sleeper = |name: &str, min, max, desired| {
        format!(
            "{}command = [\"sleep\", \"600\"]\n",
            job_toml(name, min, max, desired)
        )
    };
    c.submit(&sleeper("first", 1, 2, 2));
    let a = c.wait_world("first", 2, S(20));
    c.submit(&sleeper("second", 1, 3, 3));
    let b = c.wait_world("second", 1, S(20));
    assert!(
        b.members.iter().all(|m| a
            .members
            .iter()
            .all(|x| (&x.node, x.slot) != (&m.node, m.slot))),
        "{a:?}\n{b:?}"
    );
    let per_node = |c: &Cluster| -> Vec<usize> {
        let nodes: Vec<ductile_cluster::api::NodeView> =
            serde_json::from_str(&c.dctl_ok(&["nodes", "--json"])).unwrap();
        nodes.iter().map(|n| n.workers.len()).collect()
    };
    assert_eq!(per_node(&c), vec![1, 1, 1], "one worker per one-slot node");
    // a third job has nowhere to go, and says why
    c.submit(&sleeper("third", 1, 1, 1));
    let v = c.wait_for(S(10), "the third job waiting", || {
        Some(c.status("third")).filter(|v| v.state == JobState::Waiting)
    });
    assert!(v.message.contains("held by other jobs"), "{}", v.message);
    // the first stops: its slots go to the others
    c.dctl_ok(&["stop", "first"]);
    c.wait_world("third", 1, S(20));
    let b = c.wait_world("second", 2, S(20));
    assert_eq!(b.world_size, 2);
    c.wait_for(S(20), "one worker per slot again", || {
        (per_node(&c) == vec![1, 1, 1]).then_some(())
    });
}

#[test]
fn an_agent_killed_and_restarted_within_its_ttl_starts_its_slots_workers_again() {
    let mut c = Cluster::start(Spec::default().agents(2, 1));
    c.submit(&format!(
        "{}command = [\"sleep\", \"600\"]\n",
        job_toml("jr", 1, 2, 2)
    ));
    let v = c.wait_world("jr", 2, S(20));
    let old = v.members.iter().find(|m| m.node == "node1").unwrap().pid;
    // back before its lease expires: it takes over its own record, so no node was lost and
    // no generation changes; its view still names its slot
    let a = c.agents.get_mut("node1").unwrap();
    a.kill();
    a.restart();
    c.wait_for(S(10), "node1's slot running a new worker", || {
        let v = c.status("jr");
        let m = v.members.iter().find(|m| m.node == "node1")?;
        m.pid
            .filter(|p| Some(*p) != old && pid_alive(*p))
            .map(|_| ())
    });
}

#[test]
fn agents_run_only_what_their_policy_allows_and_the_daemon_refuses_the_rest_at_submit() {
    // node1 runs the tests' programs under the temporary directory; node2 only ductile-worker
    let mut c = Cluster::start(Spec::default().agents(1, 1));
    c.start_agent("node2", 1, &["--allowed-commands", "ductile-worker"]);
    c.wait_for(S(20), "two agents", || {
        let (ok, out, _) = c.dctl(&["nodes", "--json"]);
        (ok && out.matches("\"name\"").count() >= 2).then_some(())
    });
    let submit = |toml: &str| {
        let p = c.dir.path().join("policy-job.toml");
        std::fs::write(&p, toml).unwrap();
        c.dctl(&["submit", p.to_str().unwrap()])
    };
    let base = job_toml("pj", 1, 2, 2);
    for (extra, want) in [
        (
            "command = [\"bash\", \"-c\", \"id\"]\n".to_string(),
            "invalid command: no agent's policy allows it",
        ),
        (
            "command = [\"sleep\", \"600\"]\nenv = { LD_PRELOAD = \"/tmp/x.so\" }\n".into(),
            "invalid env.LD_PRELOAD",
        ),
        (
            "[training]\nmodel = \"mlp\"\ndataset = \"file:///etc/passwd\"\nglobal_batch = 8\n"
                .into(),
            "invalid training.dataset: no agent's policy allows it",
        ),
        (
            format!(
                "[training]\nmodel = \"mlp\"\ndataset = \"file://{}/d.bin\"\nglobal_batch = 8\n[checkpoint]\nurl = \"file://{}/../../etc\"\n",
                c.dir.path().display(),
                c.dir.path().display()
            ),
            "without . or ..",
        ),
        // the review's hostile specs: the worker's file-writing subcommand, a code-loading
        // variable, a path past allowed_paths in an allowed program's arguments
        (
            "command = [\"ductile-worker\", \"synth-data\", \"--kind\", \"tokens\", \"--out\", \"file:///var/tmp/ductile-hostile\"]\n".into(),
            "invalid command: no agent's policy allows it",
        ),
        (
            "command = [\"sleep\", \"600\"]\nenv = { CUDA_INJECTION64_PATH = \"/tmp/x.so\" }\n".into(),
            "invalid env.CUDA_INJECTION64_PATH",
        ),
        (
            "command = [\"sleep\", \"/etc/passwd\"]\n".into(),
            "invalid command[1]",
        ),
        // under the size caps, but its state fits no slot of this machine: refused at submit,
        // not by workers dying at start
        (
            format!(
                "[training]\nmodel = \"gpt\"\ndataset = \"file://{}/d.bin\"\nglobal_batch = 8\noptimizer = \"adamw\"\nmodel_config = {{ d_model = 8192, n_layer = 24, n_head = 64 }}\n",
                c.dir.path().display()
            ),
            "GiB per slot",
        ),
    ] {
        let (ok, _, err) = submit(&format!("{base}{extra}"));
        assert!(!ok, "{extra}");
        assert!(err.contains(want), "{extra}: {err}");
    }
    // nothing was submitted
    let (ok, _, err) = c.dctl(&["status", "pj"]);
    assert!(!ok && err.contains("no job named"), "{err}");
    // a job node1 allows is accepted; node2's agent never starts it, says why, and the job
    // goes on without node2
    let (ok, _, err) = submit(&format!("{base}command = [\"sleep\", \"600\"]\n"));
    assert!(ok, "{err}");
    let g = c.wait_for(S(30), "a generation without node2", || {
        c.history("pj")
            .into_iter()
            .find(|g| g.detail.contains("refused by agent node2's policy"))
    });
    assert!(
        g.detail
            .contains("\"sleep\" is not in the agent's allowed_commands"),
        "{}",
        g.detail
    );
    assert!(g.members.iter().all(|m| m.node != "node2"), "{g:?}");
    assert!(c.logs().contains("refused by this agent's policy"));
    assert!(!std::path::Path::new("/var/tmp/ductile-hostile").exists());
}

/// `dctl version` names the client's and the daemon's versions (and says when the daemon
/// cannot be asked); `dctl submit --dry-run` checks a spec and shows the plan without submitting
/// it, and refuses a bad one naming the key; `dctl completion bash` knows the verbs; `dctl
/// watch` follows a built-in job as step of max_steps to its end.
#[test]
fn dctl_version_dry_run_and_completion() {
    let c = Cluster::start(Spec::default().agents(1, 2));
    let v: serde_json::Value = serde_json::from_str(&c.dctl_ok(&["version", "--json"])).unwrap();
    let want = env!("CARGO_PKG_VERSION");
    assert_eq!(v["client"], want, "{v}");
    assert_eq!(v["server"], want, "{v}");
    let (ok, out, _) = c.dctl(&["version", "--endpoint", "http://127.0.0.1:9"]);
    assert!(ok && out.contains("unreachable"), "{out}");

    let dir = TempDir::new("dry-run");
    let f = dir.path().join("j.toml");
    let spec = format!(
        "{}[training]\nmodel = \"gpt\"\ndataset = \"file:///srv/tokens.bin\"\nglobal_batch = 8\nmax_steps = 10\n",
        job_toml("dry", 1, 2, 2)
    );
    std::fs::write(&f, &spec).unwrap();
    // the daemon asks its agents' policies: wait for node1's to be registered (a dry run
    // before it answers "0 allow it", which is true but not what this checks)
    c.wait_for(S(15), "node1 registered", || {
        node_json(&c, "node1").map(|_| ())
    });
    // the daemon's checks are asked too: its agent does not allow /srv
    let (ok, out, err) = c.dctl(&["submit", "--dry-run", f.to_str().unwrap()]);
    assert!(
        !ok && err.contains("the daemon refuses it") && err.contains("allowed_paths"),
        "{out}\n{err}"
    );
    // with no daemon to ask, dctl's own checks answer, and say the agents were not asked
    let out = c.dctl_ok(&[
        "submit",
        "--dry-run",
        f.to_str().unwrap(),
        "--endpoint",
        "http://127.0.0.1:9",
    ]);
    assert!(
        out.contains("job dry is valid (not submitted)")
            && out.contains("layout      dp2×pp1×tp1")
            && out.contains("agents      not asked (the daemon: cannot reach ductiled"),
        "{out}"
    );
    // nothing was submitted
    let (ok, _, err) = c.dctl(&["status", "dry"]);
    assert!(!ok && err.contains("dry"), "{err}");
    std::fs::write(&f, spec.replace("global_batch", "global_bach")).unwrap();
    let (ok, _, err) = c.dctl(&["submit", "--dry-run", f.to_str().unwrap()]);
    assert!(!ok && err.contains("unknown field `global_bach`"), "{err}");

    let (ok, out, _) = c.dctl(&["completion", "bash"]);
    assert!(
        ok && out.contains("_dctl") && out.contains("checkpoints"),
        "{out}"
    );

    // `dctl watch` shows a built-in job's step of max_steps, to its end, and its last commit
    let data = synth(dir.path(), "tokens", 20_000);
    c.submit(&format!(
        "{}[training]\nmodel = \"gpt\"\nmodel_config = {{ d_model = 16, n_layer = 1, n_head = 2, ctx = 8 }}\ndataset = \"{data}\"\nglobal_batch = 8\nmax_steps = 2000\n[checkpoint]\nurl = \"file://{}/ck-watched\"\ninterval = 500\npart_size_mib = \"8MiB\"\n",
        job_toml("watched", 1, 2, 2),
        dir.path().display()
    ));
    let out = c.dctl_ok(&["watch", "watched"]);
    let last = out.lines().last().unwrap_or("");
    assert!(last.starts_with("Succeeded step 2000/2000 (100%)"), "{out}");
    let ckpt: u64 = last
        .split(" ckpt ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no checkpoint step in {last:?}"));
    assert!(ckpt >= 1500 && ckpt % 500 == 0, "{out}");
    let status = c.dctl_ok(&["status", "watched"]);
    assert!(
        status.contains(&format!("checkpoint  step {ckpt}, committed "))
            && status.contains("at world 2)"),
        "{status}"
    );
    let v = c.status("watched");
    let lc = v
        .last_checkpoint
        .expect("status --json has last_checkpoint");
    assert_eq!(
        (lc.step, lc.kind.as_str(), lc.world_size),
        (ckpt, "commit", Some(2))
    );
    assert!(
        out.lines()
            .any(|l| l.starts_with("Running step ") && l.contains("/2000 (")),
        "{out}"
    );
    // and `dctl plot --term` draws its loss in the terminal
    let (ok, out, err) = c.dctl(&["plot", "watched", "--term"]);
    assert!(ok, "{err}");
    println!("{out}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "loss over steps", "{out}");
    // a mark per reported point (a job this fast reports a handful: as many as the series
    // holds, less the few that share a cell), and one more in the legend
    let s: ductile_cluster::api::SeriesView = c.get_json("/v1/jobs/watched/series");
    let held = s.points.iter().filter(|p| p.loss.is_some()).count();
    let drawn = out.matches('*').count().saturating_sub(1);
    assert!(lines[1..17].iter().all(|l| l.contains(" ┤")), "{out}");
    assert!(
        drawn >= 2 && drawn <= held && drawn >= held.min(10) / 2,
        "{drawn} marks for {held} points: {out}"
    );
    assert!(out.contains("* loss") && out.contains("2000"), "{out}");
    // dctl delete --purge: the records forgotten and the job's checkpoint directories gone
    let ck = dir.path().join("ck-watched");
    let steps = |d: &std::path::Path| {
        std::fs::read_dir(d)
            .map(|r| {
                r.filter_map(|e| e.ok())
                    .filter(|e| e.file_name().to_string_lossy().starts_with("step-"))
                    .count()
            })
            .unwrap_or(0)
    };
    assert!(steps(&ck) >= 1, "commits at {}", ck.display());
    let out = c.dctl_ok(&["delete", "watched", "--purge"]);
    assert!(
        out.contains("job watched deleted")
            && out.contains("purged:")
            && !out.contains(" 0 directories deleted"),
        "{out}"
    );
    let left: Vec<String> = std::fs::read_dir(&ck)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .filter(|n| {
            std::fs::read_dir(ck.join(n))
                .map(|mut r| r.next().is_some())
                .unwrap_or(false)
        })
        .collect();
    assert!(left.is_empty(), "left after --purge: {left:?}");
    assert!(!c.dctl_ok(&["get", "jobs"]).contains("watched"));
}

/// kubectl's verbs: `dctl get jobs` lists with a state filter and `-o wide|json|yaml`, `dctl
/// get nodes` the live nodes, `dctl describe` one job (status, spec, generations) or node;
/// `dctl delete` refuses a running job and forgets a finished one (its name free again);
/// `dctl run -- PROGRAM` submits a program job without a TOML file.
#[test]
fn dctl_get_describe_delete_and_run() {
    let bare = "/usr/bin/python3";
    let mut c = Cluster::start(Spec::default());
    let flags = torchrun_agent_flags_with(&["ductile-worker", bare]);
    let extra: Vec<&str> = flags.iter().map(String::as_str).collect();
    c.start_agent("node1", 4, &extra);
    c.submit(&job_toml("keep", 1, 2, 2));
    c.wait_world("keep", 2, S(20));
    let out = c.dctl_ok(&["get", "jobs"]);
    assert!(
        out.starts_with("NAME") && out.contains("keep") && out.contains("Running"),
        "{out}"
    );
    let out = c.dctl_ok(&["get", "jobs", "--state", "succeeded"]);
    assert!(!out.contains("keep"), "{out}");
    let out = c.dctl_ok(&["get", "jobs", "kee*", "-o", "wide"]);
    assert!(out.contains("DESIRED") && out.contains("keep"), "{out}");
    let v: serde_json::Value =
        serde_json::from_str(&c.dctl_ok(&["get", "jobs", "keep", "-o", "json"])).unwrap();
    assert_eq!(v[0]["job"], "keep", "{v}");
    let out = c.dctl_ok(&["get", "jobs", "-o", "yaml"]);
    assert!(out.contains("job: keep"), "{out}");
    let out = c.dctl_ok(&["get", "nodes", "-o", "wide"]);
    assert!(out.contains("node1") && out.contains("HOSTNAME"), "{out}");
    let out = c.dctl_ok(&["describe", "job", "keep"]);
    assert!(
        out.contains("job         keep")
            && out.contains("spec:")
            && out.contains("name = \"keep\"")
            && out.contains("gen 1"),
        "{out}"
    );
    let out = c.dctl_ok(&["describe", "node", "node1"]);
    assert!(out.contains("name: node1"), "{out}");

    // a running job is not deleted; a stopped one is, and its name is free again
    let (ok, _, err) = c.dctl(&["delete", "keep"]);
    assert!(!ok && err.contains("dctl stop keep first"), "{err}");
    c.dctl_ok(&["stop", "keep"]);
    c.wait_for(S(20), "the job to stop", || {
        Some(c.status("keep")).filter(|v| v.state.is_terminal())
    });
    let out = c.dctl_ok(&["delete", "keep"]);
    assert!(out.contains("job keep deleted"), "{out}");
    assert!(!c.dctl_ok(&["get", "jobs"]).contains("keep"));
    let (ok, _, err) = c.dctl(&["status", "keep"]);
    assert!(!ok && err.contains("keep"), "{err}");
    c.submit(&job_toml("keep", 1, 2, 2));
    let v = c.wait_world("keep", 2, S(20));
    assert_eq!(
        v.generation, 1,
        "a deleted name starts again from generation 1"
    );

    // dctl run: a program job from the command line (--dry-run prints the spec it makes)
    let dir = TempDir::new("run");
    let script = dir.path().join("hello.py");
    std::fs::write(&script, "print('hello from dctl run')\n").unwrap();
    let (ok, out, err) = c.dctl(&[
        "run",
        "--name",
        "hello",
        "--nproc",
        "2",
        "--env",
        "A=b",
        "--dry-run",
        "--",
        bare,
        script.to_str().unwrap(),
    ]);
    // the spec is printed, and the daemon's own checks say what the agent would refuse
    assert!(out.contains("A = \"b\""), "{out}");
    assert!(
        !ok && err.contains("the daemon refuses it") && err.contains("env.A"),
        "{err}"
    );
    let out = c.dctl_ok(&[
        "run",
        "--name",
        "hello",
        "--nproc",
        "2",
        "--max",
        "4",
        "--dry-run",
        "--",
        bare,
        script.to_str().unwrap(),
    ]);
    assert!(
        out.contains("name = \"hello\"")
            && out.contains("runtime = \"torchrun\"")
            && out.contains("max = 4")
            && out.contains("is valid (not submitted)"),
        "{out}"
    );
    // the daemon was asked too: the agents whose policy takes the job, nothing stored
    assert!(
        out.contains("agents      1 allow it (4 slots not draining): node1"),
        "{out}"
    );
    // a spec no agent's policy takes is refused by the dry run, naming why; the older table
    // name is still read, with a warning naming the new one
    let refused = dir.path().join("perl.toml");
    std::fs::write(
        &refused,
        "name = \"perl\"\nruntime = \"torchrun\"\ncommand = [\"/usr/bin/perl\", \"/srv/x.pl\"]\nmin = 1\nmax = 1\ndesired = 1\n[torchrun]\ngrace_s = \"20s\"\n",
    )
    .unwrap();
    let (ok, out, err) = c.dctl(&["submit", "--dry-run", refused.to_str().unwrap()]);
    assert!(
        !ok && err.contains("the daemon refuses it") && err.contains("no agent's policy allows it"),
        "{out}\n{err}"
    );
    assert!(
        err.contains("warning:") && err.contains("write [program]"),
        "{err}"
    );
    assert!(
        !c.dctl_ok(&["get", "jobs"]).contains("perl"),
        "a dry run stores nothing"
    );
    // a running job's name is taken: the dry run says so, as the submit would
    let (ok, _, err) = c.dctl(&[
        "run",
        "--name",
        "keep",
        "--nproc",
        "1",
        "--dry-run",
        "--",
        bare,
        script.to_str().unwrap(),
    ]);
    assert!(
        !ok && err.contains("already exists and has not finished"),
        "{err}"
    );
    let (ok, _, err) = c.dctl(&["status", "hello"]);
    assert!(!ok, "a dry run submits nothing: {err}");
    let out = c.dctl_ok(&["run", "--nproc", "2", "--", bare, script.to_str().unwrap()]);
    let name = out
        .split_whitespace()
        .nth(2)
        .expect("submitted job NAME")
        .to_string();
    assert!(name.starts_with("hello-"), "{out}");
    let spec: serde_json::Value =
        serde_json::from_str(&c.dctl_ok(&["describe", "job", &name, "--json"])).unwrap();
    assert_eq!(
        spec["spec"]["command"][1],
        script.to_str().unwrap(),
        "{spec}"
    );
    assert_eq!(spec["spec"]["desired"], 2, "{spec}");
    let v = c.wait_for(S(60), "the run to end", || {
        Some(c.status(&name)).filter(|v| v.state.is_terminal())
    });
    assert_eq!(v.state, JobState::Succeeded, "{}", v.message);
    assert!(c.logs().contains("hello from dctl run"));
}
