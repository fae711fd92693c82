//! `nemo-dag ops`: the ops this binary was built with, each with its version, what it does,
//! the inputs it reads and the outputs it writes, and whether it trains on a GPU (its `Spec`).

use nemo_dag_engine::diag::Result;
use nemo_dag_op::{Outputs, Registry};

pub fn exec(ops: Registry) -> Result<()> {
    let width = ops.iter().map(|op| op.name().len()).max().unwrap_or(0);
    let indent = " ".repeat(width + 2);
    for op in ops.iter() {
        let spec = op.spec();
        println!("{:<width$}  v{}  {}", spec.name, spec.version, spec.summary);
        let mut inputs: Vec<String> = spec
            .inputs
            .iter()
            .map(|p| {
                let optional = if p.required { "" } else { ", optional" };
                format!("{} ({}{optional})", p.name, p.what)
            })
            .collect();
        match spec.other_inputs {
            Some(other) if inputs.is_empty() => inputs.push(other.to_string()),
            Some(other) => inputs.push(format!("and any others: {other}")),
            None => {}
        }
        if inputs.is_empty() {
            inputs.push("none".into());
        }
        println!("{indent}    inputs: {}", inputs.join("; "));
        let outputs = match spec.outputs {
            Outputs::Fixed(list) => list.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", "),
            Outputs::Declared => "declared by the stage (`outputs:`)".into(),
        };
        let resumable = if spec.resumable { " (resumable)" } else { "" };
        println!("{indent}    outputs: {outputs}{resumable}");
        if spec.gpu {
            println!("{indent}    device: runs on a GPU under `device: cuda` or `auto`");
        }
    }
    Ok(())
}
