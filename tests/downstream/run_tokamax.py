"""tokamax's own tests, on JAX's Pallas and on ours, compared test by test.

    python tests/downstream/run_tokamax.py                  # every Pallas test file of tokamax
    python tests/downstream/run_tokamax.py --subset ci      # the fixed subset (subsets/ci.txt)
    python tests/downstream/run_tokamax.py -k splash        # pytest's -k, on both runs

tokamax (PyPI, installed with its ``test`` extra) ships its tests inside the wheel.
This script picks the test files whose imports reach a Pallas TPU or Pallas Triton
kernel module (a static scan of the installed sources), runs them with pytest twice,
each in a fresh process (``tokamax_plugin.py``): on JAX's Pallas, the reference, and
on ours, with tokamax's Pallas imports rewritten at import time (``pallas_rewrite.py``).
Test files of Mosaic GPU kernels (out of our scope) and of tokamax's PyTorch wrappers
are listed as skipped, with the reason.

It writes ``tokamax.tsv`` (one line per test: both outcomes, how many Pallas kernels
each run called, the messages) and prints the counts. The exit status is 1 when a test
that passes on JAX's Pallas does not pass on ours and ``known_differences.toml`` gives
no reason for it.
"""

from __future__ import annotations

import argparse
import ast
import collections
import fnmatch
import importlib.util
import json
import os
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOKAMAX_VERSION = "0.0.17"  # the release known_differences.toml was measured on

# What a module importing these JAX Pallas modules is (the scan's vocabulary).
_PALLAS_KERNEL = {"tpu": "Pallas TPU", "triton": "Pallas Triton"}


@dataclass
class Selection:
    run: list[Path] = field(default_factory=list)
    triton: list[Path] = field(default_factory=list)  # of ``run``, those reaching a Pallas Triton kernel
    tpu: list[Path] = field(default_factory=list)  # of ``run``, those reaching a Pallas TPU kernel
    skipped: dict[Path, str] = field(default_factory=dict)
    not_pallas: list[Path] = field(default_factory=list)


def _module_imports(path: Path) -> tuple[set[str], set[str]]:
    """(tokamax modules it imports, JAX Pallas modules / other markers it imports)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    mods, marks = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("tokamax"):
                    mods.add(a.name)
                elif a.name.startswith("jax.experimental.pallas."):
                    marks.add(a.name.split(".")[3])
                elif a.name == "torch":
                    marks.add("torch")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("tokamax"):
                mods.update([node.module] + [f"{node.module}.{a.name}" for a in node.names])
            elif node.module == "jax.experimental.pallas":
                marks.update(a.name for a in node.names)
            elif node.module.startswith("jax.experimental.pallas."):
                marks.add(node.module.split(".")[3])
            elif node.module == "torch" or node.module.startswith("torch."):
                marks.add("torch")
    return mods, marks


def select(root: Path) -> Selection:
    """tokamax's test files by what they need (``root``: the installed package)."""
    files = {}
    for f in sorted(root.rglob("*.py")):
        parts = f.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = f
    imports = {name: _module_imports(f) for name, f in files.items()}

    def reach(name: str) -> set[str]:
        seen, todo = set(), [name]
        while todo:
            n = todo.pop()
            if n in seen or n not in imports:
                continue
            seen.add(n)
            todo.extend(imports[n][0])
        return set().union(*(imports[n][1] for n in seen))

    sel = Selection()
    for name, f in files.items():
        base = f.name
        if not (base.endswith("_test.py") or base.startswith("test_")) or base == "test_base.py":
            continue  # test_base.py: tokamax's abstract test classes, collected through their subclasses
        marks = reach(name)
        own = imports[name][1]
        if "mosaic_gpu" in f.stem or "mosaic_gpu" in own:
            sel.skipped[f] = "Mosaic GPU kernels: out of our scope (pallas-gpu lowers to Triton)"
        elif "torch" in marks:
            sel.skipped[f] = "tokamax's PyTorch wrappers: need torch and torch_tpu"
        elif marks & set(_PALLAS_KERNEL):
            sel.run.append(f)
            if "triton" in marks:
                sel.triton.append(f)
            if "tpu" in marks:
                sel.tpu.append(f)
        else:
            sel.not_pallas.append(f)
    return sel


def _pytest(side: str, targets: list[str], args, out: Path, site: Path) -> dict:
    report = out / f"{side}.json"
    report.unlink(missing_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [env.get("PYTHONPATH")])])
    if args.way == "gpu":
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # two pytest workers share the GPU
    else:
        env.setdefault("JAX_PLATFORMS", "cpu")
    # Four CPU devices, as in our own suites: tokamax's sharded tests need them.
    if "xla_force_host_platform_device_count" not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "tokamax_plugin", "-p", "no:cacheprovider"]
    cmd += [
        f"--pallas={side}",
        f"--way={args.way}",
        f"--downstream-report={report}",
        "--assert=plain",
        f"--rootdir={site}",
    ]
    cmd += ["--continue-on-collection-errors", "-o", "console_output_style=count"]
    if args.tpu_kind:
        cmd += [f"--tpu-kind={args.tpu_kind}"]
    if args.jobs > 1:
        cmd += ["-n", str(args.jobs)]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd += [f"--timeout={args.timeout}"]
    if args.k:
        cmd += ["-k", args.k]
    cmd += targets
    log = out / f"{side}.log"
    print(f"--- {side}: pytest on {len(targets)} targets (log: {log})", flush=True)
    start = time.monotonic()
    with open(log, "w") as f:
        subprocess.run(cmd, cwd=out, env=env, stdout=f, stderr=subprocess.STDOUT, check=False)
    print(f"    {time.monotonic() - start:.0f} s", flush=True)
    if not report.exists():
        sys.exit(f"pytest on {side}'s Pallas wrote no report: see {log}")
    return json.loads(report.read_text())


def load_known(
    path: Path = HERE / "known_differences.toml", table: str = "cause"
) -> list[tuple[str, list[str]]]:
    """[(reason, [test id patterns])] from ``known_differences.toml``: ``cause`` for
    the interpret and GPU ways, ``compiled`` for the compiled way (patterns of
    ``test id::kernel name``)."""
    data = tomllib.loads(path.read_text())
    return [(c["reason"], c["tests"]) for c in data.get(table, [])]


def reason_for(test: str, known) -> str | None:
    for reason, patterns in known:
        if any(fnmatch.fnmatchcase(test, p) for p in patterns):
            return reason
    return None


def _subset(name: str) -> list[str]:
    path = HERE / "subsets" / f"{name}.txt"
    lines = [x.split("#")[0].strip() for x in path.read_text().splitlines()]
    if not any(lines):
        sys.exit(f"{path} lists no test")
    return [x for x in lines if x]


def compare(jax: dict, ours: dict, known) -> dict:
    """Counts and the differences of two runs' reports."""
    ids = sorted(set(jax) | set(ours))
    missing = ["missing", "", 0, 0.0]
    c = collections.Counter()
    differences, unexplained, fixed_on_ours = [], [], []
    used = set()
    for t in ids:
        j, o = jax.get(t, missing), ours.get(t, missing)
        c["tests"] += 1
        c[f"jax {j[0]}"] += 1
        c[f"ours {o[0]}"] += 1
        if j[0] not in ("skipped", "missing"):
            c["run on the CPU"] += 1
        if j[0] == "passed":
            c["pass on JAX"] += 1
            c["pass on JAX, calling a Pallas kernel"] += j[2] > 0
            if o[0] == "passed":
                c["pass on JAX and ours"] += 1
                c["pass on JAX and ours, calling a Pallas kernel"] += j[2] > 0
            else:
                reason = reason_for(t, known)
                differences.append((t, o, reason))
                if reason is None:
                    unexplained.append(t)
                else:
                    used.add(reason)
        elif o[0] == "passed":
            fixed_on_ours.append((t, j))
    stale = [r for r, _ in known if r not in used]
    return dict(
        counts=c, differences=differences, unexplained=unexplained, fixed_on_ours=fixed_on_ours, stale=stale
    )


def compare_compiled(jax: dict, ours: dict, known) -> dict:
    """The compiled way: per chip and side, TPU kernels compiled / refused by Mosaic /
    refused by the lowering; a kernel (test id and kernel name, in the order traced)
    that JAX's lowering gets through Mosaic and ours does not is a difference."""
    counts = {}  # (side, chip) -> Counter of outcomes
    tests_with_kernels = collections.Counter()
    differences, unexplained, used = [], [], set()
    for side, rep in (("jax", jax), ("ours", ours)):
        for rec in rep.values():
            rows = rec[4] if len(rec) > 4 else []
            tests_with_kernels[side] += bool(rows)
            for _, chip, outcome, _ in rows:
                counts.setdefault((side, chip), collections.Counter())[outcome] += 1
    for t in sorted(set(jax) | set(ours)):
        j = jax.get(t, [])
        o = ours.get(t, [])
        jrows, orows = (r[4] if len(r) > 4 else [] for r in (j, o))
        by_chip = collections.defaultdict(lambda: ([], []))
        for i, rows in enumerate((jrows, orows)):
            for kernel, chip, outcome, msg in rows:
                by_chip[chip][i].append((kernel.partition(" at ")[0], outcome, msg))
        for chip, (js, os_) in sorted(by_chip.items()):
            # Matched by kernel name in trace order; a kernel JAX compiled that ours did not compile.
            left = list(os_)
            for name, outcome, _ in js:
                if outcome != "compiled":
                    continue
                mine = next((x for x in left if x[0] == name), None)
                if mine is not None:
                    left.remove(mine)
                if mine is None or mine[1] != "compiled":
                    key = f"{t}::{name}"
                    reason = reason_for(key, known)
                    why = mine[2] if mine else "not traced on ours"
                    differences.append((key, chip, mine[1] if mine else "missing", why, reason))
                    if reason is None:
                        unexplained.append(key)
                    else:
                        used.add(reason)
    stale = [r for r, _ in known if r not in used]
    return dict(
        counts=counts, tests=tests_with_kernels, differences=differences, unexplained=unexplained, stale=stale
    )


def _print_compiled(r: dict, out: Path, reports: dict) -> None:
    sys.path.insert(0, str(HERE))
    from tpu_compiled import OUTCOMES

    with open(out / "compiled.tsv", "w") as f:
        f.write("test\tside\tkernel\tchip\toutcome\tmessage\n")
        for side, rep in reports.items():
            for t, rec in sorted(rep.items()):
                for kernel, chip, outcome, msg in rec[4] if len(rec) > 4 else []:
                    f.write(f"{t}\t{side}\t{kernel}\t{chip}\t{outcome}\t{msg}\n")
    print(
        f"\nTPU kernels lowered and compiled by libtpu (tests tracing one: JAX {r['tests']['jax']}, ours"
        f" {r['tests']['ours']}):"
    )
    print(f"  {'chip':5} {'side':5} " + " ".join(f"{o:>20}" for o in OUTCOMES))
    for (side, chip), c in sorted(r["counts"].items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"  {chip:5} {side:5} " + " ".join(f"{c[o]:>20}" for o in OUTCOMES))
    print(f"  compiled on JAX's lowering, not on ours: {len(r['differences'])}")
    for key, chip, outcome, why, reason in r["differences"]:
        print(f"    {chip} {key}: {outcome}: {why[:200]}  [{reason or 'UNEXPLAINED'}]")
    print(f"  per kernel: {out / 'compiled.tsv'}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--subset", help="run the test ids listed in subsets/NAME.txt")
    p.add_argument("-k", help="pytest -k expression, on both runs")
    p.add_argument("--jobs", "-n", type=int, default=2, help="pytest-xdist workers per run (2)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per test (pytest-timeout)")
    p.add_argument("--out", default="build/downstream/tokamax", help="where the logs and reports go")
    p.add_argument("--only", choices=("jax", "ours"), help="run one side; the other's report is reused")
    p.add_argument(
        "--way",
        choices=("interpret", "gpu", "compiled"),
        default="interpret",
        help="interpret (a CPU: every Pallas test file, kernels in interpret mode), gpu (the test files"
        " reaching a Pallas Triton kernel, compiled and run on the GPU) or compiled (the test files reaching"
        " a Pallas TPU kernel, in interpret mode, each TPU kernel traced also compiled by libtpu for v5e/v6e)",
    )
    p.add_argument(
        "--tpu-kind",
        choices=("v4", "v5e", "v5p", "v6e"),
        help="show tokamax a TPU of this generation while kernels run in TPU interpret mode (both runs;"
        " tokamax_plugin.py): its TPU-gated tests run on the CPU",
    )
    p.add_argument("files", nargs="*", help="test files or ids (default: every Pallas test file)")
    args = p.parse_args(argv)

    spec = importlib.util.find_spec("tokamax")
    if spec is None:
        sys.exit(f"tokamax is not installed: pip install 'tokamax[test]=={TOKAMAX_VERSION}'")
    root = Path(spec.origin).parent
    site = root.parent
    from importlib.metadata import version

    tv = version("tokamax")
    if tv != TOKAMAX_VERSION:
        print(f"warning: tokamax {tv}; known_differences.toml is for {TOKAMAX_VERSION}")

    sel = select(root)
    all_tests = len(sel.run) + len(sel.skipped) + len(sel.not_pallas)
    print(f"tokamax {tv} at {root}: {all_tests} test files")
    print(f"  {len(sel.run)} reach a Pallas TPU or Pallas Triton kernel module: run")
    for reason, n in collections.Counter(sel.skipped.values()).items():
        print(f"  {n} skipped: {reason}")
        if n <= 10:
            print(
                "      " + " ".join(str(f.relative_to(root)) for f, r in sel.skipped.items() if r == reason)
            )
    print(f"  {len(sel.not_pallas)} reach no Pallas kernel module: not run")

    if args.subset:
        targets = [str(site / t) for t in _subset(args.subset)]
    elif args.files:
        targets = args.files
    else:
        targets = [str(f) for f in {"gpu": sel.triton, "compiled": sel.tpu}.get(args.way, sel.run)]
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    reports = {}
    for side in ("jax", "ours"):
        if args.only and args.only != side and (out / f"{side}.json").exists():
            reports[side] = json.loads((out / f"{side}.json").read_text())
        else:
            reports[side] = _pytest(side, targets, args, out, site)

    known = load_known()
    r = compare(reports["jax"], reports["ours"], known)
    with open(out / "tokamax.tsv", "w") as f:
        f.write("test\tjax\tours\tjax_kernels\tours_kernels\tjax_s\tours_s\tjax_message\tours_message\n")
        missing = ["missing", "", 0, 0.0]
        for t in sorted(set(reports["jax"]) | set(reports["ours"])):
            j, o = reports["jax"].get(t, missing), reports["ours"].get(t, missing)
            js, os_ = (x[3] if len(x) > 3 else "" for x in (j, o))
            f.write(f"{t}\t{j[0]}\t{o[0]}\t{j[2]}\t{o[2]}\t{js}\t{os_}\t{j[1]}\t{o[1]}\n")

    c = r["counts"]
    where = "the GPU" if args.way == "gpu" else "the CPU"
    print(f"\ntests: {c['tests']}; run on {where} (not skipped on JAX): {c['run on the CPU']}")
    print(
        f"  on JAX's Pallas: {c['jax passed']} passed, {c['jax failed']} failed, {c['jax error']} errors, {c['jax skipped']} skipped"
    )
    print(
        f"  on ours:         {c['ours passed']} passed, {c['ours failed']} failed, {c['ours error']} errors, {c['ours skipped']} skipped"
    )
    print(
        f"  pass on JAX: {c['pass on JAX']} ({c['pass on JAX, calling a Pallas kernel']} calling a Pallas kernel);"
        f" of them pass on ours: {c['pass on JAX and ours']}"
        f" ({c['pass on JAX and ours, calling a Pallas kernel']} calling a Pallas kernel)"
    )
    print(f"  fail on JAX, pass on ours: {len(r['fixed_on_ours'])}")
    by_reason = collections.defaultdict(list)
    for t, o, reason in r["differences"]:
        by_reason[reason].append((t, o))
    print(f"\npass on JAX, not on ours: {len(r['differences'])}")
    for reason, tests in sorted(by_reason.items(), key=lambda kv: (kv[0] is None, kv[0] or "")):
        print(f"  {len(tests):4d}  {reason or 'UNEXPLAINED (not in known_differences.toml)'}")
        if reason is None:
            for t, o in tests:
                print(f"          {t}: {o[0]}: {o[1][:200]}")
    if r["stale"] and not (args.subset or args.files or args.k):
        print("\nknown_differences.toml causes no test showed (fixed? remove them):")
        for reason in r["stale"]:
            print(f"  {reason}")
    print(f"\nper test: {out / 'tokamax.tsv'}")
    if args.way == "compiled":
        rc = compare_compiled(reports["jax"], reports["ours"], load_known(table="compiled"))
        _print_compiled(rc, out, reports)
        if rc["stale"] and not (args.subset or args.files or args.k):
            print("known_differences.toml [[compiled]] causes no kernel showed: " + "; ".join(rc["stale"]))
        return 1 if r["unexplained"] or rc["unexplained"] else 0
    return 1 if r["unexplained"] else 0


if __name__ == "__main__":
    sys.exit(main())
