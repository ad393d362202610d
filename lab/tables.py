"""Tables kept as rows of data, rendered to markdown (the CLI, the docs) and to HTML (the report) separately,
so a cell holding `|` or `<` reads the same in both and never shifts a column."""

from __future__ import annotations

import html
from dataclasses import dataclass, field


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]] = field(default_factory=list)
    intro: list[str] = field(default_factory=list)  # paragraphs before the table
    notes: list[str] = field(default_factory=list)  # paragraphs after it

    def markdown(self) -> str:
        def cell(text: str) -> str:
            return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")

        lines = [*self.intro, *([""] if self.intro else []),
                 "| " + " | ".join(cell(h) for h in self.header) + " |", "|---" * len(self.header) + "|"]
        lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in self.rows]
        if self.notes:
            lines += ["", *self.notes]
        return "\n".join(lines)

    def html(self) -> str:
        def cell(tag: str, text: str) -> str:
            # common fonts lack SYMBOL FOR SPACE (U+2420); OPEN BOX (U+2423) reads the same
            return f"<{tag}>{html.escape(str(text).replace(chr(0x2420), chr(0x2423)))}</{tag}>"

        out = [f"<p>{html.escape(p)}</p>" for p in self.intro if p]
        out.append("<table>")
        out.append("<tr>" + "".join(cell("th", h) for h in self.header) + "</tr>")
        out += ["<tr>" + "".join(cell("td", c) for c in row) + "</tr>" for row in self.rows]
        out.append("</table>")
        out += [f"<p>{html.escape(p)}</p>" for p in self.notes if p]
        return "\n".join(out)

    def __str__(self) -> str:
        return self.markdown()
