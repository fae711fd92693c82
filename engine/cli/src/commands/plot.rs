//! `nemo-dag plot`: one metric of several artifacts' training curves, overlaid, as SVG or PNG.

use nemo_dag_engine::diag::{Failure, InputError, Result};
use nemo_dag_engine::plot::{png, series, svg};
use nemo_dag_engine::store::{Store, write_atomic};
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The artifacts: stage names (each its artifact from the last run; a swept stage's name
    /// means all its copies) or keys (6+ hex digits)
    #[arg(required = true)]
    pub targets: Vec<String>,
    /// The metric of the curve: loss, lr, grad_norm, tokens_per_second, or one under a point's
    /// metrics (reward, accuracy, kl, …)
    #[arg(long, default_value = "loss")]
    pub metric: String,
    /// Where to write the chart: FILE.svg, or FILE.png (drawn at twice the SVG's size);
    /// the SVG on standard output when not given
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// The manifest the stages belong to (needed when several manifests share a store)
    #[arg(long)]
    pub manifest: Option<PathBuf>,
    #[arg(long, value_name = "DIR")]
    pub store: Option<PathBuf>,
}

pub fn exec(a: Args) -> Result<()> {
    let format = match &a.output {
        None => Format::Svg,
        Some(out) => match out.extension().and_then(|e| e.to_str()) {
            Some("svg") => Format::Svg,
            Some("png") => Format::Png,
            _ => {
                return Err(InputError::new(format!(
                    "{}: plot writes .svg or .png; name a file ending in one",
                    out.display()
                ))
                .into());
            }
        },
    };
    let store = Store::find(a.store.as_deref(), a.manifest.as_deref())?;
    let mut artifacts = Vec::with_capacity(a.targets.len());
    for target in &a.targets {
        for key in store.resolve_targets(target, a.manifest.as_deref())? {
            artifacts.push(store.load_existing(&key)?);
        }
    }
    let series = series(&artifacts, &a.metric).map_err(|e| Failure::from(InputError::new(e)))?;
    let doc = svg(&series, &a.metric);
    let Some(path) = &a.output else {
        print!("{doc}");
        return Ok(());
    };
    let bytes = match format {
        Format::Svg => doc.into_bytes(),
        Format::Png => png(&doc, 2.0).map_err(|e| Failure::Other(miette::miette!("{e}")))?,
    };
    // Written beside, then renamed: an interrupted plot leaves no half picture.
    write_atomic(path, &bytes, false)
        .map_err(|e| InputError::new(format!("{}: {e}", path.display())))?;
    eprintln!(
        "wrote {} ({} curves of `{}`)",
        path.display(),
        series.len(),
        a.metric
    );
    Ok(())
}

enum Format {
    Svg,
    Png,
}
