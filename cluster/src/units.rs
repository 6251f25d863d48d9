//! Durations and sizes in a job spec: a key keeps its unit in its name (`grace_s`,
//! `part_size_mib`) and takes a number in that unit, or a string that says its unit
//! (`"30s"`, `"5m"`, `"1h 30m"` by `humantime`; `"64MiB"`, `"1GiB"`, `"500MB"` by `bytesize`).
//! Specs are stored with the number, so what a job reads back is one form.

use schemars::{json_schema, Schema, SchemaGenerator};
use serde::de::{self, Deserializer};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(untagged)]
enum Raw {
    Int(u64),
    Float(f64),
    Text(String),
}

fn whole(v: f64, unit: &str) -> Result<u64, String> {
    if v.is_finite() && v >= 0.0 && v.fract() == 0.0 && v <= u64::MAX as f64 {
        Ok(v as u64)
    } else {
        Err(format!("{v} is not a whole number of {unit}"))
    }
}

/// Seconds: a number, or a duration that is whole seconds (`"90s"`, `"5m"`, `"1h 30m"`).
fn seconds(raw: Raw) -> Result<u64, String> {
    match raw {
        Raw::Int(n) => Ok(n),
        Raw::Float(v) => whole(v, "seconds"),
        Raw::Text(t) => {
            let d = humantime::parse_duration(t.trim()).map_err(|e| {
                format!("{t:?} is not a duration ({e}): write a number of seconds or e.g. \"30s\", \"5m\", \"1h 30m\"")
            })?;
            if d.subsec_nanos() != 0 {
                return Err(format!("{t:?} is not a whole number of seconds"));
            }
            Ok(d.as_secs())
        }
    }
}

/// A size in `unit` bytes (1024 for KiB, 1 << 20 for MiB): a number of them, or a size that
/// says its unit and is a whole number of them (`"64MiB"`, `"1GiB"`).
fn size(raw: Raw, unit: u64, unit_name: &str) -> Result<f64, String> {
    match raw {
        Raw::Int(n) => Ok(n as f64),
        Raw::Float(v) if v.is_finite() && v >= 0.0 => Ok(v),
        Raw::Float(v) => Err(format!("{v} is not a size")),
        Raw::Text(t) => {
            let trimmed = t.trim();
            if trimmed.chars().all(|c| c.is_ascii_digit() || c == '.') {
                return Err(format!(
                    "{t:?} says no unit: write a number of {unit_name} or a size such as \"64MiB\""
                ));
            }
            let b: bytesize::ByteSize = trimmed.parse().map_err(|e: String| {
                format!("{t:?} is not a size ({e}): write a number of {unit_name} or e.g. \"64MiB\", \"1GiB\"")
            })?;
            Ok(b.as_u64() as f64 / unit as f64)
        }
    }
}

fn size_whole(raw: Raw, unit: u64, unit_name: &str) -> Result<u64, String> {
    let v = size(raw, unit, unit_name)?;
    whole(v, unit_name)
}

pub fn secs<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    seconds(Raw::deserialize(d)?).map_err(de::Error::custom)
}

pub fn opt_secs<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    Option::<Raw>::deserialize(d)?
        .map(seconds)
        .transpose()
        .map_err(de::Error::custom)
}

pub fn mib<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    size_whole(Raw::deserialize(d)?, 1 << 20, "MiB").map_err(de::Error::custom)
}

pub fn opt_mib_u32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    Option::<Raw>::deserialize(d)?
        .map(|r| size_whole(r, 1 << 20, "MiB").and_then(fit_u32))
        .transpose()
        .map_err(de::Error::custom)
}

pub fn opt_kib_u32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    Option::<Raw>::deserialize(d)?
        .map(|r| size_whole(r, 1 << 10, "KiB").and_then(fit_u32))
        .transpose()
        .map_err(de::Error::custom)
}

pub fn opt_gib_f64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    Option::<Raw>::deserialize(d)?
        .map(|r| size(r, 1 << 30, "GiB"))
        .transpose()
        .map_err(de::Error::custom)
}

fn fit_u32(v: u64) -> Result<u32, String> {
    u32::try_from(v).map_err(|_| format!("{v} is too large"))
}

/// The schema of a key in seconds.
pub fn secs_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "anyOf": [
            { "type": "integer", "minimum": 0 },
            { "type": "string", "pattern": "^\\s*[0-9]+\\s*[a-zA-Z]+(\\s*[0-9]+\\s*[a-zA-Z]+)*\\s*$" }
        ]
    })
}

/// The schema of a key in a size unit (the key's name says which).
pub fn size_schema(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "anyOf": [
            { "type": "number", "minimum": 0 },
            { "type": "string", "pattern": "^\\s*[0-9.]+\\s*[a-zA-Z]+\\s*$" }
        ]
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize, Debug)]
    struct T {
        #[serde(default, deserialize_with = "opt_secs")]
        t: Option<u64>,
        #[serde(default, deserialize_with = "opt_mib_u32")]
        m: Option<u32>,
        #[serde(default, deserialize_with = "opt_kib_u32")]
        k: Option<u32>,
        #[serde(default, deserialize_with = "opt_gib_f64")]
        g: Option<f64>,
    }

    fn parse(s: &str) -> Result<T, String> {
        toml::from_str(s).map_err(|e| e.message().to_string())
    }

    #[test]
    fn numbers_keep_the_key_s_unit_and_strings_say_theirs() {
        let t = parse("t = 30\nm = 25\nk = 64\ng = 1.5").unwrap();
        assert_eq!(
            (t.t, t.m, t.k, t.g),
            (Some(30), Some(25), Some(64), Some(1.5))
        );
        let t = parse("t = \"1h 30m\"\nm = \"1GiB\"\nk = \"64MiB\"\ng = \"512MiB\"").unwrap();
        assert_eq!(
            (t.t, t.m, t.k, t.g),
            (Some(5400), Some(1024), Some(65536), Some(0.5))
        );
        assert_eq!(parse("t = \"90s\"").unwrap().t, Some(90));
        assert_eq!(parse("").unwrap().t, None);
    }

    #[test]
    fn a_size_or_duration_that_is_not_whole_or_says_no_unit_is_refused_by_name() {
        let e = parse("t = \"1500ms\"").unwrap_err();
        assert!(e.contains("not a whole number of seconds"), "{e}");
        let e = parse("t = \"thirty\"").unwrap_err();
        assert!(e.contains("is not a duration"), "{e}");
        let e = parse("m = \"64\"").unwrap_err();
        assert!(e.contains("says no unit"), "{e}");
        let e = parse("m = \"1500KB\"").unwrap_err();
        assert!(e.contains("not a whole number of MiB"), "{e}");
        let e = parse("m = \"64 parsecs\"").unwrap_err();
        assert!(e.contains("is not a size"), "{e}");
        let e = parse("k = \"8TiB\"").unwrap_err();
        assert!(e.contains("too large"), "{e}");
    }
}
