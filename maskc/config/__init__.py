"""Masks in model configs: `MaskConfig`, config files (YAML / JSON / TOML) and
`MaskSpec` fields; and the masks of Hugging Face transformers and MaxText configs
(`from_hf`, `hf_operands`, `from_maxtext`).
"""

from maskc.config.hugging_face import from_hf as from_hf, hf_operands as hf_operands
from maskc.config.maxtext import from_maxtext as from_maxtext

__all__ = ["from_hf", "from_maxtext", "hf_operands"]
