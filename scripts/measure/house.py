#!/usr/bin/env python3
"""The shape of the workspace, measured from its source: long files, long library functions, and
circles of files that use each other's items. Standard library only; run from the repository root:

    python3 scripts/measure/house.py              # the summary
    python3 scripts/measure/house.py --list       # every long file and function, every circle
    python3 scripts/measure/house.py --json       # the counts as one JSON object (for table.sh)

What counts (library code only: each crate's `src/`, without `#[cfg(test)]` modules and without
files whose name ends in `tests.rs`; benches, examples and tests/ are not library code):

- a *long file* has more than 600 lines;
- a *long function* is an `fn` whose text, signature to closing brace, spans 100 lines or more;
- a file *uses* another when it names an item the other defines (`use crate::a::B`, `super::B`,
  `crate::a::b::f(..)` in code), re-exports followed to the defining file; a *circle* is a
  strongly connected set of two or more files under that relation (Tarjan's algorithm). A
  module's `mod x;` line is not a use, and neither is a `pub use` or `pub(crate) use` (a
  re-export names, it does not use).

- *trainer lines* are every line (`wc -l`) of the `.rs` files under the `src/` of the trainer's
  crates (`--trainer`, default `trainer`; name each crate when the trainer is split), tests and
  comments included;
- a file *imports the run config* when its code (library or binary source, comments and strings
  left out, `#[cfg(test)]` modules too) names `TrainConfig` (`--config`), whether through a `use`
  or a path; the module that defines it does not count (its file, and the files of its folder
  when it is a `mod.rs`).

Public items are counted from rustdoc's JSON by `public_items.sh` beside this script (it needs a
nightly toolchain); `table.sh` prints the issue's whole table.
"""

import argparse
import json
import os
import re
import sys
from collections import defaultdict

LONG_FILE = 600
LONG_FN = 100

ITEM = re.compile(
    r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:(?:const|async|unsafe|extern\s+\"[^\"]*\")\s+)*"
    r"(fn|struct|enum|trait|const|static|type|union|mod|macro_rules!)\s+(\w+)"
)
FN = re.compile(r"\bfn\s+(\w+)")


def strip(text):
    """The text with comments, strings and char literals blanked (newlines kept), so that braces
    and paths are only code's."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:i + 8]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'r(#*)"', text[i:])
            end = '"' + m.group(1)
            j = text.find(end, i + len(m.group(0)))
            j = n if j < 0 else j + len(end)
            out.append('""' + re.sub(r"[^\n]", " ", text[i + 2:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append('"' + re.sub(r"[^\n]", " ", text[i + 1:j - 1]) + '"')
            i = j
        elif c == "'":
            m = re.match(r"'(\\.[^']*|[^\\'])'", text[i:])
            if m:
                out.append("' '" + " " * (len(m.group(0)) - 3))
                i += len(m.group(0))
            else:  # a lifetime
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def close_brace(code, start):
    """Index just past the brace block opening at or after `start`."""
    i = code.index("{", start)
    depth = 0
    while i < len(code):
        if code[i] == "{":
            depth += 1
        elif code[i] == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return len(code)


def without_tests(code):
    """`code` with `#[cfg(test)]` items blanked."""
    while True:
        m = re.search(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{", code)
        if not m:
            return code
        end = close_brace(code, m.end() - 1)
        code = code[: m.start()] + re.sub(r"[^\n]", " ", code[m.start():end]) + code[end:]


def crates(root):
    """(crate name, src dir) of every workspace crate with a lib.rs or main.rs."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("target", ".git", "node_modules") and not d.startswith(".")]
        if os.path.basename(dirpath) == "src" and ("lib.rs" in filenames or "main.rs" in filenames):
            yield os.path.basename(os.path.dirname(dirpath)) or "root", dirpath


def module_of(src, path):
    """The module path of file `path` in the crate whose source root is `src`."""
    rel = os.path.relpath(path, src)[:-3].split(os.sep)
    if rel[-1] in ("lib", "main", "mod"):
        rel = rel[:-1]
    return tuple(rel)


class Crate:
    def __init__(self, name, src):
        self.name, self.src = name, src
        self.files = {}  # module path -> file
        self.code = {}  # file -> stripped code
        for dirpath, _, filenames in os.walk(src):
            for f in filenames:
                if f.endswith(".rs") and not f.endswith("tests.rs"):
                    p = os.path.join(dirpath, f)
                    mod = module_of(src, p)
                    if mod in self.files and p.endswith("lib.rs") is False and f == "main.rs":
                        continue
                    self.files.setdefault(mod, p)
                    with open(p, encoding="utf-8") as fh:
                        self.code[p] = without_tests(strip(fh.read()))
        self.defs = {p: self._defs(c) for p, c in self.code.items()}
        self.reexports = {p: self._reexports(p, c) for p, c in self.code.items()}

    @staticmethod
    def _defs(code):
        names, depth = set(), 0
        for line in code.split("\n"):
            if depth == 0:
                m = ITEM.match(line)
                if m:
                    names.add(m.group(2))
                m = re.match(r"\s*macro_rules!\s*(\w+)", line)
                if m:
                    names.add(m.group(1))
            depth += line.count("{") - line.count("}")
        return names

    def _uses(self, code):
        """(path segments, is_pub) of every `use` tree leaf in `code`."""
        for m in re.finditer(r"(?m)^\s*(pub(?:\([^)]*\))?\s+)?use\s+([^;]+);", code):
            tree = re.sub(r"\s+", "", re.sub(r"\s+as\s+", "@AS@", m.group(2))).replace("@AS@", " as ")
            for path in expand(tree):
                yield path, bool(m.group(1))

    def _reexports(self, path, code):
        out = {}
        for segs, is_pub in self._uses(code):
            if is_pub and segs:
                name = segs[-1]
                alias = name.split(" as ")[-1] if " as " in name else name
                out[alias] = segs
        return out

    def absolute(self, file, segs):
        """`segs` (a path as written in `file`) from the crate root, or None if outside it."""
        here = list(module_of(self.src, file))
        if file.endswith("mod.rs") or file.endswith("lib.rs") or file.endswith("main.rs"):
            base = here
        else:
            base = here  # a non-mod file is its own module: `self` is it, `super` its parent
        if not segs:
            return None
        head = segs[0]
        if head == "crate":
            return list(segs[1:])
        if head == "self":
            return base + list(segs[1:])
        if head == "super":
            cur, rest = list(base), list(segs)
            while rest and rest[0] == "super":
                cur, rest = cur[:-1], rest[1:]
            return cur + rest
        if tuple(base + [head]) in self.files:  # a child module named without `self::`
            return base + list(segs)
        return None

    def resolve(self, segs, seen=0):
        """The file defining the item at absolute path `segs`, following re-exports."""
        if seen > 8:
            return None
        for k in range(len(segs), -1, -1):
            mod = tuple(segs[:k])
            if mod in self.files:
                f = self.files[mod]
                rest = segs[k:]
                if not rest:
                    return f
                name = rest[0].split(" as ")[0]
                if name in self.defs[f]:
                    return f
                if name in self.reexports[f]:
                    target = self.absolute(f, self.reexports[f][name])
                    if target is not None:
                        return self.resolve(target + rest[1:], seen + 1)
                return f
        return None

    def edges(self):
        """file -> {file it uses: the names it takes from there}."""
        out = defaultdict(lambda: defaultdict(set))
        for f, code in self.code.items():
            paths = [s for s, is_pub in self._uses(code) if not is_pub]
            body = re.sub(r"(?m)^\s*(pub(?:\([^)]*\))?\s+)?use\s+[^;]+;", "", code)
            for m in re.finditer(r"\b((?:crate|super|self)(?:::\w+)+)", body):
                paths.append(m.group(1).split("::"))
            for segs in paths:
                segs = [s for s in segs if s != "*"]
                target = self.absolute(f, segs)
                if target is None:
                    continue
                g = self.resolve(target)
                if g and g != f:
                    out[f][g].add(target[-1].split(" as ")[0] if target else "")
        return out


def expand(tree):
    """The leaves of a `use` tree, `a::{b, c::{d, e as f}}` -> [[a, b], [a, c, d], [a, c, e as f]]."""
    i = tree.find("{")
    if i < 0:
        return [[s for s in tree.split("::") if s]]
    prefix = [s for s in tree[:i].split("::") if s]
    inner, depth, parts, cur = tree[i + 1: tree.rfind("}")], 0, [], ""
    for c in inner:
        if c == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += (c == "{") - (c == "}")
        cur += c
    if cur:
        parts.append(cur)
    out = []
    for p in parts:
        for leaf in expand(p):
            leaf = [] if leaf == ["self"] else leaf
            out.append(prefix + leaf)
    return out


def circles(edges):
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]
    nodes = set(edges) | {g for gs in edges.values() for g in gs}

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
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
                comps.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return comps


def long_functions(code):
    out = []
    for m in FN.finditer(code):
        brace, semi = code.find("{", m.end()), code.find(";", m.end())
        if brace < 0 or (0 <= semi < brace):
            continue  # a declaration without a body
        end = close_brace(code, brace)
        lines = code.count("\n", m.start(), end) + 1
        if lines >= LONG_FN:
            out.append((m.group(1), code.count("\n", 0, m.start()) + 1, lines))
    return out


def lines_under(src):
    """Every line of the `.rs` files below `src`."""
    total = 0
    for dirpath, _, filenames in os.walk(src):
        for f in filenames:
            if f.endswith(".rs"):
                with open(os.path.join(dirpath, f), encoding="utf-8") as fh:
                    total += sum(1 for _ in fh)
    return total


def naming(crate, name):
    """The files of `crate` whose code names `name`, less the module that defines it (the defining
    file, and when that is a folder's `mod.rs`, the files of that folder: a definition split over
    a module's files is still one definition)."""
    word = re.compile(rf"\b{re.escape(name)}\b")
    define = re.compile(rf"\b(?:struct|enum|type|trait)\s+{re.escape(name)}\b")
    homes = [f for f, code in crate.code.items() if define.search(code)]
    folders = [os.path.dirname(f) + os.sep for f in homes if os.path.basename(f) == "mod.rs"]
    return [f for f, code in crate.code.items()
            if word.search(code) and f not in homes and not any(f.startswith(d) for d in folders)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="list every long file, function and circle")
    ap.add_argument("--json", action="store_true", help="print the counts as one JSON object")
    ap.add_argument("--trainer", default="trainer", help="the trainer's crates, comma-separated")
    ap.add_argument("--config", default="TrainConfig", help="the run config's type name")
    ap.add_argument("root", nargs="?", default=".")
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    trainer = set(args.trainer.split(","))
    long_files, long_fns, all_circles, config_users, trainer_lines = [], [], [], [], 0
    for name, src in sorted(crates(root)):
        c = Crate(name, src)
        if name in trainer:
            trainer_lines += lines_under(src)
        config_users += [os.path.relpath(f, root) for f in naming(c, args.config)]
        for f, code in c.code.items():
            with open(f, encoding="utf-8") as fh:
                n = sum(1 for _ in fh)
            rel = os.path.relpath(f, root)
            if n > LONG_FILE:
                long_files.append((n, rel))
            # Nested functions are inside their parent's text: count the outermost only.
            fns = long_functions(code)
            for fname, line, lines in fns:
                long_fns.append((lines, f"{rel}:{line} {fname}"))
        edges = c.edges()
        for comp in circles(edges):
            ties = [
                f"    {os.path.relpath(f, root)} -> {os.path.relpath(g, root)}: {', '.join(sorted(edges[f][g]))}"
                for f in comp for g in comp if g in edges.get(f, {})
            ]
            all_circles.append(([os.path.relpath(f, root) for f in comp], ties))
    if args.json:
        print(json.dumps({
            "long_files": len(long_files),
            "long_functions": len(long_fns),
            "circles": len(all_circles),
            "trainer_lines": trainer_lines,
            "config_users": len(config_users),
        }))
        return
    print(f"files over {LONG_FILE} lines: {len(long_files)}")
    print(f"library functions of {LONG_FN}+ lines: {len(long_fns)}")
    print(f"circles of files: {len(all_circles)}")
    print(f"lines of the trainer's crates ({', '.join(sorted(trainer))}): {trainer_lines}")
    print(f"files importing {args.config}: {len(config_users)}")
    if args.list:
        for f in sorted(config_users):
            print(f"  config {f}")
        for n, f in sorted(long_files, reverse=True):
            print(f"  file {n:5} {f}")
        for n, f in sorted(long_fns, reverse=True):
            print(f"  fn   {n:5} {f}")
        for comp, ties in all_circles:
            print(f"  circle of {len(comp)}: {', '.join(comp)}")
            print("\n".join(ties))


if __name__ == "__main__":
    main()
