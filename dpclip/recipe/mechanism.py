"""``privacy.mechanism``: how noise is added across steps (docs/methods.md, "Correlated noise").

``{kind: dp-sgd}`` (the default) draws independent noise at every step; ``{kind: banded-mf,
bands: b}`` correlates it over b steps (banded matrix factorization, docs/formulas.md). Both
say how many ``bands`` the accounting and the sampler use: 1 is DP-SGD.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field

from dpclip.engine.policies.base import PositiveInt
from dpclip.recipe.section import Section


class DpSgd(Section):
    kind: Literal["dp-sgd"] = "dp-sgd"

    @property
    def bands(self) -> int:
        return 1


class BandedMF(Section):
    kind: Literal["banded-mf"]
    bands: PositiveInt = Field(description="b: the noise of a step is correlated with the b - 1 before it; the data "
                               "are cut into b groups sampled in turn (cyclic Poisson); 1 is DP-SGD "
                               "(docs/formulas.md, 'Banded matrix factorization')")


MechanismConfig = Annotated[Union[DpSgd, BandedMF], Field(discriminator="kind")]
