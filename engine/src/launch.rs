//! `resources.launch`: a stage whose command runs once per rank, and how the ranks find each
//! other. The one place that knows the launchers' command lines; the executors only ask.
//!
//! ```yaml
//! train:
//!   op: cmd
//!   cmd: "python train.py"
//!   resources: {launch: torchrun, nodes: 2, gpus: 8}   # 16 ranks, 8 per node
//! ```
//!
//! A launched stage is still built by one `nemo-dag exec`: it makes the one attempt directory,
//! the op starts its command under the launcher ([`Launch::slurm_command`] in a Slurm job,
//! [`Launch::local_command`] on this machine), every rank writes into that directory on the
//! shared filesystem, and `exec` publishes once, after the launcher exits 0, which it does only
//! when every rank did. Running `exec` per rank instead would have N processes race for the
//! key's lock and N attempts of one stage.
//!
//! - `srun`: one Slurm task per rank; a small `sh` wrapper turns Slurm's `SLURM_PROCID`,
//!   `SLURM_LOCALID` and `SLURM_NTASKS` into `RANK`, `LOCAL_RANK` and `WORLD_SIZE`.
//! - `torchrun`: one Slurm task per node, each a `torchrun` that starts the node's ranks and sets
//!   those variables itself, meeting the others at `MASTER_ADDR:MASTER_PORT`.
//!
//! In both, `--kill-on-bad-exit=1` ends every rank when one fails (a rank blocked in a
//! collective would otherwise wait for a peer that is gone), and `srun` exits non-zero, which
//! fails the stage.

use crate::manifest::Resources;
use nemo_dag_op::AnyOp;
use serde::{Deserialize, Serialize};

/// What `resources.launch` takes, in the order the help lists them.
pub const LAUNCHERS: [&str; 3] = ["none", "torchrun", "srun"];

/// The most ranks a stage may ask for on one node.
pub const MAX_RANKS_PER_NODE: u32 = 1_024;

/// What starts the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Launcher {
    Torchrun,
    Srun,
}

impl Launcher {
    /// `resources.launch` as written: `Ok(None)` for `none`; an unknown name is
    /// `Err((message, help))`, the help suggesting the nearest launcher.
    pub fn parse(written: &str) -> Result<Option<Launcher>, (String, String)> {
        match written {
            "none" => Ok(None),
            "torchrun" => Ok(Some(Launcher::Torchrun)),
            "srun" => Ok(Some(Launcher::Srun)),
            other => Err((
                format!("unknown launcher `{other}`"),
                crate::diag::did_you_mean(other, "the launchers are", LAUNCHERS.into_iter()),
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Launcher::Torchrun => "torchrun",
            Launcher::Srun => "srun",
        }
    }
}

/// A stage that runs once per rank: its launcher, and `nodes` × `ranks_per_node` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Launch {
    pub launcher: Launcher,
    pub nodes: u32,
    pub ranks_per_node: u32,
}

/// What the Slurm profile adds to each rank's step: the CPUs of a task and the container.
#[derive(Debug, Clone, Copy, Default)]
pub struct Step<'a> {
    pub cpus_per_task: Option<u32>,
    /// `srun --mpi=` (the profile's `mpi`).
    pub mpi: Option<&'a str>,
    pub container_image: Option<&'a str>,
    pub mounts: &'a [String],
}

impl Launch {
    /// The launch `resources` ask for, if any. The stage owns its shape: `nodes` (default 1)
    /// and `ntasks_per_node`, else one rank per GPU of `gpus`, else 1.
    pub fn of(resources: &Resources) -> Option<Launch> {
        let launcher = Launcher::parse(resources.launch.as_deref()?).ok()??;
        Some(Launch {
            launcher,
            nodes: resources.nodes.unwrap_or(1),
            ranks_per_node: resources
                .ntasks_per_node
                .or(resources.gpus.filter(|g| *g > 0))
                .unwrap_or(1),
        })
    }

    pub fn world_size(&self) -> u64 {
        u64::from(self.nodes) * u64::from(self.ranks_per_node)
    }

    /// The Slurm tasks per node the job asks for: one per rank under `srun`, one `torchrun`
    /// per node.
    pub fn tasks_per_node(&self) -> u32 {
        match self.launcher {
            Launcher::Srun => self.ranks_per_node,
            Launcher::Torchrun => 1,
        }
    }

    /// One line for people: `2 ranks (1 node × 2) started by srun`.
    pub fn describe(&self) -> String {
        format!(
            "{} rank{} ({} node{} × {}) started by {}",
            self.world_size(),
            if self.world_size() == 1 { "" } else { "s" },
            self.nodes,
            if self.nodes == 1 { "" } else { "s" },
            self.ranks_per_node,
            self.launcher.name()
        )
    }

    /// The job script's lines that wire the rendezvous before `nemo-dag exec` starts: the first
    /// node of the allocation and a port derived from the job id (10000–29999: above the
    /// well-known ports, below Linux's ephemeral range, so no client socket holds it), exported
    /// for every rank. `sed -n 1p` reads the whole list where `head -n1` would stop early and,
    /// under `pipefail`, fail the job with scontrol's SIGPIPE on a long list of nodes.
    pub fn rendezvous_lines(&self) -> String {
        format!(
            "# {}; nemo-dag exec publishes once, after every rank exits 0\n\
             MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | sed -n 1p)\n\
             MASTER_PORT=$((10000 + SLURM_JOB_ID % 20000))\n\
             export MASTER_ADDR MASTER_PORT\n",
            self.describe()
        )
    }

    /// The argv that starts a command once per rank inside the Slurm job (the command's own
    /// argv follows it): one `srun` step over the whole shape, in the step's container.
    pub fn slurm_command(&self, step: &Step) -> Vec<String> {
        let tasks_per_node = self.tasks_per_node();
        let mut argv = vec!["srun".to_string()];
        if let Some(mpi) = step.mpi {
            argv.push(format!("--mpi={mpi}"));
        }
        argv.extend([
            format!("--nodes={}", self.nodes),
            format!(
                "--ntasks={}",
                u64::from(self.nodes) * u64::from(tasks_per_node)
            ),
            format!("--ntasks-per-node={tasks_per_node}"),
        ]);
        // A step does not inherit the job's --cpus-per-task (srun(1), since Slurm 22.05).
        if let Some(cpus) = step.cpus_per_task {
            argv.push(format!("--cpus-per-task={cpus}"));
        }
        argv.push("--kill-on-bad-exit=1".into());
        if let Some(image) = step.container_image {
            argv.push(format!("--container-image={image}"));
            if !step.mounts.is_empty() {
                argv.push(format!("--container-mounts={}", step.mounts.join(",")));
            }
        }
        argv.extend(["sh".into(), "-c".into()]);
        match self.launcher {
            Launcher::Srun => argv.extend([
                format!(
                    "export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS LOCAL_WORLD_SIZE={}; exec \"$@\"",
                    self.ranks_per_node
                ),
                "nemo-dag-rank".into(),
            ]),
            Launcher::Torchrun => argv.extend([
                format!(
                    "exec torchrun --nnodes={} --nproc-per-node={} --node-rank=$SLURM_NODEID --master-addr=$MASTER_ADDR --master-port=$MASTER_PORT --no-python \"$@\"",
                    self.nodes, self.ranks_per_node
                ),
                "torchrun".into(),
            ]),
        }
        argv
    }

    /// The argv that starts a command once per rank on this machine, without Slurm: only
    /// `torchrun` on one node (`--standalone` picks a free port itself). `Err` says why not.
    pub fn local_command(&self) -> Result<Vec<String>, String> {
        let needs_slurm = match self.launcher {
            Launcher::Srun => "launch: srun starts its ranks as tasks of a Slurm job".to_string(),
            Launcher::Torchrun if self.nodes > 1 => format!(
                "launch: torchrun on {} nodes needs the nodes of a Slurm job",
                self.nodes
            ),
            Launcher::Torchrun => {
                return Ok(vec![
                    "torchrun".into(),
                    "--standalone".into(),
                    "--nnodes=1".into(),
                    format!("--nproc-per-node={}", self.ranks_per_node),
                    "--no-python".into(),
                ]);
            }
        };
        Err(needs_slurm)
    }
}

/// What the manifest loader says of a stage's `launch`, `nodes` and `ntasks_per_node`:
/// `Err((field, message, help))`.
/// `op` is the stage's op and `launched` the ops that run under a launcher
/// ([`nemo_dag_op::Spec::launched`]), for the help.
pub fn check(
    resources: &Resources,
    op: &dyn AnyOp,
    launched: &[&str],
) -> Result<(), (&'static str, String, String)> {
    let launcher = match resources.launch.as_deref() {
        Some(written) => {
            Launcher::parse(written).map_err(|(message, help)| ("launch", message, help))?
        }
        None => None,
    };
    if let Some(n) = resources.ntasks_per_node {
        if !(1..=MAX_RANKS_PER_NODE).contains(&n) {
            let bound = if n < 1 {
                "at least 1".to_string()
            } else {
                format!("at most {MAX_RANKS_PER_NODE}")
            };
            return Err((
                "ntasks_per_node",
                format!("{n}: it takes {bound}"),
                "ntasks_per_node is the ranks per node (torchrun's --nproc-per-node)".into(),
            ));
        }
        if launcher.is_none() {
            return Err((
                "ntasks_per_node",
                format!("{n} ranks per node, but nothing starts them: the command runs once"),
                "add `launch: srun` (a Slurm task per rank) or `launch: torchrun` (one torchrun per node); a command that starts its own ranks takes ntasks_per_node from the profile".into(),
            ));
        }
    }
    if launcher.is_some() && !op.spec().launched {
        return Err((
            "launch",
            format!("op `{}` does not run under a launcher", op.name()),
            match launched {
                [] => "no op of this nemo-dag runs under a launcher; remove it here".to_string(),
                _ => format!(
                    "`launch` applies to {} stages; remove it here",
                    launched
                        .iter()
                        .map(|o| format!("`{o}`"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            },
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(launcher: Launcher, nodes: u32, ranks_per_node: u32) -> Launch {
        Launch {
            launcher,
            nodes,
            ranks_per_node,
        }
    }

    #[test]
    fn the_shape_comes_from_the_stage() {
        let r = |launch: &str, nodes, gpus, ntasks| Resources {
            launch: Some(launch.into()),
            nodes,
            gpus,
            ntasks_per_node: ntasks,
            ..Resources::default()
        };
        assert_eq!(Launch::of(&r("none", Some(2), None, None)), None);
        assert_eq!(Launch::of(&Resources::default()), None);
        assert_eq!(
            Launch::of(&r("srun", None, None, None)),
            Some(launch(Launcher::Srun, 1, 1))
        );
        assert_eq!(
            Launch::of(&r("torchrun", Some(4), Some(8), None)),
            Some(launch(Launcher::Torchrun, 4, 8)),
            "a rank per GPU"
        );
        assert_eq!(
            Launch::of(&r("torchrun", Some(4), Some(8), Some(2))),
            Some(launch(Launcher::Torchrun, 4, 2))
        );
        assert_eq!(
            Launch::of(&r("srun", None, Some(0), None)),
            Some(launch(Launcher::Srun, 1, 1))
        );
    }

    #[test]
    fn srun_starts_a_task_per_rank_with_the_rank_variables() {
        let argv = launch(Launcher::Srun, 2, 4).slurm_command(&Step::default());
        assert_eq!(
            argv,
            [
                "srun",
                "--nodes=2",
                "--ntasks=8",
                "--ntasks-per-node=4",
                "--kill-on-bad-exit=1",
                "sh",
                "-c",
                "export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS LOCAL_WORLD_SIZE=4; exec \"$@\"",
                "nemo-dag-rank",
            ]
        );
        // The wrapper passes the command's words through untouched, and sets the variables.
        let out = std::process::Command::new("sh")
            .args(&argv[6..])
            .args([
                "sh",
                "-c",
                "echo $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE \"$1\"",
                "-",
                "a b",
            ])
            .env("SLURM_PROCID", "5")
            .env("SLURM_LOCALID", "1")
            .env("SLURM_NTASKS", "8")
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "5 1 8 4 a b\n");
    }

    #[test]
    fn torchrun_starts_once_per_node_with_the_rendezvous() {
        let mounts = ["/a:/a".to_string(), "/b:/b".to_string()];
        let step = Step {
            cpus_per_task: Some(32),
            mpi: Some("pmix"),
            container_image: Some("nemo.sqsh"),
            mounts: &mounts,
        };
        assert_eq!(
            launch(Launcher::Torchrun, 4, 8).slurm_command(&step),
            [
                "srun",
                "--mpi=pmix",
                "--nodes=4",
                "--ntasks=4",
                "--ntasks-per-node=1",
                "--cpus-per-task=32",
                "--kill-on-bad-exit=1",
                "--container-image=nemo.sqsh",
                "--container-mounts=/a:/a,/b:/b",
                "sh",
                "-c",
                "exec torchrun --nnodes=4 --nproc-per-node=8 --node-rank=$SLURM_NODEID --master-addr=$MASTER_ADDR --master-port=$MASTER_PORT --no-python \"$@\"",
                "torchrun",
            ]
        );
    }

    #[test]
    fn the_rendezvous_is_the_first_node_and_a_port_from_the_job_id() {
        let lines = launch(Launcher::Srun, 1, 2).rendezvous_lines();
        assert_eq!(
            lines,
            "# 2 ranks (1 node × 2) started by srun; nemo-dag exec publishes once, after every rank exits 0\n\
             MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | sed -n 1p)\n\
             MASTER_PORT=$((10000 + SLURM_JOB_ID % 20000))\n\
             export MASTER_ADDR MASTER_PORT\n"
        );
        // The port, as bash computes it, stays in its range for any job id.
        let script = format!(
            "scontrol() {{ printf 'node7\\nnode8\\n'; }}\nset -eo pipefail\n{lines}echo $MASTER_ADDR $MASTER_PORT"
        );
        for (id, port) in [
            ("1", 10001),
            ("19999", 29999),
            ("20000", 10000),
            ("4294967295", 17295),
        ] {
            let out = std::process::Command::new("bash")
                .args(["-c", &script])
                .env("SLURM_JOB_ID", id)
                .env("SLURM_JOB_NODELIST", "node[7-8]")
                .output()
                .unwrap();
            assert_eq!(
                String::from_utf8_lossy(&out.stdout),
                format!("node7 {port}\n"),
                "job {id}"
            );
        }
    }

    #[test]
    fn only_torchrun_on_one_node_runs_without_slurm() {
        assert_eq!(
            launch(Launcher::Torchrun, 1, 2).local_command().unwrap(),
            [
                "torchrun",
                "--standalone",
                "--nnodes=1",
                "--nproc-per-node=2",
                "--no-python"
            ]
        );
        let e = launch(Launcher::Torchrun, 2, 2)
            .local_command()
            .unwrap_err();
        assert!(e.contains("2 nodes"), "{e}");
        let e = launch(Launcher::Srun, 1, 2).local_command().unwrap_err();
        assert!(e.contains("launch: srun"), "{e}");
    }

    #[test]
    fn an_unknown_launcher_suggests_the_nearest() {
        let (message, help) = Launcher::parse("slurm-srun").unwrap_err();
        assert_eq!(message, "unknown launcher `slurm-srun`");
        assert_eq!(help, "the launchers are: none, torchrun, srun");
        let (_, help) = Launcher::parse("torchrn").unwrap_err();
        assert!(help.starts_with("did you mean `torchrun`?"), "{help}");
    }
}
