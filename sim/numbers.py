"""The number types of every user-facing schema: a boolean is not a number, and a float is
finite.

pydantic's default (lax) mode reads `true` as 1 and accepts NaN and infinities; a scenario
written `num_blocks = true` or `qps = nan` is a mistake, never a setting. `Int` refuses
booleans and floats; `Float` refuses booleans, NaN and +-inf, and takes integers.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AllowInfNan, Strict

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict(), AllowInfNan(False)]
