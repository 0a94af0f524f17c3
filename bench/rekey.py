"""Re-key this machine's tuning records written under the legacy target fingerprint.

    .venv/bin/python -m bench.rekey bench/tuning/*.jsonl [--dry-run]

Until 2026-11-29 a target's fingerprint hashed every feature the host reported, so two VMs of
one CPU that a hypervisor showed slightly different flags (protection keys, WBNOINVD) keyed
their records apart, and neither applied the other's. The fingerprint now hashes the vector
ISA only (`Target.fingerprint`). This rewrites, in place, every record keyed by this host's
legacy fingerprint to its current one; records of other machines are left as they are (the
committed logs' were re-keyed when the change landed, from their feature lists).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from compiler_core.target import Target, host_target


def legacy_fingerprint(target: Target) -> str:
    """The fingerprint as it was computed before 2026-11-29: over every enabled feature."""
    return target.fingerprint_over(f for f in target.features.split(",") if f.startswith("+"))


def rekey_lines(lines: list[str], legacy: str, current: str) -> tuple[list[str], int]:
    """The lines with `legacy`'s records keyed by `current`, and how many changed. Lines are
    edited as JSON, not as text, and written back in the log's compact form."""
    out, changed = [], 0
    for line in lines:
        if not line.strip():
            out.append(line)
            continue
        record = json.loads(line)
        if record.get("fingerprint") == legacy:
            record["fingerprint"] = current
            line = json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n"
            changed += 1
        out.append(line)
    return out, changed


def rewrite(path: str, lines: list[str]) -> None:
    """Replace `path` whole, so a reader sees the old log or the new one."""
    folder = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile("w", dir=folder, delete=False) as handle:
        handle.writelines(lines)
    os.replace(handle.name, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", help="JSON-lines tuning logs")
    parser.add_argument("--dry-run", action="store_true", help="count, write nothing")
    args = parser.parse_args(argv)
    target = host_target()
    legacy, current = legacy_fingerprint(target), target.fingerprint
    print(f"{target}: legacy fingerprint {legacy} -> {current}")
    for path in args.logs:
        with open(path) as handle:
            lines, changed = rekey_lines(handle.readlines(), legacy, current)
        if changed and not args.dry_run:
            rewrite(path, lines)
        print(f"{path}: {changed} records re-keyed")


if __name__ == "__main__":
    main()
