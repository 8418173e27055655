"""Runs the ```python blocks of the READMEs and of the guides' Markdown, and checks their links.

The guides' ``{code-cell}`` cells are executed by the Sphinx build (MyST-NB); this script
runs what the build does not: every fenced ```python block of the READMEs
(``README.md``, ``ARCHITECTURE.md``, ``CONTRIBUTING.md``, ``RUNTIME.md``, ``packages/*/README.md``, ``examples/README.md``,
``benchmarks/README.md``, ``tests/downstream/README.md``) and of ``docs/*.md``. The blocks of
one file run in order in a namespace of their own (all files in one fresh Python), on JAX's
CPU device: a
block may use what an earlier block of its file defined, as a reader would. A block written
as an interactive session (``>>>`` prompts) runs as a doctest, its outputs compared. A block
that cannot run on a CPU says so in an HTML comment on the line just above its fence,
``<!-- not run: needs a GPU -->``, and is counted as skipped with that reason.

It also checks that every relative link (``[text](path)``) in those files names a file
or folder that exists. Links to the outside are not fetched (no network in CI).

Usage: ``python docs/check_code_blocks.py [FILE.md ...]`` (no argument: all of the above).
Exit status 1 if a block fails or a link is broken.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_FILES = [
    "README.md",
    "ARCHITECTURE.md",
    "CONTRIBUTING.md",
    "RUNTIME.md",
    "packages/*/README.md",
    "examples/README.md",
    "benchmarks/README.md",
    "tests/downstream/README.md",
    "docs/*.md",
    "docs/*/*.md",
]
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->\s*$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")

# Runs in one fresh Python: the blocks of each file, each compiled from a file of its own
# (so that inspect.getsource, which @triton.jit needs, finds it), in a namespace per file.
# One process for all files: importing JAX once, not once per file, saves most of the time.
RUNNER = r"""
import doctest, json, sys, time, traceback
for rel, blocks in json.load(open(sys.argv[1])):
    ns = {"__name__": "__main__"}
    t0 = time.perf_counter()
    try:
        for path, line, is_doctest in blocks:
            src = open(path).read()
            where = f"{rel}:{line}"
            if is_doctest:
                test = doctest.DocTestParser().get_doctest(src, ns, where, path, 0)
                runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
                runner.run(test, clear_globs=False)
                ns.update(test.globs)  # DocTest runs in a copy of the namespace
                if runner.failures:
                    raise AssertionError(f"{runner.failures} doctest example(s) failed (above)")
            else:
                exec(compile(src, path, "exec"), ns)
        print("@@result", json.dumps([rel, None, time.perf_counter() - t0]), flush=True)
    except BaseException:
        print(f"FAILED: the block at {where}", file=sys.stderr)
        traceback.print_exc()
        print("@@result", json.dumps([rel, where, time.perf_counter() - t0]), flush=True)
"""


def blocks_of(text: str) -> list[tuple[int, str, str | None]]:
    """(line, source, reason it is not run or None) of each ```python block."""
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        reason = NOT_RUN.search(before)
        out.append((line + 1, m.group(1), reason.group(1) if reason else None))
    return out


def broken_links(path: str, text: str) -> list[str]:
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # links in code are not links
    text = re.sub(r"`[^`\n]+`", "", text)  # nor in inline code spans
    bad = []
    for m in LINK.finditer(text):
        target = (m.group(1) or m.group(2)).split("#", 1)[0]
        if not target or re.match(r"^[a-z]+:", target):
            continue  # an anchor in this page, or http:, https:, mailto:
        if not os.path.exists(os.path.join(os.path.dirname(path), target)):
            bad.append(target)
    return bad


def main(argv: list[str]) -> int:
    patterns = argv or DEFAULT_FILES
    files = sorted({os.path.relpath(p, ROOT) for pat in patterns for p in glob.glob(os.path.join(ROOT, pat))})
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    failed, run, doctests, skipped, links = [], 0, 0, [], 0
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        todo_by_file = []
        for rel in files:
            text = open(os.path.join(ROOT, rel), encoding="utf-8").read()
            for target in broken_links(os.path.join(ROOT, rel), text):
                failed.append(f"{rel}: broken link to {target}")
            links += sum(1 for _ in LINK.finditer(text))
            todo = []
            for line, src, reason in blocks_of(text):
                if reason:
                    skipped.append(f"{rel}:{line} ({reason})")
                    continue
                is_doctest = src.lstrip().startswith(">>>")
                path = os.path.join(tmp, re.sub(r"\W", "_", rel) + f"_L{line}.py")
                with open(path, "w", encoding="utf-8") as f:
                    f.write(src)
                todo.append((path, line, is_doctest))
            if todo:
                todo_by_file.append((rel, todo))
                run += len(todo)
                doctests += sum(1 for t in todo if t[2])
        spec = os.path.join(tmp, "blocks.json")
        with open(spec, "w") as f:
            json.dump(todo_by_file, f)
        proc = subprocess.run(
            [sys.executable, "-c", RUNNER, spec], cwd=ROOT, env=env, capture_output=True, text=True
        )
        reported, block_failed = set(), False
        for out in proc.stdout.splitlines():
            if out.startswith("@@result "):  # the blocks' own prints are the other lines
                rel, where, seconds = json.loads(out.split(" ", 1)[1])
                reported.add(rel)
                n = len(dict(todo_by_file)[rel])
                print(
                    f"{rel}: {n} block(s) {'ok' if where is None else 'FAILED at ' + where} ({seconds:.1f} s)"
                )
                if where is not None:
                    failed.append(f"{where}: the block failed")
                    block_failed = True
        if proc.returncode != 0 or block_failed:
            # the doctest runner's report (what was expected, what came) is on stdout
            report = [out for out in proc.stdout.splitlines() if not out.startswith("@@result ")]
            print("\n".join(report)[-8000:], file=sys.stderr)
            print(proc.stderr[-8000:], file=sys.stderr)
        for rel, _ in todo_by_file:
            if rel not in reported:
                failed.append(f"{rel}: not run (the checker's Python exited with status {proc.returncode})")
    for s in skipped:
        print(f"not run: {s}")
    print(
        f"{run} python blocks run ({doctests} as doctests) in {len(files)} files, {len(skipped)} not run, "
        f"{links} links checked, {time.perf_counter() - start:.0f} s"
    )
    for f in failed:
        print(f"error: {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
