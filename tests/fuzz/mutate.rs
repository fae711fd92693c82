//! Cases for the fuzzer: a seed (a shipped manifest or a file of the corpus), changed by
//! mutations that know what a manifest is (its tree: values, keys, stages, `cmd` lines,
//! `resources`, overrides, a variant) and by byte-level ones (tokens of YAML, TOML, Jinja and
//! the shell, splices, repeats, truncation, bytes that are not UTF-8).

use serde_json::{Map, Value, json};

/// A seeded generator (splitmix64): the same seed gives the same cases.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }

    /// True `percent` times in a hundred.
    pub fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// A manifest file to load, with its variant and override arguments.
#[derive(Clone, Debug)]
pub struct Case {
    /// `m.yaml` or `m.toml`.
    pub file: String,
    pub text: Vec<u8>,
    /// `-c NAME` and the variant file's bytes (`m/NAME.yaml`).
    pub variant: Option<(String, Vec<u8>)>,
    pub overrides: Vec<String>,
    /// A command line for the `cmd` op's check, with the case's params.
    pub cmd: String,
}

/// A seed as it is.
pub fn plain(file: &str, text: &[u8], overrides: Vec<String>) -> Case {
    Case {
        file: file.to_string(),
        text: text.to_vec(),
        variant: None,
        overrides,
        cmd: String::new(),
    }
}

/// Tokens a mutation inserts: the syntax of everything the loader reads.
const TOKENS: &[&str] = &[
    "{{",
    "}}",
    "{%",
    "%}",
    "{{ n }}",
    "{{ undefined }}",
    "{% for i in range(1000) %}",
    "{% endfor %}",
    "{% if true %}",
    "{% endif %}",
    "{{ 'a' * 1000 }}",
    "{{ range(10) | list }}",
    "{% raw %}",
    "{% endraw %}",
    "{# ",
    " #}",
    "{{ x.y.z }}",
    "{% set x = [1,2] %}",
    "&a ",
    "*a",
    "<<: *a\n",
    "- ",
    ": ",
    "? ",
    "\"",
    "'",
    "[",
    "]",
    "{",
    "}",
    "\n",
    "\r\n",
    "\t",
    " ",
    "#",
    "---\n",
    "...\n",
    "!!str ",
    "!!binary ",
    "!custom ",
    "~",
    "null",
    "1e309",
    "-0",
    "0x",
    "0o7",
    ".inf",
    "é",
    "\u{202e}",
    "\u{0}",
    "😀",
    "\u{feff}",
    "|\n",
    ">-\n",
    "|+\n",
    "{params.x}",
    "{params.n}",
    "{inputs.",
    "{outputs.o}",
    "{outputs.nums}",
    "$(",
    ")",
    "`",
    "<<EOF\n",
    "EOF\n",
    "\\",
    "$'",
    "${",
    "$((",
    "[stages.x]\n",
    "[[a]]\n",
    "= ",
    "\"\"\"",
    "'''",
    "inf",
    "nan",
    "1979-05-27T07:32:00Z",
    "stages:",
    "vars:",
    "op: cmd",
    "gen:nums",
    "stages.gen.params.n",
    "resources: {cpus: 0}",
    "time: ",
    "mem: ",
    "::",
    "../",
    "/",
];

/// Bytes that are not UTF-8 on their own.
const BAD_BYTES: &[&[u8]] = &[b"\xff", b"\xc3", b"\xe2\x82", b"\xed\xa0\x80", b"\xf8\x88"];

/// A string a value could be: ordinary, long, Unicode, shell or Jinja syntax.
pub fn hostile_string(rng: &mut Rng) -> String {
    match rng.below(12) {
        0 => String::new(),
        1 => rng.pick(TOKENS).to_string(),
        2 => rng
            .pick(&["x", "é", "😀", "ab", " "])
            .repeat(*rng.pick(&[100, 1_000, 70_000])),
        3 => "$(touch pwned)".into(),
        4 => "';touch pwned;'".into(),
        5 => "a\nb\nEOF\n".into(),
        6 => "{{ n }}{params.x}{inputs.i}".into(),
        7 => "gen:nums".into(),
        8 => rng
            .pick(&[
                "1e309",
                "-1",
                "0",
                "99999999999999999999",
                "0.0",
                "yes",
                "~",
            ])
            .to_string(),
        9 => rng
            .pick(&["04:00:00", "1-00:00", "16G", "0", "soon", "1:60", "-5"])
            .to_string(),
        10 => (0..rng.below(40))
            .map(|_| char::from_u32(rng.below(0x3000) as u32).unwrap_or('?'))
            .collect(),
        _ => format!("s{}", rng.below(1000)),
    }
}

/// A value of any type, at most a little deep (or, rarely, very deep).
pub fn hostile_value(rng: &mut Rng) -> Value {
    match rng.below(9) {
        0 => Value::Null,
        1 => json!(rng.chance(50)),
        2 => json!(*rng.pick(&[0i64, -1, 1, 3, i64::MAX, i64::MIN, 65_536, 100_000_000])),
        3 => json!(*rng.pick(&[0.5, -0.0, 1e300, 1e-300])),
        4 => {
            let depth = *rng.pick(&[2usize, 10, 99, 150, 1_000]);
            (0..depth).fold(json!(1), |v, _| json!([v]))
        }
        5 => Value::Array(
            (0..rng.below(5))
                .map(|_| json!(hostile_string(rng)))
                .collect(),
        ),
        6 => {
            let mut m = Map::new();
            for _ in 0..rng.below(4) {
                m.insert(hostile_string(rng), json!(hostile_string(rng)));
            }
            Value::Object(m)
        }
        _ => json!(hostile_string(rng)),
    }
}

/// Shell fragments for `cmd` lines, with placeholders among them.
const SHELL: &[&str] = &[
    "{params.x}",
    "{params.n}",
    "{inputs.i}",
    "{outputs.o}",
    "{params.a.b}",
    " ",
    "echo ",
    "cat ",
    "\"",
    "'",
    "$(",
    ")",
    "(",
    "`",
    "${x:-",
    "}",
    "$((",
    "))",
    "# ",
    "\n",
    "<<EOF\n",
    "EOF\n",
    "<<'EOF'\n",
    "<<-EOF\n",
    "\\",
    "$",
    "$'",
    ";",
    "|",
    "&&",
    "a",
    "=",
    "<<<",
    "> ",
    "{print $1}",
    "{",
    "case a in a) ",
    ";; esac",
];

pub fn random_cmd(rng: &mut Rng) -> String {
    (0..1 + rng.below(12)).map(|_| *rng.pick(SHELL)).collect()
}

/// Every key path of a tree (to objects' keys and arrays' items).
fn paths(tree: &Value) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut stack = vec![(Vec::new(), tree)];
    while let Some((path, node)) = stack.pop() {
        let children: Vec<(String, &Value)> = match node {
            Value::Object(m) => m.iter().map(|(k, v)| (k.clone(), v)).collect(),
            Value::Array(a) => a
                .iter()
                .enumerate()
                .map(|(i, v)| (i.to_string(), v))
                .collect(),
            _ => Vec::new(),
        };
        for (key, child) in children {
            let mut p = path.clone();
            p.push(key);
            if out.len() < 10_000 {
                stack.push((p.clone(), child));
                out.push(p);
            }
        }
    }
    out
}

fn node_at<'a>(tree: &'a mut Value, path: &[String]) -> Option<&'a mut Value> {
    path.iter().try_fold(tree, |node, key| match node {
        Value::Object(m) => m.get_mut(key),
        Value::Array(a) => key.parse::<usize>().ok().and_then(|i| a.get_mut(i)),
        _ => None,
    })
}

/// Change the tree where a manifest is most interesting: its stages.
fn mutate_tree(rng: &mut Rng, tree: &mut Value, ops: &[&str]) {
    let all = paths(tree);
    let stage_names: Vec<String> = tree["stages"]
        .as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default();
    match rng.below(10) {
        // Any node becomes any value.
        0 | 1 => {
            if let Some(node) = (!all.is_empty())
                .then(|| rng.pick(&all).clone())
                .and_then(|p| node_at(tree, &p))
            {
                *node = hostile_value(rng);
            }
        }
        // A key is renamed.
        2 => {
            let objects: Vec<&Vec<String>> = all.iter().collect();
            if let Some(path) = (!objects.is_empty()).then(|| rng.pick(&objects).to_vec())
                && let Some((last, parent)) = path.split_last()
                && let Some(Value::Object(m)) = node_at(tree, parent)
                && let Some(v) = m.remove(last)
            {
                m.insert(hostile_string(rng), v);
            }
        }
        // A node goes away.
        3 => {
            if let Some(path) = (!all.is_empty()).then(|| rng.pick(&all).clone())
                && let Some((last, parent)) = path.split_last()
                && let Some(Value::Object(m)) = node_at(tree, parent)
            {
                m.remove(last);
            }
        }
        // A new stage of some op, with odd params.
        4 => {
            let name = if rng.chance(80) {
                format!("n{}", rng.below(100))
            } else {
                hostile_string(rng)
            };
            let mut params = Map::new();
            for _ in 0..rng.below(4) {
                let key = rng.pick(&[
                    "x",
                    "n",
                    "vocab_size",
                    "seq_length",
                    "seed",
                    "model",
                    "kind",
                    "count",
                ]);
                params.insert(key.to_string(), hostile_value(rng));
            }
            let mut stage = json!({"op": *rng.pick(ops), "params": params});
            if rng.chance(60) {
                stage["outputs"] = json!({"o": "o.txt"});
                stage["cmd"] = json!(random_cmd(rng));
            }
            if rng.chance(40) && !stage_names.is_empty() {
                let from = rng.pick(&stage_names).clone();
                stage["inputs"] = json!({"i": format!("{from}:{}", hostile_string(rng))});
            }
            if let Some(m) = tree.get_mut("stages").and_then(Value::as_object_mut) {
                m.insert(name, stage);
            }
        }
        // A stage's cmd, inputs or resources change.
        5..=7 => {
            if stage_names.is_empty() {
                return;
            }
            let name = rng.pick(&stage_names).clone();
            let stage = &mut tree["stages"][&name];
            if !stage.is_object() {
                return;
            }
            match rng.below(3) {
                0 => stage["cmd"] = json!(random_cmd(rng)),
                1 => {
                    let from = rng.pick(&stage_names).clone();
                    stage["inputs"] = json!({"i": format!("{from}:o"), "x": hostile_string(rng)});
                }
                _ => {
                    let key =
                        rng.pick(&["cpus", "gpus", "nodes", "mem", "time", "device", "requeue"]);
                    stage["resources"] = json!({ key.to_string(): hostile_value(rng) });
                }
            }
        }
        // A stage is copied under another name (cycles, duplicates).
        8 => {
            if let Some(from) = (!stage_names.is_empty()).then(|| rng.pick(&stage_names).clone()) {
                let copy = tree["stages"][&from].clone();
                tree["stages"][format!("{from}{}", rng.below(3))] = copy;
            }
        }
        // `vars` change (the template reads them).
        _ => {
            tree["vars"] = json!({"n": hostile_value(rng), "x": hostile_string(rng)});
        }
    }
}

/// One byte-level change.
fn mutate_bytes(rng: &mut Rng, text: &mut Vec<u8>, donors: &[Vec<u8>]) {
    let at = rng.below(text.len() + 1);
    match rng.below(9) {
        0..=2 => {
            let token = rng.pick(TOKENS).as_bytes();
            text.splice(at..at, token.iter().copied());
        }
        3 => {
            let end = (at + 1 + rng.below(64)).min(text.len());
            text.drain(at.min(end)..end);
        }
        4 => {
            if at < text.len() {
                text[at] = rng.next() as u8;
            }
        }
        5 => {
            let end = (at + 1 + rng.below(200)).min(text.len());
            let chunk: Vec<u8> = text[at.min(end)..end].to_vec();
            let times = *rng.pick(&[2usize, 10, 100, 1_000]);
            let repeated: Vec<u8> = chunk.repeat(times);
            text.splice(at..at, repeated);
        }
        6 => {
            let donor = rng.pick(donors);
            let from = rng.below(donor.len() + 1);
            let end = (from + rng.below(300)).min(donor.len());
            text.splice(at..at, donor[from..end].iter().copied());
        }
        7 => text.truncate(at),
        _ => {
            let bad = rng.pick(BAD_BYTES);
            text.splice(at..at, bad.iter().copied());
        }
    }
}

/// Overrides: of keys the tree has (or nearly has), with odd values, and malformed ones.
fn overrides(rng: &mut Rng, tree: &Value) -> Vec<String> {
    let all = paths(tree);
    (0..1 + rng.below(3))
        .map(|_| {
            if rng.chance(15) {
                return rng
                    .pick(&[
                        "novalue", "=1", "a..b=1", "vars.=x", "stages", "-c", ".=.", "vars.n",
                    ])
                    .to_string();
            }
            let key = if all.is_empty() || rng.chance(10) {
                hostile_string(rng)
            } else {
                rng.pick(&all).join(".")
            };
            let value = if rng.chance(50) {
                hostile_string(rng)
            } else {
                hostile_value(rng).to_string()
            };
            format!("{key}={value}")
        })
        .collect()
}

/// A new case from `seed` (`file` names its format).
pub fn case(rng: &mut Rng, file: &str, seed: &[u8], donors: &[Vec<u8>], ops: &[&str]) -> Case {
    let format = if file.ends_with(".toml") {
        nemo_dag_engine::doc::Format::Toml
    } else {
        nemo_dag_engine::doc::Format::Yaml
    };
    let tree = std::str::from_utf8(seed)
        .ok()
        .and_then(|t| nemo_dag_engine::doc::parse(format, t, false).ok())
        .map(|(v, _)| v);
    let mut case = plain(file, seed, Vec::new());
    // The tree's text has no Jinja; with a `.yaml` name, JSON is YAML.
    if let Some(mut tree) = tree.filter(|_| rng.chance(50)) {
        for _ in 0..1 + rng.below(3) {
            mutate_tree(rng, &mut tree, ops);
        }
        case.file = "m.yaml".into();
        case.text = if rng.chance(80) {
            serde_json::to_vec_pretty(&tree).unwrap_or_default()
        } else {
            serde_json::to_vec(&tree).unwrap_or_default()
        };
    }
    if case.text == seed || rng.chance(50) {
        for _ in 0..1 + rng.below(4) {
            mutate_bytes(rng, &mut case.text, donors);
        }
    }
    // Keep cases small but for a few, which test the size limits.
    let most = if rng.chance(1) { 10 << 20 } else { 1 << 20 };
    case.text.truncate(most);
    if rng.chance(30) {
        let tree = std::str::from_utf8(&case.text)
            .ok()
            .and_then(|t| nemo_dag_engine::doc::parse(format, t, false).ok())
            .map(|(v, _)| v)
            .unwrap_or_default();
        case.overrides = overrides(rng, &tree);
    }
    if rng.chance(10) {
        let mut fragment = match rng.below(3) {
            0 => format!("vars:\n  n: {}\n", hostile_value(rng)).into_bytes(),
            1 => b"stages:\n  gen:\n    params: {n: 1}\n".to_vec(),
            _ => rng.pick(donors).clone(),
        };
        mutate_bytes(rng, &mut fragment, donors);
        case.variant = Some((rng.pick(&["tiny", "v", "../x", "é"]).to_string(), fragment));
    }
    case.cmd = random_cmd(rng);
    case
}
