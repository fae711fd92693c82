//! Hugging Face transformers checkpoints: our models in their layouts, and back.
//!
//! Each architecture is one file that holds its correspondence once: which of their tensors
//! each of ours is ([`Theirs`]), and how the two configs translate, with every option we do not
//! implement named as an error. Both directions go through it: `export` writes a model
//! ([`to_theirs`]), `import_model` reads one ([`to_ours`]), so an export that is imported and
//! exported again gives the same tensors.

pub mod chat;
pub mod llama;
pub mod nemotron_h;

use candle_core::{DType, Device, Tensor};
use model::checkpoint::model_tensors;
use model::net::Model;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

/// Where one of our tensors lives in their checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub enum Theirs {
    /// The same values under their name.
    Same(String),
    /// Our `(C, K)` depthwise convolution taps, theirs `(C, 1, K)`.
    Conv(String),
    /// Our rows, split in order among several of their tensors (`rows` each): a fused
    /// projection of ours (`qkv`, SwiGLU's `[gate; up]`) that they keep apart.
    Rows(Vec<(String, usize)>),
}

/// Their tensors, from our `model` through `mapping` (our name → where it goes), and how many
/// of ours `left_out` kept out. Every other tensor of the model must be in the mapping.
pub fn to_theirs(
    model: &Model,
    mapping: &[(String, Theirs)],
    left_out: impl Fn(&str) -> bool,
) -> Result<(BTreeMap<String, Tensor>, usize), String> {
    let ours = model_tensors(model).map_err(|e| e.to_string())?;
    let mapped: HashSet<&str> = mapping.iter().map(|(n, _)| n.as_str()).collect();
    if let Some(name) = ours
        .keys()
        .find(|n| !mapped.contains(n.as_str()) && !left_out(n))
    {
        return Err(format!("no place for the tensor `{name}`"));
    }
    let kept_out = ours.keys().filter(|n| left_out(n)).count();
    let mut out = BTreeMap::new();
    for (name, theirs) in mapping {
        let t = ours
            .get(name)
            .ok_or_else(|| format!("the model has no tensor `{name}`"))?;
        let bad = |e: candle_core::Error| format!("{name}: {e}");
        match theirs {
            Theirs::Same(to) => {
                out.insert(to.clone(), t.contiguous().map_err(bad)?);
            }
            Theirs::Conv(to) => {
                let (c, k) = t.dims2().map_err(bad)?;
                out.insert(to.clone(), t.reshape((c, 1, k)).map_err(bad)?);
            }
            Theirs::Rows(parts) => {
                let mut first = 0;
                for (to, rows) in parts {
                    let part = t.narrow(0, first, *rows).map_err(bad)?;
                    out.insert(to.clone(), part.contiguous().map_err(bad)?);
                    first += rows;
                }
            }
        }
    }
    Ok((out, kept_out))
}

/// Our tensors, from theirs through `mapping`. Every tensor of theirs must be used, except
/// those `ignored` accepts (counted in the second value): a tensor we would drop is an error,
/// never a silently different model.
pub fn to_ours(
    theirs: &HashMap<String, Tensor>,
    mapping: &[(String, Theirs)],
    ignored: impl Fn(&str) -> bool,
) -> Result<(HashMap<String, Tensor>, usize), String> {
    let mut used = HashSet::new();
    let mut take = |name: &str| -> Result<Tensor, String> {
        used.insert(name.to_string());
        theirs
            .get(name)
            .cloned()
            .ok_or_else(|| format!("the checkpoint has no tensor `{name}`"))
    };
    let mut ours = HashMap::new();
    for (name, from) in mapping {
        if ours.contains_key(name) {
            return Err(format!("internal: `{name}` is read from two tensors"));
        }
        let bad = |e: candle_core::Error| format!("{name}: {e}");
        let t = match from {
            Theirs::Same(from) => take(from)?,
            Theirs::Conv(from) => {
                let t = take(from)?;
                match t.dims() {
                    &[c, 1, k] => t.reshape((c, k)).map_err(bad)?,
                    dims => return Err(format!("`{from}` has shape {dims:?}, not (C, 1, K)")),
                }
            }
            Theirs::Rows(parts) => {
                let mut tensors = Vec::with_capacity(parts.len());
                for (from, rows) in parts {
                    let t = take(from)?;
                    if t.dims().first() != Some(rows) {
                        return Err(format!(
                            "`{from}` has shape {:?}; the model needs {rows} rows there",
                            t.dims()
                        ));
                    }
                    tensors.push(t);
                }
                Tensor::cat(&tensors, 0).map_err(bad)?
            }
        };
        ours.insert(name.clone(), t);
    }
    let mut unused: Vec<&String> = theirs
        .keys()
        .filter(|n| !used.contains(*n) && !ignored(n))
        .collect();
    unused.sort();
    if let Some(first) = unused.first() {
        return Err(format!(
            "{} tensor(s) of the checkpoint have no place in the model, first `{first}`",
            unused.len()
        ));
    }
    let skipped = theirs.keys().filter(|n| !used.contains(*n)).count();
    Ok((ours, skipped))
}

/// A directory's `config.json` and every tensor of its safetensors (`model.safetensors`, or
/// the shards `model.safetensors.index.json` lists), as f32 on the CPU. f32, bf16 and f16 are
/// read; any other dtype is an error naming the tensor.
pub fn read_dir(dir: &Path) -> Result<(Value, HashMap<String, Tensor>), String> {
    let config_path = dir.join("config.json");
    let text = std::fs::read_to_string(&config_path)
        .map_err(|e| format!("{}: {e}", config_path.display()))?;
    let config: Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", config_path.display()))?;
    let files = shard_files(dir)?;
    let mut tensors = HashMap::new();
    for file in files {
        let path = dir.join(&file);
        let loaded = candle_core::safetensors::load(&path, &Device::Cpu)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        for (name, t) in loaded {
            let t = match t.dtype() {
                DType::F32 => t,
                DType::BF16 | DType::F16 => t
                    .to_dtype(DType::F32)
                    .map_err(|e| format!("{}: {name}: {e}", path.display()))?,
                other => {
                    return Err(format!(
                        "{}: `{name}` is {other:?}; only f32, bf16 and f16 weights are read",
                        path.display()
                    ));
                }
            };
            if tensors.contains_key(&name) {
                return Err(format!(
                    "{}: `{name}` is in more than one shard",
                    path.display()
                ));
            }
            tensors.insert(name, t);
        }
    }
    Ok((config, tensors))
}

/// The safetensors files of a Hugging Face directory: the shards its
/// `model.safetensors.index.json` lists, each once, or `model.safetensors`.
pub fn shard_files(dir: &Path) -> Result<Vec<String>, String> {
    let index = dir.join("model.safetensors.index.json");
    if !index.is_file() {
        return Ok(vec!["model.safetensors".to_string()]);
    }
    let text = std::fs::read_to_string(&index).map_err(|e| format!("{}: {e}", index.display()))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", index.display()))?;
    let map = v["weight_map"]
        .as_object()
        .ok_or_else(|| format!("{}: no `weight_map` object", index.display()))?;
    let mut files: Vec<String> = map
        .values()
        .filter_map(|f| f.as_str().map(str::to_string))
        .collect();
    files.sort();
    files.dedup();
    if let Some(file) = files.iter().find(|f| f.contains('/') || f.contains("..")) {
        return Err(format!(
            "{}: shard `{file}` is outside the directory",
            index.display()
        ));
    }
    Ok(files)
}

/// The names of a safetensors file's tensors, read from its header alone (a shard may be
/// gigabytes), once the header is whole and the data it describes fills exactly the rest of
/// the file: a shard cut short by a failed write is an error, not a model.
pub fn shard_tensors(path: &Path) -> Result<Vec<String>, String> {
    use std::io::Read;
    let fail = |why: String| format!("{}: {why}", path.display());
    let mut file = std::fs::File::open(path).map_err(|e| fail(e.to_string()))?;
    let size = file.metadata().map_err(|e| fail(e.to_string()))?.len();
    let mut len = [0u8; 8];
    file.read_exact(&mut len)
        .map_err(|_| fail("shorter than a safetensors header".into()))?;
    let len = u64::from_le_bytes(len);
    if len > size.saturating_sub(8) || len > 100 << 20 {
        return Err(fail(format!(
            "its header claims {len} bytes, but the file has {size}"
        )));
    }
    let mut header = vec![0u8; len as usize];
    file.read_exact(&mut header)
        .map_err(|e| fail(e.to_string()))?;
    let header: serde_json::Map<String, Value> =
        serde_json::from_slice(&header).map_err(|e| fail(format!("header: {e}")))?;
    let mut end = 0u64;
    let mut names = Vec::new();
    for (name, info) in &header {
        if name == "__metadata__" {
            continue;
        }
        let offsets = info["data_offsets"]
            .as_array()
            .and_then(|o| Some((o.first()?.as_u64()?, o.get(1)?.as_u64()?)));
        let Some((_, to)) = offsets.filter(|(from, to)| from <= to) else {
            return Err(fail(format!("`{name}` has no valid data_offsets")));
        };
        end = end.max(to);
        names.push(name.clone());
    }
    let data = size - 8 - len;
    if end != data {
        return Err(fail(format!(
            "the header describes {end} bytes of tensor data, but {data} follow it (a partial write?)"
        )));
    }
    Ok(names)
}

/// `config.json` and `model.safetensors` into `out` (created if needed).
pub fn write_dir(
    out: &Path,
    config: &Value,
    tensors: BTreeMap<String, Tensor>,
) -> Result<(), String> {
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    let tensors: HashMap<String, Tensor> = tensors.into_iter().collect();
    candle_core::safetensors::save(&tensors, out.join("model.safetensors"))
        .map_err(|e| e.to_string())?;
    let text = serde_json::to_string_pretty(config).map_err(|e| e.to_string())?;
    std::fs::write(out.join("config.json"), text + "\n").map_err(|e| e.to_string())
}

/// A config key as an unsigned number, or why not.
pub(crate) fn usize_of(c: &Value, key: &str) -> Result<usize, String> {
    c[key]
        .as_u64()
        .map(|v| v as usize)
        .ok_or_else(|| format!("config.json: `{key}` is missing or not a whole number"))
}

/// `num_key_value_heads` (every head when absent) and `head_dim` (hidden / heads when absent),
/// as transformers reads them.
pub(crate) fn head_sizes(c: &Value, hidden: usize, heads: usize) -> (usize, usize) {
    let kv_heads = c["num_key_value_heads"]
        .as_u64()
        .map_or(heads, |k| k as usize);
    let head_dim = c["head_dim"]
        .as_u64()
        .map_or(hidden / heads.max(1), |d| d as usize);
    (kv_heads, head_dim)
}

/// A config key as a number, or `default` when it is absent.
pub(crate) fn f64_or(c: &Value, key: &str, default: f64) -> Result<f64, String> {
    match &c[key] {
        Value::Null => Ok(default),
        v => v
            .as_f64()
            .ok_or_else(|| format!("config.json: `{key}` is not a number")),
    }
}

/// An error unless the boolean config key is `want` (or absent and `absent` equals `want`).
pub(crate) fn require_bool(c: &Value, key: &str, absent: bool, want: bool) -> Result<(), String> {
    let v = match &c[key] {
        Value::Null => absent,
        v => v
            .as_bool()
            .ok_or_else(|| format!("config.json: `{key}` is not true or false"))?,
    };
    if v != want {
        return Err(format!(
            "config.json: `{key}: {v}` is not implemented (nemo-dag's models have {key} {want})"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::scratch;

    fn t(values: &[f32], dtype: DType) -> Tensor {
        Tensor::new(values, &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    }

    /// Sharded checkpoints are read through their index; bf16 and f16 come back as f32 with
    /// their values; a dtype we do not read is named with its tensor.
    #[test]
    fn shards_and_half_precision_are_read_as_f32() {
        let dir = scratch("hf-shards");
        std::fs::write(dir.join("config.json"), r#"{"architectures": ["X"]}"#).unwrap();
        let one = HashMap::from([("a".to_string(), t(&[1.5, -2.0], DType::BF16))]);
        let two = HashMap::from([("b".to_string(), t(&[0.25], DType::F16))]);
        candle_core::safetensors::save(&one, dir.join("m-1.safetensors")).unwrap();
        candle_core::safetensors::save(&two, dir.join("m-2.safetensors")).unwrap();
        let index = r#"{"weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors"}}"#;
        std::fs::write(dir.join("model.safetensors.index.json"), index).unwrap();
        let (config, tensors) = read_dir(&dir).unwrap();
        assert_eq!(config["architectures"][0], "X");
        let values = |n: &str| tensors[n].to_vec1::<f32>().unwrap();
        assert_eq!((values("a"), values("b")), (vec![1.5, -2.0], vec![0.25]));

        let ints = HashMap::from([("c".to_string(), t(&[1.0], DType::U32))]);
        candle_core::safetensors::save(&ints, dir.join("m-1.safetensors")).unwrap();
        let why = read_dir(&dir).unwrap_err();
        assert!(why.contains("`c` is U32"), "{why}");

        let twice = r#"{"weight_map": {"a": "m-1.safetensors", "b": "m-3.safetensors"}}"#;
        candle_core::safetensors::save(&one, dir.join("m-1.safetensors")).unwrap();
        candle_core::safetensors::save(&one, dir.join("m-3.safetensors")).unwrap();
        std::fs::write(dir.join("model.safetensors.index.json"), twice).unwrap();
        assert!(
            read_dir(&dir)
                .unwrap_err()
                .contains("in more than one shard")
        );

        let outside = r#"{"weight_map": {"a": "../elsewhere.safetensors"}}"#;
        std::fs::write(dir.join("model.safetensors.index.json"), outside).unwrap();
        assert!(
            read_dir(&dir)
                .unwrap_err()
                .contains("outside the directory")
        );
    }

    /// A fused projection's parts must each have their own rows: two swapped parts with the
    /// same total are refused, not concatenated into another model.
    #[test]
    fn each_part_of_a_fused_projection_has_its_rows() {
        let mapping = [(
            "qkv".to_string(),
            Theirs::Rows(vec![("q".into(), 2), ("k".into(), 1)]),
        )];
        let theirs = HashMap::from([
            (
                "q".to_string(),
                t(&[1.0], DType::F32).reshape((1, 1)).unwrap(),
            ),
            (
                "k".to_string(),
                t(&[2.0, 3.0], DType::F32).reshape((2, 1)).unwrap(),
            ),
        ]);
        let why = to_ours(&theirs, &mapping, |_| false).unwrap_err();
        assert!(
            why.contains("`q` has shape [1, 1]; the model needs 2 rows"),
            "{why}"
        );
        let right = HashMap::from([
            (
                "q".to_string(),
                t(&[1.0, 2.0], DType::F32).reshape((2, 1)).unwrap(),
            ),
            (
                "k".to_string(),
                t(&[3.0], DType::F32).reshape((1, 1)).unwrap(),
            ),
        ]);
        let (ours, skipped) = to_ours(&right, &mapping, |_| false).unwrap();
        assert_eq!(skipped, 0);
        assert_eq!(
            ours["qkv"].flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            [1.0, 2.0, 3.0]
        );
    }
}
