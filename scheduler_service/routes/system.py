"""``/v1/system``: operator and supervisor actions on the whole system (placeholder; filled by issue 19)."""

from fastapi import APIRouter

router = APIRouter(prefix="/v1/system", tags=["system"])
