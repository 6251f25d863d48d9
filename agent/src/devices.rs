//! What a node offers: its NVIDIA GPUs (through `nvidia-smi`), else CPU slots.

use ductile_cluster::records::{Device, DeviceKind};

use crate::config::Gpus;

/// GPUs as `nvidia-smi` reports them; empty when it is absent or finds none.
pub fn detect_gpus() -> Vec<Device> {
    let out = std::process::Command::new("nvidia-smi")
        .args([
            "--query-gpu=index,name,memory.total",
            "--format=csv,noheader,nounits",
        ])
        .stderr(std::process::Stdio::null())
        .output();
    match out {
        Ok(o) if o.status.success() => parse_nvidia_smi(&String::from_utf8_lossy(&o.stdout)),
        _ => Vec::new(),
    }
}

pub fn parse_nvidia_smi(text: &str) -> Vec<Device> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(',').map(|s| s.trim()).collect();
            if f.len() < 3 {
                return None;
            }
            Some(Device {
                kind: DeviceKind::Gpu,
                index: f[0].parse().ok()?,
                name: f[1].to_string(),
                memory_mb: f[2].parse().ok(),
            })
        })
        .collect()
}

pub fn cpu_slots(n: u32) -> Vec<Device> {
    // each slot's share of the node's memory (what a job's state is checked against at submit)
    let share = total_memory_mb().map(|m| m / n.max(1) as u64);
    (0..n)
        .map(|i| Device {
            kind: DeviceKind::Cpu,
            index: i,
            name: format!("cpu-slot-{i}"),
            memory_mb: share,
        })
        .collect()
}

/// The node's memory in MiB (`MemTotal` of /proc/meminfo); None where it cannot be read.
fn total_memory_mb() -> Option<u64> {
    std::fs::read_to_string("/proc/meminfo")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb / 1024)
}

/// The devices this node offers: one slot per GPU times `per_gpu`, else `cpu` CPU slots.
pub fn devices(gpus: &Gpus, per_gpu: u32, cpu: u32) -> Vec<Device> {
    let g = match gpus {
        Gpus::Off => Vec::new(),
        Gpus::Auto => detect_gpus(),
        Gpus::List(want) => {
            let found = detect_gpus();
            want.iter()
                .map(|i| {
                    found
                        .iter()
                        .find(|d| d.index == *i)
                        .cloned()
                        .unwrap_or(Device {
                            kind: DeviceKind::Gpu,
                            index: *i,
                            name: format!("gpu-{i} (not listed by nvidia-smi)"),
                            memory_mb: None,
                        })
                })
                .collect()
        }
    };
    if g.is_empty() {
        return cpu_slots(cpu);
    }
    share(g, per_gpu)
}

/// Each GPU offered `per_gpu` times (slots that share it).
pub fn share(gpus: Vec<Device>, per_gpu: u32) -> Vec<Device> {
    if per_gpu <= 1 {
        return gpus;
    }
    gpus.into_iter()
        .flat_map(|d| {
            (0..per_gpu).map(move |k| Device {
                name: format!("{} (shared {}/{per_gpu})", d.name, k + 1),
                ..d.clone()
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_nvidia_smi_csv() {
        let d = super::parse_nvidia_smi(
            "0, NVIDIA H100 80GB HBM3, 81559\n1, NVIDIA H100 80GB HBM3, 81559\n",
        );
        assert_eq!(d.len(), 2);
        assert_eq!((d[1].index, d[1].memory_mb), (1, Some(81559)));
        assert!(super::parse_nvidia_smi("garbage").is_empty());
    }

    #[test]
    fn listed_gpus_are_offered_and_shared() {
        use super::*;
        // indices nvidia-smi does not list are offered as given (their workers fail clearly)
        let d = devices(&Gpus::List(vec![7]), 3, 2);
        assert_eq!(d.len(), 3);
        assert!(d.iter().all(|x| x.kind == DeviceKind::Gpu && x.index == 7));
        assert!(d[2].name.contains("shared 3/3"), "{}", d[2].name);
        assert_eq!(devices(&Gpus::Off, 3, 2).len(), 2);
        assert!(devices(&Gpus::Off, 3, 2)
            .iter()
            .all(|x| x.kind == DeviceKind::Cpu));
        assert!(Gpus::parse("0,x").is_err() && Gpus::parse("1,1").is_err());
        assert_eq!(Gpus::parse(" 0, 2").unwrap(), Gpus::List(vec![0, 2]));
    }
}
