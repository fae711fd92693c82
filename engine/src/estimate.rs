//! Each stage's plan before anything runs ([`nemo_dag_op::Plan`]), and whether it fits the
//! machine that would run it.
//!
//! Plans are made in the graph's order, so each stage plans with what its upstream stages
//! declare they will hand it: `sft` sizes itself by the model its `pretrain` input will
//! produce, long before that model exists.

use crate::manifest::{Input, Manifest, Stage};
use nemo_dag_op::{DeclError, Device, Estimate, Plan, Upstream, plan::bytes};
use std::collections::BTreeMap;

/// Every stage's plan, by stage name; or the first stage whose op refuses its declaration
/// against what the stages above will hand it ([`nemo_dag_op::Op::check_upstream`]), with why.
/// Each stage's params are parsed once for both.
pub fn plans(manifest: &Manifest) -> Result<BTreeMap<String, Plan>, (String, DeclError)> {
    let mut plans: BTreeMap<String, Plan> = BTreeMap::new();
    for name in &manifest.order {
        let stage = &manifest.stages[name];
        let upstream = upstream(stage, &plans);
        // The manifest checked every stage when it built it: a failure here is not reachable,
        // and a stage without a plan is only a stage nobody estimates.
        let decl = stage.decl();
        let plan = match stage.op.check(&decl) {
            Ok(checked) => {
                stage
                    .op
                    .check_upstream(&checked, &upstream)
                    .map_err(|e| (name.clone(), e))?;
                stage.op.plan(&checked, &upstream, &decl)
            }
            Err(_) => Plan::default(),
        };
        plans.insert(name.clone(), plan);
    }
    Ok(plans)
}

/// What `stage`'s inputs will be, from the plans of the stages above it and the files the
/// manifest names.
fn upstream<'a>(stage: &'a Stage, plans: &BTreeMap<String, Plan>) -> Upstream<'a> {
    let mut upstream = Upstream::default();
    for (input, source) in &stage.inputs {
        match source {
            Input::Stage { stage: up, .. } => {
                if let Some(plan) = plans.get(up) {
                    upstream.stages.insert(input, plan.facts.clone());
                }
            }
            Input::File { path, .. } => {
                upstream.files.insert(input, path);
            }
        }
    }
    upstream
}

/// The memory a stage on `device` can have on this machine, and what it is (`24.0 GiB of RAM`).
/// `None` when it cannot be told (a GPU's memory is not probed yet: the ops train on the CPU).
pub fn capacity(device: Option<&str>) -> Option<(u64, String)> {
    match device.map(Device::parse) {
        None | Some(Ok(Device::Cpu | Device::Auto)) => {
            let ram = machine_memory()?;
            Some((ram, format!("{} of RAM", bytes(ram))))
        }
        _ => None,
    }
}

/// Why a stage's estimate does not fit `capacity`, as a message and what to do; `None` when
/// it fits.
pub fn does_not_fit(
    stage: &str,
    estimate: &Estimate,
    capacity: u64,
    what: &str,
) -> Option<(String, String)> {
    if estimate.certain_bytes() <= capacity {
        return None;
    }
    Some((
        format!(
            "stage `{stage}` needs an estimated {} of memory, more than this machine has ({what}): {estimate}",
            bytes(estimate.certain_bytes())
        ),
        "run a smaller variant (`-c tiny`), lower the stage's micro_batch or model size, or send it to a cluster profile with `--batch PROFILE` (docs/scale.md)".to_string(),
    ))
}

/// Why a launched stage's per-GPU estimate does not fit GPUs of `capacity` bytes (a Slurm
/// profile's `gpu_memory`, named by `profile`), as a message and what to do; `None` when what
/// it needs for certain fits, or when its estimate is not per GPU.
pub fn does_not_fit_gpu(
    stage: &str,
    estimate: &Estimate,
    capacity: u64,
    profile: &str,
) -> Option<(String, String)> {
    if !estimate.per_gpu() || estimate.certain_bytes() <= capacity {
        return None;
    }
    Some((
        format!(
            "stage `{stage}` needs at least {} on each GPU, more than profile `{profile}`'s \
             GPUs have (gpu_memory {}): {estimate}",
            bytes(estimate.certain_bytes()),
            bytes(capacity)
        ),
        "spread it over more GPUs (resources.nodes), split the model further \
         (params.parallel: tp, pp, ep), or lower micro_batch or seq_length; nothing was \
         submitted (docs/scale.md)"
            .to_string(),
    ))
}

/// The machine's memory as this process may use it: the physical RAM, or the cgroup's limit
/// when that is lower (a container, a Slurm job's allocation).
pub fn machine_memory() -> Option<u64> {
    static MEMORY: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *MEMORY.get_or_init(read_machine_memory)
}

fn read_machine_memory() -> Option<u64> {
    let ram = std::fs::read_to_string("/proc/meminfo")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })?
        * 1024;
    Some(match cgroup_limit() {
        Some(limit) => ram.min(limit),
        None => ram,
    })
}

/// How many processes the kernel's out-of-memory killer has ended in this process's cgroup
/// (v2 `memory.events`), when that can be read: a count that rose while a stage ran names the
/// killer of a stage that died by SIGKILL.
pub fn oom_kills() -> Option<u64> {
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = cgroup.lines().find_map(|l| l.strip_prefix("0::"))?;
    std::fs::read_to_string(format!("/sys/fs/cgroup{path}/memory.events"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|n| n.trim().parse().ok())
}

/// The memory limit of this process's cgroup (v2 `memory.max`, or v1's limit), if it has one.
fn cgroup_limit() -> Option<u64> {
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let candidates = cgroup.lines().filter_map(|line| {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        match controllers {
            "" => Some(format!("/sys/fs/cgroup{path}/memory.max")),
            c if c.split(',').any(|c| c == "memory") => {
                Some(format!("/sys/fs/cgroup/memory{path}/memory.limit_in_bytes"))
            }
            _ => None,
        }
    });
    candidates
        .filter_map(|file| std::fs::read_to_string(file).ok())
        .filter_map(|text| text.trim().parse::<u64>().ok()) // "max": no limit
        .min()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_estimate_over_the_capacity_names_the_numbers_and_what_to_do() {
        let estimate = Estimate {
            device: "cpu".into(),
            memory: vec![
                ("parameters".into(), 3 << 30),
                ("activations".into(), 2 << 30),
            ],
            flops_per_step: 1e12,
            steps: 3,
            basis: String::new(),
            least_bytes: None,
        };
        assert_eq!(
            does_not_fit("pretrain", &estimate, 6 << 30, "6.0 GiB"),
            None
        );
        let (message, help) = does_not_fit("pretrain", &estimate, 4 << 30, "4.0 GiB of RAM")
            .expect("5 GiB does not fit in 4");
        assert!(
            message.starts_with("stage `pretrain` needs an estimated 5.0 GiB of memory, more than this machine has (4.0 GiB of RAM)"),
            "{message}"
        );
        assert!(
            help.contains("-c tiny") && help.contains("--batch PROFILE"),
            "{help}"
        );
        // Rows of unknown length: refused only when even the shortest rows cannot fit.
        let bounded = Estimate {
            least_bytes: Some(3 << 30),
            ..estimate
        };
        assert_eq!(does_not_fit("grpo", &bounded, 4 << 30, "4.0 GiB"), None);
        assert!(does_not_fit("grpo", &bounded, 2 << 30, "2.0 GiB").is_some());
    }

    #[test]
    fn this_machine_has_some_memory() {
        let ram = machine_memory().expect("/proc/meminfo is readable on Linux");
        assert!(ram > 64 << 20, "{ram}");
    }
}
