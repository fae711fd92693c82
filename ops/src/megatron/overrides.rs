//! Megatron-Bridge's command-line overrides: `key=value` words that Hydra applies to the
//! recipe's config in struct mode (`run_recipe.py`, through
//! `megatron.bridge.training.utils.omegaconf_utils.process_config_with_overrides`).
//!
//! Only plain `key=value` is ever rendered. Hydra's `+key=` adds a key the config lacks, and
//! Megatron-Bridge *accepts* it and then skips it with a log line, so a misspelt `+key` would be
//! silently ignored; `~key` deletes. Both are refused, as are the keys the op sets itself.

use nemo_dag_op::DeclError;
use serde_json::Value;

/// One override, in the order it is passed.
#[derive(Debug, Clone, PartialEq)]
pub struct Override {
    pub key: String,
    pub value: String,
}

impl Override {
    pub fn new(key: &str, value: impl Into<String>) -> Self {
        Override {
            key: key.to_string(),
            value: value.into(),
        }
    }

    /// `key=value`, one argument.
    pub fn word(&self) -> String {
        format!("{}={}", self.key, self.value)
    }
}

/// The keys the op sets, and from what; a user override of one is refused, because two values
/// for one key would leave the one that wins to the order of the words.
pub const SET_BY_THE_OP: &[(&str, &str)] = &[
    ("train.train_iters", "params.steps"),
    ("train.global_batch_size", "params.global_batch"),
    ("train.micro_batch_size", "params.micro_batch"),
    ("train.exit_interval", "NEMO_DAG_STOP_AFTER_STEP"),
    (
        "train.exit_signal_handler",
        "the op (a SIGTERM saves, then exits)",
    ),
    ("optimizer.lr", "params.lr"),
    ("optimizer.min_lr", "params.min_lr"),
    ("scheduler.lr_warmup_iters", "params.warmup"),
    ("optimizer.weight_decay", "params.weight_decay"),
    ("optimizer.adam_beta1", "params.beta1"),
    ("optimizer.adam_beta2", "params.beta2"),
    ("optimizer.clip_grad", "params.clip_grad"),
    ("rng.seed", "params.seed"),
    ("model.tensor_model_parallel_size", "params.parallel.tp"),
    ("model.pipeline_model_parallel_size", "params.parallel.pp"),
    ("model.expert_model_parallel_size", "params.parallel.ep"),
    ("model.expert_tensor_parallel_size", "params.parallel.etp"),
    ("model.context_parallel_size", "params.parallel.cp"),
    ("model.sequence_parallel", "params.parallel.sp"),
    ("dataset.seq_length", "params.seq_length"),
    ("validation.eval_interval", "params.eval_interval"),
    ("validation.eval_iters", "params.eval_iters"),
    ("logger.log_interval", "params.log_interval"),
    ("checkpoint.save_interval", "params.save_interval"),
    ("checkpoint.most_recent_k", "params.keep_checkpoints"),
    // Where things are read and written: the stage's inputs and its own attempt directory.
    ("checkpoint.save", "the op (the attempt's checkpoint/)"),
    ("checkpoint.load", "the op (the attempt's checkpoint/)"),
    ("checkpoint.pretrained_checkpoint", "the `model` input"),
    ("checkpoint.ckpt_step", "the op (resume)"),
    ("checkpoint.exit_on_missing_checkpoint", "the op (resume)"),
    ("checkpoint.async_save", "the op (a synchronous save)"),
    (
        "checkpoint.finetune",
        "the op (a fresh start loads `model` as a fine-tune)",
    ),
    (
        "train.train_samples",
        "params.steps (the run is counted in iterations)",
    ),
    (
        "model.seq_length",
        "params.seq_length (run_recipe.py syncs it)",
    ),
    ("dataset.sequence_length", "params.seq_length"),
    (
        "dataset.mock",
        "the `data` input (never mock data under a real key)",
    ),
    ("dataset.data_path", "the `data` input"),
    ("checkpoint.ckpt_format", "the op (torch_dist)"),
    ("dataset.blend", "the `data` input"),
    ("dataset.blend_per_split", "the `data` input"),
    ("dataset.split", "the `data` input"),
    (
        "dataset.path_to_cache",
        "the op (the attempt's run/data_cache)",
    ),
    ("dataset.dataset_root", "the `data` input"),
    ("dataset.offline_packing_specs", "the `data` input"),
    ("dataset.do_validation", "the `data` input"),
    ("dataset.do_test", "the op"),
    ("dataset.hf_dataset", "the `data` input"),
    ("dataset.hf_validation_proportion", "the `data` input"),
    ("dataset.enable_offline_packing", "the `data` input"),
    ("tokenizer.tokenizer_type", "the `tokenizer` input"),
    ("tokenizer.tokenizer_model", "the `tokenizer` input"),
    (
        "tokenizer.use_tokenizer_vocab_size",
        "the `tokenizer` input",
    ),
    ("logger.tensorboard_dir", "the op (the attempt's run/tb)"),
    (
        "logger.save_config_filepath",
        "the op (the attempt's run/config.yaml)",
    ),
];

/// Check the stage's `params.overrides`: dotted keys of identifiers, scalar values, none the
/// op sets. Errors point at `params.overrides.KEY`.
pub fn check_user(overrides: &std::collections::BTreeMap<String, Value>) -> Result<(), DeclError> {
    check_user_of(
        overrides,
        SET_BY_THE_OP,
        "Megatron-Bridge",
        "Megatron-Bridge accepts `+key=` for a key its config lacks and then skips it, so a misspelt key would be silently ignored: override keys that exist, without a prefix",
    )
}

/// [`check_user`] for a program (`program`) whose op sets the keys `set_by`; `why_no_prefix`
/// is the help for a `+`, `++` or `~` override.
pub fn check_user_of(
    overrides: &std::collections::BTreeMap<String, Value>,
    set_by: &[(&str, &str)],
    program: &str,
    why_no_prefix: &str,
) -> Result<(), DeclError> {
    for (key, value) in overrides {
        let at = |message: String| DeclError::new(&["params", "overrides", key], message);
        if let Some(prefix) = ["++", "+", "~"].into_iter().find(|p| key.starts_with(p)) {
            return Err(at(format!(
                "`{key}`: a `{prefix}` override is not passed to {program}"
            ))
            .with_help(why_no_prefix));
        }
        let identifiers = key.split('.').all(|part| {
            part.chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && part.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        });
        if !identifiers {
            return Err(at(format!(
                "`{key}` is not a config key: dotted names of letters, digits and `_` (`model.num_layers`)"
            )));
        }
        if let Some((_, by)) = set_by
            .iter()
            .find(|(set, _)| key == set || key.starts_with(&format!("{set}.")))
        {
            return Err(
                at(format!("`{key}` is set by nemo-dag from {by}")).with_help(format!(
                    "remove it from `overrides`{}",
                    by.strip_prefix("params.")
                        .map(|p| format!(" and set params.{p}"))
                        .unwrap_or_default()
                )),
            );
        }
        scalar(value).map_err(at)?;
    }
    Ok(())
}

/// A JSON scalar as Hydra reads it: numbers and booleans as written, `null`, strings
/// single-quoted (so `1e-3`, `true` or `a,b` stay strings). A list or mapping is refused.
pub fn scalar(value: &Value) -> Result<String, String> {
    match value {
        Value::Null => Ok("null".into()),
        Value::Bool(b) => Ok(b.to_string()),
        Value::Number(n) => Ok(n.to_string()),
        Value::String(s) => quoted(s),
        other => Err(format!(
            "`{other}`: an override is one scalar (a number, true/false, null or a string)"
        )),
    }
}

/// A string as a Hydra quoted value, `'…'`. Hydra's escapes are not worth the risk: a `'`, a
/// backslash, `${` or a control character is refused.
pub fn quoted(s: &str) -> Result<String, String> {
    // `${…}` is interpolated by OmegaConf even inside quotes.
    if s.contains(['\'', '\\']) || s.contains("${") || s.chars().any(char::is_control) {
        return Err(format!(
            "`{}` holds a quote, a backslash, `${{` or a control character, which nemo-dag does not pass to Hydra",
            s.escape_debug()
        ));
    }
    Ok(format!("'{s}'"))
}

/// A Hydra list of already-rendered items: `[a,b]`.
pub fn list(items: impl IntoIterator<Item = String>) -> String {
    format!("[{}]", items.into_iter().collect::<Vec<_>>().join(","))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(key: &str, value: Value) -> Result<(), DeclError> {
        check_user(&[(key.to_string(), value)].into_iter().collect())
    }

    #[test]
    fn only_plain_overrides_of_keys_the_op_leaves_alone_pass() {
        assert!(check("model.num_layers", json!(4)).is_ok());
        assert!(check("model.hybrid_layer_pattern", json!("M*M-")).is_ok());
        let plus = check("+model.nope", json!(1)).unwrap_err();
        assert_eq!(plus.path, ["params", "overrides", "+model.nope"]);
        assert!(plus.message.contains("`+` override"), "{}", plus.message);
        assert!(check("~model.x", json!(1)).is_err());
        assert!(check("model..x", json!(1)).is_err());
        assert!(check("model.x y", json!(1)).is_err());
        let set = check("checkpoint.save", json!("/tmp/x")).unwrap_err();
        assert!(set.message.contains("set by nemo-dag"), "{}", set.message);
        let param = check("train.train_iters", json!(5)).unwrap_err();
        assert_eq!(
            param.help.as_deref(),
            Some("remove it from `overrides` and set params.steps")
        );
        let nested = check(
            "dataset.offline_packing_specs.packed_sequence_size",
            json!(8),
        )
        .unwrap_err();
        assert!(nested.message.contains("the `data` input"));
        assert!(check("model.x", json!([1, 2])).is_err());
        assert!(check("model.x", json!("it's")).is_err());
    }

    #[test]
    fn values_render_as_hydra_reads_them() {
        assert_eq!(scalar(&json!(null)).unwrap(), "null");
        assert_eq!(scalar(&json!(true)).unwrap(), "true");
        assert_eq!(scalar(&json!(8)).unwrap(), "8");
        assert_eq!(scalar(&json!(1.5e-5)).unwrap(), "0.000015");
        assert_eq!(scalar(&json!("1e-3")).unwrap(), "'1e-3'");
        assert_eq!(list(["'a'".to_string(), "'b'".to_string()]), "['a','b']");
        assert!(quoted("a\nb").is_err());
        assert!(quoted("a\\b").is_err());
        assert!(quoted("/x/${oc.env:HOME}").is_err());
    }
}
