"""`python -m tests.conformance.run_suite [pattern]`: run the suite and write the report."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from tests.conformance.suite import run_suite, write_report

DEFAULT_REPORT = Path(__file__).resolve().parents[2] / "reports" / "conformance.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("pattern", nargs="?", help="regex on test names")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--report", type=Path, default=DEFAULT_REPORT)
    parser.add_argument("--show-failures", action="store_true")
    parser.add_argument(
        "--engine",
        choices=("reference", "native"),
        default="reference",
        help="run through the reference executor or compiled native code",
    )
    args = parser.parse_args()
    report = run_suite(workers=args.workers, pattern=args.pattern, engine=args.engine)
    write_report(report, args.report)
    summary = report["summary"]
    print(
        f"in scope {summary['in_scope']}: passed {summary['passed']}, failed "
        f"{summary['failed']}, not supported {summary['not_supported']} -> pass rate "
        f"{summary['pass_rate']:.1%} (out of scope {summary['out_of_scope']})"
    )
    for reason, count in report["out_of_scope_reasons"].items():
        print(f"  out of scope: {count:4d}  {reason}")
    if args.show_failures:
        for name, result in report["results"].items():
            if result["status"] in ("failed", "not_supported"):
                print(f"{result['status']:13s} {name}: {result['reason'][:200]}")
    causes = Counter(
        r["reason"].split(":")[0][:60]
        for r in report["results"].values()
        if r["status"] in ("failed", "not_supported")
    )
    print("report:", args.report)
    for cause, count in causes.most_common(10):
        print(f"  {count:4d}  {cause}")


if __name__ == "__main__":
    main()
