"""Real example models on data that ships with the installed packages (nothing is downloaded).

- ``digits`` / ``digits-fast``: :class:`elastic_ops.examples.digits.DigitsMLP`, an MLP on
  scikit-learn's bundled 8x8 handwritten digits (bitwise / fast consistency).
- ``chartransformer``: :class:`elastic_ops.examples.chartransformer.CharTransformer`, a small
  character-level transformer language model on Python standard-library source.
- ``ncf``: :class:`elastic_ops.examples.ncf.NCF`, neural collaborative filtering on synthetic
  implicit feedback it generates, trained with parameter servers (``strategy: parameter_server``).

Their YAML specs live in this package (``elastic_ops/examples/<name>.yaml``, the source of
truth, installed with the package); the repository's top-level ``examples/<name>.yaml`` are
symbolic links to them, so ``elastic-ops run --spec examples/digits.yaml`` works from a
checkout and ``spec_path("digits")`` from an installed package.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from elastic_ops.errors import SpecError

if TYPE_CHECKING:
    from elastic_ops.spec import JobSpec

EXAMPLES: tuple[str, ...] = ("digits", "digits-fast", "digits-adaptive", "chartransformer", "ncf")
_HERE = Path(__file__).resolve().parent


def spec_path(name: str) -> Path:
    """The path of the shipped YAML spec of example ``name``."""
    if name not in EXAMPLES:
        raise SpecError("example", name, f"must be one of {', '.join(EXAMPLES)}")
    return _HERE / f"{name}.yaml"


def load_spec(name: str) -> JobSpec:
    """The validated :class:`~elastic_ops.spec.JobSpec` of example ``name``."""
    from elastic_ops.spec import JobSpec

    return JobSpec.from_yaml(spec_path(name))
