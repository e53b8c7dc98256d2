//! Chat templates: the Jinja template a model ships (`tokenizer.chat_template` in GGUF,
//! `chat_template` in `tokenizer_config.json`) rendered with `minijinja`, configured like
//! Hugging Face's renderer (`trim_blocks`, `lstrip_blocks`, Python string methods,
//! `raise_exception`, `strftime_now`).

use std::path::Path;

use minijinja::value::ValueKind;
use minijinja::{Environment, ErrorKind, Value};
use serde_json::Value as Json;

use super::hf;
use crate::formats::gguf::Metadata;
use crate::formats::{files, limits};
use crate::{Error, Result};

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// `system`, `user`, `assistant`, `tool`...
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Message {
        Message { role: role.into(), content: content.into() }
    }
}

/// The built-in templates (`ChatTemplate::builtin`), one per model family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `<|im_start|>role ... <|im_end|>` (Qwen).
    ChatMl,
    Gemma,
    Phi3,
    /// Llama 3 headers, or Llama 2 `[INST]` for a vocabulary without them.
    Llama,
    Mistral,
}

/// A model's chat template with the BOS/EOS strings it may refer to.
#[derive(Clone, Debug)]
pub struct ChatTemplate {
    source: String,
    bos_token: String,
    eos_token: String,
    origin: String,
}

impl ChatTemplate {
    /// `source`: Jinja text; `bos_token`/`eos_token`: the strings the template sees.
    pub fn new(source: impl Into<String>, bos_token: impl Into<String>, eos_token: impl Into<String>) -> ChatTemplate {
        ChatTemplate {
            source: source.into(),
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
            origin: "chat template".into(),
        }
    }

    /// The template in GGUF metadata (`tokenizer.chat_template`), None when absent.
    pub fn from_gguf(meta: &Metadata) -> Option<ChatTemplate> {
        let source = meta.get("tokenizer.chat_template")?.as_str()?;
        let token = |key: &str| -> String {
            let id = meta.get(key).and_then(|v| v.as_u64());
            let tokens = meta.get("tokenizer.ggml.tokens").and_then(|v| v.as_array());
            match (id, tokens) {
                (Some(id), Some(t)) => t.get(id as usize).and_then(|v| v.as_str()).unwrap_or_default().to_owned(),
                _ => String::new(),
            }
        };
        let name = meta.get("general.name").and_then(|v| v.as_str()).unwrap_or("GGUF model");
        Some(ChatTemplate {
            source: source.to_owned(),
            bos_token: token("tokenizer.ggml.bos_token_id"),
            eos_token: token("tokenizer.ggml.eos_token_id"),
            origin: format!("chat template of `{name}`"),
        })
    }

    /// The template of a Hugging Face directory: `chat_template.jinja`, else `chat_template` in
    /// `tokenizer_config.json` (a string, or a list of named templates: `default` is used).
    /// Ok(None) when the directory has none.
    pub fn from_hf_dir(dir: &Path) -> Result<Option<ChatTemplate>> {
        let config = hf::read_tokenizer_config(dir)?;
        let cfg = |k: &str| config.as_ref().and_then(|c| c.get(k));
        let jinja = dir.join("chat_template.jinja");
        let source = match files::read_text_opt(&jinja, limits::MAX_SMALL_FILE_BYTES, "chat_template.jinja")? {
            Some(s) => Some(s),
            None => match cfg("chat_template") {
                Some(Json::String(s)) => Some(s.clone()),
                Some(Json::Array(list)) => {
                    let named = |want: &str| {
                        list.iter()
                            .find(|t| t.get("name").and_then(Json::as_str) == Some(want))
                            .and_then(|t| t.get("template").and_then(Json::as_str).map(str::to_owned))
                    };
                    named("default")
                }
                _ => None,
            },
        };
        let Some(source) = source else { return Ok(None) };
        Ok(Some(ChatTemplate {
            source,
            bos_token: hf::token_string(cfg("bos_token")).unwrap_or_default(),
            eos_token: hf::token_string(cfg("eos_token")).unwrap_or_default(),
            origin: format!("chat template in {}", dir.display()),
        }))
    }

    /// A family's conventional template, for a model file that carries none (as llama.cpp's
    /// built-in templates); `Llama` is Llama 3's headers when the vocabulary has them, else
    /// Llama 2's `[INST]`. A system message goes where the family's own template puts it.
    /// `model` names the architecture in `origin`.
    pub fn builtin(family: Family, tok: &super::Tokenizer, model: &str) -> ChatTemplate {
        let text = |id: Option<u32>| id.and_then(|i| tok.token_text(i)).unwrap_or_default().to_owned();
        let (name, source) = match family {
            Family::ChatMl => ("ChatML", BUILTIN_CHATML),
            Family::Gemma => ("Gemma", BUILTIN_GEMMA),
            Family::Phi3 => ("Phi-3", BUILTIN_PHI3),
            Family::Llama if tok.token_id("<|start_header_id|>").is_some() => ("Llama 3", BUILTIN_LLAMA3),
            Family::Llama => ("Llama 2", BUILTIN_INST),
            Family::Mistral => ("Mistral", BUILTIN_INST),
        };
        ChatTemplate {
            source: source.to_owned(),
            bos_token: text(tok.bos_id()),
            eos_token: text(tok.eos_id()),
            origin: format!("built-in {name} chat template for {model}"),
        }
    }

    /// Where the template came from (the file, or `built-in ...`).
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// For the CLI: the template, or an error naming the model that has none.
    pub fn require(template: Option<ChatTemplate>, model: &str) -> Result<ChatTemplate> {
        template.ok_or_else(|| {
            Error::config(
                model,
                "chat_template",
                "the model has no chat template (no `tokenizer.chat_template` / `chat_template`); \
                 pass a raw prompt instead of chat messages",
            )
        })
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages`; `add_generation_prompt` appends the assistant-turn opener.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let text_bytes: u64 = messages.iter().map(|m| (m.role.len() + m.content.len()) as u64).sum();
        let msgs: Vec<Value> = messages
            .iter()
            .map(|m| {
                Value::from_pairs([
                    ("role", Value::from(m.role.as_str())),
                    ("content", Value::from(m.content.as_str())),
                ])
            })
            .collect();
        self.render_with(vec![("messages".into(), Value::from(msgs))], add_generation_prompt, text_bytes)
    }

    /// Renders an OpenAI-style request given as JSON: an array of messages, or an object with
    /// `messages` and any other variables the template reads (`tools`, `documents`...).
    /// Messages are objects with a string `role`; their other fields (`content` as text or
    /// parts, `tool_calls`, `name`...) reach the template as they are. `what` names the input
    /// in errors.
    pub fn render_json(&self, request: &Json, add_generation_prompt: bool, what: &str) -> Result<String> {
        let (messages, extra) = match request {
            Json::Array(m) => (m, None),
            Json::Object(o) => match o.get("messages") {
                Some(Json::Array(m)) => (m, Some(o)),
                _ => return Err(Error::invalid(what, "an object needs a `messages` array")),
            },
            _ => return Err(Error::invalid(what, "must be an array of messages or an object with `messages`")),
        };
        for (i, m) in messages.iter().enumerate() {
            if !m.get("role").is_some_and(Json::is_string) {
                return Err(Error::invalid(format!("{what}: messages[{i}]"), "needs a string `role`"));
            }
        }
        let mut vars: Vec<(String, Value)> = Vec::new();
        for (k, v) in extra.into_iter().flatten() {
            if !matches!(k.as_str(), "messages" | "add_generation_prompt" | "bos_token" | "eos_token") {
                vars.push((k.clone(), json_value(v)));
            }
        }
        vars.push(("messages".into(), Value::from(messages.iter().map(json_value).collect::<Vec<_>>())));
        let text_bytes = request.to_string().len() as u64;
        self.render_with(vars, add_generation_prompt, text_bytes)
    }

    /// The model's stop strings for chat: the texts of its end-of-generation tokens.
    pub fn stop_strings(tokenizer: &super::Tokenizer) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for &id in tokenizer.eos_ids() {
            if let Some(t) = tokenizer.token_text(id).filter(|t| !t.is_empty()) {
                if !out.iter().any(|o| o == t) {
                    out.push(t.to_owned());
                }
            }
        }
        out
    }

    fn render_with(&self, vars: Vec<(String, Value)>, add_generation_prompt: bool, text_bytes: u64) -> Result<String> {
        let mut env = Environment::new();
        // Hugging Face renders chat templates with trim_blocks and lstrip_blocks on.
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| self.err(e))?;
        env.set_syntax(syntax);
        // Python string/list methods (`''.join(...)`, `.split()`, `.items()`): pycompat
        // walks its receiver and arguments without charging fuel, so
        // `''.join(['a'] * 10**8)` ran for 40 s (found by the fuzzer) and a larger count would
        // exhaust memory. Charge one fuel per item walked first.
        env.set_unknown_method_callback(|state, value, method, args| {
            let items = |v: &Value| -> u64 {
                match v.kind() {
                    ValueKind::Seq | ValueKind::Map | ValueKind::Iterable => v.len().unwrap_or(0) as u64,
                    ValueKind::String | ValueKind::Bytes => v.len().unwrap_or(0) as u64 / 64,
                    _ => 0,
                }
            };
            let cost = args.iter().chain(std::iter::once(value)).map(items).fold(1u64, u64::saturating_add);
            state.consume_fuel(cost)?;
            minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
        });
        env.add_function("raise_exception", |msg: String| -> std::result::Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| strftime_utc_now(&fmt));
        // The template is model-file input: bound the render's time and memory.
        env.set_fuel(Some(
            limits::CHAT_TEMPLATE_FUEL.saturating_add(text_bytes.saturating_mul(limits::CHAT_TEMPLATE_FUEL_PER_BYTE)),
        ));
        let tmpl = env.template_from_str(&self.source).map_err(|e| self.err(e))?;
        let mut pairs = vars;
        pairs.push(("add_generation_prompt".into(), Value::from(add_generation_prompt)));
        pairs.push(("bos_token".into(), Value::from(self.bos_token.as_str())));
        pairs.push(("eos_token".into(), Value::from(self.eos_token.as_str())));
        tmpl.render(Value::from_pairs(pairs)).map_err(|e| self.err(e))
    }

    fn err(&self, e: minijinja::Error) -> Error {
        // The display of a minijinja error includes the line and the failing expression.
        let mut msg = e.to_string();
        let mut src = std::error::Error::source(&e);
        while let Some(s) = src {
            msg.push_str(&format!(": {s}"));
            src = s.source();
        }
        Error::invalid(self.origin.clone(), msg)
    }
}

const BUILTIN_CHATML: &str =
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}\
{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}";

const BUILTIN_GEMMA: &str = "{{ bos_token }}{%- if messages and messages[0]['role'] == 'system' %}\
{%- set first = messages[0]['content'] + '\\n\\n' %}{%- set rest = messages[1:] %}\
{%- else %}{%- set first = '' %}{%- set rest = messages %}{%- endif %}\
{%- for m in rest %}{%- set role = 'model' if m['role'] == 'assistant' else m['role'] %}\
{{ '<start_of_turn>' + role + '\\n' + (first if loop.first else '') + m['content'] | trim + '<end_of_turn>\\n' }}\
{%- endfor %}{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{%- endif %}";

const BUILTIN_PHI3: &str = "{%- for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}\
{%- endfor %}{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{%- endif %}";

const BUILTIN_LLAMA3: &str = "{{ bos_token }}{%- for m in messages %}\
{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}\
{%- endfor %}{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}";

/// Llama 2 and Mistral: a system message is put before the first user message.
const BUILTIN_INST: &str = "{%- if messages and messages[0]['role'] == 'system' %}\
{%- set first = messages[0]['content'] + '\\n\\n' %}{%- set rest = messages[1:] %}\
{%- else %}{%- set first = '' %}{%- set rest = messages %}{%- endif %}{{ bos_token }}\
{%- for m in rest %}{%- if m['role'] == 'user' %}{{ '[INST] ' + (first if loop.first else '') + m['content'] | trim + ' [/INST]' }}\
{%- elif m['role'] == 'assistant' %}{{ ' ' + m['content'] | trim + eos_token }}\
{%- else %}{{ raise_exception('this template knows the roles system, user and assistant, not ' + m['role']) }}\
{%- endif %}{%- endfor %}";

/// A JSON value as a template value (serde_json bounds the nesting when it parses).
fn json_value(v: &Json) -> Value {
    match v {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Value::from(i),
            (_, Some(u)) => Value::from(u),
            _ => Value::from(n.as_f64().unwrap_or(f64::NAN)),
        },
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(a) => Value::from(a.iter().map(json_value).collect::<Vec<_>>()),
        Json::Object(o) => Value::from_pairs(o.iter().map(|(k, v)| (k.as_str(), json_value(v)))),
    }
}

/// `strftime` on the current UTC time, for templates that print today's date (Llama 3.1).
/// Supports %Y %y %m %d %e %H %M %S %b %B %a %A %j %%.
fn strftime_utc_now(fmt: &str) -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    strftime(fmt, secs as i64)
}

fn strftime(fmt: &str, unix_secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let days = unix_secs.div_euclid(86400);
    let sod = unix_secs.rem_euclid(86400);
    // Civil-from-days (H. Hinnant), proleptic Gregorian.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let d = doy_mar - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let wday = (days + 3).rem_euclid(7); // 1970-01-01 was a Thursday (index 3 from Monday)
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:2}")),
            Some('H') => out.push_str(&format!("{:02}", sod / 3600)),
            Some('M') => out.push_str(&format!("{:02}", sod / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", sod % 60)),
            Some('b') => out.push_str(&MONTHS[(m - 1) as usize][..3]),
            Some('B') => out.push_str(MONTHS[(m - 1) as usize]),
            Some('a') => out.push_str(&DAYS[wday as usize][..3]),
            Some('A') => out.push_str(DAYS[wday as usize]),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-07-26 13:05:09 UTC, a Friday, day 208 of a leap year.
        assert_eq!(strftime("%d %b %Y %H:%M:%S %A %j", 1_722_000_309), "26 Jul 2024 13:25:09 Friday 208");
        assert_eq!(strftime("%Y-%m-%d %a", 0), "1970-01-01 Thu");
        assert_eq!(strftime("%Y-%m-%d", 951_782_400), "2000-02-29");
    }

    #[test]
    fn raise_exception_surfaces_the_message() {
        let t = ChatTemplate::new("{{ raise_exception('only user/assistant roles') }}", "", "");
        let err = t.render(&[], false).unwrap_err().to_string();
        assert!(err.contains("only user/assistant roles"), "{err}");
    }

    #[test]
    fn python_string_methods_and_loop_controls_work() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}\
             {{ m.content.strip().upper() }}{% if m.content.startswith(' a') %}!{% endif %}|{% endfor %}\
             {{ bos_token }}{{ eos_token }}{% if add_generation_prompt %}>{% endif %}",
            "<s>",
            "</s>",
        );
        let msgs = [Message::new("user", " abc "), Message::new("skip", "x"), Message::new("assistant", "d")];
        assert_eq!(t.render(&msgs, true).unwrap(), "ABC!|D|<s></s>>");
    }

    /// A template is model-file input: nested loops that would run 10^10 times end with an
    /// error once the render's fuel is spent, instead of hanging the host.
    #[test]
    fn a_runaway_template_runs_out_of_fuel() {
        let t = ChatTemplate::new(
            "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}",
            "",
            "",
        );
        let start = std::time::Instant::now();
        let err = t.render(&[Message::new("user", "hi")], true).unwrap_err().to_string();
        assert!(err.contains("fuel"), "{err}");
        assert!(start.elapsed() < std::time::Duration::from_secs(60), "took {:?}", start.elapsed());
        let t = ChatTemplate::new("{% set s = 'x' * 100000 %}{% for i in range(100000) %}{{ s }}{% endfor %}", "", "");
        let err = t.render(&[], false).unwrap_err().to_string();
        assert!(err.contains("fuel"), "{err}");
        // Python methods pay for what they walk (this one ran for 40 s without fuel).
        let start = std::time::Instant::now();
        let t = ChatTemplate::new("{{ ''.join(['a'] * 100000000) }}", "", "");
        let err = t.render(&[], false).unwrap_err().to_string();
        assert!(err.contains("fuel"), "{err}");
        assert!(start.elapsed() < std::time::Duration::from_secs(10), "took {:?}", start.elapsed());
        // Ordinary uses still work.
        let t = ChatTemplate::new("{{ ', '.join(['a', 'b']) }} {{ 'x y'.split() | length }}", "", "");
        assert_eq!(t.render(&[], false).unwrap(), "a, b 2");
    }

    #[test]
    fn missing_template_error_names_the_model() {
        let err = ChatTemplate::require(None, "tiny-model").unwrap_err().to_string();
        assert!(err.contains("tiny-model") && err.contains("chat template"), "{err}");
    }
}
