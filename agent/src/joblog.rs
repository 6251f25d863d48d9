//! Each program's output kept on its node, per job and slot (issue 48): every line a worker or a
//! user's program writes to stdout or stderr goes to `LOG_DIR/JOB/slot-S.log` as
//! `YYYY-MM-DD HH:MM:SS.mmm STREAM LINE`, besides the agent's own log. A line
//! `=== generation G rank R pid P ===` opens each generation the slot's process serves, so a
//! rank's output in one generation is the lines after its mark. A file past `max_bytes` is
//! rotated to `slot-S.log.1` (the previous one is dropped): a slot of a job holds at most twice
//! that. A job's directory whose files were not written for `keep` is deleted. The directory
//! is the agent's (mode 0700): a job's programs neither read another job's output nor rewrite
//! their own.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ductile_cluster::records::{LogAnswer, LogRequest};

/// One slot's log file of one job, shared by the tasks that copy the process's streams.
pub struct SlotLog {
    path: PathBuf,
    file: Option<File>,
    written: u64,
    max_bytes: u64,
    /// A write failed (a full disk): said once, then the lines go to the agent's log only.
    failed: bool,
}

pub type Shared = Arc<Mutex<SlotLog>>;

/// `O_NOFOLLOW`: a log file that is a symlink is not opened through.
fn nofollow(o: &mut OpenOptions) -> &mut OpenOptions {
    use std::os::unix::fs::OpenOptionsExt;
    o.custom_flags(nix::libc::O_NOFOLLOW)
}

impl SlotLog {
    /// The log of `slot` of `job` under `root`, appended to (a restarted process goes on in
    /// the same file).
    pub fn open(root: &Path, job: &str, slot: u32, max_bytes: u64) -> std::io::Result<Shared> {
        let dir = root.join(job);
        // nothing on the way is followed: a log_dir, a job's directory or a log file that is a
        // symlink (put there by whoever could write its parent) would have this agent, root
        // perhaps, write and chmod wherever it points
        for p in [root, dir.as_path()] {
            if fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_symlink()) {
                return Err(std::io::Error::other(format!(
                    "{} is a symlink: the agent writes programs' logs only into directories of its own",
                    p.display()
                )));
            }
        }
        fs::create_dir_all(&dir)?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let _ = fs::set_permissions(root, fs::Permissions::from_mode(0o700));
            fs::set_permissions(&dir, fs::Permissions::from_mode(0o700))?;
        }
        let path = dir.join(format!("slot-{slot}.log"));
        let file = nofollow(OpenOptions::new().create(true).append(true)).open(&path)?;
        let written = file.metadata().map(|m| m.len()).unwrap_or(0);
        Ok(Arc::new(Mutex::new(SlotLog {
            path,
            file: Some(file),
            written,
            max_bytes: max_bytes.max(4096),
            failed: false,
        })))
    }

    /// One line of the process's `stream` (`stdout`, `stderr`).
    pub fn line(&mut self, stream: &str, line: &str) {
        let ms = ductile_cluster::records::now_ms();
        let text = format!(
            "{}.{:03} {stream} {}\n",
            ductile_cluster::records::utc(ms),
            ms % 1000,
            line.trim_end_matches(['\n', '\r'])
        );
        self.write(&text);
    }

    /// The mark that opens a generation the slot's process serves.
    pub fn mark(&mut self, generation: u64, rank: u32, pid: u32) {
        self.write(&format!(
            "=== generation {generation} rank {rank} pid {pid} ===\n"
        ));
    }

    fn write(&mut self, text: &str) {
        if self.written + text.len() as u64 > self.max_bytes {
            self.rotate();
        }
        let Some(f) = self.file.as_mut() else { return };
        match f.write_all(text.as_bytes()) {
            Ok(()) => self.written += text.len() as u64,
            Err(e) => {
                if !self.failed {
                    tracing::warn!(file = %self.path.display(), error = %e, "cannot write a program's log file: its output goes to the agent's log only");
                }
                self.failed = true;
            }
        }
    }

    /// The file moves to `.1` (the previous `.1` is dropped) and a new one starts.
    fn rotate(&mut self) {
        self.file = None;
        let old = self.path.with_extension("log.1");
        let _ = fs::rename(&self.path, &old);
        match nofollow(OpenOptions::new().create(true).write(true).truncate(true)).open(&self.path)
        {
            Ok(f) => {
                self.file = Some(f);
                self.written = 0;
            }
            Err(e) => {
                if !self.failed {
                    tracing::warn!(file = %self.path.display(), error = %e, "cannot start a program's log file anew");
                }
                self.failed = true;
            }
        }
    }
}

/// Delete the job directories under `root` whose files were all last written more than `keep`
/// ago, except `active` jobs'. Returns how many went.
pub fn collect(root: &Path, keep: Duration, active: &dyn Fn(&str) -> bool) -> usize {
    let Ok(dirs) = fs::read_dir(root) else {
        return 0;
    };
    let now = std::time::SystemTime::now();
    let mut gone = 0;
    for d in dirs.flatten() {
        let name = d.file_name().to_string_lossy().into_owned();
        if active(&name) || !d.path().is_dir() {
            continue;
        }
        let newest = fs::read_dir(d.path())
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|f| f.metadata().ok()?.modified().ok())
            .max();
        let old = newest
            .and_then(|t| now.duration_since(t).ok())
            .is_none_or(|age| age > keep);
        if old && fs::remove_dir_all(d.path()).is_ok() {
            gone += 1;
        }
    }
    gone
}

/// What `dctl logs` asked of a slot's file ([`LogRequest`]): from a byte offset on (a follow),
/// or the whole (the rotated file first), one generation's lines, the last N; at most
/// [`LogAnswer::MAX_BYTES`], the newest kept.
pub fn answer(root: &Path, req: &LogRequest) -> LogAnswer {
    let path = root.join(&req.job).join(format!("slot-{}.log", req.slot));
    let file = path.display().to_string();
    if ductile_cluster::keys::validate_name("job", &req.job).is_err() {
        return LogAnswer {
            error: Some(format!("{:?} is not a job name", req.job)),
            file,
            ..Default::default()
        };
    }
    let cur = match fs::read(&path) {
        Ok(b) => b,
        Err(e) => {
            let why = if e.kind() == std::io::ErrorKind::NotFound {
                "no such file: this slot's processes wrote nothing on this node".to_string()
            } else {
                e.to_string()
            };
            return LogAnswer {
                error: Some(format!("{file}: {why}")),
                file,
                ..Default::default()
            };
        }
    };
    let len = cur.len() as u64;
    let max = LogAnswer::MAX_BYTES;
    if let Some(o) = req.offset {
        // a file shorter than the offset was rotated: the new one from its start
        let from = if o > len { 0 } else { o as usize };
        let mut chunk = &cur[from..];
        if chunk.len() > max {
            // whole lines, the next request goes on from there
            let cut = chunk[..max]
                .iter()
                .rposition(|b| *b == b'\n')
                .map_or(max, |i| i + 1);
            chunk = &chunk[..cut];
        }
        return LogAnswer {
            text: String::from_utf8_lossy(chunk).into_owned(),
            offset: (from + chunk.len()) as u64,
            truncated: false,
            file,
            error: None,
        };
    }
    let older = fs::read(path.with_extension("log.1")).unwrap_or_default();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&older),
        String::from_utf8_lossy(&cur)
    );
    let mut lines: Vec<&str> = text.lines().collect();
    if let Some(g) = req.generation {
        let mut inside = false;
        lines.retain(|l| {
            if let Some(rest) = l.strip_prefix("=== generation ") {
                inside = rest.split(' ').next().and_then(|n| n.parse::<u64>().ok()) == Some(g);
            }
            inside
        });
    }
    let mut truncated = false;
    if let Some(n) = req.tail {
        let n = n as usize;
        if lines.len() > n {
            lines.drain(..lines.len() - n);
        }
    }
    let mut bytes: usize = lines.iter().map(|l| l.len() + 1).sum();
    while bytes > max && !lines.is_empty() {
        bytes -= lines.remove(0).len() + 1;
        truncated = true;
    }
    let mut out = lines.join("\n");
    if !out.is_empty() {
        out.push('\n');
    }
    LogAnswer {
        text: out,
        offset: len,
        truncated,
        file,
        error: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 66's review: a root agent follows no symlink in log_dir, a job's directory or a
    /// slot's file.
    #[test]
    fn no_symlink_on_the_way_to_a_log_is_followed() {
        let base =
            std::env::temp_dir().join(format!("ductile-joblog-links-{}", std::process::id()));
        let _ = fs::remove_dir_all(&base);
        let target = base.join("target");
        fs::create_dir_all(&target).unwrap();
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&target, fs::Permissions::from_mode(0o755)).unwrap();
        let linked_root = base.join("logs-link");
        std::os::unix::fs::symlink(&target, &linked_root).unwrap();
        assert!(SlotLog::open(&linked_root, "j", 0, 4096).is_err());
        let root = base.join("logs");
        fs::create_dir_all(&root).unwrap();
        std::os::unix::fs::symlink(&target, root.join("j")).unwrap();
        assert!(SlotLog::open(&root, "j", 0, 4096).is_err());
        fs::create_dir_all(root.join("k")).unwrap();
        std::os::unix::fs::symlink(target.join("f"), root.join("k").join("slot-0.log")).unwrap();
        assert!(SlotLog::open(&root, "k", 0, 4096).is_err());
        assert!(!target.join("f").exists());
        assert_eq!(
            fs::metadata(&target).unwrap().permissions().mode() & 0o777,
            0o755,
            "the link's target was not chmod'ed"
        );
        let _ = fs::remove_dir_all(&base);
    }

    #[test]
    fn lines_and_marks_are_kept_and_a_full_file_rotates() {
        let root = std::env::temp_dir().join(format!("ductile-joblog-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let log = SlotLog::open(&root, "j", 3, 4096).unwrap();
        {
            let mut l = log.lock().unwrap();
            l.mark(2, 1, 77);
            l.line("stdout", "hello\n");
            l.line("stderr", "oops");
        }
        let text = fs::read_to_string(root.join("j/slot-3.log")).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "=== generation 2 rank 1 pid 77 ===");
        assert!(lines[1].ends_with(" stdout hello"), "{}", lines[1]);
        assert!(lines[2].ends_with(" stderr oops"), "{}", lines[2]);
        // 4 KiB at most per file: the older lines move to .1, one file of them
        {
            let mut l = log.lock().unwrap();
            for i in 0..200 {
                l.line("stdout", &format!("line {i} {}", "x".repeat(40)));
            }
        }
        let now = fs::metadata(root.join("j/slot-3.log")).unwrap().len();
        let before = fs::metadata(root.join("j/slot-3.log.1")).unwrap().len();
        assert!(now <= 4096 && before <= 4096, "{now} {before}");
        let last = fs::read_to_string(root.join("j/slot-3.log")).unwrap();
        assert!(last
            .trim_end()
            .ends_with(&format!("line 199 {}", "x".repeat(40))));
        // a job's directory goes once nothing in it was written for `keep`; an active job's stays
        assert_eq!(collect(&root, Duration::from_secs(3600), &|_| false), 0);
        assert_eq!(collect(&root, Duration::ZERO, &|j| j == "j"), 0);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(collect(&root, Duration::from_millis(1), &|_| false), 1);
        assert!(!root.join("j").exists());
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn an_answer_holds_a_generation_s_lines_the_last_n_or_what_came_after_an_offset() {
        let root = std::env::temp_dir().join(format!("ductile-joblog-a-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let log = SlotLog::open(&root, "j", 0, 1 << 20).unwrap();
        {
            let mut l = log.lock().unwrap();
            l.mark(1, 0, 10);
            l.line("stdout", "one");
            l.line("stdout", "two");
            l.mark(2, 1, 10);
            l.line("stderr", "three");
        }
        let ask = |generation, tail, offset| LogRequest {
            job: "j".into(),
            slot: 0,
            generation,
            tail,
            offset,
            lease: 0,
        };
        let all = answer(&root, &ask(None, None, None));
        assert_eq!(all.text.lines().count(), 5, "{}", all.text);
        let g1 = answer(&root, &ask(Some(1), None, None));
        let lines: Vec<&str> = g1.text.lines().collect();
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert!(lines[0].starts_with("=== generation 1 ") && lines[2].ends_with(" two"));
        let last = answer(&root, &ask(None, Some(1), None));
        assert!(
            last.text.trim_end().ends_with("stderr three"),
            "{}",
            last.text
        );
        // a follow: nothing new, then the next line only
        let none = answer(&root, &ask(None, None, Some(all.offset)));
        assert_eq!((none.text.as_str(), none.offset), ("", all.offset));
        log.lock().unwrap().line("stdout", "four");
        let more = answer(&root, &ask(None, None, Some(all.offset)));
        assert!(more.text.ends_with(" stdout four\n"), "{}", more.text);
        assert_eq!(more.text.lines().count(), 1);
        // no file for another slot; a name that is not a job's is refused
        let other = LogRequest {
            slot: 5,
            ..ask(None, None, None)
        };
        assert!(answer(&root, &other)
            .error
            .unwrap()
            .contains("wrote nothing"));
        let bad = LogRequest {
            job: "../x".into(),
            ..ask(None, None, None)
        };
        assert!(answer(&root, &bad)
            .error
            .unwrap()
            .contains("not a job name"));
        fs::remove_dir_all(&root).unwrap();
    }
}
