"""Compare the outcomes of a peer-suite run with the committed expectation file.

Expectation file (``vllm_expected.txt``): one expected failure per line,
``RUNS NODEID -- CATEGORY: why``, where RUNS is ``both``, ``stock`` or ``umalloc`` (the runs it fails in) and
CATEGORY is ``env`` (the environment lacks something: a model config from the hub, a device) or ``by-design``
(umalloc differs from vLLM on purpose). Lines starting with ``#`` are comments. A run is accepted iff the tests that failed
are exactly the ones the file lists for it: an unlisted failure, and a listed test that passed, was skipped or
did not run, both fail the comparison (the file must be updated with the reason).

Usage: ``python vllm_expectations.py EXPECTED RUN OUTCOMES_JSON`` prints one summary line and exits 0 or 1.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

RUNS = ("stock", "umalloc")
CATEGORIES = ("env", "by-design")


@dataclass(frozen=True)
class Expected:
    """One expected failure: the runs it fails in, the test id, its category and reason."""

    runs: tuple[str, ...]
    nodeid: str
    category: str
    reason: str


def parse(text: str) -> dict[str, Expected]:
    """Parse an expectation file. Raises ValueError naming the line on a malformed one or a repeated id."""
    out: dict[str, Expected] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        head, sep, tail = line.partition(" -- ")
        parts = head.split()
        category, colon, reason = tail.partition(":")
        if not sep or len(parts) != 2 or not colon or not reason.strip():
            raise ValueError(f"line {n}: {raw!r}: allowed 'RUNS NODEID -- CATEGORY: why'")
        runs = RUNS if parts[0] == "both" else (parts[0],)
        if not set(runs) <= set(RUNS) or category.strip() not in CATEGORIES:
            raise ValueError(f"line {n}: runs {parts[0]!r} / category {category.strip()!r}: allowed runs "
                             f"both|{'|'.join(RUNS)} and a category in {CATEGORIES}")
        if parts[1] in out:
            raise ValueError(f"line {n}: {parts[1]} is listed twice")
        out[parts[1]] = Expected(runs, parts[1], category.strip(), reason.strip())
    return out


def compare(expected: dict[str, Expected], run: str, outcomes: dict[str, str]) -> tuple[list[str], list[str]]:
    """The problems of one run: ``(unexpected_failures, unexpected_non_failures)``, each a sorted list of
    ``"nodeid (outcome)"`` strings; both empty iff the run matches the file."""
    if run not in RUNS:
        raise ValueError(f"run {run!r}: allowed one of {RUNS}")
    listed = {k for k, e in expected.items() if run in e.runs}
    failed = {k for k, v in outcomes.items() if v == "failed"}
    unexpected = sorted(f"{k} (failed)" for k in failed - listed)
    missing = sorted(f"{k} ({outcomes.get(k, 'not run')})" for k in listed - failed)
    return unexpected, missing


def main(argv: list[str]) -> int:
    expected_path, run, outcomes_path = argv
    with open(expected_path) as f:
        expected = parse(f.read())
    with open(outcomes_path) as f:
        outcomes = json.load(f)
    unexpected, missing = compare(expected, run, outcomes)
    counts = {k: sum(1 for v in outcomes.values() if v == k) for k in ("passed", "failed", "skipped")}
    for item in unexpected:
        print(f"[vllm-peer] {run}: UNEXPECTED FAILURE {item}")
    for item in missing:
        print(f"[vllm-peer] {run}: LISTED AS FAILING BUT {item}: update {expected_path}")
    verdict = "ok" if not unexpected and not missing and counts["passed"] else "MISMATCH"
    # worded so no CI log reader takes the expected failures for a failed run of this project's own suite
    print(f"[vllm-peer] {run}: vLLM tests passing {counts['passed']} of {len(outcomes)}; expected (listed) "
          f"non-passing {counts['failed']}, skipped {counts['skipped']}: {verdict}")
    return 0 if verdict == "ok" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
