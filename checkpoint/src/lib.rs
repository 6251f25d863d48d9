//! Sharded checkpoints by URL (`s3://bucket/prefix` or `file:///path`, one code path).
//!
//! - [`format`]: safetensors shards, the JSON manifest, the commit record, CRC32C.
//! - [`plan`]: which rank writes which rows (balanced by bytes), which rank reads which chunks.
//! - [`bucket`]: objects by URL; multipart uploads with bounded concurrency and retries.
//! - [`save`]: write a shard, gather the reports, commit through a fenced etcd transaction.
//! - [`restore`]: find commits, read a manifest, fetch and verify chunks.
//! - [`hf`]: a Hugging Face model directory's weight files as a manifest, to load by plan.
//! - [`retention`]: list a URL's checkpoints; keep the last K, delete the rest and stale attempts.
//!
//! This crate does not link libtorch: tensors cross it as bytes, the worker copies them.

pub mod bucket;
pub mod dataset;
pub mod format;
pub mod hf;
pub mod plan;
pub mod restore;
pub mod retention;
#[cfg(test)]
mod roundtrip_tests;
pub mod save;
pub mod store;

pub use bucket::{Bucket, BucketError, UploadOptions};

use std::path::PathBuf;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UrlError {
    #[error("checkpoint URL {url:?}: {reason}")]
    Invalid { url: String, reason: &'static str },
}

/// Where a job's checkpoints are kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    S3 { bucket: String, prefix: String },
    File { path: PathBuf },
}

impl Location {
    pub fn parse(url: &str) -> Result<Location, UrlError> {
        let bad = |reason| UrlError::Invalid {
            url: url.to_string(),
            reason,
        };
        if let Some(rest) = url.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            let ok = (3..=63).contains(&bucket.len())
                && bucket
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
                && !bucket.starts_with(['-', '.'])
                && !bucket.ends_with(['-', '.']);
            if !ok {
                return Err(bad("the bucket must be 3-63 characters of [a-z0-9.-], starting and ending with a letter or digit"));
            }
            if prefix.split('/').any(|seg| seg == "." || seg == "..") {
                return Err(bad("the prefix must not contain . or .. segments"));
            }
            return Ok(Location::S3 {
                bucket: bucket.into(),
                prefix: prefix.trim_matches('/').into(),
            });
        }
        if let Some(path) = url.strip_prefix("file://") {
            if !path.starts_with('/') {
                return Err(bad("a file URL needs an absolute path (file:///...)"));
            }
            return Ok(Location::File {
                path: PathBuf::from(path),
            });
        }
        Err(bad("must start with s3:// or file://"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_s3_and_file_urls_and_refuses_the_rest() {
        assert_eq!(
            Location::parse("s3://bucket/jobs/tiny-gpt/").unwrap(),
            Location::S3 {
                bucket: "bucket".into(),
                prefix: "jobs/tiny-gpt".into()
            }
        );
        assert_eq!(
            Location::parse("s3://my.bucket").unwrap(),
            Location::S3 {
                bucket: "my.bucket".into(),
                prefix: "".into()
            }
        );
        assert_eq!(
            Location::parse("file:///var/lib/ductile/ckpt").unwrap(),
            Location::File {
                path: "/var/lib/ductile/ckpt".into()
            }
        );
        for bad in [
            "http://x/y",
            "s3://B/x",
            "s3://ab",
            "s3://bucket/../x",
            "file://relative/x",
            "",
        ] {
            assert!(Location::parse(bad).is_err(), "{bad} accepted");
        }
    }
}
