use super::*;
use crate::sft::jinja::strftime;
use crate::sft::records::parse_messages;

/// Qwen2.5 / SmolLM2 style (ChatML).
const CHATML: &str = "{%- for message in messages %}\n    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n";

/// The same ChatML output with TRL-style `{% generation %}` markers around the assistant's
/// content and end of turn.
const CHATML_GENERATION: &str = "{%- for message in messages %}\n    {%- if message.role == 'assistant' %}\n        {{- '<|im_start|>assistant' }}\n        {%- generation %}\n        {{- '\\n' + message.content + '<|im_end|>\\n' }}\n        {%- endgeneration %}\n    {%- else %}\n        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n";

/// Llama 3 style: BOS, headers, `<|eot_id|>` after each turn.
const LLAMA3: &str = "{{- bos_token }}\n{%- for message in messages %}\n    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n{%- endif %}\n";

fn tmpl(source: &str) -> ChatTemplate {
    ChatTemplate::from_source(
        source,
        Path::new("tokenizer_config.json"),
        vec![
            ("bos_token".into(), "<|begin_of_text|>".into()),
            ("eos_token".into(), "<|eot_id|>".into()),
        ],
    )
    .unwrap()
}

fn conversation() -> Vec<Message> {
    vec![
        Message::new(Role::System, "be nice"),
        Message::new(Role::User, "hi"),
        Message::new(Role::Assistant, "hello"),
        Message::new(Role::User, "how are you"),
        Message::new(Role::Assistant, "fine"),
    ]
}

fn span_texts(r: &Rendered) -> Vec<&str> {
    r.spans.iter().map(|s| &r.text[s.clone()]).collect()
}

#[test]
fn chatml_renders_like_transformers() {
    let t = tmpl(CHATML);
    let m = conversation();
    assert_eq!(
        t.render(&m[..2], true).unwrap(),
        "<|im_start|>system\nbe nice<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert!(!t.has_generation_markers());
}

#[test]
fn prefix_spans_chatml_include_end_of_turn() {
    let r = tmpl(CHATML).render_spans(&conversation()).unwrap();
    assert_eq!(span_texts(&r), ["hello<|im_end|>\n", "fine<|im_end|>\n"]);
    assert!(r.text[..r.spans[0].start].ends_with("<|im_start|>assistant\n"));
}

#[test]
fn prefix_spans_llama3_end_at_eot_and_leave_the_next_header() {
    let r = tmpl(LLAMA3).render_spans(&conversation()).unwrap();
    assert!(r
        .text
        .starts_with("<|begin_of_text|><|start_header_id|>system"));
    assert_eq!(span_texts(&r), ["hello<|eot_id|>", "fine<|eot_id|>"]);
    assert!(r.text[r.spans[0].end..].starts_with("<|start_header_id|>user"));
}

#[test]
fn generation_markers_give_the_spans_and_keep_the_whitespace() {
    let t = tmpl(CHATML_GENERATION);
    assert!(t.has_generation_markers());
    let m = conversation();
    let r = t.render_spans(&m).unwrap();
    // Same text as the template without markers: tags keep their whitespace handling.
    assert_eq!(r.text, tmpl(CHATML).render(&m, false).unwrap());
    assert_eq!(
        t.render(&m, true).unwrap(),
        tmpl(CHATML).render(&m, true).unwrap()
    );
    assert_eq!(
        span_texts(&r),
        ["\nhello<|im_end|>\n", "\nfine<|im_end|>\n"]
    );
    assert!(!r.text.contains([GEN_START, GEN_END]));
}

#[test]
fn generation_tag_rewriting_handles_whitespace_control() {
    let (s, found) = rewrite_generation_tags("a{%- generation -%}b{%+endgeneration%}c{% if x %}");
    assert!(found);
    assert_eq!(
        s,
        "a{%- if true %}\u{E000}{% endif -%}b{%+ if true %}\u{E001}{% endif %}c{% if x %}"
    );
    let (s, found) = rewrite_generation_tags("{% generations %}");
    assert!(!found);
    assert_eq!(s, "{% generations %}");
}

#[test]
fn a_template_that_rewrites_earlier_turns_is_refused_naming_the_message() {
    // Writes the number of messages first, so no shorter rendering is a prefix.
    let t = tmpl(
        "{{ messages | length }}{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}",
    );
    let err = t.render_spans(&conversation()).unwrap_err().to_string();
    assert!(err.contains("assistant message 2"), "{err}");
    assert!(err.contains("tokenizer_config.json"), "{err}");
}

#[test]
fn tojson_writes_like_python_json_dumps() {
    let t = tmpl(concat!(
        "{{ {'b': 1, 'a': [1, 'x<&>é', none, true, 1.5]} | tojson }}|",
        "{{ {'k': [1, 2], 'e': {}} | tojson(indent=2) }}|",
        "{{ {'b': 1, 'a': 2} | tojson(sort_keys=true, separators=[',', ':']) }}"
    ));
    let out = t.render(&[], false).unwrap();
    let parts: Vec<&str> = out.split('|').collect();
    assert_eq!(parts[0], r#"{"b": 1, "a": [1, "x<&>é", null, true, 1.5]}"#);
    assert_eq!(
        parts[1],
        "{\n  \"k\": [\n    1,\n    2\n  ],\n  \"e\": {}\n}"
    );
    assert_eq!(parts[2], r#"{"a":2,"b":1}"#);
}

#[test]
fn message_keys_keep_their_order_in_tojson() {
    let m = parse_messages(r#"[{"role": "user", "content": "x", "zeta": 1, "alpha": 2}]"#).unwrap();
    let out = tmpl("{{ messages[0] | tojson }}")
        .render(&m, false)
        .unwrap();
    assert_eq!(
        out,
        r#"{"role": "user", "content": "x", "zeta": 1, "alpha": 2}"#
    );
}

#[test]
fn python_methods_loop_controls_and_special_tokens() {
    let t = tmpl(concat!(
        "{{ bos_token }}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}",
        "{% if m.content.startswith(' ') %}<{{ m.content.strip() }}>{% else %}{{ m.content.upper() }}{% endif %}",
        "{% endfor %}{{ eos_token }}"
    ));
    let m = vec![
        Message::new(Role::User, "  padded  "),
        Message::new(Role::Assistant, "abc"),
        Message::new(Role::User, "never"),
    ];
    assert_eq!(
        t.render(&m, false).unwrap(),
        "<|begin_of_text|><padded>ABC<|eot_id|>"
    );
}

#[test]
fn raise_exception_names_the_template_file() {
    let t = tmpl("{% if messages[0].role != 'user' %}{{ raise_exception('must start with user') }}{% endif %}");
    let err = t
        .render(&[Message::new(Role::Assistant, "x")], false)
        .unwrap_err()
        .to_string();
    assert!(err.contains("must start with user"), "{err}");
    assert!(err.contains("tokenizer_config.json"), "{err}");
}

#[test]
fn strftime_formats_utc_dates() {
    assert_eq!(strftime("%d %b %Y", 0).unwrap(), "01 Jan 1970");
    // 2024-07-26 13:05:09 UTC, a Friday, day 208 of a leap year.
    let t = 1_721_952_000 + 13 * 3600 + 5 * 60 + 9;
    assert_eq!(
        strftime("%A %a %d %B %m %y %H:%M:%S %j %%", t).unwrap(),
        "Friday Fri 26 July 07 24 13:05:09 208 %"
    );
    assert!(strftime("%Q", 0).is_err());
    let out = tmpl("{{ strftime_now('%Y') }}").render(&[], false).unwrap();
    assert!(out.parse::<u32>().unwrap() >= 2024, "{out}");
}

#[test]
fn template_sources_jinja_file_wins_then_string_then_legacy_list() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join(TOKENIZER_CONFIG_FILE);
    let write = |s: &str| std::fs::write(&cfg, s).unwrap();
    let hi = [Message::new(Role::User, "hi")];

    write(
        r#"{"chat_template": "S{{ eos_token }}", "eos_token": {"content": "</s>", "lstrip": false}}"#,
    );
    let t = ChatTemplate::from_model_dir(dir.path()).unwrap();
    assert_eq!(t.render(&hi, false).unwrap(), "S</s>");
    assert_eq!(t.special_token("eos_token"), Some("</s>"));
    assert_eq!(t.origin(), cfg.as_path());

    write(
        r#"{"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}"#,
    );
    let t = ChatTemplate::from_model_dir(dir.path()).unwrap();
    assert_eq!(t.render(&hi, false).unwrap(), "D");

    let jinja = dir.path().join(CHAT_TEMPLATE_FILE);
    std::fs::write(&jinja, "J{{ messages[0].content }}\n").unwrap();
    let t = ChatTemplate::from_model_dir(dir.path()).unwrap();
    // Jinja's default drops one trailing newline of the template, as transformers does.
    assert_eq!(t.render(&hi, false).unwrap(), "Jhi");
    assert_eq!(t.origin(), jinja.as_path());
    std::fs::remove_file(&jinja).unwrap();

    write(r#"{"chat_template": [{"name": "tool_use", "template": "T"}]}"#);
    let err = ChatTemplate::from_model_dir(dir.path())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("default") && err.contains("tokenizer_config.json"),
        "{err}"
    );
    write(r#"{"eos_token": "</s>"}"#);
    let err = ChatTemplate::from_model_dir(dir.path())
        .unwrap_err()
        .to_string();
    assert!(err.contains("no chat template"), "{err}");
    write("{ not json");
    let err = ChatTemplate::from_model_dir(dir.path())
        .unwrap_err()
        .to_string();
    assert!(err.contains("tokenizer_config.json"), "{err}");
    write(r#"{"chat_template": "{% for %}"}"#);
    let err = ChatTemplate::from_model_dir(dir.path())
        .unwrap_err()
        .to_string();
    assert!(err.contains("does not compile"), "{err}");
}
