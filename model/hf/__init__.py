"""Import local Hugging Face folders (config.json + safetensors + tokenizer.json) as posenc models."""

from model.hf.families import FAMILIES
from model.hf.load import import_folder, read_config

__all__ = ["FAMILIES", "import_folder", "read_config"]
