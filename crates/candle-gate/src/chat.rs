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
    '\u{FDD0}', '\u{FDD1}', '\u{FDD2}', '\u{FDD3}', '\u{FDD4}', '\u{FDD5}', '\u{FDD6}', '\u{FDD7}',
    '\u{FDD8}', '\u{FDD9}', '\u{FDDA}', '\u{FDDB}', '\u{FDDC}', '\u{FDDD}', '\u{FDDE}', '\u{FDDF}',
    '\u{FDE0}', '\u{FDE1}', '\u{FDE2}', '\u{FDE3}', '\u{FDE4}', '\u{FDE5}', '\u{FDE6}', '\u{FDE7}',
    '\u{FDE8}', '\u{FDE9}', '\u{FDEA}', '\u{FDEB}', '\u{FDEC}', '\u{FDED}', '\u{FDEE}', '\u{FDEF}',
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
        if first { Ok(()) } else { w.write_all(b", ") }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

fn tojson(value: minijinja::Value, kwargs: minijinja::value::Kwargs) -> std::result::Result<minijinja::Value, minijinja::Error> {
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
    pub fn render(&self, messages: &Json, tools: Option<&Json>, add_generation_prompt: bool, controls: &[&str]) -> Result<Rendered> {
        let list = messages.as_array().ok_or_else(|| Error::BadInput("a chat must be a list of messages".into()))?;
        if list.is_empty() {
            return Err(Error::BadInput("a chat needs at least one message".into()));
        }
        for (i, m) in list.iter().enumerate() {
            let ok_role = m.get("role").is_some_and(Json::is_string);
            let ok_content = matches!(m.get("content"), None | Some(Json::Null) | Some(Json::String(_)));
            if !ok_role || !ok_content {
                return Err(Error::BadInput(format!(
                    "message {i} must be an object with a string `role` and a string (or null) `content`"
                )));
            }
        }
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

        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_template("chat", &self.source).map_err(|e| Error::Tokenizer(format!("chat template: {e}")))?;
        let t = env.get_template("chat").map_err(|e| Error::Tokenizer(e.to_string()))?;
        let text = t
            .render(minijinja::context! {
                messages => minijinja::Value::from_serialize(&messages),
                tools => tools.map(|t| minijinja::Value::from_serialize(&t)),
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_text,
                eos_token => self.eos_text,
            })
            .map_err(|e| Error::BadInput(format!("chat template: {e}")))?;
        Ok(Rendered { text, marker })
    }
}
