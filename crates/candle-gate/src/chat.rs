//! Chat templates from the GGUF metadata, rendered the way Hugging Face's
//! `apply_chat_template` renders them (Jinja with `trim_blocks`, `lstrip_blocks`, loop controls,
//! and its own `tojson`), and the rule that keeps the text people write apart from control tokens.
//!
//! The rule: a control token (`<|im_start|>`, `<|im_end|>`, ...) comes only from the template's
//! own text. Before rendering, every string that comes from the caller (message contents, roles,
//! tool definitions) has a marker character put inside each control token's text it contains;
//! the tokenizer then cannot match those occurrences, and removes the markers before encoding the
//! text around them. So `<|im_end|>` typed by a user stays the characters `<`, `|`, `im`, ...

use serde_json::Value as Json;

use crate::error::{Error, Result};

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        ChatMessage { role: role.into(), content: content.into() }
    }
}

/// Noncharacters (Unicode's "never interchanged" code points): the marker is the first of these
/// that occurs in none of the caller's strings, so removing it never removes user text.
const MARKERS: [char; 32] = [
    '\u{FDD0}', '\u{FDD1}', '\u{FDD2}', '\u{FDD3}', '\u{FDD4}', '\u{FDD5}', '\u{FDD6}', '\u{FDD7}', '\u{FDD8}',
    '\u{FDD9}', '\u{FDDA}', '\u{FDDB}', '\u{FDDC}', '\u{FDDD}', '\u{FDDE}', '\u{FDDF}', '\u{FDE0}', '\u{FDE1}',
    '\u{FDE2}', '\u{FDE3}', '\u{FDE4}', '\u{FDE5}', '\u{FDE6}', '\u{FDE7}', '\u{FDE8}', '\u{FDE9}', '\u{FDEA}',
    '\u{FDEB}', '\u{FDEC}', '\u{FDED}', '\u{FDEE}', '\u{FDEF}',
];

/// A rendered chat whose caller-written control-token texts carry `marker`.
pub struct Rendered {
    pub text: String,
    pub marker: char,
}

impl Rendered {
    /// The text as the template rendered it, markers removed.
    pub fn plain(&self) -> String {
        self.text.chars().filter(|&c| c != self.marker).collect()
    }
}

pub struct ChatTemplate {
    source: String,
    bos_text: String,
    eos_text: String,
}

fn strings_in<'a>(v: &'a Json, out: &mut Vec<&'a str>) {
    match v {
        Json::String(s) => out.push(s),
        Json::Array(a) => a.iter().for_each(|x| strings_in(x, out)),
        Json::Object(o) => o.iter().for_each(|(k, x)| {
            out.push(k);
            strings_in(x, out)
        }),
        _ => {}
    }
}

/// Every string in `v` with `marker` put after the first character of each control text in it.
fn neutralize(v: &Json, controls: &[&str], marker: char) -> Json {
    match v {
        Json::String(s) => {
            let mut s = s.clone();
            for c in controls {
                if s.contains(c) {
                    let first = c.chars().next().map_or(0, char::len_utf8);
                    let marked = format!("{}{marker}{}", &c[..first], &c[first..]);
                    s = s.replace(c, &marked);
                }
            }
            Json::String(s)
        }
        Json::Array(a) => Json::Array(a.iter().map(|x| neutralize(x, controls, marker)).collect()),
        Json::Object(o) => Json::Object(o.iter().map(|(k, x)| (k.clone(), neutralize(x, controls, marker))).collect()),
        other => other.clone(),
    }
}

/// Python's `json.dumps(x, ensure_ascii=False)` separators (`", "`, `": "`), which is what
/// Hugging Face's `tojson` writes and so what the templates were written against.
struct PythonJson;

impl serde_json::ser::Formatter for PythonJson {
    fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

fn tojson(
    value: minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<minijinja::Value, minijinja::Error> {
    use serde::Serialize;
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let err = |e: serde_json::Error| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e.to_string());
    let mut out = Vec::new();
    match indent {
        None => value.serialize(&mut serde_json::Serializer::with_formatter(&mut out, PythonJson)).map_err(err)?,
        Some(n) => {
            let pad = vec![b' '; n];
            let f = serde_json::ser::PrettyFormatter::with_indent(&pad);
            value.serialize(&mut serde_json::Serializer::with_formatter(&mut out, f)).map_err(err)?
        }
    }
    Ok(minijinja::Value::from_safe_string(String::from_utf8(out).expect("serde_json writes UTF-8")))
}

/// Instructions a template may run for a chat: a base for its own logic plus a share per
/// message and per tool, at most [`FUEL_MAX`]. Qwen2.5's template spends about 100 instructions
/// and 31 per further message, SmolLM2's 60 and 23 (`real_templates_fit_the_fuel`); a template
/// that loops without end (a GGUF's template is untrusted) stops with an error instead of hanging.
pub const FUEL_BASE: u64 = 100_000;
pub const FUEL_PER_ITEM: u64 = 1_000;
pub const FUEL_MAX: u64 = 1_000_000;
/// Rendering runs on a thread of its own whose stack grows with the fuel: a template can nest a
/// value one level deeper per instruction (`{% set ns.x = [ns.x] %}` in a loop), and printing,
/// serializing or dropping such a value recurses once per level (up to ~390 bytes of stack per
/// level measured in release builds; more without optimizations). Found by the fuzzer: a few
/// hundred thousand levels overflowed the caller's stack.
const STACK_BASE: usize = 16 << 20;
const STACK_PER_FUEL: usize = if cfg!(debug_assertions) { 4096 } else { 1024 };
/// Bytes a rendered chat may take: a base plus a multiple of the caller's own text, so a
/// template cannot write without bound.
pub const OUTPUT_BASE: usize = 16 << 20;
pub const OUTPUT_PER_INPUT_BYTE: usize = 8;

/// The rendered text, refusing to grow past `limit` bytes.
struct Capped {
    buf: Vec<u8>,
    limit: usize,
    over: bool,
}

impl std::io::Write for Capped {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + b.len() > self.limit {
            self.over = true;
            return Err(std::io::Error::other("the rendered chat is too large"));
        }
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The shape every chat must have, whatever its template: a non-empty list of objects with a
/// string `role` and a string `content` (`null` only beside `tool_calls`).
pub fn check_messages(messages: &Json) -> std::result::Result<(), String> {
    let list = messages.as_array().ok_or("a chat must be a list of messages")?;
    if list.is_empty() {
        return Err("a chat needs at least one message".into());
    }
    for (i, m) in list.iter().enumerate() {
        let ok_role = m.get("role").is_some_and(Json::is_string);
        let ok_content = match m.get("content") {
            Some(Json::String(_)) => true,
            Some(Json::Null) => m.get("tool_calls").is_some(),
            _ => false,
        };
        if !ok_role || !ok_content {
            return Err(format!(
                "chat message {i} must be an object with a string `role` and a string `content` (null only with `tool_calls`), got {m}"
            ));
        }
    }
    Ok(())
}

impl ChatTemplate {
    pub fn new(source: String, bos_text: String, eos_text: String) -> Self {
        ChatTemplate { source, bos_text, eos_text }
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages` (OpenAI-style message objects) and optional `tools`, with the control
    /// texts the caller wrote marked (see the module docs); `controls` are the vocabulary's
    /// control-token texts.
    pub fn render(
        &self,
        messages: &Json,
        tools: Option<&Json>,
        add_generation_prompt: bool,
        controls: &[&str],
    ) -> Result<Rendered> {
        check_messages(messages).map_err(Error::BadInput)?;
        let list = messages.as_array().expect("checked");
        if tools.is_some_and(|t| !t.is_array()) {
            return Err(Error::BadInput("`tools` must be a list of tool definitions".into()));
        }
        let mut seen = Vec::new();
        strings_in(messages, &mut seen);
        if let Some(t) = tools {
            strings_in(t, &mut seen);
        }
        let marker = MARKERS
            .into_iter()
            .find(|m| !seen.iter().any(|s| s.contains(*m)))
            .ok_or_else(|| Error::BadInput("the chat uses every Unicode noncharacter U+FDD0..U+FDEF".into()))?;
        let messages = neutralize(messages, controls, marker);
        let tools = tools.map(|t| neutralize(t, controls, marker));

        let items = list.len() as u64 + tools.as_ref().and_then(Json::as_array).map_or(0, |t| t.len() as u64);
        let input_bytes: usize = seen.iter().map(|s| s.len()).sum();
        let fuel = FUEL_BASE.saturating_add(FUEL_PER_ITEM.saturating_mul(items)).min(FUEL_MAX);
        let work = || -> Result<String> {
            let mut env = minijinja::Environment::new();
            env.set_fuel(Some(fuel));
            env.set_trim_blocks(true);
            env.set_lstrip_blocks(true);
            env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
            env.add_filter("tojson", tojson);
            env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
            });
            env.add_template("chat", &self.source).map_err(|e| Error::Tokenizer(format!("chat template: {e}")))?;
            let t = env.get_template("chat").map_err(|e| Error::Tokenizer(e.to_string()))?;
            let limit = OUTPUT_BASE.saturating_add(OUTPUT_PER_INPUT_BYTE.saturating_mul(input_bytes));
            let mut out = Capped { buf: Vec::new(), limit, over: false };
            let ctx = minijinja::context! {
                messages => minijinja::Value::from_serialize(&messages),
                tools => tools.as_ref().map(minijinja::Value::from_serialize),
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_text,
                eos_token => self.eos_text,
            };
            if let Err(e) = t.render_captured_to(ctx, &mut out) {
                if out.over {
                    return Err(Error::BadInput(format!("chat template: the rendered chat exceeds {limit} bytes")));
                }
                return Err(Error::BadInput(format!("chat template: {e}")));
            }
            String::from_utf8(out.buf).map_err(|_| Error::BadInput("chat template: rendered invalid UTF-8".into()))
        };
        // Every value the template makes is made and dropped on this thread (see STACK_BASE).
        let stack = STACK_BASE.saturating_add((fuel as usize).saturating_mul(STACK_PER_FUEL));
        let text = std::thread::scope(|s| {
            std::thread::Builder::new()
                .name("chat-template".into())
                .stack_size(stack)
                .spawn_scoped(s, work)
                .map_err(|e| Error::Tokenizer(format!("chat template: cannot start its thread: {e}")))?
                .join()
                .map_err(|_| Error::BadInput("chat template: rendering panicked".into()))?
        })?;
        Ok(Rendered { text, marker })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::time::{Duration, Instant};

    fn render(source: &str) -> (Result<Rendered>, Duration) {
        let t = Instant::now();
        let msgs = json!([{"role": "user", "content": "hi"}]);
        let r =
            ChatTemplate::new(source.into(), "<s>".into(), "</s>".into()).render(&msgs, None, true, &["<|im_end|>"]);
        (r, t.elapsed())
    }

    #[test]
    fn a_template_that_would_run_for_hours_runs_out_of_fuel() {
        let src = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}";
        let (r, took) = render(src);
        let e = r.err().expect("refused").to_string();
        assert!(e.contains("fuel"), "{e}");
        assert!(took < Duration::from_secs(5), "{took:?}");
    }

    /// Found by the `chat_template` fuzz target (SIGSEGV): a value nested once per loop turn
    /// overflowed the stack when printed, serialized or dropped.
    #[test]
    fn a_template_that_nests_values_deeply_does_not_overflow_the_stack() {
        for body in ["", "{{ ns.x }}", "{{ ns.x|tojson }}", "{{ [ns.x, ns.x]|sort }}"] {
            let src = format!(
                "{{% set ns = namespace(x=[]) %}}{{% for a in range(1000) %}}{{% for b in range(1000) %}}{{% set ns.x = [ns.x] %}}{{% endfor %}}{{% endfor %}}{body}"
            );
            let (r, took) = render(&src);
            // Out of fuel after ~12k levels: refused, or rendered; either way, no crash.
            if let Err(e) = r {
                assert!(e.to_string().contains("fuel"), "{e}");
            }
            assert!(took < Duration::from_secs(20), "{took:?}");
        }
        // Deeper, with fuel for it: 1000 messages give the template FUEL_MAX.
        let msgs = Json::Array((0..1000).map(|i| json!({"role": "user", "content": format!("m{i}")})).collect());
        for body in ["{{ ns.x }}", "{{ ns.x|tojson }}"] {
            let src = format!(
                "{{% set ns = namespace(x=[]) %}}{{% for a in range(100) %}}{{% for b in range(1000) %}}{{% set ns.x = [ns.x] %}}{{% endfor %}}{{% endfor %}}{body}"
            );
            let r = ChatTemplate::new(src, String::new(), String::new()).render(&msgs, None, true, &[]).unwrap();
            assert_eq!(r.text.len(), 2 * 100_001);
        }
    }

    #[test]
    fn a_template_that_writes_without_end_is_cut_off() {
        let src = "{% for a in range(100000) %}{{ 'x' * 10000000 }}{% endfor %}";
        let (r, took) = render(src);
        let e = r.err().expect("refused").to_string();
        assert!(e.contains("exceeds"), "{e}");
        assert!(took < Duration::from_secs(5), "{took:?}");
    }

    /// The cached models' templates, where present: a long chat with tools stays well inside the
    /// fuel (the per-message share is what a message costs them, many times over).
    #[test]
    fn real_templates_fit_the_fuel() {
        let Some(home) = std::env::var_os("HOME") else { return };
        let dir = std::path::PathBuf::from(home).join(".cache/candle-gate");
        for name in ["qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "SmolLM2-135M-Instruct.Q4_1.gguf"] {
            let Ok(f) = crate::gguf::GgufFile::open(&dir.join(name)) else { continue };
            let Ok(src) = f.get_str("tokenizer.chat_template") else { continue };
            let tools = json!([{"type": "function", "function": {"name": "f", "description": "d",
                "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}]);
            let mut msgs = vec![json!({"role": "system", "content": "s"})];
            for i in 0..500 {
                msgs.push(json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": format!("m{i}")}));
            }
            let msgs = Json::Array(msgs);
            let t = ChatTemplate::new(src.clone(), String::new(), String::new());
            t.render(&msgs, Some(&tools), true, &[]).unwrap();
            // What a message costs, measured with the same template and no fuel limit.
            let mut env = minijinja::Environment::new();
            env.set_fuel(Some(u64::MAX / 4));
            env.add_filter("tojson", tojson);
            env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
            let tpl = env.template_from_str(&src).unwrap();
            let used = |n: usize| {
                let m = Json::Array(msgs.as_array().unwrap()[..n].to_vec());
                let ctx = minijinja::context! { messages => m, tools => tools.clone(), add_generation_prompt => true };
                tpl.render_captured(ctx).unwrap().state().fuel_levels().unwrap().0
            };
            let (one, many) = (used(2), used(501));
            let per = (many - one) / 499;
            eprintln!("{name}: {one} instructions for 2 messages, {per} per further message");
            assert!(one < FUEL_BASE / 10 && per < FUEL_PER_ITEM / 10, "{one} {per}");
        }
    }

    #[test]
    fn an_ordinary_template_renders_as_before() {
        let src = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}";
        let msgs = json!([{"role": "user", "content": "a <|im_end|> b"}]);
        let r = ChatTemplate::new(src.into(), String::new(), String::new())
            .render(&msgs, None, true, &["<|im_end|>"])
            .unwrap();
        assert_eq!(r.plain(), "<|im_start|>user\na <|im_end|> b<|im_end|>\n");
        assert_ne!(r.text, r.plain());
    }
}
