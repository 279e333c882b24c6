"""What a bench section produces: figures (value vs same-run baseline), tables, plots.

A figure prints as exactly one line, `name: value unit (baseline value unit, ratio x)`;
`parse_line` reads it back (the smoke test relies on it).
"""

import math
import re
from dataclasses import dataclass, field


def fmt(x: float) -> str:
    """Three significant digits, never in exponent notation."""
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return "nan" if x is None or math.isnan(x) else "inf"
    if x == 0:
        return "0"
    digits = max(0, 2 - int(math.floor(math.log10(abs(x)))))
    return f"{x:.{digits}f}"


@dataclass(frozen=True)
class Figure:
    """`value` measured against `base_value` of `baseline` (same unit, same run).
    `target` says what the issue asks for (empty: none); `met` is the verdict."""

    name: str
    value: float
    unit: str
    baseline: str
    base_value: float
    target: str = ""
    met: bool | None = None
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.value / self.base_value if self.base_value else math.inf

    def line(self) -> str:
        return (f"{self.name}: {fmt(self.value)} {self.unit} "
                f"({self.baseline} {fmt(self.base_value)} {self.unit}, {fmt(self.ratio)}x)")


LINE = re.compile(
    r"^(?P<name>[\w.@/+-]+): (?P<value>[\d.]+|nan|inf) (?P<unit>\S+) "
    r"\((?P<baseline>[\w.@/+-]+) (?P<base>[\d.]+|nan|inf) (?P=unit), (?P<ratio>[\d.]+|nan|inf)x\)$")


def parse_line(line: str) -> dict | None:
    """The fields of a figure line, or None when the line is not one."""
    m = LINE.match(line.strip())
    if not m:
        return None
    d = m.groupdict()
    for k in ("value", "base", "ratio"):
        d[k] = float(d[k])
    return d


@dataclass
class Table:
    title: str
    header: list[str]
    rows: list[list[str]]
    note: str = ""

    def markdown(self) -> str:
        out = [f"**{self.title}**", "", "| " + " | ".join(self.header) + " |",
               "|" + "|".join(" --- " for _ in self.header) + "|"]
        out += ["| " + " | ".join(str(c) for c in row) + " |" for row in self.rows]
        if self.note:
            out += ["", self.note]
        return "\n".join(out)


@dataclass
class Section:
    """One section's results. `plots` are file names under the image directory."""

    name: str
    title: str
    intro: str = ""
    figures: list[Figure] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    plots: list[tuple[str, str]] = field(default_factory=list)  # (file name, caption)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, figure: Figure) -> Figure:
        self.figures.append(figure)
        return figure
