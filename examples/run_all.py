"""Runs every example script in this folder, each in a fresh Python process, and tabulates.

An example script is any `*.py` here except this file and `_`-prefixed helpers. The contract
(see README.md): exit status 0 means the result matched its `jnp` reference, anything else is
a failure; lines such as `add: PASS  max_abs_err=1e-07 (tol 1e-06)  time=3.2 ms (...)` are
picked up for the table. Extra arguments (e.g. `--size large`) go to every script.

The table has one row per check (a result line; a script that printed none is one row, judged
by its exit status): the check's own verdict, its error and kernel time, then the exit status of
the script that printed it and that script's wall time. The summary counts those rows; a check
fails when it printed FAIL or its script did not exit 0.

Run: python examples/run_all.py [--timeout SECONDS] [script-args...]
Exits 1 if any check failed or any script exited non-zero or timed out.
"""

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The tutorial order; any other example (e.g. the jax-triton `triton_*.py` ones) follows A-Z.
FIRST = ["add", "softmax", "layer_norm", "matmul", "flash_attention"]
RESULT_LINE = re.compile(
    r"^(?P<name>\S+?): (?P<status>PASS|FAIL)\b"
    r"(?:.*?(?P<kind>max_\w*err)=(?P<err>\S+))?(?:.*?time=(?P<ms>[\d.]+) ?ms)?"
)


def example_scripts() -> list[Path]:
    scripts = [p for p in HERE.glob("*.py") if not p.name.startswith("_") and p.name != Path(__file__).name]
    order = {name: i for i, name in enumerate(FIRST)}
    return sorted(scripts, key=lambda p: (order.get(p.stem, len(FIRST)), p.stem))


def run_one(script: Path, script_args: list[str], timeout: float) -> tuple[str, float, str]:
    """Returns (exit status: "0", "1", ... or "timeout"; wall seconds; combined output) for one script."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, str(script), *script_args],
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=HERE.parent,
        )
    except subprocess.TimeoutExpired as e:
        # On timeout, the partial output can be bytes even with text=True.
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        return "timeout", time.perf_counter() - start, out
    return str(proc.returncode), time.perf_counter() - start, proc.stdout + proc.stderr


def table_rows(script: Path, exit_status: str, wall: float, output: str) -> list[tuple]:
    """One row per result line the script printed (one row named after the script if it printed
    none, its result taken from the exit status: 0 means the script's check matched)."""
    checks = [m.groupdict() for line in output.splitlines() if (m := RESULT_LINE.match(line))]
    if not checks:
        status = "PASS" if exit_status == "0" else "FAIL"
        checks = [{"name": script.stem, "status": status, "kind": None, "err": None, "ms": None}]
    rows = []
    for check in checks:
        err = check["err"] or "-"
        if check["kind"] and check["kind"] != "max_abs_err":  # e.g. max_rel_err
            err += f" ({check['kind'].removeprefix('max_').removesuffix('_err')})"
        ms = f"{float(check['ms']):.3f}" if check["ms"] else "-"
        rows.append((script.name, check["name"], check["status"], err, ms, exit_status, f"{wall:.1f}"))
    return rows


def summary(rows: list[tuple]) -> tuple[str, bool]:
    """The line under the table, counting the table's rows, and whether everything passed."""
    scripts = sorted({r[0] for r in rows})
    bad_exit = sorted(
        {f"{r[0]} ({'timed out' if r[5] == 'timeout' else f'exit {r[5]}'})" for r in rows if r[5] != "0"}
    )
    failed = [f"{r[0]}:{r[1]}" for r in rows if r[2] != "PASS" or r[5] != "0"]
    line = (
        f"{len(rows)} checks from {len(scripts)} scripts: {len(rows) - len(failed)} passed, "
        f"{len(failed)} failed" + (f" ({', '.join(failed)})" if failed else "")
    )
    if bad_exit:
        line += f"; scripts that did not exit 0: {', '.join(bad_exit)}"
    return line, not failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=600, help="seconds per script")
    args, script_args = parser.parse_known_args()

    rows = []
    for script in example_scripts():
        print(f"=== {script.name} {' '.join(script_args)}".rstrip(), flush=True)
        exit_status, wall, output = run_one(script, script_args, args.timeout)
        print(output.rstrip(), flush=True)
        rows += table_rows(script, exit_status, wall, output)

    header = ("script", "check", "result", "max err", "kernel ms", "script exit", "script s")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print()
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    line, ok = summary(rows)
    print("\n" + line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
