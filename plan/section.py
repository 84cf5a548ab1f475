"""The base of every plan and cluster section: immutable, unknown keys rejected, field docstrings as descriptions."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every plan section: immutable, unknown keys rejected, field docstrings become descriptions."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False, strict=False
    )
