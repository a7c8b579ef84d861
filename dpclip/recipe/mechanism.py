"""``privacy.mechanism``: how noise is added across steps (docs/methods.md, "Correlated noise").

``{kind: dp-sgd}`` (the default) draws independent noise at every step; ``{kind: banded-mf,
bands: b}`` correlates it over b steps (banded matrix factorization, docs/formulas.md);
``{kind: blt, buffers: k}`` over all steps from k buffers (docs/formulas.md, "BLT"). Each says
how many ``bands`` the banded accounting uses (1 is DP-SGD) and how many ``buffers`` BLT keeps
(0: not BLT).
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

    @property
    def buffers(self) -> int:
        return 0


class BandedMF(Section):
    kind: Literal["banded-mf"]
    bands: PositiveInt = Field(description="b: the noise of a step is correlated with the b - 1 before it; the data "
                               "are cut into b groups sampled in turn (cyclic Poisson); 1 is DP-SGD "
                               "(docs/formulas.md, 'Banded matrix factorization')")

    @property
    def buffers(self) -> int:
        return 0


class Blt(Section):
    kind: Literal["blt"]
    buffers: PositiveInt = Field(description="k: the noise is correlated across all steps through k buffers (memory "
                                 "k x the model); the data are cut into G = floor(1/q) groups taken in turn, and "
                                 "no amplification by sampling is claimed (docs/formulas.md, 'BLT'); at most 8")

    @property
    def bands(self) -> int:
        return 1


MechanismConfig = Annotated[Union[DpSgd, BandedMF, Blt], Field(discriminator="kind")]
