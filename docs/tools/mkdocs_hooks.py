"""MkDocs hooks (mkdocs.yml `hooks:`): ARCHITECTURE.md, kept at the top of the repository beside the code it
describes (tests take its worked example from there), also becomes the site's "architecture.md" page; and the
reference pages (docs/tools/reference.py: the Python client, posenc.v1, the HTTP API and its OpenAPI document) are
generated from the code at every build, so the site cannot describe code other than what it is built from."""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.structure.files import File, Files


def on_files(files: Files, config) -> Files:
    root = Path(config.config_file_path).resolve().parent
    files.append(File.generated(config, "architecture.md", content=(root / "ARCHITECTURE.md").read_text()))
    if str(root) not in sys.path:  # docs.tools.reference, from the repository the site is built from
        sys.path.insert(0, str(root))
    # lazy: importable only once the repository the site is built from is on sys.path (mkdocs loads this file by path)
    from docs.tools import reference

    for path, content in reference.pages().items():
        files.append(File.generated(config, path, content=content))
    return files
