//! What a user's program may be given of the node: never the agent's own credentials. An
//! operator who wants a job's programs to reach S3 writes that job's credentials to
//! `job_credentials_dir/JOB.env` (`KEY=VALUE` lines, `#` comments; only the `AWS_*` names in
//! [`PROGRAM_CREDENTIAL_NAMES`]); the agent reads it when it starts the job's launcher and hands
//! it over, with the job's etcd password, on an inherited pipe (`DUCTILE_SECRETS_FD`), never in
//! an environment another process of that uid can read.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::path::Path;

/// The names a job's credentials file may set.
pub const PROGRAM_CREDENTIAL_NAMES: &[&str] = &[
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ALLOW_HTTP",
];

/// Whether the agent's variable `k` passes to a launcher: what a program inherits of the node
/// (locale, paths, the node's NCCL/CUDA settings: `ductile_runtime::launch::node_inherited`)
/// and the launcher's own logging. The agent's credentials (`AWS_*`, anything else an operator
/// set for the agent) are not among them.
pub fn inherited(k: &str) -> bool {
    ductile_runtime::launch::node_inherited(k)
        || [
            "RUST_LOG",
            "RUST_BACKTRACE",
            "DUCTILE_COMM_HOST",
            "DUCTILE_LOG_FORMAT",
        ]
        .contains(&k)
}

/// The job's credentials for its programs from `dir/JOB.env`: none when there is no such file;
/// an error naming the file and line when it holds anything but allowed names.
pub fn job_credentials(dir: &Path, job: &str) -> Result<BTreeMap<String, String>, String> {
    let path = dir.join(format!("{job}.env"));
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    let mut out = BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (k, v) = line
            .split_once('=')
            .ok_or_else(|| format!("{} line {}: not KEY=VALUE", path.display(), n + 1))?;
        let k = k.trim();
        if !PROGRAM_CREDENTIAL_NAMES.contains(&k) {
            return Err(format!(
                "{} line {}: {k} is not among the names a job's credentials may set {PROGRAM_CREDENTIAL_NAMES:?}",
                path.display(),
                n + 1
            ));
        }
        out.insert(k.to_string(), v.trim().trim_matches('"').to_string());
    }
    Ok(out)
}

/// A pipe holding `payload`, its write end closed (close-on-exec both): the read end, for a
/// child to receive as descriptor [`SECRETS_FD`]. The payload must fit the pipe's buffer.
pub fn pipe_with(payload: &[u8]) -> std::io::Result<OwnedFd> {
    if payload.len() > 60 << 10 {
        return Err(std::io::Error::other("secrets past 60 KiB"));
    }
    use std::os::fd::FromRawFd;
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 fills both descriptors, which are then owned here
    if unsafe { nix::libc::pipe2(fds.as_mut_ptr(), nix::libc::O_CLOEXEC) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let mut f = std::fs::File::from(w);
    std::io::Write::write_all(&mut f, payload)?;
    Ok(r)
}

/// The descriptor number a launcher reads its secrets from (`ductile_runtime::SECRETS_FD`).
pub const SECRETS_FD: i32 = 3;

/// In a child between fork and exec: the pipe's read end becomes [`SECRETS_FD`], inherited.
pub fn install_in_child(fd: i32) -> std::io::Result<()> {
    use nix::libc;
    // SAFETY: async-signal-safe calls on descriptors this process owns
    unsafe {
        if fd == SECRETS_FD {
            if libc::fcntl(fd, libc::F_SETFD, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
        } else if libc::dup2(fd, SECRETS_FD) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_s_credentials_file_is_read_and_checked() {
        let dir = std::env::temp_dir().join(format!("ductile-creds-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(job_credentials(&dir, "none").unwrap().is_empty());
        std::fs::write(
            dir.join("a.env"),
            "# job a\nAWS_ACCESS_KEY_ID=ak\nAWS_SECRET_ACCESS_KEY = \"sk\"\n\n",
        )
        .unwrap();
        let c = job_credentials(&dir, "a").unwrap();
        assert_eq!(c["AWS_ACCESS_KEY_ID"], "ak");
        assert_eq!(c["AWS_SECRET_ACCESS_KEY"], "sk");
        std::fs::write(dir.join("b.env"), "LD_PRELOAD=/x.so\n").unwrap();
        let e = job_credentials(&dir, "b").unwrap_err();
        assert!(e.contains("b.env line 1: LD_PRELOAD is not among"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(
            inherited("PATH") && inherited("NCCL_DEBUG") && !inherited("AWS_SECRET_ACCESS_KEY")
        );
    }
}
