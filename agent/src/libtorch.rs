//! Where the workers' libtorch is on this node: a libtorch directory, or the `torch` package of a
//! Python environment (`libtorch`, `torch_python`). Packaged binaries carry no path of the
//! machine they were built on; the agent puts the directory found here first on
//! `LD_LIBRARY_PATH` of the `ductile-worker` processes it starts.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The libtorch version ductile-worker is built against (tch 0.24).
pub const TORCH_VERSION: &str = "2.11.0";

/// The libraries' directory of a libtorch directory (`DIR/lib`) or of a `torch/lib` directory
/// (`DIR`), checked: libtorch_cpu.so is there, and its version is [`TORCH_VERSION`] where the
/// directory says which it is.
pub fn from_dir(dir: &Path) -> anyhow::Result<PathBuf> {
    let lib = [dir.join("lib"), dir.to_path_buf()]
        .into_iter()
        .find(|d| d.join("libtorch_cpu.so").is_file())
        .ok_or_else(|| {
            anyhow::anyhow!(
                "invalid libtorch {}: no libtorch_cpu.so in it or in its lib/ (give a libtorch directory, or a torch package's torch/lib, or torch_python)",
                dir.display()
            )
        })?;
    if let Some(v) = version_of(lib.parent().unwrap_or(&lib)) {
        check_version(&v, dir)?;
    }
    Ok(lib)
}

/// torch's `lib/` in `python`'s environment, found without importing torch (its package is
/// located by `importlib.util.find_spec`), bounded at 20 s.
pub fn from_python(python: &Path) -> anyhow::Result<PathBuf> {
    let mut child = std::process::Command::new(python)
        .args([
            "-I",
            "-c",
            "import importlib.util, os; s = importlib.util.find_spec('torch'); print(os.path.dirname(s.origin) if s and s.origin else '')",
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| anyhow::anyhow!("invalid torch_python {}: cannot run it: {e}", python.display()))?;
    let t0 = Instant::now();
    loop {
        match child.try_wait()? {
            Some(_) => break,
            None if t0.elapsed() > Duration::from_secs(20) => {
                let _ = child.kill();
                let _ = child.wait();
                anyhow::bail!(
                    "invalid torch_python {}: it did not answer within 20 s",
                    python.display()
                );
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    let out = child.wait_with_output()?;
    let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() || dir.is_empty() {
        anyhow::bail!(
            "invalid torch_python {}: it has no torch package ({}{})",
            python.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .map(|l| format!(": {l}"))
                .unwrap_or_default()
        );
    }
    let torch = PathBuf::from(dir);
    if let Some(v) = version_of(&torch) {
        check_version(&v, python)?;
    }
    let lib = torch.join("lib");
    if !lib.join("libtorch_cpu.so").is_file() {
        anyhow::bail!(
            "invalid torch_python {}: its torch package at {} has no lib/libtorch_cpu.so",
            python.display(),
            torch.display()
        );
    }
    Ok(lib)
}

/// The version a torch package (`version.py`) or a libtorch directory (`build-version`, or its
/// headers' `TORCH_VERSION`) says it is.
pub fn version_of(dir: &Path) -> Option<String> {
    if let Ok(t) = std::fs::read_to_string(dir.join("version.py")) {
        return t.lines().find_map(|l| {
            let v = l.strip_prefix("__version__")?.split(['\'', '"']).nth(1)?;
            Some(v.to_string())
        });
    }
    if let Ok(t) = std::fs::read_to_string(dir.join("build-version")) {
        return Some(t.trim().to_string());
    }
    let h =
        std::fs::read_to_string(dir.join("include/torch/csrc/api/include/torch/version.h")).ok()?;
    h.lines().find_map(|l| {
        let v = l.trim().strip_prefix("#define TORCH_VERSION ")?;
        Some(v.trim().trim_matches('"').to_string())
    })
}

fn check_version(v: &str, what: &Path) -> anyhow::Result<()> {
    let base = v.split('+').next().unwrap_or(v);
    if base != TORCH_VERSION {
        anyhow::bail!(
            "invalid libtorch: {} holds torch {v}, and ductile-worker needs {TORCH_VERSION} (tch 0.24 links exactly that version)",
            what.display()
        );
    }
    Ok(())
}

/// `LD_LIBRARY_PATH` with `lib` first (and not twice).
pub fn library_path(lib: &Path, current: Option<&str>) -> String {
    let mut parts = vec![lib.display().to_string()];
    for p in current.unwrap_or("").split(':').filter(|p| !p.is_empty()) {
        if !parts.iter().any(|q| q == p) {
            parts.push(p.to_string());
        }
    }
    parts.join(":")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_libtorch_directory_is_found_and_its_version_checked() {
        let d = std::env::temp_dir().join(format!("ductile-libtorch-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(d.join("lib")).unwrap();
        let e = from_dir(&d).unwrap_err().to_string();
        assert!(e.contains("no libtorch_cpu.so"), "{e}");
        std::fs::write(d.join("lib/libtorch_cpu.so"), b"").unwrap();
        assert_eq!(from_dir(&d).unwrap(), d.join("lib"));
        assert_eq!(from_dir(&d.join("lib")).unwrap(), d.join("lib"));
        std::fs::write(d.join("build-version"), "2.5.1+cpu\n").unwrap();
        let e = from_dir(&d).unwrap_err().to_string();
        assert!(e.contains("2.5.1+cpu") && e.contains("needs 2.11.0"), "{e}");
        std::fs::write(d.join("build-version"), "2.11.0+cu130\n").unwrap();
        assert!(from_dir(&d).is_ok());
        let _ = std::fs::remove_dir_all(&d);
        assert_eq!(library_path(Path::new("/a"), Some("/b:/a::/c")), "/a:/b:/c");
        assert_eq!(library_path(Path::new("/a"), None), "/a");
    }
}
