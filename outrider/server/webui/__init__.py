"""The built-in web page at `/` (off with --no-webui): plain HTML, CSS and JS in this folder, no build step and
nothing fetched from elsewhere. The files are read once, when the app is built, and served as they are."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response

HERE = Path(__file__).parent
# URL path -> (file in this folder, media type). Nothing else here is reachable.
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/webui/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/webui/style.css": ("style.css", "text/css; charset=utf-8"),
}
PATHS = frozenset(FILES)
# The page may load and call nothing but this server.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "base-uri 'none'; frame-ancestors 'none'")


def add_routes(app: FastAPI) -> None:
    for path, (name, media_type) in FILES.items():
        app.add_api_route(path, _file_route((HERE / name).read_bytes(), media_type), methods=["GET"],
                          include_in_schema=False)


def _file_route(body: bytes, media_type: str):
    headers = {"Content-Security-Policy": CSP, "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}

    async def route():
        return Response(body, media_type=media_type, headers=headers)

    return route
