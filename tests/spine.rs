//! The engine spine end to end, driven through the built `nemo-dag` binary as a user would
//! (docs/cli.md): incremental runs and early cutoff, YAML/TOML equivalence, failing
//! stages, shell-injection attempts through params, `status` reasons, `graph`, `validate`,
//! `lineage`, `gc`, variants and overrides, `--target`, `--force` and `-j`.

use crate::common::*;
use serde_json::Value;
use std::time::{Duration, Instant};

/// The published `sum.txt` of the last run's `total`, found the way a user would: through
/// `show total --manifest M --json` (outputs.sum.path), cross-checked against the store layout
/// `<store>/artifacts/<key>/out/sum.txt`.
fn published_sum(p: &Project, manifest: &str, total_key: &str) -> String {
    let show = p.json(&["show", "total", "--manifest", manifest, "--json"]);
    assert_eq!(
        show["key"], total_key,
        "show total names another key: {show}"
    );
    let path = show["outputs"]["sum"]["path"]
        .as_str()
        .unwrap_or_else(|| panic!("`show --json` has no outputs.sum.path: {show}"));
    let via_show = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("show's output path {path} is not readable: {e}"));
    assert_eq!(
        via_show,
        p.published(total_key, "sum.txt"),
        "show's path and the store layout disagree"
    );
    via_show
}

#[test]
fn incremental_two_stage_run_then_cached_then_param_change() {
    let p = Project::new("incremental");
    p.write("m.yaml", TWO_STAGE_YAML);

    let first = p.json(&["run", "m.yaml", "--json"]);
    assert_eq!(
        states(&first),
        expect(&[("gen", "executed"), ("total", "executed")]),
        "first run: {first}"
    );
    for s in stage_list(&first) {
        let key = s["key"].as_str().unwrap_or("");
        assert!(is_key(key), "a key is 64 hex chars, got {key:?} in {first}");
        assert!(s["seconds"].is_number(), "seconds is a number: {s}");
    }
    let total3 = key_of(&first, "total");
    assert_eq!(published_sum(&p, "m.yaml", &total3).trim(), "6");
    assert_eq!(p.published(&key_of(&first, "gen"), "nums.txt"), "1\n2\n3\n");
    // Published entries are complete: artifact.json and log.txt beside out/.
    for d in p.artifact_dirs() {
        assert!(
            d.join("artifact.json").is_file(),
            "{} lacks artifact.json",
            d.display()
        );
        assert!(d.join("log.txt").is_file(), "{} lacks log.txt", d.display());
    }

    let second = p.json(&["run", "m.yaml", "--json"]);
    assert_eq!(
        states(&second),
        expect(&[("gen", "cached"), ("total", "cached")]),
        "a rerun with nothing changed runs nothing: {second}"
    );
    assert_eq!(keys(&first), keys(&second), "same manifest, same keys");

    let changed = p.json(&["run", "m.yaml", "stages.gen.params.n=4", "--json"]);
    assert_eq!(
        states(&changed),
        expect(&[("gen", "executed"), ("total", "executed")]),
        "changing gen's param reruns gen and its consumer: {changed}"
    );
    assert_ne!(key_of(&changed, "gen"), key_of(&first, "gen"));
    assert_ne!(key_of(&changed, "total"), total3);
    assert_eq!(
        published_sum(&p, "m.yaml", &key_of(&changed, "total")).trim(),
        "10"
    );

    // Going back to n=3 finds the earlier results still in the store.
    let back = p.json(&["run", "m.yaml", "--json"]);
    assert_eq!(
        states(&back),
        expect(&[("gen", "cached"), ("total", "cached")]),
        "{back}"
    );
    assert_eq!(keys(&back), keys(&first));
}

#[test]
fn early_cutoff_when_an_upstream_rerun_produces_identical_bytes() {
    let p = Project::new("cutoff");
    // `note` only reaches `:` (which does nothing): changing it changes a's key, not a's output.
    p.write(
        "chain.yaml",
        r#"stages:
  a:
    op: cmd
    params: {note: first}
    outputs: {o: a.txt}
    cmd: "echo hi > {outputs.o}; : {params.note}"
  b:
    op: cmd
    inputs: {i: "a:o"}
    outputs: {o: b.txt}
    cmd: "cat {inputs.i} {inputs.i} > {outputs.o}"
  c:
    op: cmd
    inputs: {i: "b:o"}
    outputs: {o: c.txt}
    cmd: "wc -l < {inputs.i} > {outputs.o}"
"#,
    );
    let first = p.json(&["run", "chain.yaml", "--json"]);
    assert_eq!(
        states(&first),
        expect(&[("a", "executed"), ("b", "executed"), ("c", "executed")])
    );

    let again = p.json(&["run", "chain.yaml", "stages.a.params.note=second", "--json"]);
    let st = states(&again);
    assert_eq!(st["a"], "executed", "a's key changed, so a reruns: {again}");
    assert_ne!(key_of(&again, "a"), key_of(&first, "a"));
    // b's only input came out byte-identical: b is not rerun, and says why (`cutoff`).
    assert_eq!(st["b"], "cutoff", "{again}");
    // c's upstream b did not run at all; the contract allows `cached` or `cutoff` for it, but
    // it must not run.
    assert!(
        st["c"] == "cached" || st["c"] == "cutoff",
        "c must not rerun: {again}"
    );
    assert_eq!(key_of(&again, "b"), key_of(&first, "b"));
    assert_eq!(key_of(&again, "c"), key_of(&first, "c"));
}

const DIAMOND: &str = r#"stages:
  src:
    op: cmd
    outputs: {o: src.txt}
    cmd: "seq 5 > {outputs.o}"
  left:
    op: cmd
    params: {k: 2}
    inputs: {i: "src:o"}
    outputs: {o: left.txt}
    cmd: "awk -v k={params.k} '{print $1 * k}' {inputs.i} > {outputs.o}"
  right:
    op: cmd
    params: {k: 3}
    inputs: {i: "src:o"}
    outputs: {o: right.txt}
    cmd: "awk -v k={params.k} '{print $1 + k}' {inputs.i} > {outputs.o}"
  join:
    op: cmd
    inputs: {l: "left:o", r: "right:o"}
    outputs: {o: join.txt}
    cmd: "cat {inputs.l} {inputs.r} > {outputs.o}"
"#;

#[test]
fn diamond_change_one_branch_reruns_that_branch_and_the_join_only() {
    let p = Project::new("diamond");
    p.write("d.yaml", DIAMOND);
    let first = p.json(&["run", "d.yaml", "--json"]);
    assert!(states(&first).values().all(|s| s == "executed"), "{first}");
    assert_eq!(
        p.published(&key_of(&first, "join"), "join.txt"),
        "2\n4\n6\n8\n10\n4\n5\n6\n7\n8\n"
    );

    let second = p.json(&["run", "d.yaml", "stages.left.params.k=10", "--json"]);
    assert_eq!(
        states(&second),
        expect(&[
            ("src", "cached"),
            ("left", "executed"),
            ("right", "cached"),
            ("join", "executed"),
        ]),
        "{second}"
    );
    assert_eq!(key_of(&second, "right"), key_of(&first, "right"));
    assert_eq!(
        p.published(&key_of(&second, "join"), "join.txt"),
        "10\n20\n30\n40\n50\n4\n5\n6\n7\n8\n"
    );

    // And the other branch, from the original: right and join only.
    let third = p.json(&["run", "d.yaml", "stages.right.params.k=0", "--json"]);
    assert_eq!(
        states(&third),
        expect(&[
            ("src", "cached"),
            ("left", "cached"),
            ("right", "executed"),
            ("join", "executed"),
        ]),
        "{third}"
    );
    assert_eq!(key_of(&third, "left"), key_of(&first, "left"));
}

#[test]
fn yaml_and_toml_twins_give_identical_keys() {
    let y = Project::new("twin-yaml");
    let t = Project::new("twin-toml");
    y.write("recipe.yaml", TWO_STAGE_YAML);
    t.write("recipe.toml", TWO_STAGE_TOML);

    // Separate stores (each beside its own manifest), so neither can borrow the other's results.
    let ry = y.json(&["run", "recipe.yaml", "--json"]);
    let rt = t.json(&["run", "recipe.toml", "--json"]);
    assert!(states(&rt).values().all(|s| s == "executed"), "{rt}");
    assert_eq!(keys(&ry), keys(&rt), "YAML: {ry}\nTOML: {rt}");
    assert!(keys(&ry).values().all(|k| k.as_deref().is_some_and(is_key)));

    let sy = y.json(&["status", "recipe.yaml", "--json"]);
    let st = t.json(&["status", "recipe.toml", "--json"]);
    assert_eq!(keys(&sy), keys(&st), "YAML: {sy}\nTOML: {st}");
    assert_eq!(
        keys(&sy),
        keys(&ry),
        "status reports the keys run published"
    );

    // Overrides apply the same way to both formats.
    let oy = y.json(&["run", "recipe.yaml", "vars.n=7", "--json"]);
    let ot = t.json(&["run", "recipe.toml", "vars.n=7", "--json"]);
    assert_eq!(keys(&oy), keys(&ot));
    assert_eq!(y.published(&key_of(&oy, "total"), "sum.txt").trim(), "28");
    assert_eq!(t.published(&key_of(&ot, "total"), "sum.txt").trim(), "28");
}

#[test]
fn a_failing_command_fails_its_stage_skips_descendants_and_is_not_cached() {
    let p = Project::new("failing");
    let flag = p.path("flag.txt");
    // `mid` needs a file outside the store that is not there yet: `cat` exits non-zero. The
    // path is the same in both runs, so the fix below changes no key.
    p.write(
        "f.yaml",
        &format!(
            r#"stages:
  first:
    op: cmd
    outputs: {{o: first.txt}}
    cmd: "echo one > {{outputs.o}}"
  mid:
    op: cmd
    params: {{flag: "{}"}}
    inputs: {{i: "first:o"}}
    outputs: {{o: mid.txt}}
    cmd: "cat {{params.flag}} > {{outputs.o}}"
  last:
    op: cmd
    inputs: {{i: "mid:o"}}
    outputs: {{o: last.txt}}
    cmd: "cat {{inputs.i}} > {{outputs.o}}"
"#,
            flag.display()
        ),
    );
    let out = p.run(&["run", "f.yaml", "--json"]);
    assert_eq!(out.code, 1, "a failed stage exits 1\n{out}");
    let v = out.json();
    assert_eq!(
        states(&v),
        expect(&[
            ("first", "executed"),
            ("mid", "failed"),
            ("last", "skipped")
        ]),
        "{v}"
    );
    assert!(
        out.stderr.contains("mid"),
        "stderr names the failed stage\n{out}"
    );
    // Nothing was published for the failed stage.
    if let Some(k) = stage(&v, "mid")["key"].as_str() {
        assert!(
            !p.store().join("artifacts").join(k).exists(),
            "a failed stage must not be published"
        );
    }
    let status = p.json(&["status", "f.yaml", "--json"]);
    assert_eq!(states(&status)["mid"], "stale", "{status}");

    // Fix the cause (not the manifest) and run again: mid and last run now.
    std::fs::write(&flag, "fixed\n").unwrap();
    let fixed = p.json(&["run", "f.yaml", "--json"]);
    assert_eq!(
        states(&fixed),
        expect(&[
            ("first", "cached"),
            ("mid", "executed"),
            ("last", "executed")
        ]),
        "{fixed}"
    );
    assert_eq!(p.published(&key_of(&fixed, "last"), "last.txt"), "fixed\n");
}

#[test]
fn a_declared_output_missing_after_exit_0_fails_the_stage() {
    let p = Project::new("missing-output");
    p.write(
        "m.yaml",
        r#"stages:
  lazy:
    op: cmd
    outputs: {o: made.txt, other: never.txt}
    cmd: "echo x > {outputs.o}"
  after:
    op: cmd
    inputs: {i: "lazy:o"}
    outputs: {o: after.txt}
    cmd: "cat {inputs.i} > {outputs.o}"
"#,
    );
    let out = p.run(&["run", "m.yaml", "--json"]);
    assert_eq!(out.code, 1, "{out}");
    let v = out.json();
    assert_eq!(
        states(&v),
        expect(&[("lazy", "failed"), ("after", "skipped")]),
        "{v}"
    );
    assert!(out.stderr.contains("lazy"), "{out}");
    assert!(
        p.artifact_dirs().is_empty(),
        "nothing is published: {:?}",
        p.artifact_dirs()
    );
}

#[test]
fn keep_going_runs_independent_stages_after_a_failure() {
    let p = Project::new("keep-going");
    p.write(
        "k.yaml",
        r#"stages:
  bad:
    op: cmd
    outputs: {o: bad.txt}
    cmd: "exit 3"
  good:
    op: cmd
    outputs: {o: good.txt}
    cmd: "sleep 0.2; echo good > {outputs.o}"
  join:
    op: cmd
    inputs: {a: "bad:o", b: "good:o"}
    outputs: {o: join.txt}
    cmd: "cat {inputs.a} {inputs.b} > {outputs.o}"
"#,
    );
    let out = p.run(&["run", "k.yaml", "--keep-going", "-j", "1", "--json"]);
    assert_eq!(out.code, 1, "{out}");
    let v = out.json();
    assert_eq!(
        states(&v),
        expect(&[("bad", "failed"), ("good", "executed"), ("join", "skipped")]),
        "{v}"
    );
}

#[test]
fn a_param_value_can_never_inject_shell_syntax() {
    let p = Project::new("injection");
    let values = [
        ("q", "x'; touch INJECTED1; echo '"),
        ("d", "$(touch INJECTED2)"),
        ("b", "`touch INJECTED3`"),
        ("s", "a; touch INJECTED4 && echo \"y\" | cat > INJECTED5"),
    ];
    let mut yaml = String::from("stages:\n");
    for (name, value) in values {
        // JSON strings are valid YAML double-quoted scalars.
        yaml.push_str(&format!(
            "  {name}:\n    op: cmd\n    params: {{v: {}}}\n    outputs: {{o: o.txt}}\n    cmd: \"echo {{params.v}} > {{outputs.o}}\"\n",
            serde_json::to_string(value).unwrap()
        ));
    }
    p.write("inj.yaml", &yaml);
    let v = p.json(&["run", "inj.yaml", "--json"]);
    for (name, value) in values {
        assert_eq!(stage(&v, name)["state"], "executed", "{v}");
        assert_eq!(
            p.published(&key_of(&v, name), "o.txt"),
            format!("{value}\n"),
            "stage {name}: the output holds the literal value"
        );
    }
    // The same attempt through a command-line override.
    let over = p.json(&[
        "run",
        "inj.yaml",
        "stages.q.params.v=z'; touch INJECTED6; echo '",
        "--json",
    ]);
    assert_eq!(
        p.published(&key_of(&over, "q"), "o.txt"),
        "z'; touch INJECTED6; echo '\n"
    );

    let found = find_named(&p.dir, "INJECTED");
    assert!(found.is_empty(), "injected files were created: {found:?}");
    let cwd = std::env::current_dir().unwrap();
    let found = find_named(&cwd, "INJECTED");
    assert!(
        found.is_empty(),
        "injected files in {}: {found:?}",
        cwd.display()
    );
}

#[test]
fn status_reports_up_to_date_stale_with_reasons_and_writes_nothing() {
    let p = Project::new("status");
    p.write("m.yaml", TWO_STAGE_YAML);

    // Before any run: nothing is up to date, and status creates no store.
    let before = p.json(&["status", "m.yaml", "--json"]);
    let gen_before = stage(&before, "gen");
    assert_eq!(gen_before["state"], "stale", "{before}");
    let reasons = gen_before["reasons"].to_string();
    assert!(reasons.contains("never run"), "{before}");
    assert_ne!(stage(&before, "total")["state"], "up-to-date");
    assert!(!p.store().exists(), "status must not create the store");

    p.ok(&["run", "m.yaml"]);
    let after = p.json(&["status", "m.yaml", "--json"]);
    assert!(
        states(&after).values().all(|s| s == "up-to-date"),
        "after a run everything is up to date: {after}"
    );

    let snap = snapshot(&p.store());
    let changed = p.json(&["status", "m.yaml", "stages.gen.params.n=4", "--json"]);
    let gen_stage = stage(&changed, "gen");
    assert_eq!(gen_stage["state"], "stale", "{changed}");
    let reasons: Vec<&str> = gen_stage["reasons"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("params.n") && r.contains('3') && r.contains('4')),
        "a reason names params.n with its old and new values (3 → 4): {reasons:?}"
    );
    assert_eq!(
        stage(&changed, "total")["state"],
        "pending-upstream",
        "{changed}"
    );
    // The plain-text status explains too.
    let text = p.run(&["status", "m.yaml", "stages.gen.params.n=4"]);
    assert_eq!(text.code, 0, "{text}");
    assert!(text.stdout.contains("params.n"), "{text}");
    assert_eq!(snapshot(&p.store()), snap, "status wrote into the store");

    // The run is not affected by what status saw.
    let again = p.json(&["run", "m.yaml", "--json"]);
    assert!(states(&again).values().all(|s| s == "cached"), "{again}");
}

#[test]
fn status_names_a_changed_input_file() {
    let p = Project::new("status-input");
    p.write("corpus.txt", "a\nb\n");
    p.write(
        "c.yaml",
        r#"stages:
  count:
    op: cmd
    inputs: {corpus: corpus.txt}
    outputs: {n: n.txt}
    cmd: "wc -l < {inputs.corpus} > {outputs.n}"
  report:
    op: cmd
    inputs: {n: "count:n"}
    outputs: {r: r.txt}
    cmd: "cat {inputs.n} > {outputs.r}"
"#,
    );
    let first = p.json(&["run", "c.yaml", "--json"]);
    assert_eq!(p.published(&key_of(&first, "report"), "r.txt").trim(), "2");
    let up = p.json(&["status", "c.yaml", "--json"]);
    assert!(states(&up).values().all(|s| s == "up-to-date"), "{up}");

    p.write("corpus.txt", "a\nb\nc\n");
    let snap = snapshot(&p.store());
    let v = p.json(&["status", "c.yaml", "--json"]);
    let count = stage(&v, "count");
    assert_eq!(count["state"], "stale", "{v}");
    assert!(
        count["reasons"].to_string().contains("corpus"),
        "the reason names the input: {v}"
    );
    assert_eq!(stage(&v, "report")["state"], "pending-upstream", "{v}");
    assert_eq!(snapshot(&p.store()), snap, "status wrote into the store");

    let second = p.json(&["run", "c.yaml", "--json"]);
    assert_eq!(states(&second)["count"], "executed");
    assert_eq!(p.published(&key_of(&second, "report"), "r.txt").trim(), "3");
}

#[test]
fn dry_run_plans_and_writes_nothing() {
    let p = Project::new("dry-run");
    p.write("m.yaml", TWO_STAGE_YAML);
    let before = snapshot(&p.dir);
    let v = p.json(&["run", "m.yaml", "--dry-run", "--json"]);
    assert_eq!(stage(&v, "gen")["state"], "would-run", "{v}");
    assert_ne!(stage(&v, "total")["state"], "cached", "{v}");
    assert_eq!(snapshot(&p.dir), before, "--dry-run wrote something");

    p.ok(&["run", "m.yaml"]);
    let v = p.json(&["run", "m.yaml", "--dry-run", "--json"]);
    assert!(states(&v).values().all(|s| s == "cached"), "{v}");
}

#[test]
fn graph_in_every_format_names_every_stage_and_the_edge() {
    let p = Project::new("graph");
    p.write("m.yaml", TWO_STAGE_YAML);
    for format in ["ascii", "dot", "mermaid", "json"] {
        let out = p.run(&["graph", "m.yaml", "--format", format]);
        assert_eq!(out.code, 0, "graph --format {format}\n{out}");
        assert!(
            out.stdout.contains("gen") && out.stdout.contains("total"),
            "graph --format {format} names both stages\n{out}"
        );
        match format {
            "dot" => assert!(
                out.stdout.lines().any(|l| {
                    let (g, t) = (l.find("gen"), l.find("total"));
                    l.contains("->") && g.is_some() && t.is_some() && g < t
                }),
                "a dot edge gen -> total\n{out}"
            ),
            "mermaid" => {
                assert!(out.stdout.contains("-->"), "a mermaid edge\n{out}");
            }
            "json" => {
                let v = out.json();
                let nodes: Vec<&str> = v["nodes"]
                    .as_array()
                    .unwrap_or_else(|| panic!("graph json has nodes: {v}"))
                    .iter()
                    .filter_map(|n| n["name"].as_str())
                    .collect();
                assert!(nodes.contains(&"gen") && nodes.contains(&"total"), "{v}");
                let edges = v["edges"].as_array().expect("graph json has edges");
                assert!(
                    edges
                        .iter()
                        .any(|e| e["from"] == "gen" && e["to"] == "total"),
                    "an edge gen → total: {v}"
                );
            }
            _ => {}
        }
    }
    assert!(!p.store().exists(), "graph must not create the store");
}

#[test]
fn validate_accepts_a_good_manifest_and_writes_nothing() {
    let p = Project::new("validate");
    p.write("m.yaml", TWO_STAGE_YAML);
    p.write("m.toml", TWO_STAGE_TOML);
    for m in ["m.yaml", "m.toml"] {
        let out = p.run(&["validate", m]);
        assert_eq!(out.code, 0, "validate {m}\n{out}");
    }
    let out = p.run(&["validate", "m.yaml", "vars.n=9"]);
    assert_eq!(out.code, 0, "{out}");
    assert!(!p.store().exists(), "validate must not create the store");
}

#[test]
fn lineage_lists_the_ancestor_with_its_key() {
    let p = Project::new("lineage");
    p.write("m.yaml", TWO_STAGE_YAML);
    let run = p.json(&["run", "m.yaml", "--json"]);
    let v = p.json(&["lineage", "total", "--manifest", "m.yaml", "--json"]);
    assert_eq!(v["artifact"]["stage"], "total", "{v}");
    assert_eq!(v["artifact"]["key"], key_of(&run, "total"), "{v}");
    let ancestors = v["ancestors"].as_array().expect("lineage lists ancestors");
    assert!(
        ancestors
            .iter()
            .any(|a| a["stage"] == "gen" && a["key"] == key_of(&run, "gen")),
        "gen is an ancestor, with its key: {v}"
    );
    // By key prefix, too.
    let by_key = p.json(&[
        "lineage",
        &key_of(&run, "total")[..12],
        "--store",
        p.store().to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(by_key["artifact"]["key"], key_of(&run, "total"));
}

#[test]
fn diff_names_the_params_and_inputs_that_changed_between_two_runs() {
    let p = Project::new("diff");
    p.write("m.yaml", TWO_STAGE_YAML);
    let three = p.json(&["run", "m.yaml", "--json"]);
    let five = p.json(&["run", "m.yaml", "vars.n=5", "--json"]);
    let (gen3, gen5) = (key_of(&three, "gen"), key_of(&five, "gen"));
    let store = p.store();
    let store = store.to_str().unwrap();
    let d = p.json(&["diff", &gen3, &gen5, "--store", store, "--json"]);
    assert_eq!(d["a"]["key"], gen3.as_str(), "{d}");
    assert_eq!(d["params"][0]["name"], "n", "{d}");
    assert_eq!(
        (&d["params"][0]["a"], &d["params"][0]["b"]),
        (&3.into(), &5.into())
    );
    assert_eq!(d["params"][0]["delta"], 2.0, "{d}");
    // `total` has the same params; its input's content changed.
    let (t3, t5) = (key_of(&three, "total"), key_of(&five, "total"));
    let text = p
        .ok(&["diff", &t3[..12], &t5[..12], "--store", store])
        .stdout;
    assert!(text.contains("inputs\n  nums  gen:nums ("), "{text}");
    assert!(!text.contains("params"), "{text}");
    // A stage name is its artifact of the last run; the same artifact twice differs in nothing.
    let same = p.ok(&["diff", "gen", &gen5, "--manifest", "m.yaml"]).stdout;
    assert!(same.contains("no differences"), "{same}");
    let md = p
        .ok(&["diff", &gen3, &gen5, "--store", store, "--md"])
        .stdout;
    assert!(md.contains("| param | `n` | 3 | 5 | +2 |"), "{md}");
    let missing = p.run(&["diff", "nope", &gen5, "--manifest", "m.yaml"]);
    assert_eq!(missing.code, 2, "{missing}");
}

#[test]
fn gc_removes_unreferenced_entries_and_keeps_referenced_ones() {
    let p = Project::new("gc");
    p.write("m.yaml", TWO_STAGE_YAML);
    let old = p.json(&["run", "m.yaml", "--json"]);
    let new = p.json(&["run", "m.yaml", "stages.gen.params.n=4", "--json"]);
    assert_eq!(p.artifact_dirs().len(), 4, "{:?}", p.artifact_dirs());
    let store = p.store();
    let store = store.to_str().unwrap();

    let dry = p.run(&["gc", "--store", store, "--dry-run"]);
    assert_eq!(dry.code, 0, "{dry}");
    assert_eq!(p.artifact_dirs().len(), 4, "gc --dry-run removed something");

    let out = p.run(&["gc", "--store", store]);
    assert_eq!(out.code, 0, "{out}");
    let mut left: Vec<String> = p
        .artifact_dirs()
        .iter()
        .map(|d| d.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    left.sort();
    let mut live = vec![key_of(&new, "gen"), key_of(&new, "total")];
    live.sort();
    // The last recorded run of this manifest references the n=4 entries; the n=3 ones are
    // referenced by nothing any more.
    assert_eq!(left, live, "gc keeps exactly the last run's entries");
    assert!(!left.contains(&key_of(&old, "gen")));

    // The kept entries still serve a run; the collected ones are rebuilt.
    let kept = p.json(&["run", "m.yaml", "stages.gen.params.n=4", "--json"]);
    assert!(states(&kept).values().all(|s| s == "cached"), "{kept}");
    let rebuilt = p.json(&["run", "m.yaml", "--json"]);
    assert!(
        states(&rebuilt).values().all(|s| s == "executed"),
        "{rebuilt}"
    );
    assert_eq!(keys(&rebuilt), keys(&old));
}

/// `pin` (docs/cli.md): `gc` keeps what a pinned name
/// references (`nemo-dag pin NAME STAGE|KEY`, `--remove`). Choice: a pin keeps its entry's
/// lineage too, since `lineage` of a pinned entry must keep working.
#[test]
fn gc_keeps_pinned_entries_and_their_lineage() {
    let p = Project::new("gc-pin");
    p.write("m.yaml", TWO_STAGE_YAML);
    let old = p.json(&["run", "m.yaml", "--json"]);
    let store = p.store();
    let store = store.to_str().unwrap();
    let old_total = key_of(&old, "total");
    p.ok(&["pin", "release", &old_total, "--store", store]);
    p.json(&["run", "m.yaml", "stages.gen.params.n=4", "--json"]);
    assert_eq!(p.artifact_dirs().len(), 4);

    p.ok(&["gc", "--store", store]);
    assert_eq!(p.artifact_dirs().len(), 4, "pinned entries survive gc");
    let lineage = p.json(&["lineage", &old_total, "--store", store, "--json"]);
    assert!(
        lineage["ancestors"]
            .as_array()
            .is_some_and(|a| a.iter().any(|x| x["key"] == key_of(&old, "gen"))),
        "{lineage}"
    );

    p.ok(&["pin", "release", "--remove", "--store", store]);
    p.ok(&["gc", "--store", store]);
    assert_eq!(
        p.artifact_dirs().len(),
        2,
        "unpinned, the old entries go: {:?}",
        p.artifact_dirs()
    );
    assert!(!store_has(&p, &old_total));
}

fn store_has(p: &Project, key: &str) -> bool {
    p.store().join("artifacts").join(key).is_dir()
}

#[test]
fn variants_merge_over_the_base_and_overrides_win() {
    let p = Project::new("variants");
    p.write("pipe.yaml", TWO_STAGE_YAML);
    p.write("pipe/tiny.yaml", "vars:\n  n: 2\n");
    p.write("pipe/big.toml", "[vars]\nn = 4\n");
    // A variant can also change the stage tree (deep merge: only this key changes).
    p.write(
        "pipe/double.yaml",
        "stages:\n  gen:\n    cmd: \"seq {params.n} {params.n} > {outputs.nums}\"\n",
    );
    let sum = |args: &[&str]| -> String {
        let v = p.json(args);
        p.published(&key_of(&v, "total"), "sum.txt")
            .trim()
            .to_string()
    };
    assert_eq!(sum(&["run", "pipe.yaml", "--json"]), "6");
    assert_eq!(sum(&["run", "pipe.yaml", "-c", "tiny", "--json"]), "3");
    assert_eq!(sum(&["run", "pipe.yaml", "-c", "big", "--json"]), "10");
    // seq 3 3 → "3": the stage's other fields (params, outputs) come from the base.
    assert_eq!(sum(&["run", "pipe.yaml", "-c", "double", "--json"]), "3");
    assert_eq!(sum(&["run", "pipe.yaml", "vars.n=5", "--json"]), "15");
    assert_eq!(
        sum(&["run", "pipe.yaml", "-c", "tiny", "vars.n=5", "--json"]),
        "15",
        "an override wins over the variant"
    );
    // A variant given as a path.
    assert_eq!(
        sum(&["run", "pipe.yaml", "-c", "pipe/tiny.yaml", "--json"]),
        "3"
    );
    // The base is unchanged by all of that.
    let base = p.json(&["run", "pipe.yaml", "--json"]);
    assert!(states(&base).values().all(|s| s == "cached"), "{base}");
}

#[test]
fn target_runs_only_what_it_needs_and_force_reexecutes() {
    let p = Project::new("target");
    p.write("m.yaml", TWO_STAGE_YAML);
    let only = p.json(&["run", "m.yaml", "--target", "gen", "--json"]);
    // Choice: stages outside the target's closure are absent from the list (not `skipped`).
    assert_eq!(states(&only), expect(&[("gen", "executed")]), "{only}");

    let all = p.json(&["run", "m.yaml", "-j", "1", "--json"]);
    assert_eq!(
        states(&all),
        expect(&[("gen", "cached"), ("total", "executed")]),
        "{all}"
    );

    let forced = p.json(&["run", "m.yaml", "--force", "gen", "--json"]);
    assert_eq!(
        states(&forced)["gen"],
        "executed",
        "--force reruns: {forced}"
    );
    // gen's rerun produced the same bytes: total is not rerun (early cutoff).
    assert_eq!(states(&forced)["total"], "cutoff", "{forced}");
    assert_eq!(keys(&forced), keys(&all));

    let total = p.json(&["run", "m.yaml", "--target", "total", "--json"]);
    assert_eq!(
        states(&total),
        expect(&[("gen", "cached"), ("total", "cached")]),
        "a target brings its upstream along: {total}"
    );

    let bad = p.run(&["run", "m.yaml", "--target", "nope"]);
    assert_eq!(bad.code, 2, "an unknown --target is bad input\n{bad}");
    assert!(bad.stderr.contains("nope"), "{bad}");
}

#[test]
fn jobs_limit_how_many_stages_run_at_once() {
    let p = Project::new("jobs");
    let log = p.path("events.log");
    let mut yaml = String::from("stages:\n");
    for name in ["one", "two"] {
        yaml.push_str(&format!(
            "  {name}:\n    op: cmd\n    params: {{log: \"{}\", tag: {name}}}\n    outputs: {{o: o.txt}}\n    cmd: \"echo start >> {{params.log}}; sleep 0.4; echo end >> {{params.log}}; echo {{params.tag}} > {{outputs.o}}\"\n",
            log.display()
        ));
    }
    p.write("j.yaml", &yaml);

    let out = p.json(&["run", "j.yaml", "-j", "1", "--json"]);
    assert!(states(&out).values().all(|s| s == "executed"), "{out}");
    let events = std::fs::read_to_string(&log).unwrap();
    assert_eq!(
        events, "start\nend\nstart\nend\n",
        "-j 1 runs one stage at a time"
    );

    std::fs::remove_file(&log).unwrap();
    let start = Instant::now();
    let out = p.json(&[
        "run", "j.yaml", "-j", "2", "--force", "one", "--force", "two", "--json",
    ]);
    let took = start.elapsed();
    assert!(states(&out).values().all(|s| s == "executed"), "{out}");
    let events = std::fs::read_to_string(&log).unwrap();
    assert_eq!(
        events, "start\nstart\nend\nend\n",
        "-j 2 runs both independent stages at once (took {took:?})"
    );
    assert!(took < Duration::from_secs(5));
}

#[test]
fn store_location_follows_store_flag_and_env() {
    let p = Project::new("store-flag");
    p.write("m.yaml", TWO_STAGE_YAML);
    let v = p.json(&["run", "m.yaml", "--store", "elsewhere", "--json"]);
    assert!(
        !p.store().exists(),
        "--store moves the store away from .nemo-dag"
    );
    assert_eq!(
        std::fs::read_to_string(
            p.path("elsewhere/artifacts")
                .join(key_of(&v, "total"))
                .join("out/sum.txt")
        )
        .unwrap()
        .trim(),
        "6"
    );

    let env_store = p.path("from-env");
    let out = output({
        let mut c = p.command(&["run", "m.yaml", "--json"]);
        c.env("NEMO_DAG_STORE", &env_store);
        c
    });
    assert_eq!(out.code, 0, "{out}");
    assert!(states(&out.json()).values().all(|s| s == "executed"));
    assert!(env_store.join("artifacts").join(key_of(&v, "gen")).is_dir());
    assert!(!p.store().exists());
}

const SWEEP_YAML: &str = r#"
stages:
  data:
    op: cmd
    outputs: {o: o.txt}
    cmd: "echo data > {outputs.o}"
  train:
    op: cmd
    params: {lr: 0.1, opt: {warmup: 5}}
    matrix: {lr: [1.0e-4, 3.0e-4], opt.warmup: [10, 50]}
    inputs: {d: "data:o"}
    outputs: {m: m.txt}
    cmd: "echo {params.lr} {params.opt.warmup} > {outputs.m}"
  eval:
    op: cmd
    inputs: {m: "train:m", d: "data:o"}
    outputs: {r: r.txt}
    cmd: "cat {inputs.m} > {outputs.r}"
"#;

const SWEEP_TOML: &str = r#"
[stages.data]
op = "cmd"
outputs = { o = "o.txt" }
cmd = "echo data > {outputs.o}"

[stages.train]
op = "cmd"
params = { lr = 0.1, opt = { warmup = 5 } }
matrix = { lr = [1.0e-4, 3.0e-4], "opt.warmup" = [10, 50] }
inputs = { d = "data:o" }
outputs = { m = "m.txt" }
cmd = "echo {params.lr} {params.opt.warmup} > {outputs.m}"

[stages.eval]
op = "cmd"
inputs = { m = "train:m", d = "data:o" }
outputs = { r = "r.txt" }
cmd = "cat {inputs.m} > {outputs.r}"
"#;

/// `matrix:` makes one stage per combination, named by its values; the stage upstream of the
/// sweep runs once for all of it, and the stage downstream follows one copy each. The declared
/// name means every copy to `--target` and `--force`; `show` names one copy, or lists them.
#[test]
fn a_matrix_sweeps_a_stage_and_shares_what_is_upstream() {
    let p = Project::new("sweep");
    p.write("m.yaml", SWEEP_YAML);
    let copies = |stage: &str| -> Vec<String> {
        [
            "1e-4,opt.warmup=10",
            "1e-4,opt.warmup=50",
            "3e-4,opt.warmup=10",
            "3e-4,opt.warmup=50",
        ]
        .iter()
        .map(|v| format!("{stage}[lr={v}]"))
        .collect()
    };

    let trained = p.json(&["run", "m.yaml", "--target", "train", "--json"]);
    let mut want: Vec<(String, String)> = vec![("data".into(), "executed".into())];
    want.extend(copies("train").into_iter().map(|c| (c, "executed".into())));
    assert_eq!(
        states(&trained),
        want.into_iter()
            .collect::<std::collections::BTreeMap<_, _>>(),
        "`--target train` runs every copy and `data` once: {trained}"
    );
    for (copy, text) in
        copies("train")
            .iter()
            .zip(["0.0001 10", "0.0001 50", "0.0003 10", "0.0003 50"])
    {
        assert_eq!(
            p.published(&key_of(&trained, copy), "m.txt").trim(),
            text,
            "{copy}"
        );
    }

    let all = p.json(&["run", "m.yaml", "--json"]);
    for copy in copies("eval") {
        assert_eq!(states(&all)[&copy], "executed", "{all}");
    }
    assert_eq!(states(&all).len(), 9, "{all}");
    // Each eval reads its own train copy, and the one shared data.
    let shown = p.json(&["show", "eval[lr=3e-4,opt.warmup=50]", "--json"]);
    assert_eq!(
        shown["inputs"]["m"]["stage"], "train[lr=3e-4,opt.warmup=50]",
        "{shown}"
    );
    assert_eq!(shown["inputs"]["d"]["key"], key_of(&all, "data"), "{shown}");
    assert_eq!(
        p.published(&key_of(&all, "eval[lr=3e-4,opt.warmup=50]"), "r.txt")
            .trim(),
        "0.0003 50"
    );

    let ambiguous = p.run(&["show", "train"]);
    assert_eq!(ambiguous.code, 2, "{ambiguous}");
    assert!(
        ambiguous.stderr.contains("`train` is a sweep of 4 stages"),
        "{ambiguous}"
    );

    let forced = p.json(&["run", "m.yaml", "--force", "train", "--json"]);
    for copy in copies("train") {
        assert_eq!(states(&forced)[&copy], "executed", "{forced}");
    }
    assert_eq!(states(&forced)["data"], "cached", "{forced}");

    // A value added to the sweep runs only its own copies: the others keep their names and keys.
    p.write(
        "m.yaml",
        &SWEEP_YAML.replace("lr: [1.0e-4, 3.0e-4]", "lr: [1.0e-4, 3.0e-4, 1.0e-3]"),
    );
    let wider = p.json(&["run", "m.yaml", "--json"]);
    let ran = not_cached(&wider);
    assert_eq!(
        ran,
        [
            "eval[lr=1e-3,opt.warmup=10]:executed",
            "eval[lr=1e-3,opt.warmup=50]:executed",
            "train[lr=1e-3,opt.warmup=10]:executed",
            "train[lr=1e-3,opt.warmup=50]:executed",
        ],
        "{wider}"
    );

    // The same sweep written in TOML gives the same stages and keys.
    let t = Project::new("sweep-toml");
    t.write("m.toml", SWEEP_TOML);
    assert_eq!(keys(&t.json(&["run", "m.toml", "--json"])), keys(&all));
}

/// Each executed stage records what it used: CPU seconds (its command's too), bytes read and
/// written, peak memory. `show` prints them; `status` and `run --dry-run` give each stage that
/// would run its last run's cost, and their sum.
#[test]
fn a_stage_records_what_it_used_and_status_prices_a_rerun_by_it() {
    let p = Project::new("resources");
    p.write(
        "m.yaml",
        "stages:\n  burn:\n    op: cmd\n    params: {n: 1}\n    outputs: {o: o.bin}\n    cmd: \"head -c 3000000 /dev/zero > {outputs.o}; i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done; echo {params.n}\"\n",
    );
    p.ok(&["run", "m.yaml"]);
    let shown = p.json(&["show", "burn", "--json"]);
    let r = &shown["resources"];
    let cpu = r["cpu_user_seconds"].as_f64().unwrap() + r["cpu_system_seconds"].as_f64().unwrap();
    // The shell's loop runs in a child of a child of `exec`: its CPU time is the stage's.
    assert!(cpu > 0.05, "{r}");
    assert!(
        cpu < shown["seconds"].as_f64().unwrap() * 2.0 + 0.1,
        "{shown}"
    );
    // 3 MB read from /dev/zero by `head` and written to the output, through the shell.
    for field in ["read_bytes", "written_bytes"] {
        let n = r[field].as_u64().unwrap();
        assert!((3_000_000..3_500_000).contains(&n), "{field}: {r}");
    }
    let text = p.ok(&["show", "burn"]).stdout;
    assert!(
        text.contains("s user, ") && text.contains("io       read 2.9 MiB, wrote 2.9 MiB"),
        "{text}"
    );

    let status = p.ok(&["status", "m.yaml", "stages.burn.params.n=2"]).stdout;
    assert!(
        status.contains("· last run: ") && status.contains(" CPU, "),
        "{status}"
    );
    assert!(
        status.contains("rerun: 1 stage(s); 1 of them took "),
        "{status}"
    );
    let json = p.json(&["status", "m.yaml", "stages.burn.params.n=2", "--json"]);
    let last = &stage(&json, "burn")["last_run"];
    assert_eq!(last["key"], shown["key"], "{json}");
    assert_eq!(last["seconds"], shown["seconds"], "{json}");
    assert_eq!(last["peak_rss_bytes"], r["peak_rss_bytes"], "{json}");

    // Up to date: nothing to price. Forced: priced by its current artifact.
    let fresh = p.ok(&["status", "m.yaml"]).stdout;
    assert!(
        !fresh.contains("last run") && !fresh.contains("rerun:"),
        "{fresh}"
    );
    let forced = p
        .ok(&["run", "m.yaml", "--dry-run", "--force", "burn"])
        .stderr;
    assert!(forced.contains("· last run: "), "{forced}");
}

/// The run record says why each stage it built was built, and forgets it when the stage is
/// found under another key (an earlier configuration, cached): that reason was the other key's.
#[test]
fn the_run_record_says_why_a_stage_ran_and_only_for_its_key() {
    let p = Project::new("why");
    p.write(
        "m.yaml",
        "stages:\n  a:\n    op: cmd\n    params: {n: 1}\n    outputs: {o: o.txt}\n    cmd: \"echo {params.n} > {outputs.o}\"\n",
    );
    let why = || -> Value {
        let runs = p.store().join("runs");
        let record = std::fs::read_dir(&runs)
            .unwrap()
            .flatten()
            .find(|e| e.path().extension().is_some_and(|x| x == "json"))
            .unwrap();
        let v: Value = serde_json::from_slice(&std::fs::read(record.path()).unwrap()).unwrap();
        v["why"]["a"].clone()
    };
    p.ok(&["run", "m.yaml"]);
    assert_eq!(why(), serde_json::json!(["never run"]));
    p.ok(&["run", "m.yaml", "stages.a.params.n=2"]);
    assert_eq!(why(), serde_json::json!(["params.n: 1 → 2"]));
    p.ok(&["run", "m.yaml"]);
    assert_eq!(why(), Value::Null, "found cached under its first key");
}

/// `runs` lists every run that ended, numbered across the store, with its overrides and the
/// params that differ between the runs; `diff @1 @2` compares two runs from the history and
/// `gen@1` names a stage's artifact in run 1. The history outlives `gc`: it keeps each run's
/// params and metrics, not its artifacts, and says so when an artifact is asked for.
#[test]
fn runs_lists_each_run_and_outlives_gc_which_it_does_not_pin() {
    let p = Project::new("runs");
    p.write("m.yaml", TWO_STAGE_YAML);
    p.write("other.yaml", &TWO_STAGE_YAML.replace("n: 3", "n: 7"));
    let first = p.json(&["run", "m.yaml", "--json"]);
    p.json(&["run", "m.yaml", "vars.n=5", "--json"]);
    p.json(&["run", "m.yaml", "vars.n=5", "--json"]);
    p.json(&["run", "other.yaml", "--json"]);
    // A failing run is in the history too, with the stage that failed.
    let failed = p.run(&["run", "m.yaml", "stages.total.cmd=exit 3"]);
    assert_eq!(failed.code, 1, "{failed}");
    // The record keeps a failed stage's last good artifact (n=5's); this run replaces it.
    p.json(&["run", "m.yaml", "--json"]);

    let all = p.json(&["runs", "--json"]);
    let runs = all["runs"].as_array().unwrap();
    let numbers: Vec<u64> = runs.iter().map(|r| r["run"].as_u64().unwrap()).collect();
    assert_eq!(numbers, [1, 2, 3, 4, 5, 6], "{all}");
    assert_eq!(runs[1]["overrides"], serde_json::json!(["vars.n=5"]));
    assert_eq!(runs[1]["stages"]["gen"]["params"]["n"], 5, "{all}");
    assert_eq!(runs[1]["stages"]["gen"]["outcome"], "executed", "{all}");
    assert_eq!(runs[2]["stages"]["gen"]["outcome"], "cached", "{all}");
    assert_eq!(runs[4]["stages"]["total"]["outcome"], "failed", "{all}");
    assert_eq!(runs[4]["stages"]["total"]["key"], Value::Null, "{all}");

    // One manifest's runs: the column that differs is `gen.n`, in run order.
    let table = p.ok(&["runs", "m.yaml"]).stdout;
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        [
            "run",
            "finished",
            "overrides",
            "built",
            "failed",
            "gen.n",
            "total.cmd"
        ],
        "{table}"
    );
    // Runs 1, 2, 3, 5 and 6 (4 is other.yaml's).
    let column = |name: &str| table_column(&table, name);
    assert_eq!(column("run"), ["1", "2", "3", "5", "6"], "{table}");
    assert_eq!(column("gen.n"), ["3", "5", "5", "3", "3"], "{table}");
    assert_eq!(
        column("built"),
        ["2 of 2", "2 of 2", "0 of 2", "0 of 2", "0 of 2"],
        "{table}"
    );
    assert_eq!(column("failed"), ["", "", "", "total", ""], "{table}");
    assert_eq!(column("overrides")[1], "vars.n=5", "{table}");
    assert_eq!(column("total.cmd")[3], "–", "{table}");
    assert!(
        table.contains("that are the same in every row are not shown: --all shows them"),
        "{table}"
    );
    // One row differs from nothing: every column is there, and no note.
    let last = p.ok(&["runs", "m.yaml", "-n", "1"]).stdout;
    assert_eq!(last.lines().count(), 2, "{last}");
    assert_eq!(
        table_column(&last, "gen.cmd"),
        ["seq {params.n} > {outputs.nums}"]
    );
    // Run numbers are the store's: run 4 is other.yaml's, not m.yaml's.
    let other = p.run(&["diff", "gen@4", "gen", "--manifest", "m.yaml"]);
    assert_eq!(other.code, 2, "{other}");
    assert!(other.stderr.contains("run 4 is of "), "{other}");
    let only = p.ok(&["runs", "m.yaml", "--param", "gen."]).stdout;
    let header: Vec<&str> = only
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert!(
        header.ends_with(&["gen.cmd", "gen.n"]) && !header.contains(&"total.cmd"),
        "a filter shows the params it matches, differing or not: {only}"
    );

    // Two runs compared from the history, and a stage of each by its run.
    let d = p.json(&["diff", "@1", "@2", "--manifest", "m.yaml", "--json"]);
    let first_stage = &d["stages"][0];
    assert_eq!(
        (
            &first_stage["stage"],
            &first_stage["params"][0]["name"],
            &first_stage["params"][0]["b"]
        ),
        (&"gen".into(), &"n".into(), &5.into()),
        "{d}"
    );
    let by_run = p.json(&["diff", "gen@1", "gen@3", "--manifest", "m.yaml", "--json"]);
    assert_eq!(by_run["a"]["key"], key_of(&first, "gen"), "{by_run}");
    assert_eq!(by_run["params"][0]["delta"], 2.0, "{by_run}");

    // gc keeps only what the last run records reference: run 2's artifacts go, its history
    // stays, and asking for its artifact says what happened.
    let store = p.store();
    let store = store.to_str().unwrap();
    p.ok(&["gc", "--store", store]);
    let gone = p.run(&["diff", "gen@2", "gen@1", "--manifest", "m.yaml"]);
    assert_eq!(gone.code, 2, "{gone}");
    assert!(
        gone.stderr.contains("`gen` of run 2 (") && gone.stderr.contains("`gc` removed it"),
        "{gone}"
    );
    let after = p.ok(&["diff", "@2", "@1", "--manifest", "m.yaml"]).stdout;
    assert!(after.contains("n  5 → 3"), "{after}");
    assert_eq!(p.json(&["runs", "--json"])["runs"], all["runs"]);

    let mixed = p.run(&["diff", "@1", "gen", "--manifest", "m.yaml"]);
    assert_eq!(mixed.code, 2, "{mixed}");
    let missing = p.run(&["diff", "@1", "@9", "--manifest", "m.yaml"]);
    assert!(
        missing.code == 2 && missing.stderr.contains("runs are numbered 1 to 6"),
        "{missing}"
    );
}
