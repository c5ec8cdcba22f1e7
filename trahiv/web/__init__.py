"""trahiv's web pages (FastAPI): the memory calculator now; each page is an APIRouter that an app can include."""

from __future__ import annotations

__all__: list[str] = []
