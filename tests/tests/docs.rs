//! The README and docs/ say what the code does (issue 68): every relative link leads to a file
//! (and a heading, where it names one), every job spec they show passes `dctl submit
//! --dry-run`, every `dctl` line names a verb and flags the built dctl has, and the README stays
//! a front door (at most 250 lines). Real dctl binary; no daemon needed.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use ductile_tests::*;

/// README.md and every page under docs/.
fn pages() -> Vec<PathBuf> {
    let root = repo_root();
    let mut v = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    assert!(docs.len() >= 10, "docs/ has its pages: {docs:?}");
    v.extend(docs);
    v
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn anchors(text: &str) -> BTreeSet<String> {
    let mut fenced = false;
    let mut out = BTreeSet::new();
    for l in text.lines() {
        if l.starts_with("```") {
            fenced = !fenced;
        } else if !fenced && l.starts_with('#') {
            out.insert(slug(l.trim_start_matches('#')));
        }
    }
    out
}

/// The fenced blocks of `text`: (info string, body).
fn blocks(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut cur: Option<(String, String)> = None;
    for l in text.lines() {
        match (&mut cur, l.strip_prefix("```")) {
            (None, Some(info)) => cur = Some((info.trim().to_string(), String::new())),
            (Some(_), Some(_)) => out.push(cur.take().unwrap()),
            (Some((_, body)), None) => {
                body.push_str(l);
                body.push('\n');
            }
            (None, None) => {}
        }
    }
    out
}

/// Links `[text](target)` outside code blocks and code spans.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for l in text.lines() {
        if l.starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // code spans hold no links
        let plain: String = l
            .split('`')
            .enumerate()
            .filter(|(i, _)| i % 2 == 0)
            .map(|(_, s)| s)
            .collect::<Vec<_>>()
            .join(" ");
        let mut rest = plain.as_str();
        while let Some(i) = rest.find("](") {
            let after = &rest[i + 2..];
            let Some(j) = after.find(')') else { break };
            out.push(after[..j].to_string());
            rest = &after[j..];
        }
    }
    out
}

#[test]
fn docs_every_relative_link_leads_to_its_file_and_heading() {
    let mut checked = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for link in links(&text) {
            if link.starts_with("http://") || link.starts_with("https://") {
                continue;
            }
            let (file, anchor) = match link.split_once('#') {
                Some((f, a)) => (f, Some(a)),
                None => (link.as_str(), None),
            };
            let target = if file.is_empty() {
                page.clone()
            } else {
                page.parent().unwrap().join(file)
            };
            assert!(
                target.exists(),
                "{}: the link ({link}) leads nowhere: {} is missing",
                page.display(),
                target.display()
            );
            if let Some(a) = anchor {
                let there = std::fs::read_to_string(&target).unwrap();
                assert!(
                    anchors(&there).contains(a),
                    "{}: the link ({link}) names a heading {} lacks",
                    page.display(),
                    target.display()
                );
            }
            checked += 1;
        }
    }
    assert!(
        checked > 30,
        "only {checked} links found: is the parser right?"
    );
}

#[test]
fn docs_the_readme_is_a_front_door() {
    let text = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let n = text.lines().count();
    assert!(n <= 250, "README.md has {n} lines: move the rest to docs/");
    // the two commands, as they are
    assert!(text.contains("bash scripts/quickstart.sh") && text.contains("bash scripts/test.sh"));
}

/// What a walk-through's shell variables stand for when its specs are checked.
fn expand(body: &str, dir: &Path) -> String {
    let root = repo_root();
    let vars = [
        ("$DUCTILE_LOCAL", dir.display().to_string()),
        (
            "$DUCTILE_SMOLLM2",
            std::env::var("DUCTILE_SMOLLM2").expect("DUCTILE_SMOLLM2 (scripts/setup.sh --tests)"),
        ),
        ("$DUCTILE_TORCH_PYTHON", "/usr/bin/python3".to_string()),
        ("$PWD", root.display().to_string()),
    ];
    let mut s = body.to_string();
    for (k, v) in vars {
        s = s.replace(k, &v);
    }
    s
}

/// Job specs the pages show: ```toml blocks with a `name`, and the heredocs of ```sh blocks
/// (`cat > F <<EOF ... EOF`) that hold one.
fn specs(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (info, body) in blocks(text) {
        if info == "toml" {
            out.push(body);
        } else if info == "sh" || info == "bash" {
            let mut cur: Option<String> = None;
            for l in body.lines() {
                match &mut cur {
                    None if l.contains("<<EOF") || l.contains("<<'EOF'") => {
                        cur = Some(String::new())
                    }
                    Some(b) if l.trim() == "EOF" => {
                        out.push(std::mem::take(b));
                        cur = None;
                    }
                    Some(b) => {
                        b.push_str(l);
                        b.push('\n');
                    }
                    None => {}
                }
            }
        }
    }
    // a spec names its job and its sizes (other TOML blocks are agent or daemon settings)
    out.into_iter()
        .filter(|b| {
            b.lines().any(|l| l.starts_with("name = "))
                && b.lines().any(|l| l.starts_with("max = "))
        })
        .collect()
}

#[test]
fn docs_every_job_spec_shown_passes_dctl_submit_dry_run() {
    let dir = TempDir::new("docs-specs");
    let mut checked = 0;
    let mut shown: Vec<(PathBuf, PathBuf, String)> = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for (i, spec) in specs(&text).into_iter().enumerate() {
            let f = dir.path().join(format!(
                "{}-{i}.toml",
                page.file_stem().unwrap().to_string_lossy()
            ));
            std::fs::write(&f, expand(&spec, dir.path())).unwrap();
            shown.push((page.clone(), f, spec));
        }
    }
    // the example spec files, each pointing editors at the committed schema
    let root = repo_root();
    let mut examples = 0;
    for e in std::fs::read_dir(root.join("examples/jobs")).unwrap() {
        let f = e.unwrap().path();
        if f.extension().is_some_and(|x| x == "toml") {
            let spec = std::fs::read_to_string(&f).unwrap();
            let first = spec.lines().next().unwrap_or("");
            let target = first.strip_prefix("#:schema ").unwrap_or_else(|| {
                panic!("{}: its first line is not `#:schema PATH`", f.display())
            });
            assert!(
                f.parent().unwrap().join(target).is_file(),
                "{}: #:schema {target} names no file",
                f.display()
            );
            shown.push((f.clone(), f.clone(), spec));
            examples += 1;
        }
    }
    assert!(
        examples >= 3,
        "only {examples} example specs in examples/jobs"
    );
    for (page, f, spec) in shown {
        {
            let out = std::process::Command::new(bin("dctl"))
                .args(["submit", "--dry-run"])
                .arg(&f)
                .env_remove("DCTL_TOKEN")
                .env_remove("DCTL_ENDPOINT")
                .env("HOME", dir.path())
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}: a job spec it shows fails `dctl submit --dry-run`:\n{}\n{spec}",
                page.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            // shown with today's names: an older key's warning is not what a newcomer copies
            assert!(
                !String::from_utf8_lossy(&out.stderr).contains("warning:"),
                "{}: a job spec it shows uses an older key:\n{}\n{spec}",
                page.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(
                String::from_utf8_lossy(&out.stdout).contains("is valid (not submitted)"),
                "{}",
                String::from_utf8_lossy(&out.stdout)
            );
            checked += 1;
        }
    }
    assert!(checked >= 8, "only {checked} job specs found in the docs");
}

#[test]
fn docs_every_dctl_line_names_a_verb_and_flags_dctl_has() {
    let mut helps: std::collections::BTreeMap<String, String> = Default::default();
    let mut checked = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for (info, body) in blocks(&text) {
            if info != "sh" && info != "bash" {
                continue;
            }
            for l in body.lines() {
                let code = l.split(" #").next().unwrap_or("").trim();
                let Some(rest) = code.strip_prefix("dctl ") else {
                    continue;
                };
                let verb = rest.split_whitespace().next().unwrap_or("").to_string();
                let help = helps.entry(verb.clone()).or_insert_with(|| {
                    let out = std::process::Command::new(bin("dctl"))
                        .args([verb.as_str(), "--help"])
                        .output()
                        .unwrap();
                    assert!(
                        out.status.success(),
                        "{}: `{code}`: dctl has no verb {verb:?}",
                        page.display()
                    );
                    String::from_utf8_lossy(&out.stdout).into_owned()
                });
                for flag in rest
                    .split(|c: char| c.is_whitespace() || c == '[' || c == ']' || c == '|')
                    .filter(|w| w.starts_with('-') && w.len() > 1)
                {
                    let flag = flag.split('=').next().unwrap();
                    assert!(
                        help.contains(flag),
                        "{}: `{code}`: dctl {verb} has no flag {flag}",
                        page.display()
                    );
                }
                checked += 1;
            }
        }
    }
    assert!(checked >= 20, "only {checked} dctl lines found in the docs");
}
