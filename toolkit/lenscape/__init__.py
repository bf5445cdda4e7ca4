"""lenscape: see which parts of a language model do the work.

Data flows one way: ``load`` a model -> ``capture`` attributions into labeled xarray
DataArrays -> ``save``/``open`` them -> aggregate with xarray -> draw with ``heatmap``
-> browse with ``Explorer``.
"""

from . import data, schema
from .capture import ablation, activation_patching, attribution_patching, direct_logit_attribution
from .models import LensModel, ModelSpec, from_hf, load

__all__ = [
    "LensModel",
    "ModelSpec",
    "ablation",
    "activation_patching",
    "attribution_patching",
    "data",
    "direct_logit_attribution",
    "from_hf",
    "load",
    "schema",
]
