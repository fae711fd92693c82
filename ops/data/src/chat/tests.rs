use super::*;

fn nano3() -> ChatTemplate {
    ChatTemplate::load(&TemplateSource::Bundled("nano3".into())).unwrap()
}

fn msg(role: Role, content: &str) -> Message {
    Message::new(role, content)
}

fn reasoning(content: &str, thought: &str) -> Message {
    Message {
        reasoning_content: Some(thought.into()),
        ..Message::new(Role::Assistant, content)
    }
}

fn conv(messages: Vec<Message>) -> Conversation {
    Conversation {
        messages,
        tools: None,
    }
}

const OFF: RenderFlags = RenderFlags {
    enable_thinking: false,
    truncate_history_thinking: true,
};
const ON: RenderFlags = RenderFlags {
    enable_thinking: true,
    truncate_history_thinking: true,
};

/// The fixed instructions the nano3 template appends after the tool list.
const TOOL_INSTRUCTIONS: &str = "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>";

/// One token per byte: chunk boundaries and masks are easy to read off.
fn bytes(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

fn texts(chunks: &[Chunk]) -> Vec<(&str, &str, bool)> {
    chunks
        .iter()
        .map(|c| (c.role.as_str(), c.text.as_str(), c.trained))
        .collect()
}

// --- rendering -------------------------------------------------------------------------

#[test]
fn renders_system_user_assistant() {
    let messages = [
        msg(Role::System, "You are helpful."),
        msg(Role::User, "Hi"),
        msg(Role::Assistant, "Hello!"),
    ];
    let text = nano3().render(&messages, None, false, OFF).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are helpful.<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\n<think></think>Hello!<|im_end|>\n"
    );
}

#[test]
fn writes_an_empty_system_turn_and_both_generation_prompts() {
    let messages = [msg(Role::User, "Hi")];
    let t = nano3();
    let base = "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n";
    assert_eq!(t.render(&messages, None, false, ON).unwrap(), base);
    assert_eq!(
        t.render(&messages, None, true, ON).unwrap(),
        format!("{base}<|im_start|>assistant\n<think>\n")
    );
    assert_eq!(
        t.render(&messages, None, true, OFF).unwrap(),
        format!("{base}<|im_start|>assistant\n<think></think>")
    );
}

#[test]
fn renders_reasoning_and_truncates_history_thinking() {
    let messages = [
        msg(Role::User, "2+2?"),
        reasoning("4", "Add them."),
        msg(Role::User, "3+3?"),
        reasoning(" 6 ", "Again."),
    ];
    let t = nano3();
    let head = "<|im_start|>system\n<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n";
    let tail = "<|im_start|>user\n3+3?<|im_end|>\n\
                <|im_start|>assistant\n<think>\nAgain.\n</think>\n 6<|im_end|>\n";
    // Default: the turn before the last user turn loses its thinking; what followed
    // `</think>` is kept as it was, newline included.
    assert_eq!(
        t.render(&messages, None, false, ON).unwrap(),
        format!("{head}<|im_start|>assistant\n<think></think>\n4<|im_end|>\n{tail}")
    );
    // Without truncation every turn keeps it.
    let keep = RenderFlags {
        truncate_history_thinking: false,
        ..ON
    };
    assert_eq!(
        t.render(&messages, None, false, keep).unwrap(),
        format!("{head}<|im_start|>assistant\n<think>\nAdd them.\n</think>\n4<|im_end|>\n{tail}")
    );
    // Blank reasoning counts as none.
    let blank = [msg(Role::User, "q"), reasoning("a", " \n ")];
    assert!(
        t.render(&blank, None, false, ON)
            .unwrap()
            .ends_with("<|im_start|>assistant\n<think></think>a<|im_end|>\n")
    );
}

/// A record with tools (keys deliberately not in alphabetical order), a tool call whose
/// arguments are a JSON string, a tool response and the final answer.
const TOOL_ROW: &str = r#"{
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather",
             "arguments": "{\"unit\": \"c\", \"city\": \"Paris\", \"detail\": true, \"days\": [1, 2]}"}}
        ]},
        {"role": "tool", "content": "{\"temp\": 21}", "tool_call_id": "c1"},
        {"role": "assistant", "content": "21C."}
    ],
    "tools": [
        {"type": "function", "function": {
            "name": "get_weather",
            "description": " Current weather. ",
            "parameters": {
                "type": "object",
                "properties": {
                    "unit": {"type": "string", "enum": ["c", "f"]},
                    "city": {"type": "string", "description": "City name", "minLength": 1},
                    "when": {"type": ["string", "null"]}
                },
                "required": ["city"],
                "additionalProperties": false
            }
        }}
    ]
}"#;

const TOOL_SYSTEM: &str = "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n<function>\n<name>get_weather</name>\n<description>Current weather.</description>\n<parameters>\n<parameter>\n<name>unit</name>\n<type>string</type>\n<enum>[\"c\", \"f\"]</enum>\n</parameter>\n<parameter>\n<name>city</name>\n<type>string</type>\n<description>City name</description>\n<minLength>1</minLength>\n</parameter>\n<parameter>\n<name>when</name>\n<type>['string', 'null']</type>\n</parameter>\n<additionalProperties>False</additionalProperties>\n<required>[\"city\"]</required>\n</parameters>\n</function>\n</tools>";

const TOOL_CALL_TURN: &str = "<|im_start|>assistant\n<think></think>\n<tool_call>\n<function=get_weather>\n<parameter=unit>\nc\n</parameter>\n<parameter=city>\nParis\n</parameter>\n<parameter=detail>\nTrue\n</parameter>\n<parameter=days>\n[1, 2]\n</parameter>\n</function>\n</tool_call>\n<|im_end|>\n";

#[test]
fn renders_tools_tool_calls_and_tool_responses() {
    let c = Conversation::from_row(TOOL_ROW, &RowFields::default()).unwrap();
    // Step 3: the string arguments became an object, in document order.
    let args = c.messages[2].tool_calls.as_ref().unwrap()[0]
        .get("function")
        .and_then(|f| f.get("arguments"))
        .unwrap();
    assert!(matches!(args, Json::Object(e) if e[0].0 == "unit" && e[1].0 == "city"));
    let text = nano3()
        .render(&c.messages, c.tools.as_deref(), false, OFF)
        .unwrap();
    let expected = format!(
        "{TOOL_SYSTEM}{TOOL_INSTRUCTIONS}<|im_end|>\n\
         <|im_start|>user\nWeather in Paris?<|im_end|>\n\
         {TOOL_CALL_TURN}\
         <|im_start|>user\n<tool_response>\n{{\"temp\": 21}}\n</tool_response>\n<|im_end|>\n\
         <|im_start|>assistant\n<think></think>21C.<|im_end|>\n"
    );
    assert_eq!(text, expected);
}

#[test]
fn tools_without_system_message_start_the_system_turn_directly() {
    let tools = vec![Json::parse(r#"{"name": "noop"}"#).unwrap()];
    let text = nano3()
        .render(&[msg(Role::User, "x")], Some(&tools), false, OFF)
        .unwrap();
    assert!(text.starts_with(
        "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n\
         <tools>\n<function>\n<name>noop</name>\n<parameters>\n</parameters>\n</function>\n</tools>\n\n"
    ));
}

#[test]
fn history_tool_call_turn_keeps_only_text_after_thinking() {
    let call = Json::parse(r#"{"function": {"name": "f", "arguments": {}}}"#).unwrap();
    let messages = [
        msg(Role::User, "a"),
        Message {
            tool_calls: Some(vec![call]),
            ..reasoning("Let me look.", "hmm")
        },
        msg(Role::Tool, "r"),
        msg(Role::User, "b"),
    ];
    let text = nano3().render(&messages, None, false, ON).unwrap();
    assert!(text.contains(
        "<|im_start|>assistant\n<think></think>Let me look.\n<tool_call>\n<function=f>\n</function>\n</tool_call>\n<|im_end|>\n"
    ));
}

#[test]
fn python_compatible_filters() {
    let t = ChatTemplate::new(
        "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ true }}|{{ none }}|{{ 1.5e20 }}|{{ 'a\"b' | tojson }}|{{ ' hi '.strip() }}|{{ 'a,b'.split(',') | length }}|{{ m.get('k', 'd') }}",
    )
    .unwrap();
    let env_ctx = minijinja::context! {
        x => Json::parse(r#"{"b": [1, 2.0], "a": {}}"#).unwrap().to_value(),
        m => Json::parse("{}").unwrap().to_value(),
    };
    let tmpl = t.env.get_template(TEMPLATE_NAME).unwrap();
    assert_eq!(
        tmpl.render(env_ctx).unwrap(),
        "{\"b\": [1, 2.0], \"a\": {}}|{\n  \"b\": [\n    1,\n    2.0\n  ],\n  \"a\": {}\n}|True|None|1.5e+20|\"a\\\"b\"|hi|2|d"
    );
    assert_eq!(py_float_repr(1e16), "1e+16");
    assert_eq!(py_float_repr(1e15), "1000000000000000.0");
    assert_eq!(py_float_repr(1.5e-5), "1.5e-05");
    assert_eq!(py_float_repr(0.0001), "0.0001");
}

// --- role chunks -----------------------------------------------------------------------

#[test]
fn multi_turn_chunks_train_every_assistant_turn() {
    let c = conv(vec![
        msg(Role::System, "S"),
        msg(Role::User, "q1"),
        msg(Role::Assistant, "a1"),
        msg(Role::User, "q2"),
        msg(Role::Assistant, "a2"),
    ]);
    let t = nano3();
    let seqs = role_chunks(&t, &c, &ChatOptions::default()).unwrap();
    assert_eq!(seqs.len(), 1);
    assert_eq!(
        texts(&seqs[0]),
        vec![
            ("system", "<|im_start|>system\nS<|im_end|>\n", false),
            (
                "user",
                "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\n<think></think>",
                false
            ),
            ("assistant", "a1<|im_end|>\n", true),
            (
                "user",
                "<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n<think></think>",
                false
            ),
            ("assistant", "a2<|im_end|>\n", true),
        ]
    );
    let joined: String = seqs[0].iter().map(|c| c.text.as_str()).collect();
    assert_eq!(
        joined,
        t.render(&c.messages, None, false, OFF).unwrap(),
        "chunks cover the full rendering"
    );
}

#[test]
fn first_chunk_is_split_into_system_and_user() {
    let c = conv(vec![msg(Role::User, "q"), msg(Role::Assistant, "a")]);
    let seqs = role_chunks(&nano3(), &c, &ChatOptions::default()).unwrap();
    assert_eq!(
        texts(&seqs[0]),
        vec![
            ("system", "<|im_start|>system\n<|im_end|>\n", false),
            (
                "user",
                "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think></think>",
                false
            ),
            ("assistant", "a<|im_end|>\n", true),
        ]
    );
}

#[test]
fn reasoning_conversation_gives_one_sequence_per_user_turn() {
    let c = conv(vec![
        msg(Role::System, "S"),
        msg(Role::User, "q1"),
        reasoning("a1", "r1"),
        msg(Role::User, "q2"),
        reasoning("a2", "r2"),
    ]);
    let seqs = role_chunks(&nano3(), &c, &ChatOptions::default()).unwrap();
    assert_eq!(seqs.len(), 2);
    assert_eq!(
        texts(&seqs[0]),
        vec![
            ("system", "<|im_start|>system\nS<|im_end|>\n", false),
            (
                "user",
                "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\n<think>\n",
                false
            ),
            ("assistant", "r1\n</think>\na1<|im_end|>\n", true),
        ]
    );
    // The second sequence holds the first exchange masked (its thinking truncated) and
    // trains only the final answer.
    assert_eq!(
        texts(&seqs[1]),
        vec![
            ("system", "<|im_start|>system\nS<|im_end|>\n", false),
            (
                "user",
                "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\n<think></think>\na1<|im_end|>\n\
                 <|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n<think>\n",
                false
            ),
            ("assistant", "r2\n</think>\na2<|im_end|>\n", true),
        ]
    );
}

#[test]
fn reasoning_sequences_ending_on_a_user_turn_are_skipped() {
    let c = conv(vec![
        msg(Role::User, "q1"),
        msg(Role::User, "q2"),
        reasoning("a", "r"),
        msg(Role::User, "q3"),
    ]);
    let seqs = role_chunks(&nano3(), &c, &ChatOptions::default()).unwrap();
    assert_eq!(seqs.len(), 1, "only q2's sequence has an answer");
    assert_eq!(seqs[0].last().unwrap().text, "r\n</think>\na<|im_end|>\n");
    assert!(seqs[0][1].text.contains("q1") && seqs[0][1].text.contains("q2"));
}

#[test]
fn reasoning_turns_after_tools_train_all_final_assistant_spans() {
    let call = Json::parse(r#"{"function": {"name": "f", "arguments": {"x": 1}}}"#).unwrap();
    let c = conv(vec![
        msg(Role::User, "q"),
        Message {
            tool_calls: Some(vec![call]),
            ..reasoning("", "need f")
        },
        msg(Role::Tool, "out"),
        msg(Role::Assistant, "done"), // no reasoning: renders <think></think>
    ]);
    let seqs = role_chunks(&nano3(), &c, &ChatOptions::default()).unwrap();
    assert_eq!(
        texts(&seqs[0]),
        vec![
            ("system", "<|im_start|>system\n<|im_end|>\n", false),
            (
                "user",
                "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\n",
                false
            ),
            (
                "assistant",
                "need f\n</think>\n<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>\n<|im_end|>\n",
                true
            ),
            (
                "tool",
                "<|im_start|>user\n<tool_response>\nout\n</tool_response>\n<|im_end|>\n<|im_start|>assistant\n<think></think>",
                false
            ),
            ("assistant", "done<|im_end|>\n", true),
        ]
    );
}

#[test]
fn consecutive_tool_messages_merge_into_one_chunk() {
    let calls = Json::parse(
        r#"[{"function": {"name": "a", "arguments": {}}}, {"function": {"name": "b", "arguments": {}}}]"#,
    )
    .unwrap();
    let Json::Array(calls) = calls else {
        unreachable!()
    };
    let c = conv(vec![
        msg(Role::User, "q"),
        Message {
            tool_calls: Some(calls),
            ..msg(Role::Assistant, "")
        },
        msg(Role::Tool, "A"),
        msg(Role::Tool, "B"),
        msg(Role::Assistant, "ok"),
    ]);
    let seqs = role_chunks(&nano3(), &c, &ChatOptions::default()).unwrap();
    let roles: Vec<&str> = seqs[0].iter().map(|c| c.role.as_str()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool", "assistant"]);
    assert_eq!(
        seqs[0][3].text,
        "<|im_start|>user\n<tool_response>\nA\n</tool_response>\n<tool_response>\nB\n</tool_response>\n<|im_end|>\n<|im_start|>assistant\n<think></think>"
    );
    assert_eq!(seqs[0][4].text, "ok<|im_end|>\n");
}

#[test]
fn inconsistent_template_is_a_render_mismatch() {
    // Marks the last message, so a prefix rendering is not a prefix of the full one.
    let t = ChatTemplate::new(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if loop.last %}[END]{% endif %}{% endfor %}",
    )
    .unwrap();
    let c = conv(vec![msg(Role::User, "q"), msg(Role::Assistant, "a")]);
    assert_eq!(
        role_chunks(&t, &c, &ChatOptions::default()),
        Err(DropReason::RenderMismatch { message_index: 0 })
    );
    // A consistent custom template chunks fine.
    let ok = ChatTemplate::new(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
    )
    .unwrap();
    let seqs = role_chunks(&ok, &c, &ChatOptions::default()).unwrap();
    assert_eq!(
        texts(&seqs[0]),
        vec![
            ("user", "<user>q<assistant>", false),
            ("assistant", "a", true)
        ]
    );
}

// --- records ---------------------------------------------------------------------------

#[test]
fn tool_call_text_without_tools_header_drops_the_row() {
    let fields = RowFields::default();
    let bad = r#"{"messages": [{"role": "user", "content": "q"},
        {"role": "assistant", "content": "<tool_call>\n<function=f>\n</function>\n</tool_call>"}]}"#;
    assert_eq!(
        Conversation::from_row(bad, &fields),
        Err(DropReason::ToolCallWithoutToolsHeader)
    );
    let in_reasoning = r#"{"messages": [{"role": "assistant", "content": "x", "reasoning_content": "<tool_call>"}]}"#;
    assert_eq!(
        Conversation::from_row(in_reasoning, &fields),
        Err(DropReason::ToolCallWithoutToolsHeader)
    );
    let good = r##"{"messages": [{"role": "system", "content": "# Tools\nf()"},
        {"role": "assistant", "content": "<tool_call>f</tool_call>"}]}"##;
    assert!(Conversation::from_row(good, &fields).is_ok());

    let mut stats = ChatStats::default();
    let out = process_row(&nano3(), bad, &RowConfig::default(), bytes, &mut stats);
    assert_eq!(out, Err(DropReason::ToolCallWithoutToolsHeader));
    assert_eq!(
        (
            stats.num_input_rows,
            stats.num_filtered,
            stats.num_validation_errors
        ),
        (1, 1, 1)
    );
}

#[test]
fn record_parsing_fields_and_errors() {
    let fields = RowFields {
        messages_field: "conv".into(),
        tools_field: "fns".into(),
    };
    let row = r#"{"conv": [{"role": "user", "content": null, "name": "ann"}], "fns": "[{\"name\": \"f\"}]"}"#;
    let c = Conversation::from_row(row, &fields).unwrap();
    assert_eq!(c.messages[0].content, "");
    assert_eq!(
        c.messages[0].extra,
        vec![("name".into(), Json::String("ann".into()))]
    );
    assert_eq!(c.tools.as_ref().map(Vec::len), Some(1));
    assert_eq!(
        Conversation::from_row(r#"{"conv": []}"#, &fields),
        Err(DropReason::NoMessages)
    );
    assert!(matches!(
        Conversation::from_row(r#"{"conv": [{"role": "robot", "content": "x"}]}"#, &fields),
        Err(DropReason::InvalidRow(_))
    ));
    let bad_args = r#"{"conv": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]}"#;
    assert!(matches!(
        Conversation::from_row(bad_args, &fields),
        Err(DropReason::BadToolArguments(_))
    ));
    // serde: a Conversation deserializes directly too.
    let direct: Conversation =
        serde_json::from_str(r#"{"messages": [{"role": "tool", "content": "r"}]}"#).unwrap();
    assert_eq!(direct.messages[0].role, Role::Tool);
}

#[test]
fn used_in_filter() {
    let list = Json::parse(r#"["nano_v3", "x"]"#).unwrap();
    assert!(matches_used_in(Some(&list), "nano_v3"));
    assert!(matches_used_in(
        Some(&Json::String("a, nano_v3".into())),
        "nano_v3"
    ));
    assert!(!matches_used_in(
        Some(&Json::String("nano_v2".into())),
        "nano_v3"
    ));
    assert!(!matches_used_in(None, "nano_v3"));
    let cfg = RowConfig {
        used_in_filter: Some("nano_v3".into()),
        ..RowConfig::default()
    };
    let mut stats = ChatStats::default();
    let row = r#"{"used_in": ["other"], "messages": [{"role": "user", "content": "q"}]}"#;
    assert_eq!(
        process_row(&nano3(), row, &cfg, bytes, &mut stats),
        Err(DropReason::NotUsedIn)
    );
    assert_eq!((stats.num_filtered, stats.num_errors), (1, 0));
}

// --- tokens and masks ------------------------------------------------------------------

#[test]
fn mask_is_one_exactly_on_assistant_chunk_tokens() {
    let c = conv(vec![
        msg(Role::User, "q1"),
        msg(Role::Assistant, "a1"),
        msg(Role::User, "q2"),
        msg(Role::Assistant, "a2"),
    ]);
    let t = nano3();
    let chunks = role_chunks(&t, &c, &ChatOptions::default())
        .unwrap()
        .remove(0);
    let (ids, mask) = tokenize_chunks(&chunks, bytes, None);
    let full = t.render(&c.messages, None, false, OFF).unwrap();
    assert_eq!(ids, bytes(&full), "no special tokens, no EOS");
    let trained: String = ids
        .iter()
        .zip(&mask)
        .filter(|(_, m)| **m == 1)
        .map(|(id, _)| char::from(*id as u8))
        .collect();
    assert_eq!(trained, "a1<|im_end|>\na2<|im_end|>\n");
    // The generation prompt (in the user chunk) is not trained.
    let prompt_at = full.find("<|im_start|>assistant").unwrap();
    assert_eq!(mask[prompt_at], 0);

    let (short_ids, short_mask) = tokenize_chunks(&chunks, bytes, Some(10));
    assert_eq!((short_ids.len(), short_mask.len()), (10, 10));
    assert_eq!(short_ids, ids[..10]);
}

#[test]
fn process_row_end_to_end() {
    let mut stats = ChatStats::default();
    let cfg = RowConfig {
        max_doc_tokens: Some(1000),
        ..RowConfig::default()
    };
    let seqs = process_row(&nano3(), TOOL_ROW, &cfg, bytes, &mut stats).unwrap();
    assert_eq!(seqs.len(), 1);
    let (ids, mask) = &seqs[0];
    assert_eq!(ids.len(), 1000);
    assert_eq!(mask.len(), 1000);
    assert!(
        mask.iter().all(|&m| m == 0),
        "the first 1000 bytes are system text"
    );
    assert_eq!(
        (
            stats.num_input_rows,
            stats.num_output_sequences,
            stats.num_truncated
        ),
        (1, 1, 1)
    );

    let full = process_row(&nano3(), TOOL_ROW, &RowConfig::default(), bytes, &mut stats)
        .unwrap()
        .remove(0);
    let trained: Vec<u8> = full
        .0
        .iter()
        .zip(&full.1)
        .filter(|(_, m)| **m == 1)
        .map(|(id, _)| *id as u8)
        .collect();
    let call_body = TOOL_CALL_TURN
        .strip_prefix("<|im_start|>assistant\n<think></think>")
        .unwrap();
    assert_eq!(
        String::from_utf8(trained).unwrap(),
        format!("{call_body}21C.<|im_end|>\n")
    );
}

// --- sources ---------------------------------------------------------------------------

#[test]
fn template_sources() {
    let dir = std::env::temp_dir().join(format!("nemo-dag-chat-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("t.jinja");
    std::fs::write(&file, "{{ messages | length }}").unwrap();
    let config = dir.join("tokenizer_config.json");
    std::fs::write(&config, r#"{"chat_template": [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]}"#).unwrap();

    assert_eq!(
        load_template(&TemplateSource::Bundled("nano3".into())).unwrap(),
        NANO3_TEMPLATE
    );
    assert!(load_template(&TemplateSource::Bundled("lightning35".into())).is_err());
    assert_eq!(
        load_template(&TemplateSource::Inline("X".into())).unwrap(),
        "X"
    );
    assert_eq!(
        load_template(&TemplateSource::File(file.clone())).unwrap(),
        "{{ messages | length }}"
    );
    assert_eq!(
        load_template(&TemplateSource::TokenizerConfig(dir.clone())).unwrap(),
        "D"
    );

    assert_eq!(
        TemplateSource::from_param("nano3"),
        TemplateSource::Bundled("nano3".into())
    );
    assert_eq!(
        TemplateSource::from_param(file.to_str().unwrap()),
        TemplateSource::File(file.clone())
    );
    assert_eq!(
        TemplateSource::from_param(config.to_str().unwrap()),
        TemplateSource::TokenizerConfig(config.clone())
    );
    assert_eq!(
        TemplateSource::from_param("{{ x }}"),
        TemplateSource::Inline("{{ x }}".into())
    );

    std::fs::write(&config, r#"{"chat_template": null}"#).unwrap();
    std::fs::write(dir.join("chat_template.jinja"), "J").unwrap();
    assert_eq!(
        load_template(&TemplateSource::TokenizerConfig(config)).unwrap(),
        "J"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
