"""The attention viewer's files (service/http/viewer/): / is its page, /viewer/<name> the page's scripts and
styles.  They hold no data, so they need no API key: the page loads and asks for one when its API calls get 401."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response

from service.http.front import Front
from service.http.routing import Api, Route

VIEWER = Path(__file__).resolve().parent / "viewer"
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8"}
# The viewer talks only to this worker: no script, style, font or image from another host.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def viewer_files() -> dict[str, Path]:
    """URL path -> file of the viewer."""
    files = {p.name: p for p in sorted(VIEWER.iterdir()) if p.suffix in TYPES}
    return {("/" if name == "index.html" else f"/viewer/{name}"): p for name, p in files.items()}


class Viewer(Api):
    """One route per file of the viewer's folder, read once when the front is built."""

    @classmethod
    def declarations(cls) -> list[Route]:
        return [Route("GET", path, "the viewer" if path == "/" else f"the viewer's {p.name}", response=TYPES[p.suffix],
                      keyless=True, handler="serve") for path, p in viewer_files().items()]

    def __init__(self, front: Front):
        super().__init__(front)
        self.files = {path: (p.read_bytes(), TYPES[p.suffix]) for path, p in viewer_files().items()}

    async def serve(self, request: Request) -> Response:
        data, media = self.files[request.url.path]
        return Response(data, media_type=media, headers={"content-security-policy": CSP, "cache-control": "no-cache"})
