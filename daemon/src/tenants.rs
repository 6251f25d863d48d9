//! Tenants: tokens of their own, each for the jobs whose names start with the tenant's prefix
//! (`tenants_file`, re-read on SIGHUP with the other tokens).
//!
//! ```toml
//! [[tenant]]
//! name = "vision"                # who, in refusals and logs
//! scope = "submit"               # submit (and stop, scale, logs) its own jobs; or "read"
//! jobs = "vision-"               # the job-name prefix it owns (default: NAME-)
//! max_slots = 16                 # the most slots its unfinished jobs may ask for (sum of max)
//! token_sha256 = "9f86d0…"       # the token's SHA-256, hex (`printf %s TOKEN | sha256sum`)
//! ```
//!
//! Only the token's digest is kept: the file leaks no token. A tenant sees and acts on its own
//! jobs only (status, events, series, checkpoints, spec, logs, plan, scale, stop; `dctl nodes`
//! shows it no other tenant's workers); the cluster's own calls (drain, the lighthouse's
//! view, `/metrics`) need the admin or read token, and every refusal names the scope it lacked.

use serde::Deserialize;
use sha2::{Digest, Sha256};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tenant {
    pub name: String,
    /// The job-name prefix it owns.
    pub jobs: String,
    /// May submit, stop and scale its jobs and read their logs (else: read them only).
    pub submit: bool,
    pub max_slots: Option<u32>,
    token_sha256: [u8; 32],
}

impl Tenant {
    /// Whether `token` is this tenant's (its digest compared in constant time).
    pub fn matches(&self, token: &str) -> bool {
        let d: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        d.iter()
            .zip(&self.token_sha256)
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
    }

    pub fn owns(&self, job: &str) -> bool {
        job.starts_with(&self.jobs)
    }

    /// What this token may do, for refusals: `tenant "vision" (submit, jobs vision-*)`.
    pub fn describe(&self) -> String {
        format!(
            "tenant {:?} ({}, jobs {}*)",
            self.name,
            if self.submit { "submit" } else { "read" },
            self.jobs
        )
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    tenant: Vec<Entry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    name: String,
    scope: String,
    jobs: Option<String>,
    max_slots: Option<u32>,
    token_sha256: String,
}

/// The tenants of `text` (the tenants file's), or what is wrong with it, naming the entry.
pub fn parse(text: &str) -> Result<Vec<Tenant>, String> {
    let f: File = toml::from_str(text).map_err(|e| e.to_string())?;
    let mut out: Vec<Tenant> = Vec::new();
    for (i, e) in f.tenant.into_iter().enumerate() {
        let at = format!("tenant {} ({:?})", i + 1, e.name);
        if e.name.is_empty()
            || !e
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(format!("{at}: name must be letters, digits, - or _"));
        }
        let submit = match e.scope.as_str() {
            "submit" => true,
            "read" => false,
            s => {
                return Err(format!(
                    "{at}: scope {s:?} is not \"submit\" or \"read\" (admin is the admin token's)"
                ))
            }
        };
        let jobs = e.jobs.unwrap_or_else(|| format!("{}-", e.name));
        if jobs.is_empty() {
            return Err(format!(
                "{at}: jobs (the job-name prefix) must not be empty: that would be every job"
            ));
        }
        let raw = e.token_sha256.trim().to_ascii_lowercase();
        let bytes: Vec<u8> = (0..raw.len())
            .step_by(2)
            .map(|j| {
                raw.get(j..j + 2)
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
            })
            .collect::<Option<_>>()
            .filter(|b: &Vec<u8>| b.len() == 32 && raw.len() == 64)
            .ok_or_else(|| {
                format!("{at}: token_sha256 must be 64 hex digits (printf %s TOKEN | sha256sum)")
            })?;
        if let Some(o) = out
            .iter()
            .find(|o| o.jobs.starts_with(&jobs) || jobs.starts_with(&o.jobs))
        {
            return Err(format!(
                "{at}: its jobs {jobs}* overlap tenant {:?}'s {}*: each job belongs to one tenant",
                o.name, o.jobs
            ));
        }
        let mut d = [0u8; 32];
        d.copy_from_slice(&bytes);
        if out.iter().any(|o| o.token_sha256 == d) {
            return Err(format!("{at}: its token is another tenant's"));
        }
        out.push(Tenant {
            name: e.name,
            jobs,
            submit,
            max_slots: e.max_slots,
            token_sha256: d,
        });
    }
    Ok(out)
}

/// The SHA-256 of `token`, hex (what a tenants file holds).
pub fn digest_hex(token: &str) -> String {
    Sha256::digest(token.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenants_file_parses_and_bad_ones_say_where() {
        let a = digest_hex("token-of-vision-0001");
        let b = digest_hex("token-of-speech-0001");
        let t = parse(&format!(
            "[[tenant]]\nname = \"vision\"\nscope = \"submit\"\nmax_slots = 8\ntoken_sha256 = \"{a}\"\n[[tenant]]\nname = \"speech\"\nscope = \"read\"\njobs = \"asr-\"\ntoken_sha256 = \"{b}\"\n"
        ))
        .unwrap();
        assert_eq!(t.len(), 2);
        assert!(t[0].matches("token-of-vision-0001") && !t[0].matches("token-of-speech-0001"));
        assert!(t[0].owns("vision-a") && !t[0].owns("visionary") && t[1].owns("asr-1"));
        assert!(t[0].submit && !t[1].submit);
        assert_eq!(t[0].max_slots, Some(8));
        for (text, says) in [
            (format!("[[tenant]]\nname = \"x\"\nscope = \"admin\"\ntoken_sha256 = \"{a}\"\n"), "scope"),
            ("[[tenant]]\nname = \"x\"\nscope = \"read\"\ntoken_sha256 = \"abc\"\n".to_string(), "64 hex"),
            (format!("[[tenant]]\nname = \"x\"\nscope = \"read\"\njobs = \"\"\ntoken_sha256 = \"{a}\"\n"), "every job"),
            (format!("[[tenant]]\nname = \"a\"\nscope = \"read\"\njobs = \"t-\"\ntoken_sha256 = \"{a}\"\n[[tenant]]\nname = \"b\"\nscope = \"read\"\njobs = \"t-x\"\ntoken_sha256 = \"{b}\"\n"), "overlap"),
            (format!("[[tenant]]\nname = \"a\"\nscope = \"read\"\ntoken_sha256 = \"{a}\"\n[[tenant]]\nname = \"b\"\nscope = \"read\"\ntoken_sha256 = \"{a}\"\n"), "another tenant"),
            (format!("[[tenant]]\nname = \"a\"\nscope = \"read\"\ntoken = \"x\"\ntoken_sha256 = \"{a}\"\n"), "unknown field"),
        ] {
            let e = parse(&text).unwrap_err();
            assert!(e.contains(says), "{text}: {e}");
        }
    }
}
