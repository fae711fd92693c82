//! Test doubles for the engine's own unit tests, which build without any real op: an op named
//! `cmd` that accepts any declaration and produces the outputs the stage declares, and
//! `resumable`, the same but saving on SIGTERM and resuming, as a launched training op does;
//! `trains`, the same, for an op that trains on a GPU; `in_image`, the same, for an op whose
//! software is the image its `image` param names.
//! They are never run; the engine's tests only load, key and plan manifests with them.

use nemo_dag_op::{
    AnyOp, DeclError, Metrics, Op, Outputs, Registry, RunContext, RunError, Spec, StageDecl,
};

struct DeclaredOutputs(&'static Spec);

/// A test double's spec: it takes any inputs and makes the outputs its stage declares.
const fn double(
    name: &'static str,
    summary: &'static str,
    (resumable, launched, gpu): (bool, bool, bool),
) -> Spec {
    Spec {
        name,
        summary,
        version: 1,
        inputs: &[],
        other_inputs: Some("any"),
        outputs: Outputs::Declared,
        resumable,
        launched,
        gpu,
    }
}

// (resumable, launched, gpu) of each double.
static SPEC: Spec = double(
    "cmd",
    "test double: the stage's declared outputs",
    (false, true, false),
);

static RESUMABLE: Spec = double(
    "resumable",
    "test double: the stage's declared outputs, saved on SIGTERM and resumed",
    (true, true, false),
);

static TRAINS: Spec = double(
    "trains",
    "test double: an op that trains on a GPU when its stage's device asks",
    (true, false, true),
);

static IN_IMAGE: Spec = double(
    "in_image",
    "test double: an op whose `image` param names the image its software runs in",
    (false, true, false),
);

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
    fn image(&self, params: &Self::Params) -> Option<String> {
        let image = params.get("image")?.as_str()?;
        Op::names_image(self).then(|| image.to_string())
    }
    fn names_image(&self) -> bool {
        std::ptr::eq(self.0, &IN_IMAGE)
    }
}

pub fn ops() -> Registry {
    static OPS: &[&dyn AnyOp] = &[
        &DeclaredOutputs(&SPEC),
        &DeclaredOutputs(&RESUMABLE),
        &DeclaredOutputs(&TRAINS),
        &DeclaredOutputs(&IN_IMAGE),
    ];
    Registry::new(OPS)
}
