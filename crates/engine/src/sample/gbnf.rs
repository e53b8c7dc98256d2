//! GBNF, the grammar format of llama.cpp (`--grammar`, the server's `grammar` field), converted
//! to llguidance's Lark so that a grammar written for llama.cpp runs here unchanged.
//!
//! The syntax is the whole of llama.cpp's `grammars/README.md`: rules `name ::= ...` (names of
//! letters, digits and `-`), string literals and character classes with the escapes `\n \r \t
//! \\ \" \[ \] \- \xHH \uHHHH \UHHHHHHHH`, ranges and negation `[^...]`, `.` (any character),
//! groups, `|`, `*` `+` `?` `{m}` `{m,}` `{m,n}`, `#` comments, and tokens: `<[id]>`, `<text>`
//! (the one token whose text that is) and their negations `!<[id]>`, `!<text>` (any other token).
//! `root` is the rule the output matches. Two leniencies: a rule's body may go on over several
//! lines (a new rule starts where a line begins with `name ::=`), so may a line begin with `|`.
//! Defining a rule twice is an error (llama.cpp keeps the last), and so is an empty class `[]`
//! or a backwards range `[z-a]` (llama.cpp lets them match nothing).
//!
//! GBNF matches characters: a context-free grammar with no lexer. llguidance splits a grammar
//! into lexemes, each matched greedily (longest match first); a string or a repeated class
//! kept as one lexeme would change what matches (`("abc" | "a") "bd"` would refuse `abd`). So
//! every terminal here becomes a lexeme of exactly one character (strings are split into
//! their characters) and all structure stays in Lark rules: the Lark grammar accepts exactly
//! the strings the GBNF grammar does. Repetition counts follow llama.cpp's limits: a minimum
//! above 2000 is an error, a maximum above 2000 means no maximum.

use std::collections::HashMap;
use std::fmt::{self, Write as _};

/// A grammar that does not convert: where (1-based line and column, in characters) and what.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GbnfError {
    pub line: usize,
    pub col: usize,
    pub msg: String,
}

impl fmt::Display for GbnfError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {} col {}: {}", self.line, self.col, self.msg)
    }
}

impl std::error::Error for GbnfError {}

/// llama.cpp's `MAX_REPETITION_THRESHOLD`.
const MAX_REPEAT: u64 = 2000;

/// Converts a GBNF grammar to llguidance's Lark. Without a vocabulary, a token given by its
/// text (`<text>`) is passed on as a special token of that name, and `!<text>` is refused.
pub fn gbnf_to_lark(src: &str) -> Result<String, GbnfError> {
    convert(src, None)
}

/// [`gbnf_to_lark`] with the model's vocabulary: `token_id` gives the id of the one token whose
/// text is exactly its argument (`<think>` with its brackets), as llama.cpp requires of `<text>`.
pub fn gbnf_to_lark_with_vocab(src: &str, token_id: &dyn Fn(&str) -> Option<u32>) -> Result<String, GbnfError> {
    convert(src, Some(token_id))
}

/// Text of a token → its id, when the model's vocabulary is known.
type Vocab<'a> = Option<&'a dyn Fn(&str) -> Option<u32>>;

fn convert(src: &str, vocab: Vocab<'_>) -> Result<String, GbnfError> {
    let mut p = Parser { c: src.chars().collect(), i: 0 };
    let rules = p.grammar()?;
    let mut defined: HashMap<&str, usize> = HashMap::new();
    for r in &rules {
        if let Some(&first) = defined.get(r.name.as_str()) {
            let (l, c) = p.line_col(first);
            return p.err(r.at, format!("rule `{}` is defined twice (first at line {l} col {c})", r.name));
        }
        defined.insert(&r.name, r.at);
    }
    if !defined.contains_key("root") {
        return p.err(0, "no `root` rule: the output must match a rule named `root`");
    }
    let mut out = String::new();
    for r in &rules {
        let _ = write!(out, "{}: ", lark_name(&r.name));
        emit_alts(&p, &r.alts, &defined, vocab, &mut out)?;
        out.push('\n');
    }
    Ok(out)
}

/// A collision-free Lark rule name: `root` is `start`; a name Lark takes as it is (lower case,
/// digits, `-`, starting with a letter) stays; any other gets a `g_` prefix and each capital
/// `X` becomes `_x` (a GBNF name has no `_`, so these cannot meet the names kept).
fn lark_name(name: &str) -> String {
    if name == "root" {
        return "start".into();
    }
    let plain = name.starts_with(|c: char| c.is_ascii_lowercase())
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if plain && name != "start" {
        return name.into();
    }
    let mut s = String::from("g_");
    for c in name.chars() {
        if c.is_ascii_uppercase() {
            s.push('_');
            s.push(c.to_ascii_lowercase());
        } else {
            s.push(c);
        }
    }
    s
}

struct Rule {
    name: String,
    /// Where the name starts (a char index).
    at: usize,
    alts: Vec<Vec<Item>>,
}

enum Item {
    Lit(Vec<char>),
    Class { negated: bool, ranges: Vec<(char, char)> },
    Any,
    Ref { name: String, at: usize },
    Token { tok: Tok, negated: bool, at: usize },
    Group(Vec<Vec<Item>>),
    Repeat { item: Box<Item>, min: u64, max: Option<u64> },
}

enum Tok {
    Id(u32),
    Text(String),
}

struct Parser {
    c: Vec<char>,
    i: usize,
}

fn is_word(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-'
}

fn is_newline(c: char) -> bool {
    c == '\n' || c == '\r'
}

impl Parser {
    fn line_col(&self, at: usize) -> (usize, usize) {
        let (mut line, mut col) = (1, 1);
        for &c in &self.c[..at.min(self.c.len())] {
            if c == '\n' {
                line += 1;
                col = 1;
            } else {
                col += 1;
            }
        }
        (line, col)
    }

    fn err<T>(&self, at: usize, msg: impl Into<String>) -> Result<T, GbnfError> {
        let (line, col) = self.line_col(at);
        Err(GbnfError { line, col, msg: msg.into() })
    }

    fn peek(&self) -> Option<char> {
        self.c.get(self.i).copied()
    }

    fn peek_at(&self, k: usize) -> Option<char> {
        self.c.get(self.i + k).copied()
    }

    /// The first index from `j` past spaces, tabs, `#` comments and (if `newlines`) line breaks.
    fn skip_from(&self, mut j: usize, newlines: bool) -> usize {
        while let Some(&c) = self.c.get(j) {
            if c == ' ' || c == '\t' || (newlines && is_newline(c)) {
                j += 1;
            } else if c == '#' {
                while self.c.get(j).is_some_and(|&c| !is_newline(c)) {
                    j += 1;
                }
            } else {
                break;
            }
        }
        j
    }

    fn skip(&mut self, newlines: bool) {
        self.i = self.skip_from(self.i, newlines);
    }

    /// `name ::=` starts at `j`.
    fn rule_starts_at(&self, j: usize) -> bool {
        let mut k = j;
        while self.c.get(k).is_some_and(|&c| is_word(c)) {
            k += 1;
        }
        if k == j {
            return false;
        }
        while self.c.get(k).is_some_and(|&c| c == ' ' || c == '\t') {
            k += 1;
        }
        self.c.get(k..k + 3) == Some(&[':', ':', '='][..])
    }

    fn name(&mut self) -> String {
        let start = self.i;
        while self.peek().is_some_and(is_word) {
            self.i += 1;
        }
        self.c[start..self.i].iter().collect()
    }

    fn grammar(&mut self) -> Result<Vec<Rule>, GbnfError> {
        let mut rules = Vec::new();
        self.skip(true);
        while let Some(c) = self.peek() {
            let at = self.i;
            if !is_word(c) {
                return self.err(at, format!("expected a rule (`name ::= ...`), found `{c}`"));
            }
            // A rule begins a line: `a ::= b c ::= d` is a mistake, not two rules.
            let before = self.c[..at].iter().rev().find(|&&c| c != ' ' && c != '\t');
            if before.is_some_and(|&c| !is_newline(c)) {
                return self.err(at, "a rule (`name ::= ...`) must begin a line");
            }
            let name = self.name();
            self.i = self.skip_from(self.i, false);
            if self.c.get(self.i..self.i + 3) != Some(&[':', ':', '='][..]) {
                return self.err(self.i, format!("expected `::=` after the rule name `{name}`"));
            }
            self.i += 3;
            self.skip(true);
            let alts = self.alternates(false)?;
            match self.peek() {
                Some(')') => return self.err(self.i, "`)` without a matching `(`"),
                Some(c) if !is_newline(c) && !is_word(c) => return self.err(self.i, format!("unexpected `{c}`")),
                _ => {}
            }
            self.skip(true);
            rules.push(Rule { name, at, alts });
        }
        Ok(rules)
    }

    fn alternates(&mut self, nested: bool) -> Result<Vec<Vec<Item>>, GbnfError> {
        let mut alts = vec![self.sequence(nested)?];
        while self.peek() == Some('|') {
            self.i += 1;
            self.skip(true);
            alts.push(self.sequence(nested)?);
        }
        Ok(alts)
    }

    /// Items up to `|`, `)`, the end, or (outside parentheses) the next rule.
    fn sequence(&mut self, nested: bool) -> Result<Vec<Item>, GbnfError> {
        let mut items: Vec<Item> = Vec::new();
        loop {
            self.skip(nested);
            let at = self.i;
            let Some(c) = self.peek() else { break };
            match c {
                '|' | ')' => break,
                _ if is_newline(c) => {
                    // Outside parentheses a line break ends the rule only if the next rule
                    // (or the end) follows; otherwise the body goes on.
                    let j = self.skip_from(self.i, true);
                    if j == self.c.len() || self.rule_starts_at(j) {
                        break;
                    }
                    self.i = j;
                }
                '"' => items.push(Item::Lit(self.literal()?)),
                '[' => items.push(self.class()?),
                '.' => {
                    self.i += 1;
                    items.push(Item::Any);
                }
                '<' | '!' => items.push(self.token()?),
                '(' => {
                    self.i += 1;
                    self.skip(true);
                    let alts = self.alternates(true)?;
                    if self.peek() != Some(')') {
                        return self.err(at, "this `(` is never closed");
                    }
                    self.i += 1;
                    items.push(Item::Group(alts));
                }
                '*' | '+' | '?' | '{' => {
                    let Some(last) = items.pop() else {
                        return self.err(at, format!("`{c}` has nothing before it to repeat"));
                    };
                    let (min, max) = match c {
                        '*' => (0, None),
                        '+' => (1, None),
                        '?' => (0, Some(1)),
                        _ => self.counts(nested)?,
                    };
                    if c != '{' {
                        self.i += 1;
                    }
                    items.push(Item::Repeat { item: Box::new(last), min, max });
                }
                _ if is_word(c) => {
                    if !nested && self.rule_starts_at(self.i) {
                        break;
                    }
                    let name = self.name();
                    items.push(Item::Ref { name, at });
                }
                ':' => {
                    return self.err(at, "unexpected `:` (a rule `name ::=` can only begin a line outside parentheses)")
                }
                _ => {
                    return self.err(
                        at,
                        format!(
                            "unexpected `{c}`: expected a string \"...\", a class [...], a rule name, `(`, `.`, \
                             a token <...>, `|`, or a repetition * + ? {{m,n}}"
                        ),
                    )
                }
            }
        }
        Ok(items)
    }

    /// `{m}`, `{m,}` or `{m,n}` at the cursor.
    fn counts(&mut self, nested: bool) -> Result<(u64, Option<u64>), GbnfError> {
        let open = self.i;
        self.i += 1;
        self.skip(nested);
        let Some(min) = self.number()? else { return self.err(self.i, "expected a number after `{`") };
        self.skip(nested);
        let max = match self.peek() {
            Some('}') => Some(min),
            Some(',') => {
                self.i += 1;
                self.skip(nested);
                let max = self.number()?;
                self.skip(nested);
                if self.peek() != Some('}') {
                    return self.err(self.i, "expected `}` to close the repetition");
                }
                max
            }
            _ => return self.err(self.i, "expected `,` or `}` in the repetition"),
        };
        self.i += 1;
        if min > MAX_REPEAT {
            return self.err(open, format!("repeating at least {min} times is above the limit of {MAX_REPEAT}"));
        }
        if let Some(m) = max {
            if m < min {
                return self.err(open, format!("`{{{min},{m}}}`: the maximum is below the minimum"));
            }
        }
        // As llama.cpp: a maximum past the limit is no maximum.
        Ok((min, max.filter(|&m| m <= MAX_REPEAT)))
    }

    fn number(&mut self) -> Result<Option<u64>, GbnfError> {
        let start = self.i;
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.i += 1;
        }
        if start == self.i {
            return Ok(None);
        }
        let s: String = self.c[start..self.i].iter().collect();
        match s.parse::<u64>() {
            Ok(n) => Ok(Some(n)),
            Err(_) => self.err(start, format!("{s} is too large")),
        }
    }

    /// One character of a string or class, escapes decoded.
    fn char(&mut self) -> Result<char, GbnfError> {
        let at = self.i;
        let Some(c) = self.peek() else { return self.err(at, "unexpected end of the grammar") };
        self.i += 1;
        if c != '\\' {
            return Ok(c);
        }
        let Some(e) = self.peek() else { return self.err(at, "unexpected end of the grammar after `\\`") };
        self.i += 1;
        let digits = match e {
            'n' => return Ok('\n'),
            'r' => return Ok('\r'),
            't' => return Ok('\t'),
            '\\' | '"' | '[' | ']' | '-' => return Ok(e),
            'x' => 2,
            'u' => 4,
            'U' => 8,
            _ => {
                return self
                    .err(at, format!("unknown escape `\\{e}` (known: \\n \\r \\t \\\\ \\\" \\[ \\] \\- \\x \\u \\U)"))
            }
        };
        let hex: String = self.c[self.i..(self.i + digits).min(self.c.len())].iter().collect();
        if hex.len() != digits || !hex.chars().all(|h| h.is_ascii_hexdigit()) {
            return self.err(at, format!("`\\{e}` needs {digits} hex digits"));
        }
        self.i += digits;
        let v = u32::from_str_radix(&hex, 16).unwrap_or(u32::MAX);
        match char::from_u32(v) {
            Some(c) => Ok(c),
            None => self.err(at, format!("`\\{e}{hex}` is not a Unicode scalar value")),
        }
    }

    fn literal(&mut self) -> Result<Vec<char>, GbnfError> {
        let open = self.i;
        self.i += 1;
        let mut s = Vec::new();
        loop {
            match self.peek() {
                None => return self.err(open, "this string is never closed (`\"` missing)"),
                Some('"') => {
                    self.i += 1;
                    return Ok(s);
                }
                Some(_) => s.push(self.char()?),
            }
        }
    }

    fn class(&mut self) -> Result<Item, GbnfError> {
        let open = self.i;
        self.i += 1;
        let negated = self.peek() == Some('^');
        if negated {
            self.i += 1;
        }
        let mut ranges = Vec::new();
        loop {
            match self.peek() {
                None => return self.err(open, "this character class is never closed (`]` missing)"),
                Some(']') => {
                    self.i += 1;
                    break;
                }
                Some(_) => {
                    let at = self.i;
                    let lo = self.char()?;
                    let mut hi = lo;
                    if self.peek() == Some('-') && self.peek_at(1).is_some_and(|c| c != ']') {
                        self.i += 1;
                        hi = self.char()?;
                        if hi < lo {
                            return self.err(at, format!("the range {lo:?}-{hi:?} runs backwards"));
                        }
                    }
                    ranges.push((lo, hi));
                }
            }
        }
        match (negated, ranges.is_empty()) {
            (true, true) => Ok(Item::Any),
            (false, true) => self.err(open, "the empty class `[]` matches nothing"),
            _ => Ok(Item::Class { negated, ranges }),
        }
    }

    fn token(&mut self) -> Result<Item, GbnfError> {
        let at = self.i;
        let negated = self.peek() == Some('!');
        if negated {
            self.i += 1;
            if self.peek() != Some('<') {
                return self.err(self.i, "expected `<` after `!` (a negated token: `!<[id]>` or `!<text>`)");
            }
        }
        let open = self.i;
        self.i += 1;
        if self.peek() == Some('[') {
            self.i += 1;
            let Some(id) = self.number()? else { return self.err(self.i, "expected a token id in `<[id]>`") };
            let Ok(id) = u32::try_from(id) else { return self.err(open, format!("token id {id} is too large")) };
            if self.peek() != Some(']') || self.peek_at(1) != Some('>') {
                return self.err(self.i, "expected `]>` to close the token id");
            }
            self.i += 2;
            return Ok(Item::Token { tok: Tok::Id(id), negated, at });
        }
        while self.peek().is_some_and(|c| c != '>') {
            self.i += 1;
        }
        if self.peek().is_none() {
            return self.err(open, "this token is never closed (`>` missing)");
        }
        self.i += 1;
        if self.i - open == 2 {
            return self.err(open, "`<>` names no token");
        }
        Ok(Item::Token { tok: Tok::Text(self.c[open..self.i].iter().collect()), negated, at })
    }
}

fn emit_alts(
    p: &Parser,
    alts: &[Vec<Item>],
    defined: &HashMap<&str, usize>,
    vocab: Vocab<'_>,
    out: &mut String,
) -> Result<(), GbnfError> {
    for (k, seq) in alts.iter().enumerate() {
        if k > 0 {
            out.push_str(" | ");
        }
        if seq.is_empty() {
            out.push_str("\"\"");
        }
        for (n, item) in seq.iter().enumerate() {
            if n > 0 {
                out.push(' ');
            }
            emit(p, item, false, defined, vocab, out)?;
        }
    }
    Ok(())
}

/// `item` in Lark; `atomic`: it takes a repetition suffix, so a sequence needs parentheses.
fn emit(
    p: &Parser,
    item: &Item,
    atomic: bool,
    defined: &HashMap<&str, usize>,
    vocab: Vocab<'_>,
    out: &mut String,
) -> Result<(), GbnfError> {
    match item {
        Item::Lit(s) if s.is_empty() => out.push_str("\"\""),
        Item::Lit(s) => {
            let group = atomic && s.len() > 1;
            if group {
                out.push('(');
            }
            for (n, &c) in s.iter().enumerate() {
                if n > 0 {
                    out.push(' ');
                }
                lark_char(c, out);
            }
            if group {
                out.push(')');
            }
        }
        Item::Class { negated, ranges } => {
            out.push_str(if *negated { "/[^" } else { "/[" });
            for &(lo, hi) in ranges {
                regex_char(lo, out);
                if hi != lo {
                    out.push('-');
                    regex_char(hi, out);
                }
            }
            out.push_str("]/");
        }
        Item::Any => out.push_str("/(?s:.)/"),
        Item::Ref { name, at } => {
            if !defined.contains_key(name.as_str()) {
                return p.err(*at, format!("undefined rule `{name}`"));
            }
            out.push_str(&lark_name(name));
        }
        Item::Token { tok, negated, at } => {
            let id = match (tok, vocab) {
                (Tok::Id(id), _) => *id,
                (Tok::Text(t), Some(vocab)) => match vocab(t) {
                    Some(id) => id,
                    None => return p.err(*at, format!("`{t}` is not one token of the model's vocabulary")),
                },
                (Tok::Text(t), None) if *negated => {
                    return p.err(*at, format!("`!{t}` needs the model's vocabulary: write its id, `!<[id]>`"))
                }
                (Tok::Text(t), None) => {
                    if t[1..t.len() - 1].contains(|c: char| c.is_whitespace() || c == '<') {
                        return p.err(*at, format!("`{t}`: a token's text cannot hold spaces or `<` here"));
                    }
                    out.push_str(t);
                    return Ok(());
                }
            };
            let _ = write!(out, "<[{}{id}]>", if *negated { "^" } else { "" });
        }
        Item::Group(alts) => {
            out.push('(');
            emit_alts(p, alts, defined, vocab, out)?;
            out.push(')');
        }
        Item::Repeat { max: Some(0), .. } => out.push_str("\"\""),
        Item::Repeat { item, min, max } => {
            if atomic {
                out.push('(');
            }
            emit(p, item, true, defined, vocab, out)?;
            let _ = match (min, max) {
                (0, None) => write!(out, "*"),
                (1, None) => write!(out, "+"),
                (0, Some(1)) => write!(out, "?"),
                (m, None) => write!(out, "{{{m},}}"),
                (m, Some(n)) if m == n => write!(out, "{{{m}}}"),
                (m, Some(n)) => write!(out, "{{{m},{n}}}"),
            };
            if atomic {
                out.push(')');
            }
        }
    }
    Ok(())
}

/// One character as a Lark (JSON-syntax) string.
fn lark_char(c: char, out: &mut String) {
    match c {
        '"' => out.push_str(r#""\"""#),
        '\\' => out.push_str(r#""\\""#),
        c if (c as u32) < 0x20 || c == '\x7f' => {
            let _ = write!(out, "\"\\u{:04x}\"", c as u32);
        }
        c => {
            out.push('"');
            out.push(c);
            out.push('"');
        }
    }
}

/// One character inside a regex class: letters and digits as they are, the rest as `\x{..}`.
fn regex_char(c: char, out: &mut String) {
    if c.is_ascii_alphanumeric() {
        out.push(c);
    } else {
        let _ = write!(out, "\\x{{{:x}}}", c as u32);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use llguidance::api::TopLevelGrammar;
    use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
    use llguidance::{Matcher, ParserFactory};

    use super::*;

    const EOS: u32 = 256;
    const THINK: u32 = 257;
    const END_THINK: u32 = 258;

    /// A vocabulary of the 256 bytes (token = byte) and three special tokens, so that a string
    /// is fed byte by byte.
    fn factory() -> ParserFactory {
        let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        for s in ["<eos>", "<think>", "</think>"] {
            let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
            w.extend_from_slice(s.as_bytes());
            words.push(w);
        }
        let trie = TokTrie::from(&TokRxInfo::new(words.len() as u32, EOS), &words);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut f = ParserFactory::new_simple(&env).unwrap();
        f.set_stderr_log_level(0);
        f
    }

    fn vocab(t: &str) -> Option<u32> {
        match t {
            "<think>" => Some(THINK),
            "</think>" => Some(END_THINK),
            _ => None,
        }
    }

    /// The grammar, converted and compiled, matches exactly these tokens.
    fn accepts_tokens(lark: &str, tokens: &[u32]) -> bool {
        let parser = factory().create_parser(TopLevelGrammar::from_lark(lark.to_string()));
        let mut m = Matcher::new(parser.map_err(|e| panic!("{e}\n{lark}")));
        assert!(m.get_error().is_none(), "{:?}\n{lark}", m.get_error());
        if m.validate_tokens(tokens).unwrap() < tokens.len() {
            return false;
        }
        m.consume_tokens(tokens).unwrap();
        m.is_accepting().unwrap()
    }

    fn accepts(gbnf: &str, s: &str) -> bool {
        let lark = gbnf_to_lark(gbnf).unwrap_or_else(|e| panic!("{e}\n{gbnf}"));
        accepts_tokens(&lark, &s.bytes().map(u32::from).collect::<Vec<_>>())
    }

    /// Each grammar accepts each of `yes` and none of `no`.
    fn check(gbnf: &str, yes: &[&str], no: &[&str]) {
        for s in yes {
            assert!(accepts(gbnf, s), "{gbnf:?} should accept {s:?}; Lark: {}", gbnf_to_lark(gbnf).unwrap());
        }
        for s in no {
            assert!(!accepts(gbnf, s), "{gbnf:?} should refuse {s:?}; Lark: {}", gbnf_to_lark(gbnf).unwrap());
        }
    }

    fn error(gbnf: &str) -> GbnfError {
        match gbnf_to_lark(gbnf) {
            Ok(lark) => panic!("{gbnf:?} converted to {lark:?}"),
            Err(e) => e,
        }
    }

    fn assert_error(gbnf: &str, line: usize, col: usize, says: &str) {
        let e = error(gbnf);
        assert_eq!((e.line, e.col), (line, col), "{e}");
        assert!(e.msg.contains(says), "{e} should say {says:?}");
        assert!(e.to_string().starts_with(&format!("line {line} col {col}: ")), "{e}");
    }

    #[test]
    fn string_literals_and_their_escapes() {
        check(r#"root ::= "ab c""#, &["ab c"], &["ab", "abc", "ab cd"]);
        check(
            r#"root ::= "\n\r\t\\\"\x41\u00e9\U0001F600\[\]\-""#,
            &["\n\r\t\\\"Aé😀[]-"],
            &["\n\r\t\\\"Ae😀[]-", "\\n"],
        );
        check("root ::= \"é€😀\"", &["é€😀"], &["é€"]);
        check(r#"root ::= "a" "" "b""#, &["ab"], &["a", "a b"]);
        check(r#"root ::= "/" "\x00" "\x7F""#, &["/\0\x7f"], &["/"]);
    }

    #[test]
    fn character_classes_ranges_negation_and_any() {
        check("root ::= [a-c0-9_]+", &["b9_", "a"], &["d", "", "A"]);
        check(r"root ::= [^a-z\]\n]+", &["AB1[", "€"], &["a", "]", "\n", "Ab"]);
        check(r"root ::= [\[\]\-\\]+", &["[]-\\"], &["a"]);
        check("root ::= [a-]", &["a", "-"], &["b"]);
        check("root ::= [-a]", &["a", "-"], &["b"]);
        check(r"root ::= [\x41-\x43\u00e0-\u00ff\U0001F600-\U0001F64F]", &["B", "é", "😀"], &["D", "a", "🚀"]);
        check("root ::= [ぁ-ゟ]+", &["ひらがな"], &["カ"]);
        check("root ::= [^]", &["x", "\n"], &["", "xy"]);
        check("root ::= . .", &["\nx", "€😀"], &["a", "abc"]);
        check(r#"root ::= [/"] [\x00-\x1F]"#, &["/\t", "\"\0"], &["/ "]);
    }

    #[test]
    fn groups_alternatives_and_repetition() {
        check(r#"root ::= ("ab" | "c")+ "d""#, &["abd", "cabcd"], &["d", "abc", "ad"]);
        check(r#"root ::= "x"* "y""#, &["y", "xxy"], &["x", "yy"]);
        check(r#"root ::= "ab"+"#, &["ab", "abab"], &["", "aba"]);
        check(r#"root ::= "ab"? "c""#, &["c", "abc"], &["ababc", "ac"]);
        check(r#"root ::= "ab"{2}"#, &["abab"], &["ab", "ababab"]);
        check(r#"root ::= [0-9]{2,}"#, &["12", "12345"], &["1"]);
        check(r#"root ::= [0-9]{ 1 , 3 } "!""#, &["1!", "123!"], &["!", "1234!"]);
        check(r#"root ::= "a" "b"{0} "c"{0,0}"#, &["a"], &["ab", "ac"]);
        check(r#"root ::= ("a" [0-9]?)* "#, &["", "a1a", "aa9"], &["1", "a12"]);
        // Stacked operators apply in turn, as in llama.cpp: `x*?` is `(x*)?`.
        check(r#"root ::= "ab"*? "c"+{2}"#, &["cc", "ababcccc"], &["c", "abc"]);
        check(r#"root ::= ( )"#, &[""], &["a"]);
        check(r#"root ::= "a" | | "b""#, &["a", "", "b"], &["ab"]);
        // A maximum above llama.cpp's limit of 2000 is no maximum.
        check(r#"root ::= "a"{1,3000}"#, &["a", &"a".repeat(2500)], &[""]);
    }

    #[test]
    fn terminals_match_like_gbnf_not_like_greedy_lexemes() {
        // A lexer taking the longest match would read "ab" as the start of "abc" and fail.
        check(r#"root ::= ("abc" | "a") "bd""#, &["abd", "abcbd"], &["abcd"]);
        check(r#"root ::= [a-z]* "a" [a-z]"#, &["bcab", "aa"], &["bca"]);
        check(r#"root ::= [0-9]+ "0""#, &["100", "00"], &["0"]);
    }

    #[test]
    fn rules_names_comments_and_lines() {
        let g = "# a grammar\n\
                 root ::= item-1 Item2   # two items\n   | start | 9lives\n\
                 item-1 ::= \"x\"\n\
                 Item2 ::= ( \"y\"  # nested lines\n\n  | \"z\" )\n\
                 start ::= \"s\" root?\n\
                 9lives ::= \"9\"\r\n";
        check(g, &["xy", "xz", "s", "sxy", "ss9", "9"], &["xs", "y", ""]);
        let lark = gbnf_to_lark(g).unwrap();
        for name in ["start:", "item-1:", "g__item2:", "g_start:", "g_9lives:"] {
            assert!(lark.lines().any(|l| l.starts_with(name)), "{name} in {lark}");
        }
        // A body goes on over lines until a line begins with `name ::=`, and a line may begin with `|`.
        let g = "root ::=\n  \"a\"\n  tail\n  | \"b\"\ntail ::= \"c\"\n\n";
        check(g, &["ac", "b"], &["a", "c"]);
        // Names differing in case or `-` stay apart.
        check("root ::= ab AB a-b\nab ::= \"1\"\nAB ::= \"2\"\na-b ::= \"3\"", &["123"], &["111"]);
    }

    #[test]
    fn tokens_by_id_and_by_text() {
        let by_id = gbnf_to_lark("root ::= <[257]> [a-z]+ <[258]>").unwrap();
        assert!(accepts_tokens(&by_id, &[THINK, 104, 105, END_THINK]));
        assert!(!accepts_tokens(&by_id, &[104, END_THINK]));
        // Without a vocabulary, `<text>` is llguidance's special token of that name.
        let by_name = gbnf_to_lark("root ::= <think> [a-z]+ </think>").unwrap();
        assert!(accepts_tokens(&by_name, &[THINK, 104, END_THINK]));
        assert!(!accepts_tokens(&by_name, &[END_THINK]));
        // With one, negations by text work too.
        let neg = gbnf_to_lark_with_vocab("root ::= <think> !</think>* </think> \"!\"", &vocab).unwrap();
        assert!(accepts_tokens(&neg, &[THINK, 104, 105, END_THINK, 33]));
        assert!(!accepts_tokens(&neg, &[THINK, END_THINK, END_THINK]));
        let neg_id = gbnf_to_lark("root ::= !<[258]>+").unwrap();
        assert!(accepts_tokens(&neg_id, &[104, THINK]));
        assert!(!accepts_tokens(&neg_id, &[END_THINK]));
        let e = gbnf_to_lark_with_vocab("root ::= \"a\"\n  <nope>", &vocab).unwrap_err();
        assert_eq!((e.line, e.col), (2, 3), "{e}");
        assert!(e.msg.contains("`<nope>` is not one token"), "{e}");
        assert_error("root ::= !<think>", 1, 10, "needs the model's vocabulary");
    }

    /// llama.cpp's grammars/json.gbnf (llama-cpp-python 0.3.36).
    pub(crate) const JSON_GBNF: &str = include_str!("../../tests/data/json.gbnf");

    #[test]
    fn llama_cpp_json_grammar() {
        check(
            JSON_GBNF,
            &[r#"{"a": [1, -2.5e3, "x\u00e9\n", true, null], "b": {}}"#, "{}", "{ \"k\" : \"v\" }\n  "],
            &["[]", r#"{"a": 01}"#, r#"{"a": "x"#, r#"{"a" 1}"#, "{}{}"],
        );
    }

    #[test]
    fn errors_name_the_line_column_and_problem() {
        assert_error("", 1, 1, "no `root` rule");
        assert_error("item ::= \"a\"\n", 1, 1, "no `root` rule");
        assert_error("root ::= item\n  other\nitem ::= \"a\"", 2, 3, "undefined rule `other`");
        assert_error("root ::= \"a\"\nroot ::= \"b\"", 2, 1, "defined twice (first at line 1 col 1)");
        assert_error("root ::= \"a\nb", 1, 10, "string is never closed");
        assert_error("root ::= [a-z\n", 1, 10, "class is never closed");
        assert_error("root ::= []", 1, 10, "matches nothing");
        assert_error("root ::= [z-a]", 1, 11, "runs backwards");
        assert_error("root ::= (\"a\" | \"b\"\n", 1, 10, "`(` is never closed");
        assert_error("root ::= \"a\" )", 1, 14, "`)` without a matching `(`");
        assert_error("root ::= \"\\q\"", 1, 11, "unknown escape `\\q`");
        assert_error("root ::= \"\\x4\"", 1, 11, "needs 2 hex digits");
        assert_error("root ::= \"\\uD800\"", 1, 11, "not a Unicode scalar value");
        assert_error("root ::= * \"a\"", 1, 10, "nothing before it to repeat");
        assert_error("root ::= \"a\" | +", 1, 16, "nothing before it to repeat");
        assert_error("root ::= \"a\"{3,1}", 1, 13, "maximum is below the minimum");
        assert_error("root ::= \"a\"{,3}", 1, 14, "expected a number after `{`");
        assert_error("root ::= \"a\"{2;", 1, 15, "expected `,` or `}`");
        assert_error("root ::= \"a\"{2001}", 1, 13, "above the limit of 2000");
        assert_error("root ::= 'a'", 1, 10, "unexpected `'`");
        assert_error("root = \"a\"", 1, 6, "expected `::=` after the rule name `root`");
        assert_error("root ::= a b ::= \"c\"\na ::= \"a\"", 1, 12, "must begin a line");
        assert_error("root ::= (a\nb ::= \"c\")", 2, 3, "unexpected `:`");
        assert_error("root ::= <[12]", 1, 14, "expected `]>`");
        assert_error("root ::= <think", 1, 10, "never closed");
        assert_error("root ::= !x", 1, 11, "expected `<` after `!`");
        assert_error("  ::= \"a\"", 1, 3, "expected a rule");
    }
}
