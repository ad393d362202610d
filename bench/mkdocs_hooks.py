"""MkDocs hooks (mkdocs.yml `hooks:`): ARCHITECTURE.md, kept at the top of the repository beside the code it
describes (tests take its worked example from there), also becomes the site's "architecture.md" page."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files


def on_files(files: Files, config) -> Files:
    root = Path(config.config_file_path).resolve().parent
    files.append(File.generated(config, "architecture.md", content=(root / "ARCHITECTURE.md").read_text()))
    return files
