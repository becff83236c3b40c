"""What scripts/test-all.sh prints at the end of a CI run, from the run's files:

python -m tests.ci_report slowest JUNIT_XML N   the N slowest tests (setup + call + teardown)
python -m tests.ci_report starts START_LOG      the expensive starts (tests/starts.py)
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from tests.starts import tally


def slowest(junit_xml: Path, count: int) -> list[str]:
    """The ``count`` slowest test cases of a pytest junit file, as printed lines."""
    cases = []
    for case in ElementTree.parse(junit_xml).getroot().iter("testcase"):
        outcome = (
            "failed" if case.find("failure") is not None or case.find("error") is not None else ""
        )
        outcome = outcome or ("skipped" if case.find("skipped") is not None else "")
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        cases.append((float(case.get("time", 0.0)), name, outcome))
    cases.sort(reverse=True)
    return [
        f"  {seconds:7.1f} s  {name} {outcome}".rstrip() for seconds, name, outcome in cases[:count]
    ]


def starts_line(start_log: Path) -> str:
    events = []
    for raw in start_log.read_text(errors="replace").splitlines():
        try:
            events.append(json.loads(raw))
        except json.JSONDecodeError:
            continue
    counted, engine_seconds, _ = tally(events)
    parts = [f"{kind} {count}" for kind, count in sorted(counted.items())]
    return "; ".join(parts) + f" (engine cores built in {engine_seconds:.0f} s)"


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "slowest":
        print("\n".join(slowest(Path(argv[1]), int(argv[2]))))
        return 0
    if len(argv) == 2 and argv[0] == "starts":
        print(starts_line(Path(argv[1])))
        return 0
    print(
        f"usage: python -m tests.ci_report slowest JUNIT_XML N | starts START_LOG; found {argv}",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
