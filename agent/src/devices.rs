//! What a node offers: its NVIDIA GPUs (through `nvidia-smi`), else CPU slots.

use ductile_cluster::records::{Device, DeviceKind};

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
    (0..n)
        .map(|i| Device {
            kind: DeviceKind::Cpu,
            index: i,
            name: format!("cpu-slot-{i}"),
            memory_mb: None,
        })
        .collect()
}

/// The devices this node offers.
pub fn devices(use_gpus: bool, cpu: u32) -> Vec<Device> {
    if use_gpus {
        let g = detect_gpus();
        if !g.is_empty() {
            return g;
        }
    }
    cpu_slots(cpu)
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
}
