"""Read the instruction order of a compiled program's entry computation (CPU schedule)."""

import re

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute")


def entry_schedule(compiled_text: str) -> list[tuple[str, str]]:
    """(kind, line) for each collective and matmul in the scheduled ENTRY computation, in order.

    kind is a collective's opcode or "matmul" (a `dot`, or a fusion made from a dot_general).
    """
    entry = compiled_text[compiled_text.index("\nENTRY") :]
    entry = entry[: entry.index("\n}")]
    out = []
    for line in entry.splitlines()[1:]:
        m = re.search(r"= \S+ ([a-z-]+)\(", line) or re.search(r"= \(.*?\) ([a-z-]+)\(", line)
        if not m:
            continue
        op = m.group(1)
        if op in COLLECTIVES:
            out.append((op, line.strip()))
        elif op == "dot" or (op == "fusion" and 'dot_general"' in line):
            out.append(("matmul", line.strip()))
    return out


def positions(schedule, kind: str, shape: str | None = None) -> list[int]:
    """Indices in `schedule` of instructions of `kind` (and, if given, whose text contains `shape`)."""
    return [i for i, (k, line) in enumerate(schedule) if k == kind and (shape is None or shape in line)]
