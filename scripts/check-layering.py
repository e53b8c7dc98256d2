#!/usr/bin/env python3
"""Fails when modules of different folders import each other in a cycle.

For every crate (crates/*/src, ascend-sys/src) it reads each .rs file's `crate::` and `super::`
paths (use declarations and inline paths, comments and strings stripped), resolves them to the
module file they name, and builds a graph whose nodes are folders: a file belongs to the folder
it sits in, and a file at a crate's root (error.rs, lib.rs) is a node of its own. Edges between
a folder and its own ancestors are left out: a parent declares its children and a child may use
its parent's types. Any other cycle (model -> tokenizer -> model, matmul -> quant -> matmul) is
an error, printed with one import that makes each edge.

    scripts/check-layering.py      exit 0 when acyclic, 1 otherwise

Cycles between the files of one folder fail too (a ring of files is a layer with no bottom).
"""
import os
import re
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def crates():
    base = os.path.join(ROOT, "crates")
    for name in sorted(os.listdir(base)):
        src = os.path.join(base, name, "src")
        if os.path.isdir(src):
            yield f"crates/{name}", src
    yield "ascend-sys", os.path.join(ROOT, "ascend-sys", "src")


def strip(code):
    """Removes comments, string and char literals (a lexer good enough for paths)."""
    out, i, n = [], 0, len(code)
    while i < n:
        c = code[i]
        if code.startswith("//", i):
            j = code.find("\n", i)
            i = n if j < 0 else j
        elif code.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if code.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif code.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif c == "r" and re.match(r'r#*"', code[i:i + 10]) and (i == 0 or not (code[i - 1].isalnum() or code[i - 1] == "_")):
            m = re.match(r'r(#*)"', code[i:])
            end = '"' + m.group(1)
            j = code.find(end, i + len(m.group(0)))
            i = n if j < 0 else j + len(end)
            out.append('""')
        elif c == '"':
            i += 1
            while i < n and code[i] != '"':
                i += 2 if code[i] == "\\" else 1
            i += 1
            out.append('""')
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", code[i:i + 4]) or code.startswith("'\\u{", i):
            j = code.find("'", i + 1)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def expand(text, i):
    """Expands the path starting at text[i] (after `crate::`/`super::`) into a list of paths."""
    paths, cur = [], []
    while i < len(text):
        m = re.match(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(::)?", text[i:])
        if text[i:].lstrip().startswith("{"):
            j = text.index("{", i) + 1
            depth, k = 1, j
            while k < len(text) and depth:
                depth += {"{": 1, "}": -1}.get(text[k], 0)
                k += 1
            inner = text[j:k - 1]
            parts, d, start = [], 0, 0
            for p, ch in enumerate(inner):
                d += {"{": 1, "}": -1}.get(ch, 0)
                if ch == "," and d == 0:
                    parts.append(inner[start:p])
                    start = p + 1
            parts.append(inner[start:])
            for part in parts:
                part = part.strip()
                if not part:
                    continue
                for sub in expand(part, 0):
                    paths.append(cur + sub)
            return paths
        if not m:
            break
        cur.append(m.group(1))
        i += m.end()
        if not m.group(2):
            break
    return [cur] if cur else paths or [[]]


def module_files(src):
    mods = {}
    for dirpath, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), src)
            parts = rel[:-3].split(os.sep)
            if parts[-1] in ("mod", "lib", "main"):
                parts = parts[:-1]
            mods[tuple(parts)] = rel
    return mods


def folder_of(rel):
    d = os.path.dirname(rel)
    if d == "":
        base = rel[:-3]
        return "(root)" if base in ("lib", "main") else base
    return d


def is_ancestor(a, b):
    return a == "(root)" or b.startswith(a + "/") or a.startswith(b + "/") or b == "(root)"


def sccs(graph):
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def main():
    failed = False
    for crate, src in crates():
        mods = module_files(src)
        folder_edges, file_edges, why = defaultdict(set), defaultdict(set), {}
        for mod, rel in mods.items():
            code = strip(open(os.path.join(src, rel), encoding="utf-8").read())
            for m in re.finditer(r"\b(crate|super)\s*::", code):
                if m.group(1) == "crate":
                    base = []
                else:
                    # `super` in a mod.rs/x.rs file is the parent of the file's module.
                    base = list(mod[:-1])
                    rest = code[m.end():]
                    while re.match(r"\s*super\s*::", rest):
                        base = base[:-1]
                        rest = rest[re.match(r"\s*super\s*::", rest).end():]
                for path in expand(code, m.end()):
                    path = [p for p in path if p != "super"]
                    full = base + path
                    target = None
                    for k in range(len(full), -1, -1):
                        if tuple(full[:k]) in mods:
                            target = mods[tuple(full[:k])]
                            break
                    if target is None or target == rel:
                        continue
                    a, b = folder_of(rel), folder_of(target)
                    if a != b and not is_ancestor(a, b):
                        folder_edges[a].add(b)
                        why.setdefault((a, b), f"{rel} -> {'::'.join(full)}")
                    if os.path.dirname(rel) == os.path.dirname(target):
                        file_edges[rel].add(target)
        for comp in sccs(folder_edges):
            failed = True
            print(f"{crate}: import cycle between folders: {' <-> '.join(comp)}")
            for a in comp:
                for b in sorted(folder_edges[a]):
                    if b in comp:
                        print(f"    {a} -> {b}: {why[(a, b)]}")
        for comp in sccs(file_edges):
            failed = True
            print(f"{crate}: import cycle between the files of one folder: {' <-> '.join(comp)}")
    if failed:
        print("check-layering: move the shared piece down into a module both can import, "
              "or invert the dependency")
        return 1
    print("check-layering: no import cycle between modules of different folders, nor between files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
