//! Every bad input is exit code 2, a diagnostic on stderr that names the problem, and nothing
//! written anywhere: no `.nemo-dag` store, and the project directory exactly as it was
//! (docs/cli.md, exit codes; docs/manifest.md "Errors").

use crate::common::*;

/// Run `nemo-dag ARGS` (and the same manifest through `validate` and `status`) and check the
/// contract for bad input. `needles` must all appear in stderr (case-insensitive).
fn assert_bad_input(p: &Project, args: &[&str], needles: &[&str]) {
    let before = snapshot(&p.dir);
    let mut commands: Vec<Vec<&str>> = vec![args.to_vec()];
    // The same manifest and options through the read-only commands: the same error.
    if args[0] == "run" {
        for cmd in ["validate", "status"] {
            let mut c = args.to_vec();
            c[0] = cmd;
            c.retain(|a| *a != "--json");
            commands.push(c);
        }
    }
    for argv in commands {
        let out = p.run(&argv);
        assert_eq!(out.code, 2, "nemo-dag {argv:?}: bad input exits 2\n{out}");
        assert!(
            out.stdout.trim().is_empty(),
            "nemo-dag {argv:?}: nothing on stdout for bad input\n{out}"
        );
        // miette wraps long messages at 80 columns (even in the middle of a path) behind a `│`
        // gutter, so compare with whitespace and gutters squeezed out of both sides.
        let err = squash(&out.stderr);
        for n in needles {
            assert!(
                err.contains(&squash(n)),
                "nemo-dag {argv:?}: stderr should mention {n:?}\n{out}"
            );
        }
        assert!(
            !p.store().exists(),
            "nemo-dag {argv:?}: bad input must not create the store\n{out}"
        );
        assert_eq!(
            snapshot(&p.dir),
            before,
            "nemo-dag {argv:?}: bad input must write nothing\n{out}"
        );
    }
}

/// Lowercase, without whitespace or miette's `│` gutter.
fn squash(s: &str) -> String {
    s.chars()
        .filter(|c| !c.is_whitespace() && *c != '│')
        .flat_map(char::to_lowercase)
        .collect()
}

fn with_manifest(test: &str, file: &str, text: &str) -> Project {
    let p = Project::new(test);
    p.write(file, text);
    p
}

#[test]
fn yaml_syntax_error() {
    let p = with_manifest(
        "yaml-syntax",
        "broken.yaml",
        "stages:\n  gen:\n    op: cmd\n    outputs: {o: [o.txt}\n    cmd: \"echo > {outputs.o}\"\n",
    );
    // The diagnostic points into the file: its name and the line (4).
    assert_bad_input(&p, &["run", "broken.yaml"], &["broken.yaml:4"]);
}

#[test]
fn toml_syntax_error() {
    let p = with_manifest(
        "toml-syntax",
        "broken.toml",
        "[stages.gen]\nop = \"cmd\"\noutputs = { o = \"o.txt\" \ncmd = \"echo > {outputs.o}\"\n",
    );
    assert_bad_input(&p, &["run", "broken.toml"], &["broken.toml:4"]);
}

#[test]
fn jinja_undefined_variable() {
    let p = with_manifest(
        "jinja-undefined",
        "t.yaml",
        "vars: {n: 3}\nstages:\n  gen:\n    op: cmd\n    params: {n: {{ undefined_var }}}\n    outputs: {o: o.txt}\n    cmd: \"seq {params.n} > {outputs.o}\"\n",
    );
    // Strict templating: the name of the undefined variable is in the message or the snippet.
    assert_bad_input(&p, &["run", "t.yaml"], &["t.yaml", "undefined_var"]);
}

#[test]
fn jinja_syntax_error() {
    let p = with_manifest(
        "jinja-syntax",
        "t.yaml",
        "vars: {n: 3}\nstages:\n  gen:\n    op: cmd\n    params: {n: {{ n }}\n    outputs: {o: o.txt}\n    cmd: \"seq {params.n} > {outputs.o}\"\n{% if %}\n",
    );
    assert_bad_input(&p, &["run", "t.yaml"], &["t.yaml"]);
}

#[test]
fn jinja_undefined_variable_in_toml() {
    let p = with_manifest(
        "jinja-undefined-toml",
        "t.toml",
        "[stages.gen]\nop = \"cmd\"\nparams = { n = {{ qqnum }} }\noutputs = { o = \"o.txt\" }\ncmd = \"seq {params.n} > {outputs.o}\"\n",
    );
    assert_bad_input(&p, &["run", "t.toml"], &["t.toml", "qqnum"]);
}

#[test]
fn unknown_op() {
    let p = with_manifest(
        "unknown-op",
        "m.yaml",
        "stages:\n  gen:\n    op: frobnicate\n    outputs: {o: o.txt}\n    cmd: \"echo > {outputs.o}\"\n",
    );
    assert_bad_input(&p, &["run", "m.yaml"], &["frobnicate"]);

    // A misspelt op gets the nearest name.
    let p = with_manifest(
        "misspelt-op",
        "m.yaml",
        "stages:\n  gen:\n    op: genrate\n    params: {kind: arithmetic, count: 5, seed: 1}\n",
    );
    assert_bad_input(
        &p,
        &["run", "m.yaml"],
        &["unknown op `genrate`", "did you mean `generate`?"],
    );
}

/// Every op's inputs and outputs are checked against its spec, in one place, the same way:
/// an input the op does not read (with the nearest name), a required input that is missing,
/// outputs declared for an op that names its own.
#[test]
fn inputs_and_outputs_are_checked_against_the_op() {
    let generate = "  gen:\n    op: generate\n    params: {kind: arithmetic, count: 5, seed: 1}\n";
    let p = with_manifest(
        "misspelt-input",
        "m.yaml",
        &format!("stages:\n{generate}  hf:\n    op: export\n    inputs: {{modle: \"gen:chat\"}}\n"),
    );
    assert_bad_input(
        &p,
        &["run", "m.yaml"],
        &[
            "export has no input named `modle`",
            "did you mean `model`?",
            "modle: \"gen:chat\"",
        ],
    );
    let p = with_manifest(
        "missing-input",
        "m.yaml",
        &format!(
            "stages:\n{generate}  tok:\n    op: tokenize\n    inputs: {{corpus: \"gen:pretrain\"}}\n"
        ),
    );
    assert_bad_input(
        &p,
        &["run", "m.yaml"],
        &["stage `tok`: tokenize needs an input named `tokenizer`"],
    );
    let p = with_manifest(
        "own-outputs",
        "m.yaml",
        &format!("stages:\n{generate}    outputs: {{x: x.txt}}\n"),
    );
    assert_bad_input(
        &p,
        &["run", "m.yaml"],
        &["generate names its own outputs", "remove `outputs:`"],
    );
    // A misspelt output of an upstream stage gets the nearest name too.
    let p = with_manifest(
        "misspelt-output",
        "m.yaml",
        &format!(
            "stages:\n{generate}  tok:\n    op: train_tokenizer\n    params: {{vocab_size: 300}}\n    inputs: {{corpus: \"gen:pretrian\"}}\n"
        ),
    );
    assert_bad_input(
        &p,
        &["run", "m.yaml"],
        &[
            "stage `gen` has no output `pretrian`",
            "did you mean `pretrain`?",
        ],
    );
}

#[test]
fn unknown_field_in_a_stage() {
    let p = with_manifest(
        "unknown-field",
        "m.yaml",
        "stages:\n  gen:\n    opp: cmd\n    outputs: {o: o.txt}\n    cmd: \"echo > {outputs.o}\"\n",
    );
    assert_bad_input(&p, &["run", "m.yaml"], &["opp"]);

    // A typo next to a correct `op` as well.
    let p = with_manifest(
        "unknown-field-2",
        "m.yaml",
        "stages:\n  gen:\n    op: cmd\n    ouputs: {o: o.txt}\n    cmd: \"echo > o.txt\"\n",
    );
    assert_bad_input(&p, &["run", "m.yaml"], &["ouputs"]);
}

#[test]
fn unknown_top_level_key() {
    let p = with_manifest(
        "unknown-top",
        "m.toml",
        "[varz]\nn = 3\n\n[stages.gen]\nop = \"cmd\"\noutputs = { o = \"o.txt\" }\ncmd = \"echo > {outputs.o}\"\n",
    );
    assert_bad_input(&p, &["run", "m.toml"], &["varz"]);
}

#[test]
fn reference_to_a_missing_stage() {
    // `nope` is not a stage. Per docs/manifest.md an input `NAME:OUTPUT` whose NAME is not a
    // stage is read as a path, so this may be reported as a missing stage or a missing file;
    // either way the message must name `nope`.
    let p = with_manifest(
        "bad-ref-stage",
        "m.yaml",
        "stages:\n  gen:\n    op: cmd\n    outputs: {o: o.txt}\n    cmd: \"echo > {outputs.o}\"\n  use:\n    op: cmd\n    inputs: {i: \"nope:out\"}\n    outputs: {o: o.txt}\n    cmd: \"cat {inputs.i} > {outputs.o}\"\n",
    );
    assert_bad_input(&p, &["run", "m.yaml"], &["nope"]);
    // A misspelt stage gets the nearest name.
    let p = with_manifest(
        "misspelt-ref-stage",
        "m.yaml",
        "stages:\n  gen:\n    op: cmd\n    outputs: {o: o.txt}\n    cmd: \"echo > {outputs.o}\"\n  use:\n    op: cmd\n    inputs: {i: \"gne:o\"}\n    outputs: {o: o.txt}\n    cmd: \"cat {inputs.i} > {outputs.o}\"\n",
    );
    assert_bad_input(
        &p,
        &["run", "m.yaml"],
        &["no stage `gne`", "did you mean `gen`?"],
    );
}

#[test]
fn reference_to_a_missing_output() {
    let p = with_manifest(
        "bad-ref-output",
        "m.yaml",
        "stages:\n  gen:\n    op: cmd\n    outputs: {o: o.txt}\n    cmd: \"echo > {outputs.o}\"\n  use:\n    op: cmd\n    inputs: {i: \"gen:missing_out\"}\n    outputs: {o: o.txt}\n    cmd: \"cat {inputs.i} > {outputs.o}\"\n",
    );
    assert_bad_input(&p, &["run", "m.yaml"], &["missing_out"]);
}

#[test]
fn a_cycle_is_named_whole() {
    let p = with_manifest(
        "cycle",
        "m.yaml",
        r#"stages:
  alpha:
    op: cmd
    inputs: {i: "gamma:o"}
    outputs: {o: o.txt}
    cmd: "cat {inputs.i} > {outputs.o}"
  beta:
    op: cmd
    inputs: {i: "alpha:o"}
    outputs: {o: o.txt}
    cmd: "cat {inputs.i} > {outputs.o}"
  gamma:
    op: cmd
    inputs: {i: "beta:o"}
    outputs: {o: o.txt}
    cmd: "cat {inputs.i} > {outputs.o}"
  fine:
    op: cmd
    outputs: {o: o.txt}
    cmd: "echo > {outputs.o}"
"#,
    );
    assert_bad_input(&p, &["run", "m.yaml"], &["cycle", "alpha", "beta", "gamma"]);
    // Named whole, as a closed path (`a → b → c → a`, any rotation, either direction); `fine`
    // is not part of it.
    let err = squash(&p.run(&["validate", "m.yaml"]).stderr);
    let whole = (0..3).any(|i| {
        let mut ring = ["alpha", "beta", "gamma"];
        ring.rotate_left(i);
        let fwd = [ring[0], ring[1], ring[2], ring[0]];
        let back = [ring[0], ring[2], ring[1], ring[0]];
        [fwd, back]
            .iter()
            .any(|path| err.contains(&path.join("→")) || err.contains(&path.join("->")))
    });
    assert!(whole, "the cycle is named whole, as a closed path:\n{err}");
    assert!(!err.contains("fine→") && !err.contains("→fine"), "{err}");
}

#[test]
fn a_self_cycle() {
    let p = with_manifest(
        "self-cycle",
        "m.yaml",
        "stages:\n  loop:\n    op: cmd\n    inputs: {i: \"loop:o\"}\n    outputs: {o: o.txt}\n    cmd: \"cat {inputs.i} > {outputs.o}\"\n",
    );
    assert_bad_input(&p, &["run", "m.yaml"], &["cycle", "loop"]);
}

#[test]
fn unknown_override_key() {
    let p = with_manifest("unknown-override", "m.yaml", TWO_STAGE_YAML);
    assert_bad_input(&p, &["run", "m.yaml", "stages.gen.params.zzz=1"], &["zzz"]);
    assert_bad_input(&p, &["run", "m.yaml", "vars.zzq=5"], &["zzq"]);
    assert_bad_input(
        &p,
        &["run", "m.yaml", "stages.gne.params.n=5"],
        &["gne", "did you mean `gen`?"],
    );
    // Not KEY=VALUE at all.
    assert_bad_input(
        &p,
        &["run", "m.yaml", "stages.gen.params.n"],
        &["stages.gen.params.n"],
    );
}

#[test]
fn missing_input_file() {
    let p = with_manifest(
        "missing-input",
        "m.yaml",
        "stages:\n  count:\n    op: cmd\n    inputs: {corpus: absent-corpus.txt}\n    outputs: {o: o.txt}\n    cmd: \"wc -l < {inputs.corpus} > {outputs.o}\"\n",
    );
    assert_bad_input(&p, &["run", "m.yaml"], &["absent-corpus.txt"]);
}

#[test]
fn unknown_variant_lists_the_paths_tried() {
    let p = with_manifest("unknown-variant", "pipe.yaml", TWO_STAGE_YAML);
    p.write("pipe/tiny.yaml", "vars:\n  n: 2\n");
    assert_bad_input(
        &p,
        &["run", "pipe.yaml", "-c", "nope"],
        &["pipe/nope.yaml", "pipe/nope.yml", "pipe/nope.toml"],
    );
}

#[test]
fn undefined_param_placeholder_in_cmd() {
    let p = with_manifest(
        "undefined-placeholder",
        "m.yaml",
        "stages:\n  gen:\n    op: cmd\n    params: {n: 3}\n    outputs: {o: o.txt}\n    cmd: \"seq {params.undefined} > {outputs.o}\"\n",
    );
    assert_bad_input(&p, &["run", "m.yaml"], &["params.undefined"]);
}

#[test]
fn undefined_input_and_output_placeholders_in_cmd() {
    let p = with_manifest(
        "undefined-io-placeholder",
        "m.yaml",
        "stages:\n  gen:\n    op: cmd\n    outputs: {o: o.txt}\n    cmd: \"cat {inputs.nothing} > {outputs.o}\"\n",
    );
    assert_bad_input(&p, &["run", "m.yaml"], &["inputs.nothing"]);
    let p = with_manifest(
        "undefined-out-placeholder",
        "m.yaml",
        "stages:\n  gen:\n    op: cmd\n    outputs: {o: o.txt}\n    cmd: \"echo > {outputs.elsewhere}\"\n",
    );
    assert_bad_input(&p, &["run", "m.yaml"], &["outputs.elsewhere"]);
}

#[test]
fn an_error_after_a_successful_run_writes_nothing_either() {
    // With a store already there, a bad override must leave it byte-for-byte unchanged.
    let p = with_manifest("error-after-run", "m.yaml", TWO_STAGE_YAML);
    p.ok(&["run", "m.yaml"]);
    let before = snapshot(&p.dir);
    for argv in [
        vec!["run", "m.yaml", "stages.gen.params.zzz=1"],
        vec!["run", "m.yaml", "-c", "nope"],
        vec!["status", "m.yaml", "vars.zzz=1"],
    ] {
        let out = p.run(&argv);
        assert_eq!(out.code, 2, "{argv:?}\n{out}");
        assert_eq!(snapshot(&p.dir), before, "{argv:?} wrote something\n{out}");
    }
}

#[test]
fn a_reader_that_stops_early_is_not_a_crash() {
    // `nemo-dag status | head`: the pipe closes under a printing command; it ends quietly.
    // 2,000 stages print far more than a pipe buffers, so the writes after `head` left fail.
    let p = with_manifest(
        "closed-pipe",
        "m.yaml",
        "stages:\n{% for i in range(2000) %}\n  s{{ i }}: {op: cmd, outputs: {o: o.txt}, cmd: \"echo {{ i }} > {outputs.o}\"}\n{% endfor %}\n",
    );
    for cmd in ["status m.yaml --json", "graph m.yaml", "validate m.yaml"] {
        let out = output({
            let mut c = std::process::Command::new("sh");
            c.current_dir(&p.dir)
                .arg("-c")
                .arg(format!("'{BIN}' {cmd} | head -c 1 >/dev/null; sleep 0.2"));
            c
        });
        assert!(
            !out.stderr.contains("panicked") && !out.stderr.contains("Broken pipe"),
            "nemo-dag {cmd} | head:\n{out}"
        );
    }
}

/// A placeholder is replaced by a single-quoted word; inside "…", '…' or a heredoc that quoting
/// is undone and the value would run as shell code. Such a manifest is refused before anything
/// runs, with the placeholder and its context named (issue #15, item 4).
#[test]
fn a_placeholder_inside_quotes_is_refused_before_it_can_inject() {
    // (context, cmd line, a value that runs `touch pwned` there when substituted quoted,
    // where the error points)
    let cases = [
        (
            "double quotes",
            r#"cmd: 'echo "{params.x}" > {outputs.o}'"#,
            "$(touch pwned)",
            "m.yaml:6",
        ),
        (
            "single quotes",
            r#"cmd: "echo '{params.x}' > {outputs.o}""#,
            "$(touch pwned)",
            "m.yaml:6",
        ),
        (
            "here-document",
            "cmd: |\n      cat > {outputs.o} <<EOF\n      {params.x}\n      EOF",
            "$(touch pwned)",
            "m.yaml:7",
        ),
        (
            "backslash",
            r#"cmd: 'echo \{params.x} > {outputs.o}'"#,
            ";touch pwned;'",
            "m.yaml:6",
        ),
    ];
    for (context, cmd, hostile, place) in cases {
        let p = with_manifest(
            "inject",
            "m.yaml",
            &format!(
                "stages:\n  a:\n    op: cmd\n    params: {{x: \"{hostile}\"}}\n    outputs: {{o: o.txt}}\n    {cmd}\n"
            ),
        );
        assert_bad_input(
            &p,
            &["run", "m.yaml"],
            &[place, "stage `a`", "{params.x}", context, "word of its own"],
        );
        assert!(
            find_named(&p.dir, "pwned").is_empty(),
            "{context}: the value ran"
        );
    }
    // An input whose file name is shell code, inside double quotes.
    let p = with_manifest(
        "inject-input",
        "m.yaml",
        "stages:\n  a:\n    op: cmd\n    inputs: {i: \"$(touch pwned).txt\"}\n    outputs: {o: o.txt}\n    cmd: 'cat \"{inputs.i}\" > {outputs.o}'\n",
    );
    p.write("$(touch pwned).txt", "data\n");
    assert_bad_input(&p, &["run", "m.yaml"], &["{inputs.i}", "double quotes"]);
    assert!(find_named(&p.dir, "pwned").is_empty(), "the file name ran");
}

/// The same hostile values as words of their own (also inside `$(…)`, whose words the shell
/// parses afresh, even within "…") reach the command literally.
#[test]
fn a_placeholder_as_a_word_is_one_literal_argument() {
    let p = with_manifest(
        "placeholder-word",
        "m.yaml",
        "stages:\n  a:\n    op: cmd\n    params: {x: \"$(touch pwned)'\\\"`touch pwned`\"}\n    outputs: {o: o.txt}\n    cmd: 'printf \"%s|\" {params.x} \"$(printf %s {params.x})\" > {outputs.o}'\n",
    );
    let run = p.json(&["run", "m.yaml", "--json"]);
    let key = key_of(&run, "a");
    assert_eq!(
        p.published(&key, "o.txt"),
        "$(touch pwned)'\"`touch pwned`|$(touch pwned)'\"`touch pwned`|"
    );
    assert!(find_named(&p.dir, "pwned").is_empty());
}

/// An error past column 65,535 of a line: miette panicked (exit 101) padding its label. The
/// shown line is clipped around the place; the location is the real one (issue #15, item 8).
#[test]
fn an_error_far_along_a_long_line_is_shown_clipped() {
    let long = "x".repeat(70_000);
    let text = format!(
        "stages: {{a: {{op: cmd, outputs: {{o: o.txt}}, cmd: \"echo {long} > {{outputs.o}}\", bogus: 1}}}}\n"
    );
    let column = text.find("bogus").expect("the key is there") + 1;
    let p = with_manifest("long-line", "m.yaml", &text);
    assert_bad_input(
        &p,
        &["run", "m.yaml"],
        &["unknown field `bogus`", &format!("m.yaml:1:{column}]")],
    );
    let out = p.run(&["validate", "m.yaml"]);
    assert!(out.stderr.len() < 3_000, "the long line is clipped:\n{out}");
    assert!(
        out.stderr.contains("bogus: 1"),
        "the place is shown:\n{out}"
    );
}

/// A template syntax error past column 65,535 of a line. minijinja 3.1 counts columns in 16
/// bits and adds one past the last on a lexer error: it wraps in a release build (its byte
/// offsets, which we show, stay right) and panicked in a debug one. Found by the fuzzer.
#[test]
fn a_template_error_far_along_a_long_line_is_shown_at_its_place() {
    let long = "x".repeat(70_000);
    let text = format!(
        "stages:\n  a: {{op: cmd, outputs: {{o: o.txt}}, cmd: \"echo {long} {{{{ 'abc }}}} > {{outputs.o}}\"}}\n"
    );
    // The string runs to the end of the line, where minijinja reports it.
    let column = text.lines().nth(1).expect("two lines").len() + 1;
    let p = with_manifest("long-template-line", "m.yaml", &text);
    assert_bad_input(
        &p,
        &["validate", "m.yaml"],
        &["unexpected end of string", &format!("m.yaml:2:{column}]")],
    );
}

/// A multi-megabyte value named in a message: wrapping it took 36 s and 1.3 GB for 8 MB. Values
/// in messages are shortened, with how much was cut (issue #15, item 12).
#[test]
fn a_huge_value_in_a_message_is_shortened() {
    let op = "y".repeat(2_000_000);
    let p = with_manifest(
        "huge-value",
        "m.yaml",
        &format!(
            "stages:\n  a:\n    op: {op}\n    outputs: {{o: o.txt}}\n    cmd: \"echo > {{outputs.o}}\"\n"
        ),
    );
    let started = std::time::Instant::now();
    assert_bad_input(&p, &["run", "m.yaml"], &["unknown op", "m.yaml:3", "bytes"]);
    assert!(
        started.elapsed() < std::time::Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
    let out = p.run(&["validate", "m.yaml"]);
    assert!(out.stderr.len() < 3_000, "the value is shortened:\n{out}");
}

/// A stage name of 70,000 characters: `status` and `graph` panicked padding their columns
/// (issue #15, item 9). Names have a length limit, checked when the manifest loads.
#[test]
fn a_stage_name_over_the_length_limit_is_refused() {
    // TOML: YAML itself refuses an implicit key over 1,024 characters.
    let manifest = |name: &str| {
        format!(
            "[stages.{name}]\nop = \"cmd\"\noutputs = {{ o = \"o.txt\" }}\ncmd = \"echo > {{outputs.o}}\"\n"
        )
    };
    let p = with_manifest("long-name", "m.toml", &manifest(&"s".repeat(70_000)));
    assert_bad_input(&p, &["run", "m.toml"], &["m.toml:1", "128 characters"]);
    assert_bad_input(&p, &["graph", "m.toml"], &["m.toml:1", "128 characters"]);
    // The longest allowed name is fine everywhere.
    p.write("m.toml", &manifest(&"s".repeat(128)));
    for argv in [
        ["status", "m.toml"],
        ["graph", "m.toml"],
        ["validate", "m.toml"],
    ] {
        p.ok(&argv);
    }
}

/// Nine levels of nine aliases: 342 bytes that expand to 9^9 strings. The loader aborted out of
/// memory (signal 6 past 2 GB); aliases now have a budget of nodes (issue #15, item 10).
#[test]
fn a_yaml_alias_bomb_is_refused() {
    let mut bomb = String::from("x-bomb:\n  a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
    for (level, previous) in "bcdefghi".chars().zip("abcdefgh".chars()) {
        let aliases = vec![format!("*{previous}"); 9].join(", ");
        bomb.push_str(&format!("  {level}: &{level} [{aliases}]\n"));
    }
    let p = with_manifest(
        "alias-bomb",
        "m.yaml",
        &format!(
            "stages:\n  a: {{op: cmd, outputs: {{o: o.txt}}, cmd: \"echo > {{outputs.o}}\"}}\n{bomb}"
        ),
    );
    assert_bad_input(
        &p,
        &["run", "m.yaml"],
        &["m.yaml:", "aliases expand to more than"],
    );
}

/// `- - - - … x`, 50,000 levels of block sequences in 100 KB: the loader overflowed its stack
/// (exit 134); YAML's flow style has a limit of its own, block style none. Nesting, aliases
/// included, is limited (issue #15, item 10).
#[test]
fn yaml_nested_too_deep_is_refused() {
    let deep = "- ".repeat(50_000);
    let p = with_manifest(
        "deep-yaml",
        "m.yaml",
        &format!(
            "stages:\n  a: {{op: cmd, outputs: {{o: o.txt}}, cmd: \"echo > {{outputs.o}}\"}}\nx:\n  {deep}x\n"
        ),
    );
    assert_bad_input(&p, &["run", "m.yaml"], &["m.yaml:4", "nested deeper than"]);
    // Through aliases: each anchor one level deeper than the last.
    let mut chain = String::from("x:\n  a0: &a0 [x]\n");
    for i in 1..2_000 {
        chain.push_str(&format!("  a{i}: &a{i} [*a{}]\n", i - 1));
    }
    p.write(
        "m.yaml",
        &format!("stages:\n  a: {{op: cmd, outputs: {{o: o.txt}}, cmd: \"echo > {{outputs.o}}\"}}\n{chain}"),
    );
    assert_bad_input(&p, &["run", "m.yaml"], &["m.yaml:", "nested deeper than"]);
}

/// Run `nemo-dag ARGS` and require that it ends within `limit` (killing it if not).
fn run_within(p: &Project, args: &[&str], limit: std::time::Duration) -> Out {
    let mut child = p.spawn(args);
    let ended = wait_for(limit, || child.try_wait().is_ok_and(|s| s.is_some()));
    if !ended {
        let _ = child.kill();
    }
    let out = child_output(child);
    assert!(ended, "nemo-dag {args:?} still ran after {limit:?}\n{out}");
    out
}

/// Templates that do unbounded work: two nested `range(100000)` loops ran past 20 s (killed),
/// and `"a" * 100000000` rendered 100 MB (208 MB resident) into a YAML comment and loaded.
/// Rendering has a budget of work ("fuel"), and the manifest a size limit (issue #15, item 12).
#[test]
fn a_template_that_does_too_much_work_is_stopped() {
    let stage = "stages:\n  a: {op: cmd, outputs: {o: o.txt}, cmd: \"echo > {outputs.o}\"}\n";
    let limit = std::time::Duration::from_secs(15);
    for (name, template, needles) in [
        (
            "loops",
            "# {% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}\n",
            &["m.yaml:3", "too much work"][..],
        ),
        (
            "repeat",
            "# {{ \"a\" * 100000000 }}\n",
            &["m.yaml:3", "too much work"][..],
        ),
        (
            "size",
            "# {{ \"a\" * 9000000 }}\n",
            &["m.yaml", "more than 8 MiB"][..],
        ),
    ] {
        let p = with_manifest(name, "m.yaml", &format!("{stage}{template}"));
        let out = run_within(&p, &["validate", "m.yaml"], limit);
        assert_eq!(out.code, 2, "{name}: {out}");
        assert_bad_input(&p, &["run", "m.yaml"], needles);
    }
}

/// A manifest file over 8 MiB is refused before it is read whole (issue #15, item 12).
#[test]
fn a_manifest_over_the_size_limit_is_refused() {
    let padding = "# padding\n".repeat(900_000);
    let p = with_manifest(
        "huge-file",
        "m.yaml",
        &format!(
            "stages:\n  a: {{op: cmd, outputs: {{o: o.txt}}, cmd: \"echo > {{outputs.o}}\"}}\n{padding}"
        ),
    );
    assert_bad_input(&p, &["run", "m.yaml"], &["m.yaml", "more than 8 MiB"]);
}

/// A manifest that is not UTF-8: the error said only "stream did not contain valid UTF-8".
/// It names the byte, its offset, line and column (issue #15, item 16).
#[test]
fn a_manifest_that_is_not_utf8_names_the_byte() {
    let p = Project::new("not-utf8");
    let text = b"stages:\n  a: {op: cmd, outputs: {o: o.txt}, cmd: \"echo \xff > {outputs.o}\"}\n";
    let offset = text.iter().position(|b| *b == 0xff).expect("there");
    std::fs::write(p.path("m.yaml"), text).expect("written");
    assert_bad_input(
        &p,
        &["run", "m.yaml"],
        &[
            "not UTF-8",
            &format!("byte 0xff at offset {offset}"),
            &format!("m.yaml:2:{}]", offset - "stages:\n".len() + 1),
        ],
    );
}

/// Errors that come from the command line point at the argument, as manifest errors point
/// at the file (docs/manifest.md, "Errors"); a value an override set is blamed on the
/// override, not on the line of the file it replaced (issue #15, item 16).
#[test]
fn an_error_from_the_command_line_points_at_the_argument() {
    let p = with_manifest("argument-place", "m.yaml", TWO_STAGE_YAML);
    assert_bad_input(
        &p,
        &["run", "m.yaml", "vars.n=2", "stages.gen.params.zzz=1"],
        &[
            "command line:1:10]",
            "vars.n=2 stages.gen.params.zzz=1",
            "has no key `zzz`",
        ],
    );
    assert_bad_input(
        &p,
        &["run", "m.yaml", "stages.total.inputs.nums=gen:nope"],
        &[
            "stage `gen` has no output `nope`",
            "command line:1:1]",
            "stages.total.inputs.nums=gen:nope",
        ],
    );
    assert_bad_input(
        &p,
        &["run", "m.yaml", "-c", "nope", "vars.n=2"],
        &["no variant `nope`", "command line:1:1]", "-c nope vars.n=2"],
    );
}

/// `resources:` values were taken as written: `cpus: 0`, `time: soon`, `mem: lots` loaded and
/// went to the executors. Each is checked when the manifest loads, with the place
/// (issue #15, item 18).
#[test]
fn nonsense_resources_are_refused() {
    let manifest = |resources: &str| {
        format!(
            "stages:\n  a:\n    op: cmd\n    outputs: {{o: o.txt}}\n    cmd: \"echo > {{outputs.o}}\"\n    resources: {{{resources}}}\n"
        )
    };
    for (resources, needles) in [
        ("cpus: 0", &["resources.cpus", "at least 1"][..]),
        ("cpus: 100000000", &["resources.cpus", "at most"][..]),
        ("gpus: 5000", &["resources.gpus", "at most"][..]),
        ("nodes: 0", &["resources.nodes", "at least 1"][..]),
        ("mem: lots", &["resources.mem", "`lots`", "16G"][..]),
        ("mem: -5", &["resources.mem", "`-5`"][..]),
        ("mem: 2.5G", &["resources.mem", "`2.5G`"][..]),
        ("mem: 900000T", &["resources.mem", "at most"][..]),
        ("time: soon", &["resources.time", "`soon`", "HH:MM:SS"][..]),
        ("time: 0", &["resources.time", "leave `time` out"][..]),
        ("time: \"1:75:00\"", &["resources.time", "`1:75:00`"][..]),
        ("time: 10000000", &["resources.time", "at most"][..]),
        ("device: \"\"", &["resources.device", "empty"][..]),
        ("device: gpu", &["resources.device", "`gpu`", "cuda:N"][..]),
        ("device: \"cuda:x\"", &["resources.device", "`cuda:x`"][..]),
    ] {
        let p = with_manifest("resources", "m.yaml", &manifest(resources));
        let mut needles = needles.to_vec();
        needles.push("m.yaml:6");
        assert_bad_input(&p, &["run", "m.yaml"], &needles);
    }
    // Sensible values load, in Slurm's forms.
    for resources in [
        "cpus: 2, gpus: 0, nodes: 1, mem: 16G, time: \"04:00:00\"",
        "mem: 0, time: 90",
        "mem: 512, time: \"1-12\"",
        "time: \"2-00:30:00\", device: cuda",
        "device: \"cuda:1\"",
        "device: auto",
        "device: cpu",
    ] {
        let p = with_manifest("resources-ok", "m.yaml", &manifest(resources));
        p.ok(&["validate", "m.yaml"]);
    }
}

/// A `matrix:` that cannot make stages is refused at the value that is wrong.
#[test]
fn a_bad_matrix_is_refused_at_its_place() {
    let stage = |matrix: &str| {
        format!(
            "stages:\n  train:\n    op: cmd\n    params: {{lr: 1, opt: 3}}\n    matrix: {matrix}\n    outputs: {{m: m.txt}}\n    cmd: \"echo {{params.lr}} > {{outputs.m}}\"\n"
        )
    };
    let cases: [(&str, &str, &[&str]); 5] = [
        (
            "not-a-list",
            "{lr: 3}",
            &["matrix.lr: must be a non-empty list of values", "m.yaml:5"],
        ),
        (
            "nested",
            "{lr: [1, {a: 2}]}",
            &["matrix.lr.1", "cannot name a stage", "m.yaml:5"],
        ),
        (
            "repeat",
            "{lr: [0.0001, 1.0e-4]}",
            &["matrix.lr.1: value 1e-4 repeats value 0"],
        ),
        (
            "into-a-number",
            "{opt.x: [1]}",
            &["params.opt is not a mapping"],
        ),
        (
            "empty",
            "{}",
            &["matrix: must map param names to lists of values"],
        ),
    ];
    for (name, matrix, needles) in cases {
        let p = with_manifest(&format!("matrix-{name}"), "m.yaml", &stage(matrix));
        assert_bad_input(&p, &["run", "m.yaml"], needles);
    }
}

/// An override of a swept param would be replaced by the swept values: it is refused at the
/// argument, and the swept values can be overridden instead.
#[test]
fn an_override_of_a_swept_param_is_refused() {
    let p = with_manifest(
        "matrix-override",
        "m.yaml",
        "stages:\n  train:\n    op: cmd\n    params: {lr: 1, n: 2}\n    matrix: {lr: [1, 2]}\n    outputs: {m: m.txt}\n    cmd: \"echo {params.lr} > {outputs.m}\"\n",
    );
    assert_bad_input(
        &p,
        &["run", "m.yaml", "stages.train.params.lr=5"],
        &[
            "sweeps params.lr",
            "this override would have no effect",
            "stages.train.matrix.lr.0=VALUE",
        ],
    );
    let ok = p.run(&[
        "validate",
        "m.yaml",
        "stages.train.matrix.lr.0=5",
        "stages.train.params.n=3",
    ]);
    assert_eq!(ok.code, 0, "{ok}");
}

/// A swept value the op refuses is shown at its place in the matrix; a declared stage named
/// like a sweep's copy is refused, not replaced by the copy.
#[test]
fn a_bad_swept_value_is_shown_in_the_matrix() {
    let p = with_manifest(
        "matrix-op-check",
        "m.yaml",
        "stages:\n  gen:\n    op: generate\n    params: {kind: arithmetic, count: 5, seed: 1}\n    matrix: {kind: [arithmetic, poetry]}\n",
    );
    assert_bad_input(&p, &["run", "m.yaml"], &["gen[kind=poetry]", "m.yaml:5:33"]);
    let p = with_manifest(
        "matrix-name-clash",
        "m.yaml",
        "stages:\n  t:\n    op: cmd\n    matrix: {n: [1]}\n    outputs: {o: o.txt}\n    cmd: \"echo {params.n} > {outputs.o}\"\n  t[n=1]:\n    op: cmd\n    outputs: {o: o.txt}\n    cmd: \"echo > {outputs.o}\"\n",
    );
    assert_bad_input(
        &p,
        &["run", "m.yaml"],
        &["stage name `t[n=1]` may only use letters"],
    );
}
