#!/usr/bin/env bash
# Checks that README.md and docs/ stay short and true to the tree:
#   - README.md has fewer than 220 lines (the rest belongs in docs/);
#   - every relative link in README.md and docs/**/*.md points to an existing file or folder,
#     and a link's #anchor to a heading of the linked Markdown file;
#   - every path in inline code that starts with crates/, scripts/, examples/, include/,
#     ascend-sys/, ascend-sim/ or cmake/ exists;
#   - no doc names a path of the layout before crates/ (src/ffi, src/cli, tests/cpp,
#     kernels/src, src/<module>/, tests/<name>.rs at the top level).
# Prints one line per problem and exits 1 if there is any. Needs python3.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 - <<'PY'
import glob, os, re, sys

MAX_README_LINES = 220
problems = []
docs = ["README.md"] + sorted(glob.glob("docs/**/*.md", recursive=True))

def prose_lines(text):
    """(line number, line) outside fenced code blocks (``` or ~~~, closed by the same marker)."""
    fence = None
    for n, line in enumerate(text.split("\n"), 1):
        m = re.match(r"\s*(```|~~~)", line)
        if fence is None:
            if m:
                fence = m.group(1)
                continue
            yield n, line
        elif m and m.group(1) == fence and line.strip() == fence:
            fence = None

def slug(heading):
    # GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens.
    h = re.sub(r"`", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", h).replace(" ", "-")

def anchors(path):
    seen, out = {}, set()
    for _, line in prose_lines(open(path, encoding="utf-8").read()):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            k = seen.get(s, 0)
            out.add(s if k == 0 else f"{s}-{k}")
            seen[s] = k + 1
    return out

n_readme = open("README.md", encoding="utf-8").read().count("\n")
if n_readme >= MAX_README_LINES:
    problems.append(f"README.md: {n_readme} lines, the limit is {MAX_README_LINES - 1}: move a section to docs/")

PATH_PREFIXES = ("crates/", "scripts/", "examples/", "include/", "ascend-sys/", "ascend-sim/", "cmake/")
OLD_PATHS = [
    (re.compile(r"(?<![\w/.-])(src/ffi|src/cli|tests/cpp|kernels/src)\b"), "a path of the layout before crates/"),
    (re.compile(r"(?<![\w/.-])src/(backend|engine|kv|model|op_api|plan|runner|sample|sched|tokenizer|formats)\b"),
     "src/<module> is crates/engine/src/<module> now"),
    (re.compile(r"(?<![\w/.-])tests/\w+\.rs\b"), "top-level tests/ moved into crates/*/tests/"),
]

for doc in docs:
    base = os.path.dirname(doc)
    text = open(doc, encoding="utf-8").read()
    for n, line in prose_lines(text):
        where = f"{doc}:{n}"
        for pat, why in OLD_PATHS:
            for m in pat.finditer(line):
                problems.append(f"{where}: `{m.group(0)}`: {why}")
        # Links, outside inline code.
        plain = re.sub(r"``.*?``|`[^`]*`", "", line)
        for m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)\)", plain):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(base, path)) if path else doc
            if not os.path.exists(full):
                problems.append(f"{where}: link to {target}: {full} does not exist")
                continue
            if anchor and full.endswith(".md") and anchor not in anchors(full):
                problems.append(f"{where}: link to {target}: no heading #{anchor} in {full}")
        # Paths in inline code.
        for code in re.findall(r"``(.*?)``|`([^`]*)`", line):
            for token in " ".join(code).split():
                token = token.strip(".,;:()[]'\"")
                if token.startswith(PATH_PREFIXES) and not re.search(r"[*<>{}$]|\.\.\.", token):
                    if not os.path.exists(token.split("#")[0]):
                        problems.append(f"{where}: `{token}` does not exist")

for p in problems:
    print(p)
print(f"check-docs: {len(docs)} files, README.md {n_readme} lines, {len(problems)} problem(s)")
sys.exit(1 if problems else 0)
PY
