//! `nemo-dag status`: each stage's freshness against the store, and why.

use super::ManifestArgs;
use nemo_dag_engine::diag::Result;
use nemo_dag_engine::digest::Digester;
use nemo_dag_engine::executor::slurm;
use nemo_dag_engine::plan::{self, Freshness};
use nemo_dag_engine::store::short;
use nemo_dag_op::Registry;
use serde_json::{Value, json};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    m: ManifestArgs,
    #[arg(long)]
    json: bool,
}

pub fn exec(a: Args, ops: Registry) -> Result<()> {
    let (manifest, store) = a.m.load(ops)?;
    let plans = plan::plan(&manifest, &store, &mut Digester::load(&store.memo_file()))?;
    // Jobs of the last cluster submission, if any, reconciled with Slurm now.
    let jobs = slurm::job_report(&manifest, &store);
    let job_of = |name: &str, freshness: Freshness| {
        jobs.get(name).filter(|_| freshness != Freshness::UpToDate)
    };
    if a.json {
        let stages: Vec<Value> = plans
            .iter()
            .map(|p| {
                let mut v = json!({"name": p.name, "state": p.freshness.as_str(), "key": p.key, "reasons": p.reasons});
                if let Some(job) = job_of(&p.name, p.freshness) {
                    v["job"] = job.clone();
                }
                if let Some(e) = manifest.estimate(&p.name) {
                    v["estimate"] = e.to_json();
                }
                if let Some(last) = &p.last_run {
                    v["last_run"] = json!(last);
                }
                v
            })
            .collect();
        println!("{}", json!({ "stages": stages }));
        return Ok(());
    }
    let width = plans.iter().map(|p| p.name.len()).max().unwrap_or(0);
    for p in &plans {
        let key = p.key.as_deref().map(short).unwrap_or("-");
        let job = job_of(&p.name, p.freshness)
            .map(|j| {
                format!(
                    "  job {} {}",
                    j["id"].as_str().unwrap_or(""),
                    j["state"].as_str().unwrap_or("")
                )
            })
            .unwrap_or_default();
        println!(
            "{:<width$}  {:<16}  {key}{job}",
            p.name,
            p.freshness.as_str()
        );
        for r in &p.reasons {
            println!("{:<width$}    · {r}", "");
        }
        if p.freshness != Freshness::UpToDate
            && let Some(e) = manifest.estimate(&p.name)
        {
            println!("{:<width$}    · plan: {e}", "");
        }
        if let Some(last) = &p.last_run {
            println!("{:<width$}    · last run: {last}", "");
        }
        if let Some(because) = jobs
            .get(&p.name)
            .and_then(|j| j.get("because"))
            .and_then(Value::as_str)
        {
            println!("{:<width$}    · cancelled: {because}", "");
        }
    }
    let would_run = plans.iter().filter(|p| p.freshness != Freshness::UpToDate);
    if let Some(total) = plan::rerun_cost(would_run.map(|p| p.last_run.as_ref())) {
        println!("{total}");
    }
    Ok(())
}
