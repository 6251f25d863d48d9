//! The exactly-once ledger: every worker (run with `DUCTILE_LEDGER_DIR`) writes, per process,
//! one line per step with the sample indices it computed and one when it applied the step.
//! This module reads a directory of them back and says what is wrong, if anything.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Every line of every process's ledger in `dir`: (the process's file name, the line). A
/// process killed mid-write leaves a torn last line: it did nothing there, so it is skipped.
fn read(dir: &Path) -> Result<Vec<(String, serde_json::Value)>, String> {
    let files =
        std::fs::read_dir(dir).map_err(|e| format!("ledger directory {}: {e}", dir.display()))?;
    let mut out = Vec::new();
    for f in files.flatten() {
        let name = f.file_name().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(f.path()).map_err(|e| format!("ledger {name}: {e}"))?;
        // only the last line may be torn (one without its newline); any other that does not
        // parse is a ledger that says something this checker cannot read: an error
        let complete = text.ends_with('\n');
        let lines: Vec<&str> = text.lines().collect();
        for (i, l) in lines.iter().enumerate() {
            match serde_json::from_str(l) {
                Ok(v) => out.push((name.clone(), v)),
                Err(_) if i + 1 == lines.len() && !complete => {}
                Err(e) => return Err(format!("ledger {name} line {}: {e}: {l:?}", i + 1)),
            }
        }
    }
    Ok(out)
}

/// One step of a run, as its ledger tells it: the samples its ranks computed (in rank order)
/// and, from rank 0's line applying it, the learning rate it ran at and its loss. A step
/// computed in several generations (a failure between) is the last generation's.
#[derive(Clone, Debug, PartialEq)]
pub struct StepRecord {
    pub samples: Vec<u64>,
    pub lr: f64,
    pub loss: f64,
}

/// Every applied step of the run whose ledger is `dir`, by step.
pub fn steps(dir: &Path) -> Result<BTreeMap<u64, StepRecord>, String> {
    // (step, generation) → rank → samples; (step, generation) → rank 0's (lr, loss)
    let mut idx: BTreeMap<(u64, u64), BTreeMap<u64, Vec<u64>>> = BTreeMap::new();
    let mut applied: BTreeMap<(u64, u64), (f64, f64)> = BTreeMap::new();
    for (_, v) in read(dir)? {
        let (Some(g), Some(s), Some(r)) = (v["g"].as_u64(), v["s"].as_u64(), v["r"].as_u64())
        else {
            continue;
        };
        if let Some(list) = v["idx"].as_array() {
            idx.entry((s, g))
                .or_default()
                .entry(r)
                .or_default()
                .extend(list.iter().filter_map(|x| x.as_u64()));
        }
        if v["applied"] == true && r == 0 {
            let (Some(lr), Some(loss)) = (v["lr"].as_f64(), v["loss"].as_f64()) else {
                return Err(format!(
                    "step {s} generation {g}: an applied line without lr and loss: {v}"
                ));
            };
            applied.insert((s, g), (lr, loss));
        }
    }
    let mut out = BTreeMap::new();
    for ((s, g), (lr, loss)) in applied {
        let samples = idx
            .get(&(s, g))
            .map(|by_rank| by_rank.values().flatten().copied().collect())
            .ok_or_else(|| format!("step {s} generation {g} was applied, no rank computed it"))?;
        // later generations replace earlier ones (BTreeMap order: g ascending per step)
        out.insert(s, StepRecord { samples, lr, loss });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_torn_last_line_is_skipped() {
        let dir = std::env::temp_dir().join(format!("ductile-ledger-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("a"), "{\"s\":0}\n{\"s\":1}\n{\"s\":").unwrap();
        assert_eq!(read(&dir).unwrap().len(), 2);
        std::fs::write(dir.join("a"), "{\"s\":0}\n{\"s\n{\"s\":1}\n").unwrap();
        assert!(read(&dir).unwrap_err().contains("line 2"));
        std::fs::write(dir.join("a"), "{\"s\":0}\nnot json\n").unwrap();
        assert!(read(&dir).unwrap_err().contains("line 2"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Two members split round 0 (A: 0..4, B: 4..8); both enter fragment 0's exchange with 2
    /// samples trained; B leaves; A finishes its piece and commits round 0 keeping B's first 2;
    /// round 1 trains B's rest.
    #[test]
    fn a_departed_members_exchanged_samples_count_once_when_an_exchange_shows_them() {
        let dir = std::env::temp_dir().join(format!("ductile-ledger-kept-{}", std::process::id()));
        let run = |a: &str, b: &str| {
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("a"), a).unwrap();
            std::fs::write(dir.join("b"), b).unwrap();
            round_violations(&dir, 8, 8).0
        };
        let b = concat!(
            r#"{"g":1,"round":0,"r":1,"idx":[4,5]}"#,
            "\n",
            r#"{"g":1,"round":0,"r":1,"fragment":0,"done":2}"#,
            "\n"
        );
        let a = |exchanged: bool, round1: &str| {
            let mut a = String::new();
            a += "{\"g\":1,\"round\":0,\"r\":0,\"idx\":[0,1]}\n";
            a += "{\"g\":1,\"round\":0,\"r\":0,\"fragment\":0,\"done\":2}\n";
            if exchanged {
                a += "{\"g\":1,\"round\":0,\"r\":0,\"fragment\":0,\"exchanged\":true}\n";
            }
            a += "{\"g\":2,\"round\":0,\"r\":0,\"idx\":[2,3]}\n";
            a += "{\"g\":2,\"round\":0,\"r\":0,\"contrib\":true}\n";
            a += "{\"g\":2,\"round\":0,\"r\":0,\"committed\":true,\"kept\":[[1,1,2]]}\n";
            a += &format!("{{\"g\":2,\"round\":1,\"r\":0,\"idx\":{round1}}}\n");
            a += "{\"g\":2,\"round\":1,\"r\":0,\"contrib\":true}\n";
            a += "{\"g\":2,\"round\":1,\"r\":0,\"committed\":true,\"kept\":[]}\n";
            a
        };
        assert_eq!(run(&a(true, "[6,7]"), b), Vec::<String>::new());
        // the exchange never completed: B's samples were not in the weights
        let v = run(&a(false, "[6,7]"), b);
        assert!(
            v.iter().any(|e| e.contains("no completed exchange")),
            "{v:?}"
        );
        // B's exchanged samples trained again
        let v = run(&a(true, "[4,5,6,7]"), b);
        assert!(v.iter().any(|e| e.contains("not the run's 8")), "{v:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Round 0 committed in generation 1 by a, which went on; every holder then lost, a cold
    /// start in generation 3 trains round 0 anew (c): counted once, from the cold start on.
    #[test]
    fn a_diloco_cold_start_supersedes_what_earlier_generations_committed() {
        let dir = std::env::temp_dir().join(format!("ductile-ledger-cold-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let a = concat!(
            r#"{"g":1,"round":0,"r":0,"idx":[0,1]}"#,
            "\n",
            r#"{"g":1,"round":0,"r":0,"contrib":true}"#,
            "\n",
            r#"{"g":1,"round":0,"r":0,"committed":true,"kept":[]}"#,
            "\n",
            r#"{"g":2,"round":1,"r":0,"idx":[0]}"#,
            "\n",
        );
        let c = |cold: bool| {
            let mut t = String::new();
            if cold {
                t += "{\"g\":3,\"round\":0,\"r\":0,\"cold\":true}\n";
            }
            t + concat!(
                r#"{"g":3,"round":0,"r":0,"idx":[0,1]}"#,
                "\n",
                r#"{"g":3,"round":0,"r":0,"contrib":true}"#,
                "\n",
                r#"{"g":3,"round":0,"r":0,"committed":true,"kept":[]}"#,
                "\n",
            )
        };
        std::fs::write(dir.join("a"), a).unwrap();
        std::fs::write(dir.join("c"), c(true)).unwrap();
        let (v, rounds) = round_violations(&dir, 2, 2);
        assert!(v.is_empty(), "{v:?}");
        assert_eq!(rounds, vec![2]);
        std::fs::write(dir.join("c"), c(false)).unwrap();
        let (v, _) = round_violations(&dir, 2, 2);
        assert!(v.iter().any(|e| e.contains("went on")), "{v:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Two owners (processes a and b) in one generation; b pushes one update of samples 0..2.
    #[test]
    fn an_async_update_counts_when_every_surviving_owner_applied_it() {
        let dir = std::env::temp_dir().join(format!("ductile-ledger-async-{}", std::process::id()));
        let run = |a: &str, b: &str| {
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("a"), a).unwrap();
            std::fs::write(dir.join("b"), b).unwrap();
            async_violations(&dir, 2, 2, 2)
        };
        let push = "{\"g\":1,\"r\":1,\"agreed\":true,\"from\":null,\"restored\":null}\n{\"g\":1,\"r\":1,\"id\":1,\"idx\":[0,1],\"pushed\":true}\n";
        let dec = |owner: u32, applied: bool| {
            format!("{{\"g\":1,\"owner\":{owner},\"from\":1,\"id\":1,\"staleness\":0,\"applied\":{applied}}}\n")
        };
        let ok = run(&dec(0, true), &format!("{push}{}", dec(1, true)));
        assert!(ok.violations.is_empty(), "{ok:?}");
        // applied by one owner only: not atomic
        let v = run(&dec(0, true), push).violations;
        assert!(v.iter().any(|e| e.contains("but not by")), "{v:?}");
        // applied by one, dropped by the other
        let v = run(&dec(0, true), &format!("{push}{}", dec(1, false))).violations;
        assert!(v.iter().any(|e| e.contains("dropped by")), "{v:?}");
        // applied without a push line: the samples are unknown
        let agree = "{\"g\":1,\"r\":0,\"agreed\":true,\"from\":null,\"restored\":null}\n";
        let v = run(&format!("{agree}{}", dec(0, true)), &dec(1, true)).violations;
        assert!(v.iter().any(|e| e.contains("no worker wrote")), "{v:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Generation 1 (processes a, b) applies update 1 (samples 0, 1), snaps at step 1, applies
    /// update 2 (samples 2, 3) and is lost whole; generation 2 (c, d) restores step 1 and trains
    /// samples 2, 3 again: each sample counts once, update 2 of generation 1 not at all.
    #[test]
    fn an_async_restore_counts_the_updates_before_the_snap_it_restored() {
        let dir = std::env::temp_dir().join(format!("ductile-ledger-snap-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let line = |v: serde_json::Value| format!("{v}\n");
        let owner = |g: u64, o: u64, id: u64| {
            line(
                serde_json::json!({"g": g, "owner": o, "from": 0, "id": id, "staleness": 0, "applied": true}),
            )
        };
        let gen1 = |o: u64| {
            let mut t = line(
                serde_json::json!({"g": 1, "r": o, "agreed": true, "from": null, "restored": null}),
            );
            if o == 0 {
                t += &line(
                    serde_json::json!({"g": 1, "r": 0, "id": 1, "idx": [0, 1], "pushed": true}),
                );
            }
            t += &owner(1, o, 1);
            t += &line(serde_json::json!({"g": 1, "owner": o, "snap": 1}));
            t += &line(serde_json::json!({"g": 1, "r": o, "snapped": 1, "step": 1}));
            if o == 0 {
                t += &line(
                    serde_json::json!({"g": 1, "r": 0, "id": 2, "idx": [2, 3], "pushed": true}),
                );
            }
            t + &owner(1, o, 2)
        };
        let gen2 = |o: u64| {
            let mut t = line(
                serde_json::json!({"g": 2, "r": o, "agreed": true, "from": null, "restored": 1}),
            );
            if o == 0 {
                t += &line(
                    serde_json::json!({"g": 2, "r": 0, "id": 1, "idx": [2, 3], "pushed": true}),
                );
            }
            t + &owner(2, o, 1)
        };
        for (name, text) in [
            ("a", gen1(0)),
            ("b", gen1(1)),
            ("c", gen2(0)),
            ("d", gen2(1)),
        ] {
            std::fs::write(dir.join(name), text).unwrap();
        }
        let l = async_violations(&dir, 4, 4, 2);
        assert!(l.violations.is_empty(), "{l:?}");
        assert_eq!(l.restores, 1);
        // restored from no known snap: named
        std::fs::write(
            dir.join("c"),
            gen2(0).replace("\"restored\":1", "\"restored\":7"),
        )
        .unwrap();
        std::fs::write(
            dir.join("d"),
            gen2(1).replace("\"restored\":1", "\"restored\":7"),
        )
        .unwrap();
        let v = async_violations(&dir, 4, 4, 2).violations;
        assert!(v.iter().any(|e| e.contains("restored step 7")), "{v:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// Check that steps `0..steps` were each committed once, over `samples` samples with a global
/// batch of `batch`: every step applied, each from exactly `batch` samples, and every sample
/// used `⌊steps·batch / samples⌋` or one more times (exactly `steps·batch mod samples` of them
/// once more), so nothing was skipped or repeated.
///
/// A step may show as applied in two generations only when every process that applied it in
/// the earlier one never went on to a later generation (a killed rank that finished the
/// all-reduce before the abort reached it, or a cold start from a checkpoint behind it): its
/// state left with it, so the step was computed again over the same samples. The last
/// application is the one the job kept. Returns the violations found (empty: all is well).
pub fn violations(dir: &Path, steps: u64, samples: u64, batch: u64) -> Vec<String> {
    let mut out = Vec::new();
    // (generation, step) → indices; step → generation → processes that applied it
    let mut idx: BTreeMap<(u64, u64), Vec<u64>> = BTreeMap::new();
    let mut applied: BTreeMap<u64, BTreeMap<u64, BTreeSet<String>>> = BTreeMap::new();
    // process → the highest generation it wrote anything for
    let mut last_gen: BTreeMap<String, u64> = BTreeMap::new();
    let lines = match read(dir) {
        Ok(l) => l,
        Err(e) => return vec![e],
    };
    for (proc_name, v) in lines {
        let (Some(g), Some(s)) = (v["g"].as_u64(), v["s"].as_u64()) else {
            continue;
        };
        let e = last_gen.entry(proc_name.clone()).or_insert(g);
        *e = (*e).max(g);
        if v["applied"] == true {
            applied
                .entry(s)
                .or_default()
                .entry(g)
                .or_default()
                .insert(proc_name.clone());
        } else if let Some(a) = v["idx"].as_array() {
            idx.entry((g, s))
                .or_default()
                .extend(a.iter().filter_map(|x| x.as_u64()));
        }
    }
    let missing: Vec<u64> = (0..steps).filter(|s| !applied.contains_key(s)).collect();
    if !missing.is_empty() {
        out.push(format!("steps never committed: {missing:?}"));
    }
    let mut count: BTreeMap<u64, u64> = BTreeMap::new();
    for (s, gens) in applied.range(..steps) {
        let (&g, _) = gens.iter().next_back().unwrap();
        for (&earlier, procs) in gens.range(..g) {
            let went_on: Vec<&String> = procs
                .iter()
                .filter(|p| last_gen.get(*p).is_some_and(|l| *l > earlier))
                .collect();
            if !went_on.is_empty() {
                out.push(format!(
                    "step {s} was applied in generation {earlier} by {went_on:?}, which went on to later generations, and applied again in generation {g}"
                ));
            }
        }
        let used = idx.get(&(g, *s)).map(|v| v.as_slice()).unwrap_or(&[]);
        if used.len() as u64 != batch {
            out.push(format!(
                "step {s} (generation {g}): {} samples, not the global batch of {batch}",
                used.len()
            ));
        }
        for i in used {
            if *i >= samples {
                out.push(format!("step {s}: sample {i} is out of range"));
            }
            *count.entry(*i).or_default() += 1;
        }
    }
    let (full, rest) = (steps * batch / samples, steps * batch % samples);
    if (count.len() as u64) < samples.min(steps * batch) {
        out.push(format!(
            "{} of {samples} samples were never used",
            samples - count.len() as u64
        ));
    }
    let odd: Vec<(u64, u64)> = count
        .iter()
        .filter(|(_, c)| **c != full && **c != full + 1)
        .map(|(i, c)| (*i, *c))
        .take(10)
        .collect();
    if !odd.is_empty() {
        out.push(format!(
            "samples used neither {full} nor {} times (sample, count): {odd:?}",
            full + 1
        ));
    }
    let extra = count.values().filter(|c| **c == full + 1).count() as u64;
    if odd.is_empty() && extra != rest {
        out.push(format!(
            "{extra} samples used {} times, expected {rest}",
            full + 1
        ));
    }
    out
}

/// The DiLoCo ledger (`sync = "diloco"`): per process, one line per local step with the round
/// and the samples it trained, one `contrib` line when it enters a round's commit, one
/// `committed` line when the commit completed (with what the round kept of departed members'
/// pieces: `kept`, [generation, rank, samples]); streaming adds a line when a member enters a
/// fragment's exchange (`done`: the samples of its piece it had trained) and one when the
/// exchange completed (`exchanged`). Checks that rounds `0..` were committed without a gap and
/// that the samples of the committed rounds cover `total` positions over `samples` samples with
/// nothing skipped or repeated: each sample used `⌊total / samples⌋` or one more times. A
/// round's samples are those of the processes that entered its last commit (from every
/// generation they trained it in), and, for each `kept` entry, the first samples of the round
/// of the departed process that entered an exchange with that many trained, which must show as
/// completed in some process's ledger (not the committing members' word alone). A round
/// committed in two generations is allowed only when every process of the earlier commit never
/// went on to a later generation (its state left with it), or when a cold start (a `cold` line:
/// no member held the rounds' state; the seed or a checkpoint at that round) came in between:
/// what earlier generations committed of the rounds from the cold start's on is not counted.
/// Returns the violations and the samples each committed round trained.
pub fn round_violations(dir: &Path, total: u64, samples: u64) -> (Vec<String>, Vec<u64>) {
    let mut out = Vec::new();
    // (process, round) → samples; (generation, round) → processes that entered its commit;
    // round → generation → processes that completed it
    let mut idx: BTreeMap<(String, u64), Vec<u64>> = BTreeMap::new();
    let mut contrib: BTreeMap<(u64, u64), BTreeSet<String>> = BTreeMap::new();
    let mut committed: BTreeMap<u64, BTreeMap<u64, BTreeSet<String>>> = BTreeMap::new();
    let mut last_gen: BTreeMap<String, u64> = BTreeMap::new();
    // (generation, round) → the `kept` each committing process wrote; (generation, round,
    // rank, samples done) → (process, fragment) entering an exchange; (generation, round,
    // fragment) of the exchanges that completed
    let mut kept: BTreeMap<(u64, u64), BTreeSet<Vec<[u64; 3]>>> = BTreeMap::new();
    type Entry = (u64, u64, u64, u64);
    let mut entered: BTreeMap<Entry, Vec<(String, u64)>> = BTreeMap::new();
    let mut exchanged: BTreeSet<(u64, u64, u64)> = BTreeSet::new();
    // (generation, round) of the cold starts
    let mut cold: Vec<(u64, u64)> = Vec::new();
    let lines = match read(dir) {
        Ok(l) => l,
        Err(e) => return (vec![e], vec![]),
    };
    for (p, v) in lines {
        let (Some(g), Some(r)) = (v["g"].as_u64(), v["round"].as_u64()) else {
            continue;
        };
        let e = last_gen.entry(p.clone()).or_insert(g);
        *e = (*e).max(g);
        if v["cold"] == true {
            cold.push((g, r));
        } else if v["committed"] == true {
            committed
                .entry(r)
                .or_default()
                .entry(g)
                .or_default()
                .insert(p.clone());
            let k: Vec<[u64; 3]> = serde_json::from_value(v["kept"].clone()).unwrap_or_default();
            kept.entry((g, r)).or_default().insert(k);
        } else if v["exchanged"] == true {
            if let Some(f) = v["fragment"].as_u64() {
                exchanged.insert((g, r, f));
            }
        } else if let (Some(f), Some(done), Some(rank)) =
            (v["fragment"].as_u64(), v["done"].as_u64(), v["r"].as_u64())
        {
            entered
                .entry((g, r, rank, done))
                .or_default()
                .push((p.clone(), f));
        } else if v["contrib"] == true {
            contrib.entry((g, r)).or_default().insert(p.clone());
        } else if let Some(a) = v["idx"].as_array() {
            idx.entry((p.clone(), r))
                .or_default()
                .extend(a.iter().filter_map(|x| x.as_u64()));
        }
    }
    // a cold start in generation gc at round rc: the commits of rounds from rc on made before
    // gc went with their members
    for (r, gens) in committed.iter_mut() {
        gens.retain(|g, _| !cold.iter().any(|(gc, rc)| g < gc && r >= rc));
    }
    committed.retain(|_, gens| !gens.is_empty());
    let rounds = committed.keys().next_back().map(|r| r + 1).unwrap_or(0);
    let missing: Vec<u64> = (0..rounds).filter(|r| !committed.contains_key(r)).collect();
    if !missing.is_empty() {
        out.push(format!("rounds never committed: {missing:?}"));
    }
    let mut count: BTreeMap<u64, u64> = BTreeMap::new();
    let mut used_total = 0u64;
    let mut per_round = vec![0u64; rounds as usize];
    for (r, gens) in &committed {
        let (&g, _) = gens.iter().next_back().unwrap();
        for (&earlier, procs) in gens.range(..g) {
            let went_on: Vec<&String> = procs
                .iter()
                .filter(|p| last_gen.get(*p).is_some_and(|l| *l > earlier))
                .collect();
            if !went_on.is_empty() {
                out.push(format!(
                    "round {r} was committed in generation {earlier} by {went_on:?}, which went on, and again in generation {g}"
                ));
            }
        }
        let Some(procs) = contrib.get(&(g, *r)) else {
            out.push(format!(
                "round {r}: committed in generation {g}, which nobody entered"
            ));
            continue;
        };
        // the committing processes' samples, then the departed ones' kept part
        let mut trained: Vec<&[u64]> = procs
            .iter()
            .map(|p| {
                idx.get(&(p.clone(), *r))
                    .map(|v| v.as_slice())
                    .unwrap_or(&[])
            })
            .collect();
        let said = kept.get(&(g, *r)).cloned().unwrap_or_default();
        if said.len() > 1 {
            out.push(format!(
                "round {r}: the members that committed it disagree on what it kept: {said:?}"
            ));
        }
        for [kg, kr, n] in said.into_iter().next().unwrap_or_default() {
            let by = entered.get(&(kg, *r, kr, n)).and_then(|v| {
                v.iter()
                    .find(|(_, f)| exchanged.contains(&(kg, *r, *f)))
                    .map(|(p, _)| p)
            });
            let Some(p) = by else {
                out.push(format!(
                    "round {r} kept {n} samples of rank {kr} of generation {kg}, but no completed exchange shows that member had trained them"
                ));
                continue;
            };
            if procs.contains(p) {
                out.push(format!(
                    "round {r} kept samples of {p}, which also committed it"
                ));
                continue;
            }
            let all = idx
                .get(&(p.clone(), *r))
                .map(|v| v.as_slice())
                .unwrap_or(&[]);
            if (all.len() as u64) < n {
                out.push(format!(
                    "round {r} kept {n} samples of {p}, which trained {} in it",
                    all.len()
                ));
                continue;
            }
            trained.push(&all[..n as usize]);
        }
        for part in trained {
            for i in part {
                if *i >= samples {
                    out.push(format!("round {r}: sample {i} is out of range"));
                }
                *count.entry(*i).or_default() += 1;
                used_total += 1;
                per_round[*r as usize] += 1;
            }
        }
    }
    if used_total != total {
        out.push(format!(
            "the committed rounds trained {used_total} samples, not the run's {total}"
        ));
    }
    out.extend(uneven(&count, total, samples));
    (out, per_round)
}

/// What the async ledger (`sync = "async"`) shows. It does not take the dispenser's word:
/// each worker writes one line per update it pushes (its samples) and one per generation's
/// agreement (where the state came from: a generation's members, or a checkpoint's step); each
/// owner writes one per decision it applied or dropped (`owner`, `from`, `id`, `staleness`,
/// `applied`) and one per snap (a checkpoint's state, or the run's end), which the workers
/// number alike (`snapped`, with the step saved).
#[derive(Debug, Default)]
pub struct AsyncLedger {
    pub violations: Vec<String>,
    /// Updates applied and dropped, per (generation, pushing rank), in the final state's
    /// lineage.
    pub applied: BTreeMap<(u64, u64), u64>,
    pub dropped: BTreeMap<(u64, u64), u64>,
    pub max_staleness: u64,
    /// Decisions an owner learned only in the next generation's agreement.
    pub recovered: u64,
    /// Generations whose state came from a checkpoint.
    pub restores: u64,
}

/// Check an async run. The final state's lineage runs back from the last generation: each
/// generation's state came from the members of an earlier one (then the updates those members
/// applied count), or from a checkpoint (then the updates the owners of the generation that
/// took it applied before that snap count, and nothing after it), or from the seed. In each,
/// an update that counts must be applied by every owner that carried the state on (a decision
/// is atomic) and dropped by none. Every applied update's staleness is at most `bound`, and the
/// applied updates' samples cover `total` positions over `samples` samples with nothing skipped
/// or repeated (each sample used `⌊total / samples⌋` or one more times), so a dropped update's
/// samples, and those of updates a full loss took back to a checkpoint, were trained again.
pub fn async_violations(dir: &Path, total: u64, samples: u64, bound: u64) -> AsyncLedger {
    let mut out = AsyncLedger::default();
    let lines = match read(dir) {
        Ok(l) => l,
        Err(e) => {
            out.violations.push(e);
            return out;
        }
    };
    // (generation, rank, id) of an update
    type Update = (u64, u64, u64);
    let mut pushed: BTreeMap<Update, Vec<u64>> = BTreeMap::new();
    // update → owner process → (applied, staleness, its line number in that process's file)
    let mut decided: BTreeMap<Update, BTreeMap<String, (bool, u64, usize)>> = BTreeMap::new();
    // (generation, process) → line numbers of its snaps, in order
    let mut snaps: BTreeMap<(u64, String), Vec<usize>> = BTreeMap::new();
    // step → (generation, snap number) of the workers' `snapped` lines
    let mut snapped: BTreeMap<u64, BTreeSet<(u64, u64)>> = BTreeMap::new();
    // generation → (from, restored step, the generation that took it) of its agreement
    type Origin = (Option<u64>, Option<u64>, Option<u64>);
    let mut agreed: BTreeMap<u64, BTreeSet<Origin>> = BTreeMap::new();
    let mut procs: BTreeMap<u64, BTreeSet<String>> = BTreeMap::new();
    let mut at: BTreeMap<String, usize> = BTreeMap::new();
    for (p, v) in lines {
        let n = {
            let n = at.entry(p.clone()).or_default();
            *n += 1;
            *n
        };
        let Some(g) = v["g"].as_u64() else { continue };
        procs.entry(g).or_default().insert(p.clone());
        if v["pushed"] == true {
            let (Some(r), Some(id), Some(idx)) =
                (v["r"].as_u64(), v["id"].as_u64(), v["idx"].as_array())
            else {
                out.violations
                    .push(format!("{p}: a push line without r, id or idx: {v}"));
                continue;
            };
            let idx = idx.iter().filter_map(|x| x.as_u64()).collect();
            if pushed.insert((g, r, id), idx).is_some() {
                out.violations.push(format!(
                    "{p}: update {id} of rank {r} in generation {g} pushed twice"
                ));
            }
        } else if v["agreed"] == true {
            let origin = (
                v["from"].as_u64(),
                v["restored"].as_u64(),
                v["restored_from"].as_u64(),
            );
            agreed.entry(g).or_default().insert(origin);
        } else if let (Some(k), Some(step)) = (v["snapped"].as_u64(), v["step"].as_u64()) {
            snapped.entry(step).or_default().insert((g, k));
        } else if v["snap"].is_u64() {
            snaps.entry((g, p.clone())).or_default().push(n);
        } else if let (Some(_), Some(from), Some(id), Some(sigma)) = (
            v["owner"].as_u64(),
            v["from"].as_u64(),
            v["id"].as_u64(),
            v["staleness"].as_u64(),
        ) {
            if v["recovered"] == true {
                out.recovered += 1;
            }
            decided
                .entry((g, from, id))
                .or_default()
                .insert(p.clone(), (v["applied"] == true, sigma, n));
        }
    }
    // the lineage, from the last generation back: (generation, the processes that carried its
    // state on, the snap it was cut at)
    let Some(&last) = agreed.keys().next_back() else {
        out.violations
            .push("no generation's agreement in the ledger".into());
        return out;
    };
    let mut lineage: Vec<(u64, Vec<String>, Option<u64>)> = Vec::new();
    let (mut cur, mut carried, mut cut): (u64, Vec<String>, Option<u64>) =
        (last, procs[&last].iter().cloned().collect(), None);
    loop {
        lineage.push((cur, carried.clone(), cut));
        let Some(how) = agreed.get(&cur) else {
            out.violations
                .push(format!("generation {cur}: no agreement line"));
            break;
        };
        if how.len() > 1 {
            out.violations.push(format!(
                "generation {cur}: members disagree on where its state came from: {how:?}"
            ));
        }
        let (from, restored, taken_in) = *how.iter().next().unwrap();
        let (next, next_cut) = match (restored, from) {
            (Some(step), _) => {
                out.restores += 1;
                // the snap that took the checkpoint: in the generation the checkpoint names
                // (the same step may have been snapped in a lineage a full loss abandoned)
                let at: Option<Vec<&(u64, u64)>> = snapped.get(&step).map(|s| {
                    s.iter()
                        .filter(|(g, _)| taken_in.is_none_or(|t| t == *g))
                        .collect()
                });
                match at {
                    Some(s) if s.len() == 1 => (s[0].0, Some(s[0].1)),
                    other => {
                        out.violations.push(format!(
                            "generation {cur} restored step {step}, taken at {other:?} snaps"
                        ));
                        break;
                    }
                }
            }
            (None, Some(p)) => (p, None),
            (None, None) => break,
        };
        if next >= cur {
            out.violations
                .push(format!("generation {cur} took its state from {next}"));
            break;
        }
        // the owners of `next` that carried its state on: those in `cur` (from members) or
        // those that took the snap (a checkpoint)
        let none = BTreeSet::new();
        let of_next = procs.get(&next).unwrap_or(&none);
        carried = match next_cut {
            None => of_next
                .iter()
                .filter(|p| procs.get(&cur).is_some_and(|c| c.contains(*p)))
                .cloned()
                .collect(),
            Some(k) => of_next
                .iter()
                .filter(|p| {
                    snaps
                        .get(&(next, (*p).clone()))
                        .is_some_and(|s| s.len() as u64 >= k)
                })
                .cloned()
                .collect(),
        };
        (cur, cut) = (next, next_cut);
    }
    let mut count: BTreeMap<u64, u64> = BTreeMap::new();
    let mut used = 0u64;
    for (g, carriers, cut) in &lineage {
        // the line before which an owner's decisions count
        let limit = |p: &String| -> usize {
            match cut {
                None => usize::MAX,
                Some(k) => snaps
                    .get(&(*g, p.clone()))
                    .and_then(|s| s.get(*k as usize - 1))
                    .copied()
                    .unwrap_or(0),
            }
        };
        for ((_, r, id), by) in decided.range((*g, 0, 0)..(*g + 1, 0, 0)) {
            let applied: Vec<&String> = carriers
                .iter()
                .filter(|p| by.get(*p).is_some_and(|(a, _, n)| *a && *n < limit(p)))
                .collect();
            if applied.is_empty() {
                let seen = carriers
                    .iter()
                    .any(|p| by.get(p).is_some_and(|(_, _, n)| *n < limit(p)));
                if seen {
                    *out.dropped.entry((*g, *r)).or_default() += 1;
                }
                continue;
            }
            let missing: Vec<&String> = carriers
                .iter()
                .filter(|p| !by.get(*p).is_some_and(|(a, _, n)| *a && *n < limit(p)))
                .collect();
            let dropped: Vec<&String> = by
                .iter()
                .filter(|(_, (a, _, _))| !a)
                .map(|(p, _)| p)
                .collect();
            if !missing.is_empty() || !dropped.is_empty() {
                out.violations.push(format!(
                    "update {id} of rank {r} (generation {g}) was applied by {applied:?} but not by {missing:?}, dropped by {dropped:?}"
                ));
            }
            *out.applied.entry((*g, *r)).or_default() += 1;
            let sigma = by.values().map(|(_, s, _)| *s).max().unwrap_or(0);
            out.max_staleness = out.max_staleness.max(sigma);
            if sigma > bound {
                out.violations.push(format!(
                    "update {id} of rank {r} (generation {g}) was applied at staleness {sigma} (bound {bound})"
                ));
            }
            let Some(idx) = pushed.get(&(*g, *r, *id)) else {
                out.violations.push(format!(
                    "update {id} of rank {r} (generation {g}) was applied, but no worker wrote that it pushed it"
                ));
                continue;
            };
            for i in idx {
                *count.entry(*i).or_default() += 1;
                used += 1;
            }
        }
    }
    if used != total {
        out.violations.push(format!(
            "the applied updates trained {used} samples, not the run's {total}"
        ));
    }
    out.violations.extend(uneven(&count, total, samples));
    out
}

/// `total` positions over `samples` samples, each used `count` times: every sample must be
/// used `⌊total / samples⌋` or one more times (up to ten that are not, named).
fn uneven(count: &BTreeMap<u64, u64>, total: u64, samples: u64) -> Option<String> {
    let full = total / samples;
    let odd: Vec<(u64, u64)> = (0..samples)
        .map(|i| (i, count.get(&i).copied().unwrap_or(0)))
        .filter(|(_, c)| *c != full && *c != full + 1)
        .take(10)
        .collect();
    (!odd.is_empty()).then(|| {
        format!(
            "samples used neither {full} nor {} times (sample, count): {odd:?}",
            full + 1
        )
    })
}
