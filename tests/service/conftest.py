import os

import pytest

# a tiny variant whose fast graph has each cache layout (service/layouts.py); every registered layout needs one
ARTIFACT_OF = {"padded": "alibi", "compact": "rope"}


@pytest.fixture(scope="session")
def fast_artifacts(tiny_artifacts, tmp_path_factory):
    """The tiny artifacts of ARTIFACT_OF's variants with their fast graphs added (python -m export.fuse), hard links
    to the shared ones otherwise."""
    from export.fuse import add_to_artifact

    root = tmp_path_factory.mktemp("fast")
    for variant in sorted(set(ARTIFACT_OF.values())):
        (root / variant).mkdir()
        for f in (tiny_artifacts[0] / variant).iterdir():
            os.link(f, root / variant / f.name)
        add_to_artifact(root / variant)
    return root
