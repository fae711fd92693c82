//! A test double for the engine's own unit tests, which build without any real op: one op
//! named `cmd` that accepts any declaration and produces the outputs the stage declares. It
//! is never run; the engine's tests only load, key and plan manifests with it.

use nemo_dag_op::{DeclError, Metrics, Op, Registry, RunContext, RunError, StageDecl};
use std::collections::BTreeMap;

struct DeclaredOutputs;

impl Op for DeclaredOutputs {
    fn name(&self) -> &'static str {
        "cmd"
    }
    fn version(&self) -> u32 {
        1
    }
    fn summary(&self) -> &'static str {
        "test double: the stage's declared outputs"
    }
    fn check(&self, _: &StageDecl) -> Result<(), DeclError> {
        Ok(())
    }
    fn outputs(&self, stage: &StageDecl) -> BTreeMap<String, String> {
        stage.outputs.clone()
    }
    fn run(&self, _: &mut RunContext) -> Result<Metrics, RunError> {
        Err(RunError::new("the engine's test double never runs"))
    }
}

pub fn ops() -> Registry {
    static OPS: &[&dyn Op] = &[&DeclaredOutputs];
    Registry::new(OPS)
}
