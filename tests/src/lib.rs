//! The integration-test harness. Each test builds its own [`Cluster`]: a real etcd, optionally
//! a real S3-compatible server, one or more `ductiled` and N `ductile-agent`s, all on free
//! loopback ports with their own temporary directories. Any process can be killed (SIGKILL),
//! stopped (SIGSTOP/SIGCONT) and restarted. Everything is torn down when the cluster is dropped,
//! also on panic; a failing test prints the tail of every process's log.
//!
//! Tools come from the environment `scripts/setup.sh` prepares: `etcd` on PATH (or
//! `DUCTILE_ETCD_BIN`), `moto_server` from `DUCTILE_MOTO_SERVER` (or PATH). Set
//! `DUCTILE_TEST_S3_ENDPOINT` (+ `_BUCKET`, `_ACCESS_KEY`, `_SECRET_KEY`, `_REGION`) to run the
//! same tests against another S3-compatible server instead.

pub mod chaos;
pub mod ledger;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ductile_cluster::api::JobView;
use ductile_cluster::{Keys, Store};

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// The API token every test cluster uses.
pub const TOKEN: &str = "test-token-0123456789";
/// The cluster's read-only API token.
pub const READ_TOKEN: &str = "test-read-token-9876543210";

/// A temporary directory removed on drop (kept if `DUCTILE_KEEP_TEST_DIRS` is set).
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        TempDir::new_in(&std::env::temp_dir(), tag)
    }
    pub fn new_in(base: &Path, tag: &str) -> TempDir {
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let p = base.join(format!("ductile-{tag}-{}-{n}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::env::var_os("DUCTILE_KEEP_TEST_DIRS").is_none() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// A TCP port on 127.0.0.1 that nothing holds now, for a server a test starts next. It is
/// taken outside the kernel's ephemeral range: a port `127.0.0.1:0` hands out can be taken,
/// between this check and the server's bind, by an outgoing connection of the processes the
/// tests run (a CI run's etcd failed so: "bind: address already in use"). Each call in this
/// process tries the next port, from a place its pid picks, and skips ports held now.
pub fn free_port() -> u16 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    static RANGE: std::sync::OnceLock<Option<(u64, u64)>> = std::sync::OnceLock::new();
    let Some((lo, span)) = *RANGE.get_or_init(server_ports) else {
        // no room below or above the ephemeral range: the kernel's choice
        return TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
    };
    let start = u64::from(std::process::id()) * 7919 % span;
    for _ in 0..span {
        let k = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = (lo + (start + k) % span) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no loopback port in {lo}..{} can be bound", lo + span);
}

/// The kernel's ephemeral port range (`/proc/sys/net/ipv4/ip_local_port_range`, 32768–60999
/// by default): first and last port.
fn ephemeral_ports() -> Option<(u64, u64)> {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let mut it = range.split_whitespace().map(|v| v.parse::<u64>().ok());
    Some((it.next()??, it.next()??))
}

/// Where [`free_port`] takes its ports (first port, count): the 10,000 just below the
/// ephemeral range, or just above it where there is no room below; `None` where there is
/// room on neither side.
fn server_ports() -> Option<(u64, u64)> {
    const SPAN: u64 = 10_000;
    let (lo, hi) = ephemeral_ports()?;
    if lo >= 1024 + SPAN {
        Some((lo - SPAN, SPAN))
    } else if hi + SPAN <= 65535 {
        Some((hi + 1, SPAN))
    } else {
        None
    }
}

/// Where the workspace's binaries are (`DUCTILE_BIN_DIR`, or next to the test executable).
pub fn bin(name: &str) -> PathBuf {
    let dir = match std::env::var_os("DUCTILE_BIN_DIR") {
        Some(d) => PathBuf::from(d),
        None => {
            let exe = std::env::current_exe().unwrap();
            let deps = exe.parent().unwrap();
            if deps.ends_with("deps") {
                deps.parent().unwrap().to_path_buf()
            } else {
                deps.to_path_buf()
            }
        }
    };
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} is missing: build the binaries first (cargo build --workspace --bins)",
        p.display()
    );
    p
}

/// With `DUCTILE_TEST_HASHES=FILE`, every finished job's final weights hash is appended to FILE
/// as `TEST JOB SHA256` (a refactor's before/after check of the deterministic runs' bits).
fn record_final_hash(job: &str, done: &JobView) {
    let (Some(path), Some(sha)) = (
        std::env::var_os("DUCTILE_TEST_HASHES"),
        done.final_weights_sha256.as_deref(),
    ) else {
        return;
    };
    let test = std::thread::current().name().unwrap_or("?").to_string();
    let line = format!("{test} {job} {sha}\n");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .unwrap_or_else(|e| panic!("DUCTILE_TEST_HASHES={path:?}: {e}"));
    std::io::Write::write_all(&mut f, line.as_bytes()).unwrap();
}

/// A CA and certificates for etcd, ductiled's API and etcd's clients, as an operator makes
/// them (`scripts/secure.sh certs`), in `dir/pki`.
pub fn make_pki(dir: &Path) -> PathBuf {
    let pki = dir.join("pki");
    let out = Command::new("bash")
        .arg(repo_root().join("scripts/secure.sh"))
        .arg("certs")
        .arg(&pki)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "secure.sh certs failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    pki
}

/// The repository's root (its scripts are the operators' tools the tests use too).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn tool(env: &str, name: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(env) {
        return PathBuf::from(p);
    }
    for dir in std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()) {
        let p = dir.join(name);
        if p.exists() {
            return p;
        }
    }
    panic!(
        "{name} not found: run scripts/setup.sh and source the env file it prints (or set {env})"
    );
}

/// A process the harness started. Killed (SIGKILL) and reaped on drop.
pub struct Proc {
    pub name: String,
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    pub log: PathBuf,
    child: Option<Child>,
}

impl Proc {
    pub fn start(
        name: &str,
        program: &Path,
        args: &[String],
        env: &[(String, String)],
        log: PathBuf,
    ) -> Proc {
        let mut p = Proc {
            name: name.into(),
            program: program.into(),
            args: args.to_vec(),
            env: env.to_vec(),
            log,
            child: None,
        };
        p.spawn();
        p
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args)
            .envs(self.env.iter().cloned())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        cmd.env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
        );
        let child = cmd.spawn().unwrap_or_else(|e| {
            panic!(
                "cannot start {} ({}): {e}",
                self.name,
                self.program.display()
            )
        });
        self.child = Some(child);
    }

    pub fn pid(&self) -> u32 {
        self.child
            .as_ref()
            .map(|c| c.id())
            .expect("process not running")
    }

    fn signal(&self, sig: i32) {
        if let Some(c) = &self.child {
            unsafe { libc::kill(c.id() as i32, sig) };
        }
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn stop(&self) {
        self.signal(libc::SIGSTOP);
    }

    pub fn cont(&self) {
        self.signal(libc::SIGCONT);
    }

    pub fn terminate(&self) {
        self.signal(libc::SIGTERM);
    }

    /// Start again with the same arguments (after `kill`, or kill first).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// What an operator's `systemctl restart` does across an upgrade: SIGTERM, wait up to
    /// `limit` for the process to exit (SIGKILL after), then start `program` (the new release's
    /// binary) with the same arguments. Returns how the old process ended.
    pub fn replace_with(
        &mut self,
        program: &Path,
        limit: Duration,
    ) -> Option<std::process::ExitStatus> {
        self.terminate();
        let ended = self.wait_exit(limit);
        self.kill();
        self.program = program.into();
        self.spawn();
        ended
    }

    pub fn program(&self) -> &Path {
        &self.program
    }

    /// Exit status if it has exited.
    pub fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Waits up to `limit` for the process to exit.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let t0 = Instant::now();
        while t0.elapsed() < limit {
            if let Some(s) = self.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.cont();
        self.kill();
    }
}

/// Whether a process id is alive (and not a zombie).
pub fn pid_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !s
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z'),
        Err(_) => false,
    }
}

/// A real etcd on free ports.
pub struct Etcd {
    pub proc: Proc,
    pub endpoint: String,
    /// With TLS and auth ([`Etcd::start_secure`]): the certificates and passwords
    /// `scripts/secure.sh` made.
    pub pki: Option<PathBuf>,
    /// etcd's data directory: on tmpfs (`/dev/shm`) where there is one, so that a slow disk's
    /// fsync (1.4 s seen on a CI machine) does not stall raft and delay lease expiry under the
    /// tests' liveness bounds; the tests check ductile, not the disk.
    _data: TempDir,
}

impl Etcd {
    pub fn start(dir: &Path) -> Etcd {
        Self::start_with(dir, None)
    }

    /// etcd over TLS that asks for client certificates (`--client-cert-auth`), with auth on:
    /// users root, ductile-daemon (role root) and ductile-agent (its prefix), made by
    /// `scripts/secure.sh` as an operator would.
    pub fn start_secure(dir: &Path, pki: &Path) -> Etcd {
        let e = Self::start_with(dir, Some(pki));
        let out = Command::new("bash")
            .arg(repo_root().join("scripts/secure.sh"))
            .args(["etcd-auth", &e.endpoint])
            .arg(pki)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "secure.sh etcd-auth failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        e
    }

    fn start_with(dir: &Path, pki: Option<&Path>) -> Etcd {
        let (client, peer) = (free_port(), free_port());
        let scheme = if pki.is_some() { "https" } else { "http" };
        let c = format!("{scheme}://127.0.0.1:{client}");
        let p = format!("http://127.0.0.1:{peer}");
        let shm = Path::new("/dev/shm");
        let data = TempDir::new_in(if shm.is_dir() { shm } else { dir }, "etcd-data");
        let mut args: Vec<String> = [
            "--name",
            "t",
            "--data-dir",
            &data.path().display().to_string(),
            "--listen-client-urls",
            &c,
            "--advertise-client-urls",
            &c,
            "--listen-peer-urls",
            &p,
            "--initial-advertise-peer-urls",
            &p,
            "--initial-cluster",
            &format!("t={p}"),
            "--heartbeat-interval",
            "10",
            "--election-timeout",
            "100",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if let Some(pki) = pki {
            let f = |n: &str| pki.join(n).display().to_string();
            args.extend([
                "--cert-file".into(),
                f("etcd.pem"),
                "--key-file".into(),
                f("etcd-key.pem"),
                "--trusted-ca-file".into(),
                f("ca.pem"),
                "--client-cert-auth".into(),
            ]);
        }
        let proc = Proc::start(
            "etcd",
            &tool("DUCTILE_ETCD_BIN", "etcd"),
            &args,
            &[],
            dir.join("etcd.log"),
        );
        let e = Etcd {
            proc,
            endpoint: c,
            pki: pki.map(Path::to_path_buf),
            _data: data,
        };
        e.wait_ready();
        e
    }

    /// How `who` (root, daemon, agent; a client certificate of that name, `worker` included)
    /// reaches this etcd; plain for an etcd without TLS.
    pub fn access(&self, who: &str) -> ductile_cluster::access::EtcdAccess {
        use ductile_cluster::access::{EtcdAccess, Secret};
        let Some(pki) = &self.pki else {
            return EtcdAccess::plain(self.endpoint.clone());
        };
        let cert = if who == "root" { "daemon" } else { who };
        let password = std::fs::read_to_string(pki.join(format!("{who}.password")))
            .ok()
            .map(|p| Secret::new(p.trim()));
        EtcdAccess {
            endpoints: self.endpoint.clone(),
            ca: Some(pki.join("ca.pem")),
            cert: Some(pki.join(format!("{cert}.pem"))),
            key: Some(pki.join(format!("{cert}-key.pem"))),
            user: password.as_ref().map(|_| match who {
                "root" => "root".to_string(),
                w => format!("ductile-{w}"),
            }),
            password,
        }
    }

    /// The flags a daemon (`daemon`) or an agent (`agent`) is started with to reach this etcd.
    pub fn flags(&self, who: &str) -> Vec<String> {
        let a = self.access(who);
        let mut f = vec!["--etcd".to_string(), a.endpoints.clone()];
        let Some(pki) = &self.pki else {
            return f;
        };
        let p = |n: &str| pki.join(n).display().to_string();
        f.extend([
            "--etcd-ca".into(),
            p("ca.pem"),
            "--etcd-cert".into(),
            p(&format!("{who}.pem")),
            "--etcd-key".into(),
            p(&format!("{who}-key.pem")),
            "--etcd-user".into(),
            format!("ductile-{who}"),
            "--etcd-password-file".into(),
            p(&format!("{who}.password")),
        ]);
        if who == "agent" {
            f.extend([
                "--etcd-worker-cert".into(),
                p("worker.pem"),
                "--etcd-worker-key".into(),
                p("worker-key.pem"),
            ]);
        }
        f
    }

    fn wait_ready(&self) {
        if self.pki.is_some() {
            // over TLS: a real connection with the daemon's certificate (before auth is on it
            // needs no user; after, etcd takes its CN, ductile-daemon, for one)
            let mut a = self.access("daemon");
            a.user = None;
            a.password = None;
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            if let Err(e) = rt.block_on(ductile_cluster::connect_etcd_with(
                &a,
                Duration::from_secs(20),
            )) {
                panic!(
                    "etcd (TLS) did not become ready: {e}\n{}",
                    self.proc.log_tail(20)
                );
            }
            return;
        }
        let t0 = Instant::now();
        let port: u16 = self.endpoint.rsplit(':').next().unwrap().parse().unwrap();
        loop {
            if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                // a real request: the health endpoint answers once the server serves
                if let Ok(body) = http("GET", &format!("{}/health", self.endpoint), &[], b"") {
                    if body.0 == 200 && body.1.contains("true") {
                        return;
                    }
                }
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "etcd did not become ready:\n{}",
                self.proc.log_tail(20)
            );
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// SIGKILL etcd and start it again on the same ports and data.
    pub fn restart(&mut self) {
        self.proc.restart();
        self.wait_ready();
    }
}

/// An S3-compatible server: moto's, started here, or an external one from the environment.
pub struct S3 {
    pub proc: Option<Proc>,
    pub endpoint: String,
    pub bucket: String,
    pub access_key: String,
    pub secret_key: String,
    pub region: String,
}

impl S3 {
    pub fn start(dir: &Path) -> S3 {
        S3::start_kind(dir, false)
    }

    /// moto behind a filter that drops `If-None-Match`: a store that accepts conditional
    /// creates and does not enforce them.
    pub fn start_lax(dir: &Path) -> S3 {
        S3::start_kind(dir, true)
    }

    fn start_kind(dir: &Path, lax: bool) -> S3 {
        if let (false, Ok(endpoint)) = (lax, std::env::var("DUCTILE_TEST_S3_ENDPOINT")) {
            let v = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.to_string());
            return S3 {
                proc: None,
                endpoint,
                bucket: v("DUCTILE_TEST_S3_BUCKET", "ductile-test"),
                access_key: v("DUCTILE_TEST_S3_ACCESS_KEY", "test"),
                secret_key: v("DUCTILE_TEST_S3_SECRET_KEY", "test"),
                region: v("DUCTILE_TEST_S3_REGION", "us-east-1"),
            };
        }
        let port = free_port();
        let args = vec![
            "-H".to_string(),
            "127.0.0.1".to_string(),
            "-p".to_string(),
            port.to_string(),
        ];
        let proc = if lax {
            let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("lax_s3.py");
            let args = vec![
                script.display().to_string(),
                "127.0.0.1".to_string(),
                port.to_string(),
            ];
            Proc::start(
                "lax_s3",
                &tool("DUCTILE_PYTHON", "python3"),
                &args,
                &[],
                dir.join("s3-lax.log"),
            )
        } else {
            Proc::start(
                "moto_server",
                &tool("DUCTILE_MOTO_SERVER", "moto_server"),
                &args,
                &[],
                dir.join("s3.log"),
            )
        };
        let endpoint = format!("http://127.0.0.1:{port}");
        let t0 = Instant::now();
        loop {
            if let Ok((code, _)) = http("GET", &format!("{endpoint}/"), &[], b"") {
                if code == 200 {
                    break;
                }
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "moto_server did not become ready:\n{}",
                proc.log_tail(20)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let bucket = format!("ductile-{}", COUNTER.fetch_add(1, Ordering::SeqCst));
        let (code, body) = http("PUT", &format!("{endpoint}/{bucket}"), &[], b"").unwrap();
        assert!(code == 200, "cannot create bucket {bucket}: {code} {body}");
        S3 {
            proc: Some(proc),
            endpoint,
            bucket,
            access_key: "test".into(),
            secret_key: "test".into(),
            region: "us-east-1".into(),
        }
    }
}

impl S3 {
    /// The environment object_store reads (endpoint, region, keys).
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("AWS_ENDPOINT".into(), self.endpoint.clone()),
            ("AWS_REGION".into(), self.region.clone()),
            ("AWS_ACCESS_KEY_ID".into(), self.access_key.clone()),
            ("AWS_SECRET_ACCESS_KEY".into(), self.secret_key.clone()),
        ]
    }
}

/// A TCP proxy in front of an HTTP/1.1 server: `stop` cuts every connection and refuses new
/// ones (the server is gone, its data is not), `start` serves again on the same port,
/// `throttle` limits the client-to-server rate (to catch an upload in the middle), and
/// `answer_503` makes it answer `503 Slow Down` itself to the requests whose request line
/// contains a pattern (an S3 that sheds load), closing their connection.
pub struct Proxy {
    pub port: u16,
    upstream: u16,
    up: Arc<std::sync::atomic::AtomicBool>,
    rate: Arc<std::sync::atomic::AtomicU64>,
    /// Requests answered 503: those whose request line contains this ("" : every one).
    fail: Arc<Mutex<Option<String>>>,
    /// Open connections (client and server side), by id; removed when both directions end,
    /// so a long run does not run out of descriptors.
    conns: Arc<Mutex<BTreeMap<u64, Vec<std::net::TcpStream>>>>,
}

impl Proxy {
    pub fn start(upstream: u16) -> Proxy {
        let p = Proxy {
            port: free_port(),
            upstream,
            up: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            rate: Arc::new(std::sync::atomic::AtomicU64::new(0)),
            fail: Arc::new(Mutex::new(None)),
            conns: Arc::new(Mutex::new(BTreeMap::new())),
        };
        p.serve();
        p
    }

    /// From now on, answer `503 Slow Down` to every request whose request line (method, path
    /// and query) contains `pattern` ("": every request); `None`: pass everything again.
    pub fn answer_503(&self, pattern: Option<&str>) {
        *self.fail.lock().unwrap() = pattern.map(str::to_string);
    }

    /// Bytes per second from clients to the server (0: unlimited).
    pub fn throttle(&self, bytes_per_sec: u64) {
        self.rate.store(bytes_per_sec, Ordering::SeqCst);
    }

    pub fn serve(&self) {
        use std::net::{Shutdown, TcpListener, TcpStream};
        self.up.store(true, Ordering::SeqCst);
        let listener = TcpListener::bind(("127.0.0.1", self.port)).expect("proxy port");
        listener.set_nonblocking(true).unwrap();
        let (up, rate, conns, upstream, fail) = (
            self.up.clone(),
            self.rate.clone(),
            self.conns.clone(),
            self.upstream,
            self.fail.clone(),
        );
        std::thread::spawn(move || {
            let mut next_id = 0u64;
            while up.load(Ordering::SeqCst) {
                let Ok((client, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                client.set_nonblocking(false).unwrap();
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                next_id += 1;
                let id = next_id;
                conns.lock().unwrap().insert(
                    id,
                    vec![client.try_clone().unwrap(), server.try_clone().unwrap()],
                );
                let pipes = Arc::new(AtomicU64::new(2));
                for (mut from, mut to, limited) in [
                    (
                        client.try_clone().unwrap(),
                        server.try_clone().unwrap(),
                        true,
                    ),
                    (server, client, false),
                ] {
                    let (rate, pipes, conns) = (rate.clone(), pipes.clone(), conns.clone());
                    let fail = fail.clone();
                    std::thread::spawn(move || {
                        use std::io::{Read, Write};
                        if limited {
                            // the client's requests, one by one (a request the 503 rule matches
                            // is answered here; anything this cannot frame passes through)
                            http_requests(&mut from, &mut to, &rate, &fail);
                        }
                        let mut buf = vec![0u8; 64 << 10];
                        loop {
                            let n = match from.read(&mut buf) {
                                Ok(0) | Err(_) => break,
                                Ok(n) => n,
                            };
                            let r = rate.load(Ordering::SeqCst);
                            if limited && r > 0 {
                                std::thread::sleep(Duration::from_secs_f64(n as f64 / r as f64));
                            }
                            if to.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                        let _ = to.shutdown(Shutdown::Write);
                        if pipes.fetch_sub(1, Ordering::SeqCst) == 1 {
                            conns.lock().unwrap().remove(&id);
                        }
                    });
                }
            }
        });
    }

    /// Cut every connection and stop accepting.
    pub fn stop(&self) {
        self.up.store(false, Ordering::SeqCst);
        for c in std::mem::take(&mut *self.conns.lock().unwrap())
            .into_values()
            .flatten()
        {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Relay HTTP/1.1 requests from `from` (a client) to `to` (the server) one at a time: a
/// request whose request line the `fail` rule matches gets `503 Slow Down` from here and the
/// connection is closed; a body is relayed by its `Content-Length` (at `rate` bytes a second).
/// Returns (for the caller to relay the rest as bytes) at a request it cannot frame (chunked)
/// or at the end of the connection.
fn http_requests(
    from: &mut std::net::TcpStream,
    to: &mut std::net::TcpStream,
    rate: &AtomicU64,
    fail: &Mutex<Option<String>>,
) {
    use std::io::{Read, Write};
    let mut pending: Vec<u8> = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        // the request's head
        let end = loop {
            if let Some(i) = pending.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            match from.read(&mut buf) {
                Ok(0) | Err(_) => {
                    let _ = to.write_all(&pending);
                    let _ = to.shutdown(std::net::Shutdown::Write);
                    return;
                }
                Ok(n) => pending.extend_from_slice(&buf[..n]),
            }
        };
        let head = String::from_utf8_lossy(&pending[..end]).into_owned();
        let line = head.lines().next().unwrap_or("").to_string();
        let rule = fail.lock().unwrap().clone();
        if rule.is_some_and(|p| line.contains(&p)) {
            let body = "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>";
            let _ = from.write_all(
                format!(
                    "HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                )
                .as_bytes(),
            );
            let _ = from.shutdown(std::net::Shutdown::Both);
            let _ = to.shutdown(std::net::Shutdown::Both);
            return;
        }
        let header = |name: &str| {
            head.lines().skip(1).find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.trim()
                    .eq_ignore_ascii_case(name)
                    .then(|| v.trim().to_string())
            })
        };
        if header("transfer-encoding").is_some() {
            // not framed by a length: the rest goes through as bytes
            let _ = to.write_all(&pending);
            return;
        }
        let mut left: u64 = header("content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        if to.write_all(&pending[..end]).is_err() {
            return;
        }
        pending.drain(..end);
        // the body: what came with the head, then the rest
        loop {
            let have = (pending.len() as u64).min(left) as usize;
            if have > 0 {
                let r = rate.load(Ordering::SeqCst);
                if r > 0 {
                    std::thread::sleep(Duration::from_secs_f64(have as f64 / r as f64));
                }
                if to.write_all(&pending[..have]).is_err() {
                    return;
                }
                pending.drain(..have);
                left -= have as u64;
            }
            if left == 0 {
                break;
            }
            match from.read(&mut buf) {
                Ok(0) | Err(_) => {
                    let _ = to.shutdown(std::net::Shutdown::Write);
                    return;
                }
                Ok(n) => pending.extend_from_slice(&buf[..n]),
            }
        }
    }
}

/// A minimal blocking HTTP/1.1 client for the harness (status, body).
pub fn http(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<(u16, String)> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| std::io::Error::other("only http:// URLs"))?;
    let (host, path) = rest
        .split_once('/')
        .map(|(h, p)| (h, format!("/{p}")))
        .unwrap_or((rest, "/".into()));
    let mut s = TcpStream::connect(host)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes())?;
    s.write_all(body)?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    // de-chunk if needed
    let body = if text
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(&body)
    } else {
        body
    };
    Ok((code, body))
}

fn dechunk(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some((len, after)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(len.trim(), 16).unwrap_or(0);
        if n == 0 || after.len() < n {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].trim_start_matches("\r\n");
    }
    out
}

/// A local stand-in for the cloud's spot-interruption metadata URL: 404 until `notice()`.
pub struct SpotServer {
    pub url: String,
    notice: Arc<Mutex<Option<String>>>,
    stop: Arc<AtomicBool>,
}

impl SpotServer {
    pub fn start() -> SpotServer {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        let url = format!(
            "http://{}/latest/meta-data/spot/instance-action",
            l.local_addr().unwrap()
        );
        let notice: Arc<Mutex<Option<String>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (n, st) = (notice.clone(), stop.clone());
        std::thread::spawn(move || {
            while !st.load(Ordering::SeqCst) {
                match l.accept() {
                    Ok((mut s, _)) => {
                        let _ = s.set_nonblocking(false);
                        let mut buf = [0u8; 4096];
                        let _ = s.read(&mut buf);
                        let resp = match &*n.lock().unwrap() {
                            Some(body) => format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()),
                            None => "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_string(),
                        };
                        let _ = s.write_all(resp.as_bytes());
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        SpotServer { url, notice, stop }
    }

    pub fn notice(&self, action: &str) {
        *self.notice.lock().unwrap() = Some(format!(
            "{{\"action\": \"{action}\", \"time\": \"2026-11-21T12:00:00Z\"}}"
        ));
    }
}

impl Drop for SpotServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Which cloud a [`MetadataServer`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CloudKind {
    /// AWS IMDSv2: a token by PUT, every read refused (401) without a valid one.
    Aws,
    /// GCP: `Metadata-Flavor: Google` required (403 without), `wait_for_change` with ETags.
    Gcp,
    /// Azure: `Metadata: true` required (400 without), Scheduled Events acknowledged by POST.
    Azure,
    /// No cloud: 404 to everything.
    None,
}

/// What a [`MetadataServer`] serves and has seen.
#[derive(Default)]
pub struct MetadataState {
    /// AWS: the spot instance-action document, the rebalance recommendation's.
    pub instance_action: Option<String>,
    pub rebalance: Option<String>,
    /// AWS: tokens handed out (valid ones), and how many were ever.
    pub tokens: Vec<String>,
    pub tokens_issued: u32,
    /// AWS: reads refused for a missing or expired token, and those of them without any token.
    pub refused_unauthorized: u32,
    pub tokenless: u32,
    /// GCP: `instance/preempted` and `instance/maintenance-event`, each with a version (its ETag).
    pub preempted: (String, u64),
    pub maintenance: (String, u64),
    /// GCP: reads that waited for a change (`wait_for_change=true` with the current ETag).
    pub waited: u32,
    /// Azure: the Scheduled Events (raw JSON objects) and the acknowledged event ids.
    pub azure_events: Vec<serde_json::Value>,
    pub azure_acked: Vec<String>,
    pub azure_incarnation: u64,
    /// Requests refused for a missing metadata header (GCP, Azure), as `METHOD path`.
    pub refused_header: Vec<String>,
    /// Every request, as `METHOD path`.
    pub requests: Vec<String>,
}

/// A cloud instance metadata service on loopback that keeps its cloud's rules (the paths,
/// headers, tokens and answers each cloud documents), for the agents' preemption notices
/// (`--spot-notice ... --spot-metadata-endpoint URL`).
pub struct MetadataServer {
    pub url: String,
    pub kind: CloudKind,
    pub state: Arc<(Mutex<MetadataState>, std::sync::Condvar)>,
    stop: Arc<AtomicBool>,
}

impl MetadataServer {
    pub fn start(kind: CloudKind) -> MetadataServer {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let state: Arc<(Mutex<MetadataState>, std::sync::Condvar)> = Arc::default();
        {
            let mut st = state.0.lock().unwrap();
            st.preempted = ("FALSE".into(), 1);
            st.maintenance = ("NONE".into(), 1);
            st.azure_incarnation = 1;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (stt, sp) = (state.clone(), stop.clone());
        std::thread::spawn(move || {
            while !sp.load(Ordering::SeqCst) {
                match l.accept() {
                    Ok((s, _)) => {
                        let (stt, sp) = (stt.clone(), sp.clone());
                        std::thread::spawn(move || Self::serve(kind, s, &stt, &sp));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        MetadataServer {
            url,
            kind,
            state,
            stop,
        }
    }

    /// Change what it serves (waiting GCP reads see the change at once).
    pub fn set(&self, f: impl FnOnce(&mut MetadataState)) {
        let mut st = self.state.0.lock().unwrap();
        f(&mut st);
        self.state.1.notify_all();
    }

    pub fn with<T>(&self, f: impl FnOnce(&MetadataState) -> T) -> T {
        f(&self.state.0.lock().unwrap())
    }

    fn serve(
        kind: CloudKind,
        mut s: TcpStream,
        state: &(Mutex<MetadataState>, std::sync::Condvar),
        stop: &AtomicBool,
    ) {
        let _ = s.set_nonblocking(false);
        let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        let head_end = loop {
            match s.read(&mut chunk) {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            if buf.len() > 65536 {
                return;
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
        let mut lines = head.split("\r\n");
        let mut first = lines.next().unwrap_or("").split(' ');
        let method = first.next().unwrap_or("").to_string();
        let target = first.next().unwrap_or("").to_string();
        let headers: BTreeMap<String, String> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        let len: usize = headers
            .get("content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        while buf.len() < head_end + len {
            match s.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let body =
            String::from_utf8_lossy(&buf[head_end..(head_end + len).min(buf.len())]).to_string();
        let (path, query) = target.split_once('?').unwrap_or((&target, ""));
        let q: BTreeMap<&str, &str> = query
            .split('&')
            .filter_map(|kv| kv.split_once('='))
            .collect();
        let (status, extra, text) =
            Self::answer(kind, &method, path, &q, &headers, &body, state, stop);
        let reason = match status {
            200 => "OK",
            400 => "Bad Request",
            401 => "Unauthorized",
            403 => "Forbidden",
            404 => "Not Found",
            _ => "Error",
        };
        let mut resp = format!(
            "HTTP/1.1 {status} {reason}\r\nContent-Length: {}\r\nConnection: close\r\n",
            text.len()
        );
        for (k, v) in extra {
            resp.push_str(&format!("{k}: {v}\r\n"));
        }
        resp.push_str("\r\n");
        resp.push_str(&text);
        let _ = s.write_all(resp.as_bytes());
    }

    #[allow(clippy::too_many_arguments)]
    fn answer(
        kind: CloudKind,
        method: &str,
        path: &str,
        q: &BTreeMap<&str, &str>,
        headers: &BTreeMap<String, String>,
        body: &str,
        state: &(Mutex<MetadataState>, std::sync::Condvar),
        stop: &AtomicBool,
    ) -> (u16, Vec<(String, String)>, String) {
        let mut st = state.0.lock().unwrap();
        st.requests.push(format!("{method} {path}"));
        let none = (404, vec![], String::new());
        match kind {
            CloudKind::None => none,
            CloudKind::Aws => {
                if method == "PUT" && path == "/latest/api/token" {
                    let ttl: u64 = headers
                        .get("x-aws-ec2-metadata-token-ttl-seconds")
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(0);
                    if !(1..=21600).contains(&ttl) {
                        return (400, vec![], String::new());
                    }
                    st.tokens_issued += 1;
                    let t = format!(
                        "token-{}-{}",
                        st.tokens_issued,
                        ductile_cluster::records::random_hex(8)
                    );
                    st.tokens.push(t.clone());
                    return (
                        200,
                        vec![(
                            "X-aws-ec2-metadata-token-ttl-seconds".into(),
                            ttl.to_string(),
                        )],
                        t,
                    );
                }
                if method != "GET" || !path.starts_with("/latest/") {
                    return none;
                }
                let ok = headers
                    .get("x-aws-ec2-metadata-token")
                    .is_some_and(|t| st.tokens.contains(t));
                if !ok {
                    st.refused_unauthorized += 1;
                    if !headers.contains_key("x-aws-ec2-metadata-token") {
                        st.tokenless += 1;
                    }
                    return (401, vec![], String::new());
                }
                let doc = match path {
                    "/latest/meta-data/spot/instance-action" => st.instance_action.clone(),
                    "/latest/meta-data/events/recommendations/rebalance" => st.rebalance.clone(),
                    _ => None,
                };
                match doc {
                    Some(d) => (200, vec![("Content-Type".into(), "text/plain".into())], d),
                    None => none,
                }
            }
            CloudKind::Gcp => {
                if headers.get("metadata-flavor").map(String::as_str) != Some("Google") {
                    st.refused_header.push(format!("{method} {path}"));
                    return (403, vec![], "Missing Metadata-Flavor:Google header.".into());
                }
                let flavor = ("Metadata-Flavor".to_string(), "Google".to_string());
                let read = |st: &MetadataState| match path {
                    "/computeMetadata/v1/instance/id" => Some(("4321".to_string(), 1)),
                    "/computeMetadata/v1/instance/preempted" => Some(st.preempted.clone()),
                    "/computeMetadata/v1/instance/maintenance-event" => {
                        Some(st.maintenance.clone())
                    }
                    _ => None,
                };
                let Some(mut cur) = read(&st) else {
                    return (404, vec![flavor], String::new());
                };
                if q.get("wait_for_change") == Some(&"true") {
                    let last = q.get("last_etag").copied().unwrap_or("");
                    let wait_s: u64 = q
                        .get("timeout_sec")
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(60);
                    if last == format!("e{}", cur.1) {
                        st.waited += 1;
                        let until = Instant::now() + Duration::from_secs(wait_s.min(60));
                        while Instant::now() < until && !stop.load(Ordering::SeqCst) {
                            let (g, _) = state
                                .1
                                .wait_timeout(st, Duration::from_millis(200))
                                .unwrap();
                            st = g;
                            cur = read(&st).unwrap();
                            if last != format!("e{}", cur.1) {
                                break;
                            }
                        }
                    }
                }
                (
                    200,
                    vec![flavor, ("ETag".into(), format!("e{}", cur.1))],
                    cur.0,
                )
            }
            CloudKind::Azure => {
                if headers.get("metadata").map(String::as_str) != Some("true") {
                    st.refused_header.push(format!("{method} {path}"));
                    return (
                        400,
                        vec![],
                        "{\"error\": \"Bad request. Required metadata header not specified\"}"
                            .into(),
                    );
                }
                if !q.contains_key("api-version") {
                    return (
                        400,
                        vec![],
                        "{\"error\": \"Bad request. api-version was not specified\"}".into(),
                    );
                }
                match (method, path) {
                    ("GET", "/metadata/instance/compute/name") => (200, vec![], "vm1".into()),
                    ("GET", "/metadata/scheduledevents") => (
                        200,
                        vec![("Content-Type".into(), "application/json".into())],
                        serde_json::json!({
                            "DocumentIncarnation": st.azure_incarnation,
                            "Events": st.azure_events,
                        })
                        .to_string(),
                    ),
                    ("POST", "/metadata/scheduledevents") => {
                        let Ok(v) = serde_json::from_str::<serde_json::Value>(body) else {
                            return (400, vec![], String::new());
                        };
                        let ids: Vec<String> = v["StartRequests"]
                            .as_array()
                            .map(|a| {
                                a.iter()
                                    .filter_map(|r| r["EventId"].as_str().map(str::to_string))
                                    .collect()
                            })
                            .unwrap_or_default();
                        // a started event leaves the document
                        st.azure_events
                            .retain(|e| !ids.iter().any(|i| e["EventId"].as_str() == Some(i)));
                        st.azure_acked.extend(ids);
                        st.azure_incarnation += 1;
                        (200, vec![], String::new())
                    }
                    _ => none,
                }
            }
        }
    }
}

impl Drop for MetadataServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.state.1.notify_all();
    }
}

/// How to build a test cluster.
#[derive(Clone, Debug)]
pub struct Spec {
    pub daemons: usize,
    pub agents: Vec<(String, u32)>,
    pub lease_ttl: i64,
    pub election_ttl: i64,
    pub debounce_ms: u64,
    pub restart_backoff_ms: u64,
    pub s3: bool,
    /// Put a [`Proxy`] between the cluster and the S3 server (`Cluster::s3_proxy`).
    pub s3_proxy: bool,
    /// Extra environment of every agent (its workers inherit it).
    pub agent_env: Vec<(String, String)>,
    /// etcd over TLS with client certificates and auth ([`Etcd::start_secure`]): the daemons
    /// and agents connect as their own users, workers as their job's.
    pub secure_etcd: bool,
    /// The daemons serve their API over TLS (else plain HTTP on loopback, `--insecure-http`);
    /// dctl checks them against the cluster's CA.
    pub api_tls: bool,
    /// The agents have a mesh TLS certificate (jobs with `mesh_tls` can run).
    pub mesh_tls: bool,
    /// The daemons serve TorchFT's lighthouse (`--torchft-listen` on a free port each), with
    /// these extra flags (`--torchft-min-replicas 2`, ...).
    pub torchft: Option<Vec<String>>,
    /// Where the daemons' and agents' binaries come from (an older release's, for an upgrade
    /// test); else this build's ([`bin`]).
    pub bin_dir: Option<PathBuf>,
    /// Extra flags of every daemon (`--tenants-file FILE`, ...).
    pub daemon_args: Vec<String>,
}

impl Default for Spec {
    fn default() -> Self {
        Spec {
            daemons: 1,
            agents: vec![],
            lease_ttl: 2,
            election_ttl: 2,
            debounce_ms: 300,
            restart_backoff_ms: 1000,
            s3: false,
            s3_proxy: false,
            agent_env: vec![],
            secure_etcd: false,
            api_tls: false,
            mesh_tls: false,
            torchft: None,
            bin_dir: None,
            daemon_args: vec![],
        }
    }
}

impl Spec {
    pub fn agents(mut self, n: usize, slots: u32) -> Self {
        self.agents = (1..=n).map(|i| (format!("node{i}"), slots)).collect();
        self
    }
}

/// A running test cluster. Dropping it tears everything down.
pub struct Cluster {
    pub spec: Spec,
    pub daemons: Vec<Proc>,
    pub daemon_ports: Vec<u16>,
    /// Each daemon's TorchFT lighthouse port (`Spec::torchft`).
    pub torchft_ports: Vec<u16>,
    pub agents: BTreeMap<String, Proc>,
    pub s3: Option<S3>,
    pub s3_proxy: Option<Proxy>,
    pub etcd: Etcd,
    /// The certificates ([`make_pki`]) when etcd or the API use TLS.
    pub pki: Option<PathBuf>,
    pub dir: TempDir,
    pub prefix: String,
}

impl Cluster {
    pub fn start(spec: Spec) -> Cluster {
        let dir = TempDir::new("cluster");
        let pki = (spec.secure_etcd || spec.api_tls || spec.mesh_tls).then(|| make_pki(dir.path()));
        let etcd = match (&pki, spec.secure_etcd) {
            (Some(pki), true) => Etcd::start_secure(dir.path(), pki),
            _ => Etcd::start(dir.path()),
        };
        let s3 = (spec.s3 || spec.s3_proxy).then(|| S3::start(dir.path()));
        let mut spec = spec;
        let mut s3_proxy = None;
        if let Some(s3) = &s3 {
            let mut env = s3.env();
            if spec.s3_proxy {
                let upstream: u16 = s3.endpoint.rsplit(':').next().unwrap().parse().unwrap();
                let p = Proxy::start(upstream);
                env[0].1 = format!("http://127.0.0.1:{}", p.port);
                s3_proxy = Some(p);
            }
            spec.agent_env.extend(env);
        }
        std::fs::write(dir.path().join("token"), TOKEN).unwrap();
        std::fs::write(dir.path().join("read-token"), READ_TOKEN).unwrap();
        let mut c = Cluster {
            spec: spec.clone(),
            daemons: vec![],
            daemon_ports: vec![],
            torchft_ports: vec![],
            agents: BTreeMap::new(),
            s3,
            s3_proxy,
            etcd,
            pki,
            dir,
            prefix: "/ductile/v1".into(),
        };
        for i in 0..spec.daemons {
            c.start_daemon(i);
        }
        for (name, slots) in spec.agents.clone() {
            c.start_agent(&name, slots, &[]);
        }
        c
    }

    pub fn start_daemon(&mut self, i: usize) {
        let port = free_port();
        let mut args = self.etcd.flags("daemon");
        args.extend([
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--token-file".into(),
            self.dir.path().join("token").display().to_string(),
            "--read-token-file".into(),
            self.dir.path().join("read-token").display().to_string(),
            "--election-ttl".into(),
            self.spec.election_ttl.to_string(),
            "--debounce-ms".into(),
            self.spec.debounce_ms.to_string(),
            "--id".into(),
            format!("daemon{i}"),
        ]);
        args.extend(self.spec.daemon_args.iter().cloned());
        if let Some(flags) = &self.spec.torchft {
            let tf = free_port();
            args.extend(["--torchft-listen".into(), format!("127.0.0.1:{tf}")]);
            args.extend(flags.iter().cloned());
            self.torchft_ports.push(tf);
        }
        match (&self.pki, self.spec.api_tls) {
            (Some(pki), true) => args.extend([
                "--tls-cert".into(),
                pki.join("api.pem").display().to_string(),
                "--tls-key".into(),
                pki.join("api-key.pem").display().to_string(),
            ]),
            _ => args.push("--insecure-http".into()),
        }
        // the daemon reads checkpoint stores (dctl checkpoints) with the cluster's S3 settings
        let env: Vec<(String, String)> = self
            .spec
            .agent_env
            .iter()
            .filter(|(k, _)| k.starts_with("AWS_"))
            .cloned()
            .collect();
        let p = Proc::start(
            &format!("daemon{i}"),
            &self.spec_bin("ductiled"),
            &args,
            &env,
            self.dir.path().join(format!("daemon{i}.log")),
        );
        self.daemons.push(p);
        self.daemon_ports.push(port);
        self.wait_daemon(i);
    }

    /// A daemon's or agent's binary: from the spec's `bin_dir` if it names one.
    pub fn spec_bin(&self, name: &str) -> PathBuf {
        match &self.spec.bin_dir {
            Some(d) => d.join(name),
            None => bin(name),
        }
    }

    /// Upgrade daemon `i` as an operator would (`systemctl restart` with the new package
    /// installed): SIGTERM, then this build's `ductiled` on the same port, ready.
    pub fn upgrade_daemon(&mut self, i: usize) {
        let ended = self.daemons[i].replace_with(&bin("ductiled"), Duration::from_secs(10));
        assert!(
            ended.is_some(),
            "daemon{i} did not exit within 10 s of SIGTERM:\n{}",
            self.daemons[i].log_tail(20)
        );
        self.wait_daemon(i);
    }

    /// Upgrade agent `name`: SIGTERM (it drains its node: the job shrinks), wait for it to
    /// exit, then this build's `ductile-agent` with the same flags.
    pub fn upgrade_agent(&mut self, name: &str, limit: Duration) {
        let a = self.agents.get_mut(name).unwrap();
        let ended = a.replace_with(&bin("ductile-agent"), limit);
        assert!(
            ended.is_some(),
            "agent {name} did not exit within {limit:?} of SIGTERM:\n{}",
            a.log_tail(20)
        );
    }

    /// SIGKILL daemon `i` and start it again on the same port.
    pub fn restart_daemon(&mut self, i: usize) {
        self.daemons[i].restart();
        self.wait_daemon(i);
    }

    fn wait_daemon(&self, i: usize) {
        let port = self.daemon_ports[i];
        let t0 = Instant::now();
        let healthy = || match (&self.pki, self.spec.api_tls) {
            // over TLS: curl, checking the daemon's certificate against the cluster's CA
            (Some(pki), true) => Command::new("curl")
                .args(["-sf", "-o", "/dev/null", "--max-time", "5", "--cacert"])
                .arg(pki.join("ca.pem"))
                .arg(format!("https://127.0.0.1:{port}/readyz"))
                .status()
                .is_ok_and(|s| s.success()),
            _ => match http("GET", &format!("http://127.0.0.1:{port}/readyz"), &[], b"") {
                Ok((200, _)) => true,
                Ok((503, _)) | Err(_) => false,
                // a release before /readyz (an upgrade test's): ready once it answers a read
                Ok(_) => http(
                    "GET",
                    &format!("http://127.0.0.1:{port}/v1/jobs"),
                    &[("Authorization", &format!("Bearer {TOKEN}"))],
                    b"",
                )
                .is_ok_and(|r| r.0 == 200),
            },
        };
        while !healthy() {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "daemon{i} did not become ready (/readyz) within 20 s:\n{}",
                self.daemons[i].log_tail(30)
            );
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// Start an agent; `extra` flags are appended (e.g. `--spot-notice-url URL`).
    pub fn start_agent(&mut self, name: &str, slots: u32, extra: &[&str]) {
        let mut args = self.etcd.flags("agent");
        args.extend([
            "--node".into(),
            name.into(),
            "--cpu-slots".into(),
            slots.to_string(),
            "--lease-ttl".into(),
            self.spec.lease_ttl.to_string(),
            "--restart-backoff-ms".into(),
            self.spec.restart_backoff_ms.to_string(),
            "--advertise-host".into(),
            "127.0.0.1".into(),
            "--stop-grace-ms".into(),
            "2000".into(),
        ]);
        // the tests' workers and stand-ins, and their temporary directories, unless the caller
        // sets a policy of its own
        // an agent given a config file takes its policy from it (a reload re-reads the file;
        // flags would win over it)
        let policy_from_file = extra.contains(&"--config");
        if !extra.contains(&"--allowed-commands") && !policy_from_file {
            args.extend(["--allowed-commands".into(), "ductile-worker,sleep".into()]);
            // the control-plane tests' stand-in worker runs directly, as a default-runtime job
            if !extra.contains(&"--direct-commands") {
                args.extend(["--direct-commands".into(), "sleep".into()]);
            }
        }
        // the lab's workers read and write the tests' S3 server with the node's credentials
        // (set in this process's environment or the spec's); tenancy tests give each job its own
        if !extra.contains(&"--worker-credentials") && !policy_from_file {
            args.extend(["--worker-credentials".into(), "node".into()]);
        }
        if !extra.contains(&"--allowed-paths") && !policy_from_file {
            // and the models set-up made, which jobs name as their model_path
            let models = ["DUCTILE_HF_FIXTURES", "DUCTILE_SMOLLM2"]
                .iter()
                .filter_map(|v| std::env::var(v).ok())
                .map(|p| format!(",{p}"))
                .collect::<String>();
            args.extend([
                "--allowed-paths".into(),
                format!("{}{models}", std::env::temp_dir().display()),
            ]);
        }
        if let (Some(pki), true) = (&self.pki, self.spec.mesh_tls) {
            for (flag, file) in [
                ("--mesh-tls-ca", "ca.pem"),
                ("--mesh-tls-cert", "mesh.pem"),
                ("--mesh-tls-key", "mesh-key.pem"),
            ] {
                args.extend([flag.to_string(), pki.join(file).display().to_string()]);
            }
        }
        // programs' logs, per job and slot, in the cluster's own directory
        if !extra.contains(&"--log-dir") {
            args.extend([
                "--log-dir".to_string(),
                self.dir
                    .path()
                    .join(format!("logs-{name}"))
                    .display()
                    .to_string(),
            ]);
        }
        // programs' per-job working directories in the cluster's own directory
        if !extra.contains(&"--work-root") {
            args.extend([
                "--work-root".to_string(),
                self.dir
                    .path()
                    .join(format!("work-{name}"))
                    .display()
                    .to_string(),
            ]);
        }
        // CPU slots unless the caller names GPUs
        if !extra.contains(&"--gpus") {
            args.extend(["--gpus".to_string(), "off".to_string()]);
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        // workers check NCCL's rules on the TCP backend (`ductile_comm::strict`) wherever their
        // generation would run on NCCL on GPUs; a test's own setting comes after and wins
        let env: Vec<(String, String)> = [("DUCTILE_COMM_STRICT".to_string(), "1".to_string())]
            .into_iter()
            .chain(self.spec.agent_env.iter().cloned())
            .collect();
        let p = Proc::start(
            name,
            &self.spec_bin("ductile-agent"),
            &args,
            &env,
            self.dir.path().join(format!("{name}.log")),
        );
        self.agents.insert(name.into(), p);
    }

    pub fn endpoint(&self) -> String {
        let live = self
            .daemons
            .iter()
            .position(|d| d.child.is_some())
            .unwrap_or(0);
        let scheme = if self.spec.api_tls { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.daemon_ports[live])
    }

    /// The leading replica's name (`daemonN`), as the API says; None while no replica answers.
    pub fn leader(&self) -> Option<String> {
        let (ok, _, _) = self.dctl(&["status"]);
        if !ok {
            return None;
        }
        let (code, body) = http(
            "GET",
            &format!("{}/v1/leader", self.endpoint()),
            &[("Authorization", &format!("Bearer {TOKEN}"))],
            b"",
        )
        .ok()?;
        (code == 200)
            .then(|| {
                serde_json::from_str::<serde_json::Value>(&body).ok()?["leader"]
                    .as_str()
                    .map(String::from)
            })
            .flatten()
    }

    /// SIGKILL the leading daemon and wait (20 s at most) for a standby to lead: (the killed
    /// replica's index, the new leader's name, from the kill to the standby leading).
    pub fn kill_leader(&mut self) -> (usize, String, Duration) {
        let first = self.wait_for(Duration::from_secs(10), "a leader", || self.leader());
        let idx: usize = first.trim_start_matches("daemon").parse().unwrap();
        let killed_at = Instant::now();
        self.daemons[idx].kill();
        let second = self.wait_for(Duration::from_secs(20), "the standby to lead", || {
            self.leader().filter(|l| *l != first)
        });
        (idx, second, killed_at.elapsed())
    }

    /// GET an API path with the read-only token; the parsed JSON body (panics on an error).
    pub fn get_json<T: serde::de::DeserializeOwned>(&self, path: &str) -> T {
        let (code, body) = http(
            "GET",
            &format!("{}{path}", self.endpoint()),
            &[("Authorization", &format!("Bearer {READ_TOKEN}"))],
            b"",
        )
        .unwrap_or_else(|e| panic!("GET {path}: {e}"));
        assert_eq!(code, 200, "GET {path}: {body}");
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET {path}: {e}: {body}"))
    }

    /// Run dctl against this cluster with the admin token: (exit success, stdout, stderr).
    pub fn dctl(&self, args: &[&str]) -> (bool, String, String) {
        self.dctl_as(TOKEN, args)
    }

    /// Run dctl with `token` (through DCTL_TOKEN, as users should).
    pub fn dctl_as(&self, token: &str, args: &[&str]) -> (bool, String, String) {
        let mut cmd = Command::new(bin("dctl"));
        if let (Some(pki), true) = (&self.pki, self.spec.api_tls) {
            cmd.arg("--ca").arg(pki.join("ca.pem"));
        }
        let out = cmd
            .args(["--endpoint", &self.endpoint()])
            .args(args)
            .env_remove("DCTL_ENDPOINT")
            .env_remove("DCTL_TOKEN_FILE")
            .env_remove("DCTL_CA")
            .env("DCTL_TOKEN", token)
            .env("HOME", self.dir.path())
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// dctl that must succeed.
    pub fn dctl_ok(&self, args: &[&str]) -> String {
        let (ok, out, err) = self.dctl(args);
        assert!(ok, "dctl {args:?} failed: {err}");
        out
    }

    pub fn submit(&self, toml: &str) {
        let p = self.dir.path().join(format!(
            "job-{}.toml",
            COUNTER.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::write(&p, toml).unwrap();
        self.dctl_ok(&["submit", p.to_str().unwrap()]);
    }

    pub fn status(&self, job: &str) -> JobView {
        serde_json::from_str(&self.dctl_ok(&["status", job, "--json"])).unwrap()
    }

    /// Poll `f` until it returns Some, or panic after `limit` saying what was awaited. The
    /// polls start 50 ms apart and slow to 200 ms: most polls run `dctl`, a process each, and
    /// at 20 a second they took a twelfth of the CPU from the jobs (a profile of the tensor
    /// suite's longest test).
    pub fn wait_for<T>(&self, limit: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
        let t0 = Instant::now();
        let mut every = Duration::from_millis(50);
        loop {
            if let Some(v) = f() {
                return v;
            }
            assert!(
                t0.elapsed() < limit,
                "timed out after {limit:?} waiting for {what}"
            );
            std::thread::sleep(every);
            every = (every * 3 / 2).min(Duration::from_millis(200));
        }
    }

    /// Poll `f` until it returns Some, or give up after `limit` (None).
    pub fn wait_for_opt<T>(&self, limit: Duration, f: impl FnMut() -> Option<T>) -> Option<T> {
        poll(limit, Duration::from_millis(100), f)
    }

    /// Wait until the job's current generation has `world` members, all with a worker pid.
    pub fn wait_world(&self, job: &str, world: u32, limit: Duration) -> JobView {
        self.wait_for(
            limit,
            &format!("job {job} at world size {world} with every worker running"),
            || {
                let v = self.status(job);
                (v.world_size == world
                    && v.members.len() == world as usize
                    && v.members.iter().all(|m| m.pid.is_some()))
                .then_some(v)
            },
        )
    }

    /// Every agent's whole log (their workers' lines are in them).
    pub fn agent_logs(&self) -> String {
        self.agents
            .values()
            .map(|a| std::fs::read_to_string(&a.log).unwrap_or_default())
            .collect()
    }

    /// The job's generations, oldest first (`dctl events JOB --json`).
    pub fn history(&self, job: &str) -> Vec<ductile_cluster::records::Generation> {
        self.dctl_ok(&["events", job, "--json"])
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// Wait until the job reports step `step` or later.
    pub fn wait_step(&self, job: &str, step: u64, limit: Duration) -> JobView {
        self.wait_for(limit, &format!("job {job} past step {step}"), || {
            Some(self.status(job)).filter(|v| v.step >= step)
        })
    }

    /// Wait until the job succeeded.
    pub fn wait_done(&self, job: &str, limit: Duration) -> JobView {
        let done = self.wait_for(limit, &format!("job {job} succeeded"), || {
            Some(self.status(job))
                .filter(|v| v.state == ductile_cluster::records::JobState::Succeeded)
        });
        record_final_hash(job, &done);
        done
    }

    /// Every rank's weights record for generation `g`, as the workers published them
    /// (`step:sha256`, and `:first-end` of the units held in a pipeline generation).
    pub async fn weights(&self, job: &str, g: u64, world: u32) -> Vec<String> {
        let store = self.store().await;
        for _ in 0..400 {
            let (kvs, _) = store
                .backend
                .list(&store.keys.weights(job, g))
                .await
                .unwrap();
            if kvs.len() == world as usize {
                return kvs
                    .into_iter()
                    .map(|kv| String::from_utf8(kv.value).unwrap())
                    .collect();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("generation {g} did not report {world} weights");
    }

    /// The join records of generation `g` of `job` (`world` ranks, in rank order), waiting
    /// up to 60 s for all of them.
    pub async fn joins(
        &self,
        job: &str,
        g: u64,
        world: u32,
    ) -> Vec<ductile_cluster::records::JoinRecord> {
        let store = self.store().await;
        for _ in 0..1200 {
            let (kvs, _) = store
                .backend
                .list(&store.keys.joined(job, g))
                .await
                .unwrap();
            if kvs.len() == world as usize {
                let mut v: Vec<ductile_cluster::records::JoinRecord> = kvs
                    .iter()
                    .map(|kv| serde_json::from_slice(&kv.value).unwrap())
                    .collect();
                v.sort_by_key(|j| j.rank);
                return v;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("generation {g} of {job} did not record {world} joins within 60 s");
    }

    /// A typed store over this cluster's etcd.
    pub async fn store(&self) -> Store {
        let b =
            ductile_cluster::connect_etcd_with(&self.etcd.access("root"), Duration::from_secs(10))
                .await
                .unwrap();
        Store::new(b, Keys::new(&self.prefix))
    }

    /// Every daemon's, agent's and etcd's whole log, for tests that look for a line: a tail
    /// would lose early lines on a busy run.
    pub fn logs(&self) -> String {
        self.daemons
            .iter()
            .chain(self.agents.values())
            .chain(std::iter::once(&self.etcd.proc))
            .map(|p| std::fs::read_to_string(&p.log).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The last lines of every process's log, headed by its name: what a failed test prints.
    pub fn log_tails(&self) -> String {
        let mut s = String::new();
        let procs = self
            .daemons
            .iter()
            .chain(self.agents.values())
            .chain(std::iter::once(&self.etcd.proc));
        for p in procs {
            s.push_str(&format!(
                "\n===== {} ({}) =====\n{}\n",
                p.name,
                p.log.display(),
                p.log_tail(60)
            ));
        }
        s
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("{}", self.log_tails());
        }
        // agents first (their workers die with them), then daemons, then etcd
        self.agents.clear();
        self.daemons.clear();
    }
}

/// A job spec in TOML.
pub fn job_toml(name: &str, min: u32, max: u32, desired: u32) -> String {
    format!("name = \"{name}\"\nmin = {min}\nmax = {max}\ndesired = {desired}\n")
}

/// Write a synthetic dataset with `ductile-worker synth-data`; returns its file:// URL.
pub fn synth(dir: &Path, kind: &str, size: u64) -> String {
    synth_to(
        &format!("file://{}/{kind}-{size}.bin", dir.display()),
        kind,
        size,
        &[],
    )
}

/// A cluster of 2 agents × 2 slots whose workers write the exactly-once ledger into
/// `ledger` (restarts after 300 ms).
pub fn ledger_cluster(ledger: &TempDir) -> Cluster {
    Cluster::start(Spec {
        restart_backoff_ms: 300,
        agent_env: vec![(
            "DUCTILE_LEDGER_DIR".into(),
            ledger.path().display().to_string(),
        )],
        ..Spec::default().agents(2, 2)
    })
}

/// Each spec text is refused at submit with an error containing its phrase, and no job was
/// stored.
pub fn assert_refused<T: AsRef<str>>(c: &Cluster, cases: &[(T, &str)]) {
    for (i, (text, want)) in cases.iter().enumerate() {
        let p = c.dir.path().join(format!("refused-{i}.toml"));
        std::fs::write(&p, text.as_ref()).unwrap();
        let (ok, _, err) = c.dctl(&["submit", p.to_str().unwrap()]);
        assert!(!ok, "case {i} accepted");
        assert!(err.contains(want), "case {i}: {err}");
    }
    let jobs: Vec<JobView> = serde_json::from_str(&c.dctl_ok(&["status", "--json"])).unwrap();
    assert!(jobs.is_empty(), "nothing was stored");
}

/// The newest generation of `job` from `from` on, once every member wrote its weights record
/// (`step:sha256`): its number and the records, in rank order. The records are watched, not
/// polled: the leader deletes an ended job's rendezvous data, weights records included, and
/// a short job (an MLP's last steps take milliseconds) can write them and end between two
/// polls; a watch from the generation's first revision sees every put.
pub fn joined_weights(c: &Cluster, job: &str, from: u64) -> (u64, Vec<String>) {
    let limit = Duration::from_secs(60);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let store = rt.block_on(c.store());
    // the revision generation `from` (or a later one) was first published at
    let first = poll(limit, Duration::from_millis(50), || {
        rt.block_on(async {
            let history: Vec<(ductile_cluster::records::Generation, _)> = store
                .list_json(&store.keys.history(job), "generation")
                .await
                .unwrap();
            history
                .into_iter()
                .filter(|(g, _)| g.number >= from)
                .map(|(_, kv)| kv.create_revision)
                .min()
        })
    });
    let Some(rev) = first else {
        panic!("timed out after 60 s waiting for generation {from} or later of job {job}")
    };
    let prefix = store.keys.all_rendezvous(job);
    rt.block_on(async {
        let mut rx = store.backend.watch(&prefix, rev).await.unwrap();
        let deadline = tokio::time::Instant::now() + limit;
        // generation → rank → record, as put
        let mut put: BTreeMap<u64, BTreeMap<u32, String>> = BTreeMap::new();
        loop {
            let (g, _) = store.generation(job).await.unwrap().expect("a generation");
            let got = put.get(&g.number);
            if g.number >= from && got.is_some_and(|r| r.len() == g.world_size as usize) {
                let records = got.unwrap().values().cloned().collect();
                return (g.number, records);
            }
            let seen = format!(
                "generation {} (world {}) with weights records of ranks {:?}",
                g.number,
                g.world_size,
                got.map(|r| r.keys().collect::<Vec<_>>()).unwrap_or_default()
            );
            let events = match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(Ok(events))) => events,
                Ok(Some(Err(e))) => panic!("watching {prefix}: {e}"),
                Ok(None) => panic!("the watch of {prefix} ended; the job had {seen}"),
                Err(_) => panic!(
                    "timed out after 60 s waiting for generation {from} or later of job {job} with every rank's weights record: the job had {seen}"
                ),
            };
            for e in events {
                let ductile_cluster::kv::WatchEvent::Put(kv) = e else {
                    continue;
                };
                // {generation:020}/weights/{rank}
                let rest = kv.key.strip_prefix(&prefix).unwrap_or_default();
                let parts: Vec<&str> = rest.split('/').collect();
                if let [gen, "weights", rank] = parts[..] {
                    if let (Ok(gen), Ok(rank)) = (gen.parse::<u64>(), rank.parse::<u32>()) {
                        let value = String::from_utf8(kv.value).unwrap();
                        put.entry(gen).or_default().insert(rank, value);
                    }
                }
            }
        }
    })
}

/// SIGKILL `pid` and wait for `job` to re-form at `world` from its peers' state (a failure
/// generation, no checkpoint); the new generation's view and record.
pub fn kill_and_reform(
    c: &Cluster,
    job: &str,
    pid: u32,
    world: u32,
) -> (JobView, ductile_cluster::records::Generation) {
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let v = c.wait_world(job, world, Duration::from_secs(30));
    let g = c.history(job).into_iter().last().unwrap();
    assert_eq!(
        (g.reason, g.state_source),
        (
            ductile_cluster::records::Reason::Failure,
            ductile_cluster::records::StateSource::Peers
        ),
        "{g:?}"
    );
    (v, g)
}

/// SIGKILL worker `pid` of `job` where a free slot can take its place: wait for the failure's
/// generation (state from peers), then for `world` workers running.
pub fn kill_and_replace(c: &Cluster, job: &str, pid: u32, world: u32) -> JobView {
    let before = c.history(job).last().map(|g| g.number).unwrap_or(0);
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let g = c.wait_for(
        Duration::from_secs(30),
        "the generation after a kill",
        || c.history(job).into_iter().find(|g| g.number > before),
    );
    assert_eq!(
        (g.reason, g.state_source),
        (
            ductile_cluster::records::Reason::Failure,
            ductile_cluster::records::StateSource::Peers
        ),
        "{g:?}"
    );
    c.wait_world(job, world, Duration::from_secs(60))
}

/// Load `url` in headless Chromium (Debian's `chromium`, installed by scripts/setup.sh) with a
/// fresh profile under `profile`, a virtual-time budget of `budget_ms` (it runs only while
/// nothing is pending) and `args` (`--dump-dom`, `--screenshot=...`); its stdout. Bounded: 90 s.
pub fn chromium(
    profile: &Path,
    budget_ms: u64,
    args: &[&str],
    url: &str,
) -> std::io::Result<String> {
    let out = Command::new("timeout")
        .args([
            "90",
            "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
        ])
        .args(["--disable-dev-shm-usage", "--no-first-run"])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg(format!("--virtual-time-budget={budget_ms}"))
        .args(args)
        .arg(url)
        .output()?;
    if !out.status.success() {
        return Err(std::io::Error::other(format!(
            "chromium {args:?} {url} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The loss a job reported `later` is below the one it reported `early`.
pub fn assert_loss_fell(early: &JobView, later: &JobView) {
    let (a, b) = (early.loss.unwrap(), later.loss.unwrap());
    assert!(b < a, "{}: loss {a} → {b}", later.job);
}

/// Write a synthetic dataset to `url` (file:// or s3://, with `env` for the store).
pub fn synth_to(url: &str, kind: &str, size: u64, env: &[(String, String)]) -> String {
    synth_with(url, kind, size, &[], env)
}

/// `ductile-worker synth-data` (seed 7) with extra `args`; returns `url`.
fn synth_with(url: &str, kind: &str, size: u64, args: &[&str], env: &[(String, String)]) -> String {
    let out = Command::new(bin("ductile-worker"))
        .args(["synth-data", "--kind", kind, "--out", url, "--seed", "7"])
        .args(["--size", &size.to_string()])
        .args(args)
        .envs(env.iter().cloned())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "synth-data failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    url.to_string()
}

/// A synthetic token corpus of `size` tokens written as shards of `shard_tokens` and their
/// `index.json` under `prefix` (file:// or s3://, ending in `/`).
pub fn synth_shards(
    prefix: &str,
    size: u64,
    shard_tokens: u64,
    env: &[(String, String)],
) -> String {
    synth_with(
        prefix,
        "tokens",
        size,
        &["--shard-tokens", &shard_tokens.to_string()],
        env,
    )
}

/// `ductile-worker tokenize` of `inputs` into `out` with extra `args`: its `--json` summary.
pub fn tokenize_with(
    model: &Path,
    inputs: &[&Path],
    out: &str,
    args: &[&str],
) -> serde_json::Value {
    let o = Command::new(bin("ductile-worker"))
        .args(["tokenize", "--json", "--tokenizer"])
        .arg(model)
        .arg("--input")
        .args(inputs)
        .args(["--out", out])
        .args(args)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "tokenize: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).unwrap()
}

/// The set-up's transformers fixtures (`DUCTILE_HF_FIXTURES`, made by scripts/setup.sh).
pub fn hf_fixtures() -> PathBuf {
    PathBuf::from(std::env::var("DUCTILE_HF_FIXTURES").expect(
        "DUCTILE_HF_FIXTURES is not set: run scripts/setup.sh and source ~/.cache/ductile/env.sh",
    ))
}

/// The set-up's torch venv interpreter (`DUCTILE_TORCH_PYTHON`).
pub fn torch_python_bin() -> String {
    std::env::var("DUCTILE_TORCH_PYTHON")
        .expect("DUCTILE_TORCH_PYTHON is not set: run scripts/setup.sh --tests and source ~/.cache/ductile/env.sh")
}

/// The set-up's TensorFlow venv interpreter (`DUCTILE_TF_PYTHON`: tensorflow-cpu and tf_keras).
pub fn tf_python_bin() -> String {
    std::env::var("DUCTILE_TF_PYTHON")
        .expect("DUCTILE_TF_PYTHON is not set: run scripts/setup.sh --tests and source ~/.cache/ductile/env.sh")
}

/// Agent flags for tf jobs running `examples/tensorflow/keras_fit.py`: the TensorFlow venv's
/// interpreter the one allowed command; the temporary directories and the examples the
/// allowed paths.
pub fn tf_agent_flags() -> Vec<String> {
    let mut f = torchrun_agent_flags();
    f[1] = tf_python_bin();
    f
}

/// The set-up's Horovod venv interpreter (`DUCTILE_HOROVOD_PYTHON`: torch 2.0.1 and horovod
/// 0.28.1 built with gloo).
pub fn horovod_python_bin() -> String {
    std::env::var("DUCTILE_HOROVOD_PYTHON")
        .expect("DUCTILE_HOROVOD_PYTHON is not set: run scripts/setup.sh --tests and source ~/.cache/ductile/env.sh")
}

/// Agent flags for horovod jobs running `examples/horovod/hvd_train.py`: the Horovod venv's
/// interpreter the one allowed command; the temporary directories and the examples the
/// allowed paths.
pub fn horovod_agent_flags() -> Vec<String> {
    let mut f = torchrun_agent_flags();
    f[1] = horovod_python_bin();
    f
}

/// Agent flags for torchrun jobs running `examples/torchrun/ddp_train.py`: the torch venv's
/// interpreter the one allowed command; the temporary directories and the examples the
/// allowed paths.
pub fn torchrun_agent_flags() -> Vec<String> {
    vec![
        "--allowed-commands".into(),
        torch_python_bin(),
        "--allowed-paths".into(),
        format!(
            "{},{}",
            std::env::temp_dir().display(),
            repo_root().join("examples").display()
        ),
    ]
}

/// [`torchrun_agent_flags`] with `commands` allowed too (`ductile-worker` for built-in jobs,
/// Debian's `/usr/bin/python3` for a program without the test venv).
pub fn torchrun_agent_flags_with(commands: &[&str]) -> Vec<String> {
    let mut flags = torchrun_agent_flags();
    flags[1] = std::iter::once(flags[1].as_str())
        .chain(commands.iter().copied())
        .collect::<Vec<_>>()
        .join(",");
    flags
}

/// One line of `ddp_train.py --step-log`: (unix time, pid, world size, step).
pub fn step_log_line(line: &str) -> Option<(f64, u32, u32, u64)> {
    let mut f = line.split_whitespace();
    Some((
        f.next()?.parse().ok()?,
        f.next()?.parse().ok()?,
        f.next()?.parse().ok()?,
        f.next()?.parse().ok()?,
    ))
}

/// Run a Python script with the set-up's torch venv (`DUCTILE_TORCH_PYTHON`); its stdout.
pub fn torch_python<A: AsRef<std::ffi::OsStr>>(script: &str, args: &[A]) -> String {
    let o = Command::new(torch_python_bin())
        .arg("-c")
        .arg(script)
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

/// A training job spec in TOML.
pub fn training_toml(
    name: &str,
    min: u32,
    max: u32,
    desired: u32,
    model: &str,
    dataset: &str,
    extra: &str,
) -> String {
    format!(
        "name = \"{name}\"\nmin = {min}\nmax = {max}\ndesired = {desired}\n{extra}\n[training]\nmodel = \"{model}\"\ndataset = \"{dataset}\"\nglobal_batch = 32\nlr = 3e-3\nseed = 7\n"
    )
}

/// `ductile-worker tokenize --tokenizer MODEL --input JSONL --out OUT`: the tokens written.
pub fn tokenize(model: &Path, jsonl: &Path, out: &str) -> u64 {
    let o = Command::new(bin("ductile-worker"))
        .args(["tokenize", "--tokenizer"])
        .arg(model)
        .arg("--input")
        .arg(jsonl)
        .args(["--out", out])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        o.status.success(),
        "tokenize: {said} {}",
        String::from_utf8_lossy(&o.stderr)
    );
    said.split(" tokens of")
        .next()
        .and_then(|s| s.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("tokenize said {said}"))
}

/// Each rank's state bytes in `job`'s first generation, from the ranks' join records.
pub fn first_state_bytes(c: &Cluster, rt: &tokio::runtime::Runtime, job: &str) -> Vec<u64> {
    let g = c.history(job)[0].clone();
    rt.block_on(c.joins(job, g.number, g.world_size))
        .iter()
        .map(|j| j.state_bytes)
        .collect()
}

/// The final weights' and optimizer state's hashes rank 0 printed for `job`.
/// The line goes out before the job is marked done, but the agent relays a rank's output to
/// its log on its own: a few seconds are allowed for it to land there.
pub fn final_hashes(c: &Cluster, job: &str) -> (String, String) {
    let find = || {
        c.logs()
            .lines()
            .find(|l| l.contains("finished at step") && l.contains(&format!("job={job} ")))
            .map(str::to_string)
    };
    let line = c.wait_for(
        Duration::from_secs(10),
        &format!("the final line of job {job} after its end"),
        find,
    );
    let after = |key: &str| {
        line.split(key)
            .nth(1)
            .and_then(|r| r.split([',', ' ']).next())
            .unwrap_or_else(|| panic!("no {key:?} in {line}"))
            .to_string()
    };
    (
        after("final weights sha256 "),
        after("optimizer state sha256 "),
    )
}

/// Calls `f` every `every` until it finds something, or `limit` passes (None).
pub fn poll<T>(limit: Duration, every: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if t0.elapsed() >= limit {
            return None;
        }
        std::thread::sleep(every);
    }
}

/// Unix time in seconds, the clock of `examples/torchft/train_ddp.py`'s commit log.
pub fn now_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// One committed step of `examples/torchft/train_ddp.py --log`.
#[derive(Clone, Debug, PartialEq)]
pub struct TorchftCommit {
    pub time: f64,
    pub group: u32,
    pub pid: u32,
    pub step: u64,
    pub quorum: i64,
    pub participants: u32,
    pub healed: bool,
}

/// Every commit a replica group's log holds, in order.
pub fn torchft_commits(log: &Path) -> Vec<TorchftCommit> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let time = f.next()?.parse().ok()?;
            let kv: BTreeMap<&str, &str> = f.filter_map(|x| x.split_once('=')).collect();
            Some(TorchftCommit {
                time,
                group: kv.get("group")?.parse().ok()?,
                pid: kv.get("pid")?.parse().ok()?,
                step: kv.get("step")?.parse().ok()?,
                quorum: kv.get("quorum")?.parse().ok()?,
                participants: kv.get("participants")?.parse().ok()?,
                healed: *kv.get("healed")? == "1",
            })
        })
        .collect()
}

/// `examples/torchft/train_ddp.py`, TorchFT's DDP example loop.
pub fn torchft_script() -> String {
    repo_root()
        .join("examples/torchft/train_ddp.py")
        .display()
        .to_string()
}

/// A `runtime = "torchft"` job `name` of `sizes` (min, max, desired) running the torchft
/// example with `args` under the test venv's interpreter; `extra` follows (sections).
pub fn torchft_job_toml(
    name: &str,
    sizes: (u32, u32, u32),
    args: &[String],
    extra: &str,
) -> String {
    let command: Vec<String> = [torch_python_bin(), torchft_script()]
        .iter()
        .chain(args)
        .map(|a| format!("{a:?}"))
        .collect();
    format!(
        "name = \"{name}\"\nruntime = \"torchft\"\ncommand = [{}]\nmin = {}\nmax = {}\ndesired = {}\n{extra}\n",
        command.join(", "),
        sizes.0,
        sizes.1,
        sizes.2
    )
}

/// A TorchFT replica group of one process running `examples/torchft/train_ddp.py` against the
/// lighthouse at `lighthouse` (`http://HOST:PORT`): its commits go to `{dir}/{tag}.log`, its
/// final weights' SHA-256 to `{dir}/g{group}.sha`.
pub fn torchft_group(
    dir: &Path,
    tag: &str,
    group: u32,
    lighthouse: &str,
    steps: u64,
    extra: &[&str],
) -> Proc {
    let mut args = vec![
        torchft_script(),
        "--steps".into(),
        steps.to_string(),
        "--log".into(),
        dir.join(format!("{tag}.log")).display().to_string(),
        "--sha-out".into(),
        dir.join(format!("g{group}.sha")).display().to_string(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    Proc::start(
        tag,
        Path::new(&torch_python_bin()),
        &args,
        &[
            ("TORCHFT_LIGHTHOUSE".into(), lighthouse.into()),
            ("REPLICA_GROUP_ID".into(), group.to_string()),
            ("OMP_NUM_THREADS".into(), "1".into()),
        ],
        dir.join(format!("{tag}.out")),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Servers' ports come from outside the ephemeral range, where no outgoing connection can
    /// take one before its server binds it, and no two calls hand out the same port.
    #[test]
    fn free_ports_lie_outside_the_ephemeral_range_and_differ() {
        let (lo, hi) = ephemeral_ports().unwrap();
        let ports: Vec<u16> = (0..50).map(|_| free_port()).collect();
        let mut distinct = ports.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), ports.len(), "{ports:?}");
        // (where the range leaves no room on either side, the kernel's choice stands)
        assert!(
            server_ports().is_none()
                || ports
                    .iter()
                    .all(|p| u64::from(*p) < lo || u64::from(*p) > hi),
            "{ports:?} vs ephemeral {lo}-{hi}"
        );
        // and each can be bound now
        for p in ports {
            TcpListener::bind(("127.0.0.1", p)).unwrap();
        }
    }
}
