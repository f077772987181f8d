"""``GET /usage``: the tenant usage page, three static files shipped in the package and served by the service.

No build step and nothing from elsewhere: the page's script reads the usage API of this same service with the
tenant key the user types (kept in the tab's session storage, sent as the usual bearer header). The page itself
needs no key, so its paths are open in `RequestGuard`; it is served with a Content-Security-Policy that lets it
load and call only this service.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from llmvisor.shipped import data_dir

PAGE_DIR_NAME = "usage-page"
PAGE_FILES = {"/usage": ("index.html", "text/html; charset=utf-8"), "/usage/app.js": ("app.js", "text/javascript; charset=utf-8"),
              "/usage/style.css": ("style.css", "text/css; charset=utf-8")}
PAGE_PATHS = frozenset(PAGE_FILES)
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

router = APIRouter(tags=["page"])


def page_response(path: str) -> Response:
    name, media_type = PAGE_FILES[path]
    return Response((data_dir() / PAGE_DIR_NAME / name).read_bytes(), media_type=media_type, headers=PAGE_HEADERS)


@router.get("/usage", include_in_schema=False)
def usage_page() -> Response:
    return page_response("/usage")


@router.get("/usage/app.js", include_in_schema=False)
def usage_script() -> Response:
    return page_response("/usage/app.js")


@router.get("/usage/style.css", include_in_schema=False)
def usage_style() -> Response:
    return page_response("/usage/style.css")
