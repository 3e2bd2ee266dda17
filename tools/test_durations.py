"""Per-test and per-file cost of the test suite, from a pytest junit XML report.

Usage (the README's test command, with a report)::

    .venv/bin/python -m pytest -n 2 tests --junitxml=/tmp/suite.xml
    .venv/bin/python -m tools.test_durations /tmp/suite.xml --note "load 1.2 (uptime), quiet" \\
        --json benchmarks/results/test_durations.json --markdown benchmarks/test_durations.md

For each test the report holds its wall time (setup + call + teardown, seconds) and, from the hook in
``tests/conftest.py``, its CPU time: ``cpu_s`` (the pytest worker) and ``child_cpu_s`` (subprocesses
reaped during the test: servers, engine processes). Wall time on a loaded machine grows with the load;
CPU time does not, so the sum of CPU time over the suite, divided by the 2 cores the suite runs on,
is the quiet-machine estimate this tool prints (a lower bound: it leaves out collection, waiting and
imperfect balance between the two workers).
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def read_junit(path: Path) -> list[dict]:
    """One dict per test case: ``nodeid``, ``file``, ``wall_s``, ``cpu_s``, ``child_cpu_s``, ``outcome``."""
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "")
        name = case.get("name", "")
        if name.rfind("@") > name.rfind("]"):  # pytest-xdist's --dist loadgroup suffix "@group"
            name = name[: name.rfind("@")]
        parts = module.split(".")
        # classname is "tests.pkg.test_mod" or "tests.pkg.test_mod.TestClass"
        cut = next((i for i in range(len(parts), 0, -1) if parts[i - 1].startswith("test")), len(parts))
        file = "/".join(parts[:cut]) + ".py"
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = tag
        tests.append(
            {
                "nodeid": f"{file}::{'::'.join(parts[cut:] + [name])}",
                "file": file,
                "wall_s": round(float(case.get("time", 0.0)), 3),
                "cpu_s": round(float(props.get("cpu_s", 0.0)), 3),
                "child_cpu_s": round(float(props.get("child_cpu_s", 0.0)), 3),
                "outcome": outcome,
            }
        )
    return tests


def per_file(tests: list[dict]) -> list[dict]:
    """Tests grouped by file, sorted by CPU time (own + children), most expensive first."""
    files: dict[str, dict] = defaultdict(
        lambda: {"tests": 0, "wall_s": 0.0, "cpu_s": 0.0, "child_cpu_s": 0.0}
    )
    for t in tests:
        f = files[t["file"]]
        f["tests"] += 1
        for key in ("wall_s", "cpu_s", "child_cpu_s"):
            f[key] += t[key]
    rows = [
        {"file": name, **{k: round(v, 1) if k != "tests" else v for k, v in f.items()}}
        for name, f in files.items()
    ]
    return sorted(rows, key=lambda r: -(r["cpu_s"] + r["child_cpu_s"]))


def summary(tests: list[dict]) -> dict:
    cpu = sum(t["cpu_s"] + t["child_cpu_s"] for t in tests)
    outcomes: dict[str, int] = defaultdict(int)
    for t in tests:
        outcomes[t["outcome"]] += 1
    return {
        "tests": len(tests),
        "outcomes": dict(outcomes),
        "wall_s_sum": round(sum(t["wall_s"] for t in tests), 1),
        "cpu_s_sum": round(cpu, 1),
        "quiet_2core_lower_bound_s": round(cpu / 2, 1),
    }


def markdown(tests: list[dict], note: str, top: int) -> str:
    s = summary(tests)
    lines = [
        "# Test suite cost",
        "",
        f"Measured: {note}",
        "",
        f"{s['tests']} tests {s['outcomes']}; wall time summed over tests {s['wall_s_sum']:.0f} s; "
        f"CPU time (own + children) {s['cpu_s_sum']:.0f} s, so at least {s['quiet_2core_lower_bound_s'] / 60:.1f} "
        "min on 2 cores.",
        "",
        "Regenerate: see `docs/contributing_docs.md` (section *Test suite cost*).",
        "",
        "## Per file (most CPU first)",
        "",
        "| file | tests | wall s | CPU s | children CPU s |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in per_file(tests):
        lines.append(
            f"| {r['file']} | {r['tests']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['child_cpu_s']:.1f} |"
        )
    lines += [
        "",
        f"## Slowest {top} tests (wall)",
        "",
        "| test | wall s | CPU s | children CPU s |",
        "|---|---:|---:|---:|",
    ]
    for t in sorted(tests, key=lambda t: -t["wall_s"])[:top]:
        nodeid = t["nodeid"].replace("|", "\\|")  # a parameter id may hold a table separator
        lines.append(f"| {nodeid} | {t['wall_s']:.1f} | {t['cpu_s']:.1f} | {t['child_cpu_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("junit", type=Path, nargs="+", help="pytest --junitxml report(s); later ones win")
    ap.add_argument("--note", default="", help="how it was measured: machine, load (uptime), command")
    ap.add_argument("--json", type=Path, help="write every test's numbers here")
    ap.add_argument("--markdown", type=Path, help="write the per-file summary here")
    ap.add_argument("--top", type=int, default=40, help="how many slowest tests the summary lists")
    args = ap.parse_args(argv)
    by_id = {t["nodeid"]: t for path in args.junit for t in read_junit(path)}
    tests = list(by_id.values())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"note": args.note, "summary": summary(tests), "files": per_file(tests), "tests": tests}
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
    text = markdown(tests, args.note, args.top)
    if args.markdown:
        args.markdown.write_text(text)
    print(text if not args.markdown else json.dumps(summary(tests)))


if __name__ == "__main__":
    main()
