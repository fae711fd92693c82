//! `nemo-dag ops`: the ops this binary was built with.

use nemo_dag_engine::diag::Result;
use nemo_dag_op::Registry;

pub fn exec(ops: Registry) -> Result<()> {
    let width = ops.iter().map(|op| op.name().len()).max().unwrap_or(0);
    for op in ops.iter() {
        println!("{:<width$}  v{}  {}", op.name(), op.version(), op.summary());
    }
    Ok(())
}
