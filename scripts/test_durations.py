"""Per-file durations of a test run, as the Markdown table docs/test_durations.md holds.

    python -m pytest -q -n auto --dist loadfile --no-loadscope-reorder --junitxml=suite.xml
    python scripts/test_durations.py suite.xml --title "..." > docs/test_durations.md

Each file's time is the sum of its tests' JUnit times (setup, call and teardown: a module fixture's build is in
its first test), in worker-seconds: with 2 pytest workers the suite's wall time is about half the total.
"""

import argparse
import collections
import xml.etree.ElementTree as ET
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("junit", help="the JUnit XML pytest wrote (--junitxml)")
    parser.add_argument("--title", default="Test durations per file", help="the page's heading")
    parser.add_argument("--note", default="", help="a paragraph under the heading: the machine, the load, the run")
    args = parser.parse_args(argv)
    seconds, tests, slowest = collections.Counter(), collections.Counter(), {}
    for case in ET.parse(args.junit).iter("testcase"):
        path = case.get("classname", "").split(".")
        name = f"{path[0]}/{path[1]}.py" if len(path) > 1 else path[0]
        time = float(case.get("time") or 0.0)
        seconds[name] += time
        tests[name] += 1
        if time > slowest.get(name, (0.0, ""))[0]:
            slowest[name] = (time, case.get("name", ""))
    total = sum(seconds.values())
    print(f"# {args.title}\n")
    if args.note:
        print(f"{args.note}\n")
    print(f"{sum(tests.values())} tests, {total:,.0f} worker-seconds in all.\n")
    print("| file | tests | seconds | share | slowest test (seconds) |")
    print("|---|---|---|---|---|")
    for name, time in seconds.most_common():
        worst_time, worst = slowest[name]
        print(f"| `{name}` | {tests[name]} | {time:.1f} | {100 * time / total:.1f} % | `{worst}` ({worst_time:.1f}) |")


if __name__ == "__main__":
    main()
