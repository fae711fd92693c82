//! Test doubles for the engine's own unit tests, which build without any real op: an op named
//! `cmd` that accepts any declaration and produces the outputs the stage declares, and
//! `resumable`, the same but saving on SIGTERM and resuming, as a launched training op does;
//! `trains`, the same, for an op that trains on a GPU.
//! They are never run; the engine's tests only load, key and plan manifests with them.

use nemo_dag_op::{
    AnyOp, DeclError, Metrics, Op, Outputs, Registry, RunContext, RunError, Spec, StageDecl,
};

struct DeclaredOutputs(&'static Spec);

static SPEC: Spec = Spec {
    name: "cmd",
    version: 1,
    summary: "test double: the stage's declared outputs",
    inputs: &[],
    other_inputs: Some("any"),
    outputs: Outputs::Declared,
    resumable: false,
    launched: true,
    gpu: false,
};

static RESUMABLE: Spec = Spec {
    name: "resumable",
    summary: "test double: the stage's declared outputs, saved on SIGTERM and resumed",
    version: 1,
    inputs: &[],
    other_inputs: Some("any"),
    outputs: Outputs::Declared,
    resumable: true,
    launched: true,
    gpu: false,
};

static TRAINS: Spec = Spec {
    name: "trains",
    summary: "test double: an op that trains on a GPU when its stage's device asks",
    version: 1,
    inputs: &[],
    other_inputs: Some("any"),
    outputs: Outputs::Declared,
    resumable: true,
    launched: false,
    gpu: true,
};

impl Op for DeclaredOutputs {
    type Params = serde_json::Value;

    fn spec(&self) -> &'static Spec {
        self.0
    }
    fn check(&self, _: &Self::Params, _: &StageDecl) -> Result<(), DeclError> {
        Ok(())
    }
    fn run(&self, _: &Self::Params, _: &mut RunContext) -> Result<Metrics, RunError> {
        Err(RunError::new("the engine's test double never runs"))
    }
}

pub fn ops() -> Registry {
    static OPS: &[&dyn AnyOp] = &[
        &DeclaredOutputs(&SPEC),
        &DeclaredOutputs(&RESUMABLE),
        &DeclaredOutputs(&TRAINS),
    ];
    Registry::new(OPS)
}
