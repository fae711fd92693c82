//! Sweeps: a stage's `matrix:`.
//!
//! A stage that declares `matrix: {lr: [1e-4, 3e-4], warmup: [10, 50]}` becomes one stage per
//! combination of the values, named by it (`sft[lr=1e-4,warmup=10]`), with each axis set in its
//! `params`. An axis is a param path, so `optimizer.lr` sets `params.optimizer.lr`.
//!
//! A stage that consumes a swept stage's output is swept with it: one copy per upstream copy,
//! named by the same values (`eval[lr=1e-4,warmup=10]` reads `sft[lr=1e-4,warmup=10]`). Stages
//! upstream of a sweep are not copied: they keep one key and run once for the whole sweep. Where
//! two sweeps meet downstream their combinations multiply, and the axes are then named by the
//! stage that declares them (`eval[dpo.beta=0.1,sft.lr=1e-4]`). A stage that reads two copies of
//! one sweep (`sft` and `dpo` of the same `lr`) reads matching ones.
//!
//! This module decides the copies, their names and what each sets; [`crate::manifest`] makes
//! the stages. Names depend only on the manifest's text, so `--target` and `show` can name a
//! copy, and the same manifest always gives the same names.

use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// The most combinations one `matrix:` may declare.
pub const MAX_COMBINATIONS: usize = 256;
/// The most stages a manifest may expand into.
pub const MAX_STAGES: usize = 4096;

/// Where a copy sits in its sweep.
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    /// The stage as the manifest declares it (`sft`).
    pub base: String,
    /// Each axis and its value here, in the order the name gives them (`lr` → 1e-4).
    pub values: Vec<(String, Value)>,
    /// Its place among the copies of its stage: the matrix's order, the first axis slowest.
    pub ordinal: usize,
}

impl Point {
    /// The point as its copy's name gives it: `lr=1e-4,warmup=10`.
    pub fn text(&self) -> String {
        let each: Vec<String> = self
            .values
            .iter()
            .map(|(k, v)| format!("{k}={}", label(v)))
            .collect();
        each.join(",")
    }
}

/// A stage as the manifest declares it, as much of it as a sweep needs.
pub struct Declared<'a> {
    pub name: &'a str,
    pub matrix: Option<&'a Value>,
    pub params: &'a Value,
    /// The stages whose outputs it reads.
    pub upstream: BTreeSet<&'a str>,
}

/// One copy of a swept stage.
#[derive(Debug, Clone, PartialEq)]
pub struct Copy {
    pub name: String,
    pub point: Point,
    /// The params this copy sets: (path under `params`, value).
    pub set: Vec<(Vec<String>, Value)>,
    /// For each swept upstream stage, the name of the copy this one reads.
    pub upstream: BTreeMap<String, String>,
}

/// A bad `matrix:`: the manifest path it is about, and what is wrong.
#[derive(Debug, PartialEq)]
pub struct SweepError {
    pub path: Vec<String>,
    /// Point at the key rather than its value.
    pub at_key: bool,
    pub message: String,
    pub help: Option<String>,
}

/// The copies of every swept stage, by declared name; empty when no stage declares a matrix.
/// A manifest with a cycle is left alone: loading it reports the cycle.
pub fn expand(stages: &[Declared]) -> Result<BTreeMap<String, Vec<Copy>>, SweepError> {
    let mut matrices = BTreeMap::new();
    for s in stages {
        if let Some(m) = s.matrix {
            matrices.insert(s.name, Matrix::parse(s, m)?);
        }
    }
    if matrices.is_empty() {
        return Ok(BTreeMap::new());
    }
    let Some(order) = order(stages) else {
        return Ok(BTreeMap::new());
    };
    let by_name: HashMap<&str, &Declared> = stages.iter().map(|s| (s.name, s)).collect();
    // Each swept stage's bindings: for every sweep it belongs to, which combination.
    let mut bindings: HashMap<&str, Vec<Binding>> = HashMap::new();
    let mut names: HashMap<(&str, Binding), String> = HashMap::new();
    let mut copies = BTreeMap::new();
    let mut total = 0usize;
    for name in order {
        let stage = by_name[name];
        let too_many = |copies: usize| SweepError {
            path: vec!["stages".into(), name.into()],
            at_key: true,
            message: format!(
                "the sweep makes more than {MAX_STAGES} stages by `{name}` (at least {copies} copies of it)"
            ),
            help: Some("sweep fewer values, or split the sweep across manifests".into()),
        };
        let room = MAX_STAGES.saturating_sub(total);
        let mut mine: Vec<Binding> = vec![Binding::new()];
        for up in &stage.upstream {
            if let Some(theirs) = bindings.get(up) {
                mine = join(&mine, theirs, room).ok_or_else(|| too_many(room + 1))?;
            }
        }
        if let Some(m) = matrices.get(name) {
            if mine.len().saturating_mul(m.combinations.len()) > room {
                return Err(too_many(mine.len().saturating_mul(m.combinations.len())));
            }
            mine = mine
                .iter()
                .flat_map(|b| {
                    (0..m.combinations.len()).map(move |i| {
                        let mut b = b.clone();
                        b.insert(name, i);
                        b
                    })
                })
                .collect();
        }
        if mine.len() == 1 && mine[0].is_empty() {
            total += 1;
            continue;
        }
        total += mine.len();
        if total > MAX_STAGES {
            return Err(too_many(mine.len()));
        }
        let mut list = Vec::with_capacity(mine.len());
        for b in &mine {
            let qualified = b.len() > 1;
            let mut values = Vec::new();
            for (origin, &i) in b {
                let m = &matrices[origin];
                for (axis, &v) in m.axes.iter().zip(&m.combinations[i]) {
                    let label = if qualified {
                        format!("{origin}.{}", axis.name)
                    } else {
                        axis.name.clone()
                    };
                    values.push((label, axis.values[v].clone()));
                }
            }
            let point = Point {
                base: name.to_string(),
                values,
                ordinal: list.len(),
            };
            let copy_name = format!("{name}[{}]", point.text());
            let length = copy_name.chars().count();
            if length > crate::manifest::MAX_STAGE_NAME {
                return Err(SweepError {
                    path: vec!["stages".into(), name.into()],
                    at_key: true,
                    message: format!(
                        "the sweep names a stage `{copy_name}`, {length} characters long; a name has at most {} characters",
                        crate::manifest::MAX_STAGE_NAME
                    ),
                    help: Some("use shorter stage names, axis names or values".into()),
                });
            }
            let set = match (matrices.get(name), b.get(name)) {
                (Some(m), Some(&i)) => m
                    .axes
                    .iter()
                    .zip(&m.combinations[i])
                    .map(|(axis, &v)| (axis.path.clone(), axis.values[v].clone()))
                    .collect(),
                _ => Vec::new(),
            };
            let upstream = stage
                .upstream
                .iter()
                .filter_map(|up| {
                    let theirs = bindings.get(up)?.first()?;
                    let restricted: Binding = b
                        .iter()
                        .filter(|(o, _)| theirs.contains_key(*o))
                        .map(|(o, i)| (*o, *i))
                        .collect();
                    Some((up.to_string(), names.get(&(*up, restricted))?.clone()))
                })
                .collect();
            names.insert((name, b.clone()), copy_name.clone());
            list.push(Copy {
                name: copy_name,
                point,
                set,
                upstream,
            });
        }
        bindings.insert(name, mine);
        copies.insert(name.to_string(), list);
    }
    Ok(copies)
}

/// For each sweep (by its declaring stage), which of its combinations.
type Binding<'a> = BTreeMap<&'a str, usize>;

/// Every consistent union of one binding from each list: two sweeps multiply, and one sweep
/// reached by two paths keeps one combination. `None` past `limit` bindings, before making
/// them. The bindings of one list all name the same sweeps, so each pair that agrees on the
/// sweeps both name makes a different union.
fn join<'a>(left: &[Binding<'a>], right: &[Binding<'a>], limit: usize) -> Option<Vec<Binding<'a>>> {
    let shared: Vec<&str> = match (left.first(), right.first()) {
        (Some(a), Some(b)) => a.keys().filter(|k| b.contains_key(*k)).copied().collect(),
        _ => return Some(Vec::new()),
    };
    let on_shared = |b: &Binding| -> Vec<usize> { shared.iter().map(|k| b[k]).collect() };
    let mut by_shared: HashMap<Vec<usize>, Vec<&Binding>> = HashMap::new();
    for b in right {
        by_shared.entry(on_shared(b)).or_default().push(b);
    }
    let mut out: Vec<Binding> = Vec::new();
    for a in left {
        for b in by_shared.get(&on_shared(a)).into_iter().flatten() {
            if out.len() == limit {
                return None;
            }
            let mut merged = a.clone();
            merged.extend(b.iter().map(|(k, v)| (*k, *v)));
            out.push(merged);
        }
    }
    Some(out)
}

/// Declared stages, each after the stages it reads; `None` when they form a cycle.
fn order<'a>(stages: &[Declared<'a>]) -> Option<Vec<&'a str>> {
    let known: BTreeSet<&str> = stages.iter().map(|s| s.name).collect();
    let mut waiting: BTreeMap<&str, usize> = BTreeMap::new();
    let mut readers: HashMap<&str, Vec<&str>> = HashMap::new();
    for s in stages {
        let ups: Vec<&str> = s
            .upstream
            .iter()
            .copied()
            .filter(|u| known.contains(u))
            .collect();
        waiting.insert(s.name, ups.len());
        for u in ups {
            readers.entry(u).or_default().push(s.name);
        }
    }
    let mut ready: Vec<&str> = waiting
        .iter()
        .filter(|(_, n)| **n == 0)
        .map(|(s, _)| *s)
        .collect();
    let mut out = Vec::with_capacity(stages.len());
    while let Some(s) = ready.pop() {
        out.push(s);
        for r in readers.get(s).into_iter().flatten() {
            let n = waiting.entry(r).or_default();
            *n -= 1;
            if *n == 0 {
                ready.push(r);
            }
        }
    }
    (out.len() == stages.len()).then_some(out)
}

struct Axis {
    /// As written: `lr`, `optimizer.lr`.
    name: String,
    path: Vec<String>,
    values: Vec<Value>,
}

struct Matrix {
    /// In name order.
    axes: Vec<Axis>,
    /// Each combination: one value index per axis, the first axis varying slowest.
    combinations: Vec<Vec<usize>>,
}

impl Matrix {
    fn parse(stage: &Declared, value: &Value) -> Result<Matrix, SweepError> {
        let at = |rest: &[&str], at_key: bool, message: String, help: Option<&str>| {
            let mut path = vec![
                "stages".to_string(),
                stage.name.to_string(),
                "matrix".into(),
            ];
            path.extend(rest.iter().map(|s| s.to_string()));
            SweepError {
                path,
                at_key,
                message: format!("stage `{}`: matrix{}: {message}", stage.name, {
                    let dotted: Vec<&str> = rest.to_vec();
                    if dotted.is_empty() {
                        String::new()
                    } else {
                        format!(".{}", dotted.join("."))
                    }
                }),
                help: help.map(str::to_string),
            }
        };
        let example = "e.g. `matrix: {lr: [1.0e-4, 3.0e-4], warmup: [10, 50]}`";
        let Some(map) = value.as_object().filter(|m| !m.is_empty()) else {
            return Err(at(
                &[],
                false,
                "must map param names to lists of values".into(),
                Some(example),
            ));
        };
        let mut axes = Vec::new();
        for (name, values) in map {
            let path: Vec<String> = name.split('.').map(str::to_string).collect();
            let ident =
                |s: &str| !s.is_empty() && s.chars().all(|c| c.is_alphanumeric() || c == '_');
            if !path.iter().all(|p| ident(p)) {
                return Err(at(
                    &[name],
                    true,
                    format!(
                        "`{name}` is not a param name; an axis names a param, or a path into one (`optimizer.lr`)"
                    ),
                    None,
                ));
            }
            let mut node = stage.params;
            for (depth, seg) in path[..path.len() - 1].iter().enumerate() {
                match node.get(seg) {
                    Some(next) if next.is_object() => node = next,
                    None => break,
                    Some(_) => {
                        return Err(at(
                            &[name],
                            true,
                            format!(
                                "params.{} is not a mapping, so there is no `{name}` to sweep",
                                path[..=depth].join(".")
                            ),
                            None,
                        ));
                    }
                }
            }
            let Some(list) = values.as_array().filter(|l| !l.is_empty()) else {
                return Err(at(
                    &[name],
                    false,
                    "must be a non-empty list of values".into(),
                    Some(example),
                ));
            };
            let mut seen: BTreeMap<String, usize> = BTreeMap::new();
            for (i, v) in list.iter().enumerate() {
                let index = i.to_string();
                let ok = match v {
                    Value::Number(_) | Value::Bool(_) => true,
                    Value::String(s) => {
                        !s.is_empty()
                            && s.chars().all(|c| c.is_alphanumeric() || "_.+-".contains(c))
                    }
                    _ => false,
                };
                if !ok {
                    return Err(at(
                        &[name, &index],
                        false,
                        format!(
                            "{v} cannot name a stage: a swept value is a number, true/false, or a word of letters, digits, `_`, `.`, `+` and `-`"
                        ),
                        None,
                    ));
                }
                if let Some(first) = seen.insert(label(v), i) {
                    return Err(at(
                        &[name, &index],
                        false,
                        format!("value {} repeats value {first}", label(v)),
                        None,
                    ));
                }
            }
            axes.push(Axis {
                name: name.clone(),
                path,
                values: list.clone(),
            });
        }
        // `opt` and `opt.lr` would both set `params.opt`: the second would undo the first.
        for (i, a) in axes.iter().enumerate() {
            if let Some(b) = axes[i + 1..].iter().find(|b| b.path.starts_with(&a.path)) {
                return Err(at(
                    &[&b.name],
                    true,
                    format!(
                        "`{}` is inside `{}`, which the matrix also sweeps",
                        b.name, a.name
                    ),
                    Some("sweep one or the other"),
                ));
            }
        }
        let count = axes
            .iter()
            .try_fold(1usize, |n, a| n.checked_mul(a.values.len()))
            .filter(|n| *n <= MAX_COMBINATIONS);
        let Some(count) = count else {
            return Err(at(
                &[],
                false,
                format!("more than {MAX_COMBINATIONS} combinations"),
                Some("sweep fewer values"),
            ));
        };
        let mut combinations = Vec::with_capacity(count);
        for mut i in 0..count {
            let mut combo = vec![0; axes.len()];
            for (slot, axis) in combo.iter_mut().zip(&axes).rev() {
                *slot = i % axis.values.len();
                i /= axis.values.len();
            }
            combinations.push(combo);
        }
        Ok(Matrix { axes, combinations })
    }
}

/// A value as a stage name shows it: numbers in their shorter form (`1e-4`, not `0.0001`).
pub fn label(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Number(n) if n.is_f64() => {
            let x = n.as_f64().unwrap_or_default();
            let plain = format!("{x}");
            let exp = format!("{x:e}");
            if exp.len() < plain.len() { exp } else { plain }
        }
        other => other.to_string(),
    }
}

/// Set `path` under `params` to `value`, making the mappings on the way.
pub fn set(params: &mut Value, path: &[String], value: Value) {
    let mut node = params;
    for seg in path {
        if !node.is_object() {
            *node = Value::Object(Default::default());
        }
        let Value::Object(m) = node else { return };
        node = m.entry(seg.clone()).or_insert(Value::Null);
    }
    *node = value;
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn declared<'a>(
        name: &'a str,
        matrix: Option<&'a Value>,
        params: &'a Value,
        upstream: &[&'a str],
    ) -> Declared<'a> {
        Declared {
            name,
            matrix,
            params,
            upstream: upstream.iter().copied().collect(),
        }
    }

    fn names(copies: &BTreeMap<String, Vec<Copy>>, stage: &str) -> Vec<String> {
        copies[stage].iter().map(|c| c.name.clone()).collect()
    }

    #[test]
    fn a_matrix_multiplies_its_axes_and_downstream_follows_one_copy_each() {
        let p = json!({"lr": 1.0, "optimizer": {"warmup": 5}});
        let m = json!({"lr": [1e-4, 3e-4], "optimizer.warmup": [10, 50]});
        let none = json!({});
        let stages = [
            declared("data", None, &none, &[]),
            declared("sft", Some(&m), &p, &["data"]),
            declared("eval", None, &none, &["sft", "data"]),
        ];
        let copies = expand(&stages).unwrap();
        assert!(
            !copies.contains_key("data"),
            "upstream of a sweep is shared"
        );
        assert_eq!(
            names(&copies, "sft"),
            [
                "sft[lr=1e-4,optimizer.warmup=10]",
                "sft[lr=1e-4,optimizer.warmup=50]",
                "sft[lr=3e-4,optimizer.warmup=10]",
                "sft[lr=3e-4,optimizer.warmup=50]",
            ]
        );
        let third = &copies["sft"][2];
        assert_eq!(
            third.set,
            [
                (vec!["lr".to_string()], json!(3e-4)),
                (vec!["optimizer".into(), "warmup".into()], json!(10)),
            ]
        );
        let eval = &copies["eval"];
        assert_eq!(eval.len(), 4);
        assert_eq!(eval[2].name, "eval[lr=3e-4,optimizer.warmup=10]");
        assert_eq!(eval[2].upstream["sft"], third.name);
        assert!(eval[2].set.is_empty(), "eval's own params are untouched");
        assert_eq!(eval[2].point.base, "eval");
    }

    #[test]
    fn two_sweeps_multiply_and_one_sweep_reached_twice_stays_matched() {
        let none = json!({});
        let lr = json!({"lr": [1, 2]});
        let beta = json!({"beta": [0.1, 0.5, 0.9]});
        let stages = [
            declared("sft", Some(&lr), &none, &[]),
            declared("dpo", Some(&beta), &none, &["sft"]),
            declared("eval", None, &none, &["sft", "dpo"]),
        ];
        let copies = expand(&stages).unwrap();
        assert_eq!(copies["dpo"].len(), 6);
        assert_eq!(copies["dpo"][0].name, "dpo[dpo.beta=0.1,sft.lr=1]");
        // eval reads sft and dpo: 2 × 3, never sft of one lr with dpo of the other.
        assert_eq!(copies["eval"].len(), 6);
        for e in &copies["eval"] {
            let sft = &e.upstream["sft"];
            let dpo = &e.upstream["dpo"];
            let lr = sft.trim_start_matches("sft[lr=").trim_end_matches(']');
            assert!(dpo.contains(&format!("sft.lr={lr}]")), "{sft} with {dpo}");
        }
    }

    /// Two sweeps of 256 meeting downstream are refused before their product is made; one
    /// sweep of 256 reached by two paths is not a product and passes.
    #[test]
    fn the_stage_limit_holds_before_the_product_is_made() {
        let none = json!({});
        let a = json!({"x": (0..256).collect::<Vec<i32>>()});
        let b = json!({"y": (0..256).collect::<Vec<i32>>()});
        let stages = [
            declared("a", Some(&a), &none, &[]),
            declared("b", Some(&b), &none, &[]),
            declared("c", None, &none, &["a", "b"]),
        ];
        let clock = std::time::Instant::now();
        let e = expand(&stages).unwrap_err();
        assert_eq!(e.path, ["stages", "c"]);
        assert!(e.message.contains("more than 4096 stages"), "{}", e.message);
        assert!(clock.elapsed() < std::time::Duration::from_secs(1));
        let stages = [
            declared("a", Some(&a), &none, &[]),
            declared("l", None, &none, &["a"]),
            declared("r", None, &none, &["a"]),
            declared("c", None, &none, &["l", "r"]),
        ];
        assert_eq!(expand(&stages).unwrap()["c"].len(), 256);
    }

    #[test]
    fn without_a_matrix_nothing_expands() {
        let none = json!({});
        let stages = [
            declared("a", None, &none, &[]),
            declared("b", None, &none, &["a"]),
        ];
        assert!(expand(&stages).unwrap().is_empty());
    }

    #[test]
    fn numbers_are_named_in_their_shorter_form() {
        assert_eq!(label(&json!(0.0001)), "1e-4");
        assert_eq!(label(&json!(0.00025)), "2.5e-4");
        assert_eq!(label(&json!(0.5)), "0.5");
        assert_eq!(label(&json!(100.0)), "100");
        assert_eq!(label(&json!(12)), "12");
        assert_eq!(label(&json!(true)), "true");
        assert_eq!(label(&json!("cosine")), "cosine");
    }

    #[test]
    fn bad_matrices_are_errors_at_their_place() {
        let p = json!({"opt": 3});
        let err = |m: Value| {
            let stages = [declared("sft", Some(&m), &p, &[])];
            match expand(&stages) {
                Err(e) => (e.path.join("."), e.message),
                Ok(c) => panic!("{m} expanded: {c:?}"),
            }
        };
        let (path, msg) = err(json!([1, 2]));
        assert_eq!(path, "stages.sft.matrix");
        assert!(msg.contains("must map param names"), "{msg}");
        let (path, msg) = err(json!({"lr": []}));
        assert_eq!(path, "stages.sft.matrix.lr");
        assert!(msg.contains("non-empty list"), "{msg}");
        let (path, msg) = err(json!({"lr": 3}));
        assert_eq!(path, "stages.sft.matrix.lr");
        assert!(msg.contains("non-empty list"), "{msg}");
        let (path, msg) = err(json!({"lr": [1, {"a": 1}]}));
        assert_eq!(path, "stages.sft.matrix.lr.1");
        assert!(msg.contains("cannot name a stage"), "{msg}");
        let (path, _) = err(json!({"name": ["a b"]}));
        assert_eq!(path, "stages.sft.matrix.name.0");
        let (path, msg) = err(json!({"lr": [0.0001, 1e-4]}));
        assert_eq!(path, "stages.sft.matrix.lr.1");
        assert!(msg.contains("repeats value 0"), "{msg}");
        let (path, msg) = err(json!({"opt.lr": [1]}));
        assert_eq!(path, "stages.sft.matrix.opt.lr");
        assert!(msg.contains("params.opt is not a mapping"), "{msg}");
        let (_, msg) = err(json!({"a b": [1]}));
        assert!(msg.contains("is not a param name"), "{msg}");
        let (path, msg) = err(json!({"lr": [1], "lr.x": [2]}));
        assert_eq!(path, "stages.sft.matrix.lr.x");
        assert!(msg.contains("inside `lr`"), "{msg}");
        let many: Vec<i32> = (0..17).collect();
        let (path, msg) = err(json!({"a": many, "b": many}));
        assert_eq!(path, "stages.sft.matrix");
        assert!(msg.contains("more than 256 combinations"), "{msg}");
    }

    #[test]
    fn set_makes_the_mappings_on_the_way() {
        let mut p = json!({"a": 1});
        set(&mut p, &["b".into(), "c".into()], json!(2));
        set(&mut p, &["a".into()], json!(3));
        assert_eq!(p, json!({"a": 3, "b": {"c": 2}}));
    }
}
