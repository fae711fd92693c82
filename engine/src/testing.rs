//! A test double for the engine's own unit tests, which build without any real op: one op
//! named `cmd` that accepts any declaration and produces the outputs the stage declares. It
//! is never run; the engine's tests only load, key and plan manifests with it.

use nemo_dag_op::{
    AnyOp, DeclError, Metrics, Op, Outputs, Registry, RunContext, RunError, Spec, StageDecl,
};

struct DeclaredOutputs;

static SPEC: Spec = Spec {
    name: "cmd",
    version: 1,
    summary: "test double: the stage's declared outputs",
    inputs: &[],
    other_inputs: Some("any"),
    outputs: Outputs::Declared,
    resumable: false,
    launched: true,
};

impl Op for DeclaredOutputs {
    type Params = serde_json::Value;

    fn spec(&self) -> &'static Spec {
        &SPEC
    }
    fn check(&self, _: &Self::Params, _: &StageDecl) -> Result<(), DeclError> {
        Ok(())
    }
    fn run(&self, _: &Self::Params, _: &mut RunContext) -> Result<Metrics, RunError> {
        Err(RunError::new("the engine's test double never runs"))
    }
}

pub fn ops() -> Registry {
    static OPS: &[&dyn AnyOp] = &[&DeclaredOutputs];
    Registry::new(OPS)
}
