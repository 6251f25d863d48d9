//! Each job's private working directory on this node, `WORK_ROOT/JOB`: made by the agent for
//! the job's user, mode 700, before any of its processes starts, and removed when the job has
//! no slot here any more. `WORK_ROOT` itself is the agent's, mode 711: a job can reach its own
//! directory by name but cannot list the others, nor put anything (a symlink, a module) where
//! another job's directory will be.

use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The file that marks a directory as an agent's work root: only there does the agent
/// remove what no job of its owns.
pub const MARKER: &str = ".ductile-work-root";

/// Make `root` if need be, mode 711, marked as a work root. Refused: a directory that other
/// users may write (`/tmp`), or one that holds files and is not marked (`/home`): the agent
/// removes what no job owns in its work root, and must never do so in a shared directory.
/// Returns whether `root` was already a work root (what an earlier agent left may be swept).
pub fn prepare_root(root: &Path) -> Result<bool, String> {
    std::fs::create_dir_all(root).map_err(|e| format!("{}: {e}", root.display()))?;
    let md = std::fs::symlink_metadata(root).map_err(|e| format!("{}: {e}", root.display()))?;
    if !md.is_dir() {
        return Err(format!("{} is not a directory", root.display()));
    }
    if md.mode() & 0o002 != 0 {
        return Err(format!(
            "{} may be written by every user (mode {:o}): give the agent a directory of its own (e.g. /var/lib/ductile/work), where it makes each job's private directory and removes what no job owns",
            root.display(),
            md.mode() & 0o7777
        ));
    }
    let marker = root.join(MARKER);
    let marked = std::fs::symlink_metadata(&marker).is_ok_and(|m| m.is_file());
    if !marked {
        let foreign = std::fs::read_dir(root)
            .map_err(|e| format!("{}: {e}", root.display()))?
            .next()
            .is_some();
        if foreign {
            return Err(format!(
                "{} holds files and is not an agent's work root (no {MARKER}): give the agent an empty or new directory",
                root.display()
            ));
        }
        std::fs::write(
            &marker,
            "ductile-agent's work root: each job's private directory\n",
        )
        .map_err(|e| format!("{}: {e}", marker.display()))?;
    }
    if md.uid() == nix::unistd::geteuid().as_raw() && md.mode() & 0o7777 != 0o711 {
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o711))
            .map_err(|e| format!("{}: {e}", root.display()))?;
    }
    Ok(marked)
}

/// The job's directory under `root`; its name is the job's (checked: one path component).
pub fn job_dir(root: &Path, job: &str) -> Result<PathBuf, String> {
    if job.is_empty() || job == "." || job == ".." || job.contains('/') || job.contains('\0') {
        return Err(format!("job name {job:?} cannot name a directory"));
    }
    Ok(root.join(job))
}

/// `WORK_ROOT/JOB` for `owner` (uid, gid; None: this agent's own user), mode 700. Whatever is
/// at that name and is not already such a directory (a symlink, a file, a directory of another
/// owner or mode: what an earlier run or another user left) is removed first; nothing is
/// followed.
pub fn make(root: &Path, job: &str, owner: Option<(u32, u32)>) -> Result<PathBuf, String> {
    let dir = job_dir(root, job)?;
    let (uid, gid) = owner.unwrap_or_else(|| {
        (
            nix::unistd::geteuid().as_raw(),
            nix::unistd::getegid().as_raw(),
        )
    });
    match std::fs::symlink_metadata(&dir) {
        Ok(md) if md.is_dir() && md.uid() == uid && md.mode() & 0o7777 == 0o700 => return Ok(dir),
        Ok(md) if md.is_dir() => remove(root, job)?,
        Ok(_) => std::fs::remove_file(&dir).map_err(|e| format!("{}: {e}", dir.display()))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(format!("{}: {e}", dir.display())),
    }
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        // made meanwhile (another slot's start): taken if it is what this call makes
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            match std::fs::symlink_metadata(&dir) {
                Ok(md) if md.is_dir() && md.uid() == uid && md.mode() & 0o7777 == 0o700 => {
                    return Ok(dir)
                }
                _ => {
                    return Err(format!(
                        "cannot make {}: {e}, and what is there is not this job's directory",
                        dir.display()
                    ))
                }
            }
        }
        Err(e) => return Err(format!("cannot make {}: {e}", dir.display())),
    }
    if owner.is_some() {
        // lchown: the name was just made by this agent in its own directory
        std::os::unix::fs::lchown(&dir, Some(uid), Some(gid)).map_err(|e| {
            format!(
                "cannot give {} to uid {uid}: {e} (the agent needs root or CAP_CHOWN)",
                dir.display()
            )
        })?;
    }
    Ok(dir)
}

/// Remove `WORK_ROOT/JOB` and everything in it, following no symlink. A directory this agent
/// cannot empty (another user's, mode 700, without root) is emptied by a process running as
/// its owner, then removed from the agent's own `WORK_ROOT`.
pub fn remove(root: &Path, job: &str) -> Result<(), String> {
    let dir = job_dir(root, job)?;
    let md = match std::fs::symlink_metadata(&dir) {
        Ok(md) => md,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(format!("{}: {e}", dir.display())),
    };
    if !md.is_dir() {
        return std::fs::remove_file(&dir).map_err(|e| format!("{}: {e}", dir.display()));
    }
    let me = nix::unistd::geteuid();
    if !me.is_root() && md.uid() != me.as_raw() {
        // as the owner: make every directory writable (a job may have made one read-only),
        // then delete depth-first; find's -delete does not follow symlinks
        use std::os::unix::process::CommandExt;
        let status = std::process::Command::new("/bin/sh")
            .args([
                "-c",
                "chmod -R u+rwX -- \"$1\" 2>/dev/null; find \"$1\" -mindepth 1 -delete",
                "sh",
            ])
            .arg(&dir)
            .uid(md.uid())
            .gid(md.gid())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .status()
            .map_err(|e| format!("cannot empty {} as uid {}: {e}", dir.display(), md.uid()))?;
        if !status.success() {
            return Err(format!(
                "emptying {} as uid {} failed ({status})",
                dir.display(),
                md.uid()
            ));
        }
        return std::fs::remove_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()));
    }
    std::fs::remove_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_s_directory_is_private_replaces_what_was_planted_and_goes() {
        let t = tempfile_dir();
        let root = t.join("work");
        assert_eq!(prepare_root(&root), Ok(false));
        let md = std::fs::metadata(&root).unwrap();
        assert_eq!(md.mode() & 0o777, 0o711);
        assert_eq!(prepare_root(&root), Ok(true), "marked: an earlier agent's");
        // never a shared directory, nor one with files of others in it
        let shared = t.join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let e = prepare_root(&shared).unwrap_err();
        assert!(e.contains("every user"), "{e}");
        let home = t.join("home");
        std::fs::create_dir(&home).unwrap();
        std::fs::write(home.join("precious"), "x").unwrap();
        let e = prepare_root(&home).unwrap_err();
        assert!(e.contains("not an agent's work root"), "{e}");
        assert_eq!(std::fs::metadata(&home).unwrap().mode() & 0o777, 0o755);
        // what another user left at the name: a symlink to somewhere else, then a directory
        // with a module in it
        let elsewhere = t.join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, root.join("j")).unwrap();
        let d = make(&root, "j", None).unwrap();
        assert!(std::fs::symlink_metadata(&d).unwrap().is_dir());
        assert!(elsewhere.exists(), "the link's target is left alone");
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(d.join("json.py"), "raise SystemExit('planted')").unwrap();
        let d = make(&root, "j", None).unwrap();
        assert!(
            !d.join("json.py").exists(),
            "a directory of the wrong mode is made afresh"
        );
        assert_eq!(std::fs::metadata(&d).unwrap().mode() & 0o777, 0o700);
        std::fs::write(d.join("out.txt"), "kept while the job runs").unwrap();
        let d = make(&root, "j", None).unwrap();
        assert!(
            d.join("out.txt").exists(),
            "the job's own directory is kept"
        );
        std::os::unix::fs::symlink(&elsewhere, d.join("link")).unwrap();
        std::fs::write(elsewhere.join("precious"), "x").unwrap();
        remove(&root, "j").unwrap();
        assert!(!d.exists());
        assert!(
            elsewhere.join("precious").exists(),
            "removal follows no link"
        );
        assert!(make(&root, "../x", None).is_err());
        let _ = std::fs::remove_dir_all(&t);
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "ductile-workdir-test-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
