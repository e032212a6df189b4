"""/docs served from this machine: Swagger UI's assets come from the swagger-ui-bundle
package, mounted under /docs-assets, not from a CDN, so the page works offline and makes the
browser fetch nothing from a third party. ReDoc (CDN only) is not served; /openapi.json is.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from swagger_ui_bundle import swagger_ui_path

ASSETS = "/docs-assets"


def install_docs(app: FastAPI) -> None:
    """Serve /docs with local assets; the app must be built with docs_url=None and
    redoc_url=None."""
    app.mount(ASSETS, StaticFiles(directory=str(swagger_ui_path)), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} API",
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon-32x32.png",
            # No badge fetched from validator.swagger.io.
            swagger_ui_parameters={"validatorUrl": None})
