"""Reading a local Hugging Face folder: config.json, the safetensors weights (one file or an index with shards) and
tokenizer.json.  Offline and torch-light: tensors are read one at a time from memory-mapped files, checked against
the shape the config implies, and converted to float32 as they are taken.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from model.errors import ImportRefusedError

CONFIG, WEIGHTS, INDEX, TOKENIZER = "config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json"


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ImportRefusedError(f"{path}: missing")
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise ImportRefusedError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ImportRefusedError(f"{path}: not a JSON object")
    return data


class Weights:
    """The folder's tensors by name, from model.safetensors or from the shards an index lists.  Each tensor is read
    (and its memory-mapped pages touched) only when taken; `unused()` names what no mapping took."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.where: dict[str, Path] = {}  # tensor name -> file
        index = folder / INDEX
        if (folder / WEIGHTS).is_file():
            files = [folder / WEIGHTS]
        elif index.is_file():
            data = read_json(index)
            weight_map = data.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ImportRefusedError(f"{index}: no weight_map")
            files = []
            for shard in dict.fromkeys(weight_map.values()):
                if not isinstance(shard, str) or Path(shard).name != shard:
                    raise ImportRefusedError(f"{index}: shard name {shard!r} is not a file in the folder")
                if not (folder / shard).is_file():
                    raise ImportRefusedError(f"{folder / shard}: listed in {INDEX} but absent")
                files.append(folder / shard)
        else:
            raise ImportRefusedError(f"{folder}: no {WEIGHTS} or {INDEX} (safetensors weights are required; "
                                     "pytorch_model.bin is not read: nothing is ever unpickled)")
        self.handles = {}
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt")
                names = list(handle.keys())
            except (SafetensorError, OSError, ValueError) as err:  # a truncated file fails here, at its header
                raise ImportRefusedError(f"{path}: unreadable or truncated safetensors ({err})") from None
            self.handles[path] = handle
            for name in names:
                self.where[name] = path
        if index.is_file() and not (folder / WEIGHTS).is_file():
            for name, shard in read_json(index)["weight_map"].items():
                if self.where.get(name) != folder / shard:
                    raise ImportRefusedError(f"{folder / shard}: does not hold {name}, which {INDEX} says it does")
        self.taken: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.where

    def shape(self, name: str) -> list[int]:
        return list(self.handles[self.where[name]].get_slice(name).get_shape())

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor `name` as float32, refused unless it has exactly `shape`."""
        if name not in self.where:
            raise ImportRefusedError(f"{self.folder}: weights have no tensor {name}")
        got = self.shape(name)
        if tuple(got) != tuple(shape):
            raise ImportRefusedError(f"{self.where[name]}: tensor {name} has shape {got}, the config implies "
                                     f"{list(shape)}")
        self.taken.add(name)
        try:
            return self.handles[self.where[name]].get_tensor(name).to(torch.float32)
        except (SafetensorError, OSError, RuntimeError) as err:
            raise ImportRefusedError(f"{self.where[name]}: cannot read tensor {name} ({err})") from None

    def unused(self) -> list[str]:
        return sorted(set(self.where) - self.taken)


def tokenizer_vocab_size(path: Path) -> int:
    """Ids a tokenizer.json can produce: one past the largest id in its model's vocabulary and added tokens (read
    from the JSON; the worker loads the same file with the `tokenizers` library)."""
    data = read_json(path)
    model = data.get("model")
    if not isinstance(model, dict):
        raise ImportRefusedError(f"{path}: no tokenizer model")
    vocab = model.get("vocab")
    if isinstance(vocab, dict):
        ids = [int(i) for i in vocab.values()]
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...], ids are positions
        ids = [len(vocab) - 1] if vocab else []
    else:
        raise ImportRefusedError(f"{path}: tokenizer model {model.get('type')!r} has no vocabulary")
    ids += [int(t["id"]) for t in data.get("added_tokens") or [] if isinstance(t, dict) and "id" in t]
    if not ids:
        raise ImportRefusedError(f"{path}: empty vocabulary")
    return max(ids) + 1
