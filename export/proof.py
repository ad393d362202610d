"""The proof at import: the imported model against transformers' own model of the same folder, before anything is
written (python -m export --from-hf; on whenever transformers is installed, --no-verify off; the generic import is
never written without it).

transformers builds its model from the folder (eager attention, float32, never remote code) and both run the probes
the config calls for: a left-padded batch of 3 at lengths 1, 7 and one past every window, chunk and original
context (up to a cap), and a prefill followed by decode steps, each side on its own cache.  Logits must agree within
TOLERANCE["logits"] times the logits' size (at least 1) on the real rows, attention probabilities within
TOLERANCE["attentions"].  When they do not, the same probe is run again with each decoder layer's output caught on
both sides, and the refusal names the first layer and part that differ and the largest difference.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
from pathlib import Path
from typing import Any

import torch

from export.errors import ExportError
from export.report import TOLERANCE
from model.transformer import Transformer
from model.variants import max_positions

# transformers' eager Falcon adds the ALiBi bias twice (5.24), its SDPA path once, as Falcon's own code: with ALiBi
# the SDPA model is the reference, for logits only (it returns no attention maps)
SDPA_REFERENCE = {"falcon": "alibi"}
STEPS = 3  # decode steps after the prefill


class ProofError(ExportError):
    """The import and transformers differ, or transformers cannot build the folder's model."""


def available() -> bool:
    return importlib.util.find_spec("transformers") is not None


def overridden(config: Any, override: dict[str, Any]) -> None:
    """transformers' config given the RoPE scaling posenc-export --rope-scaling gives the import: the override
    replaces the folder's scaling and keeps its base and rotated fraction (model/hf/families/base.py's Fields.rope),
    in each layer type's parameters where the config has them per type."""
    params = getattr(config, "rope_parameters", None) or {}
    kept = ("rope_theta", "partial_rotary_factor")
    if params and all(isinstance(v, dict) for v in params.values()):  # per layer type (Gemma 3 and 4)
        config.rope_parameters = {kind: {**{k: v[k] for k in kept if k in v}, **override} for kind, v in params.items()}
    else:
        config.rope_parameters = {**{k: params[k] for k in kept if k in params}, **override}


def reference(folder: Path, data: dict[str, Any], override: dict[str, Any] | None = None) -> tuple[Any, bool]:
    """transformers' model of the folder (eval, float32), with posenc's RoPE-scaling override where the import has
    one, and whether its attention maps are compared."""
    import transformers  # lazy: an optional dependency of the exporter (the build extra), never of the worker

    transformers.utils.logging.disable_progress_bar()  # its bars and warnings on stderr would break a one-line refusal
    transformers.utils.logging.set_verbosity_error()
    sdpa = bool(data.get(SDPA_REFERENCE.get(data.get("model_type"), ""), False))
    try:
        config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=False)
        if override is not None:
            overridden(config, override)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            folder, config=config, attn_implementation="sdpa" if sdpa else "eager", dtype=torch.float32,
            trust_remote_code=False)
    except (ValueError, OSError, KeyError, RuntimeError, TypeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ProofError(f"{folder}: transformers cannot build this folder's model to prove the import ({first})") \
            from None
    if hasattr(hf, "set_experts_implementation") and any(n.endswith(".experts") for n, _ in hf.named_modules()):
        hf.set_experts_implementation("eager")  # its own loop over the experts, not grouped_mm
    return hf.eval(), not sdpa


def probe_lengths(model: Transformer, cap: int) -> list[int]:
    """1, 7 and one past every window, chunk and original context the config has (at most cap and the table)."""
    c = model.cfg
    reach = max(c.sliding_window, c.attention_chunk, c.rope_original_context if c.rope_scaling != "none" else 0, 8)
    limit = min(cap, max_positions(c) or cap)
    return [n for n in dict.fromkeys((1, 7, min(reach + 9, limit))) if n <= limit]


def batch(length: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """3 rows, left-padded: full, about half, one token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, length), generator=g)
    mask = torch.ones(3, length, dtype=torch.int64)
    mask[1, : length // 2] = 0
    mask[2, : length - 1] = 0
    return ids, mask


class Proof:
    """posenc runs the left-padded batch; transformers runs each row alone, unpadded, on its own cache (its dynamic
    scalings, LongRoPE's switch among them, decide per batch: a row alone is the reference a row must equal)."""

    def __init__(self, model: Transformer, hf, maps: bool, folder: Path):
        self.model, self.hf, self.maps, self.folder = model, hf, maps, folder
        self.worst = {"logits": 0.0, "attentions": 0.0}
        self.cases = 0
        # BLOOM takes no positions (its ALiBi comes from the mask); the rest are given each row's own
        params = inspect.signature(hf.forward).parameters
        self.positions = "position_ids" in params
        self.cache = "cache" if "cache" in params else "past_key_values"  # transformers >= 5.2x names it cache

    @torch.inference_mode()
    def run(self, ids, mask, past, caches, row: int | None = None):
        """posenc's output for the batch and transformers' per row (None for a row with no new token); caches: each
        row's transformers cache, replaced by the grown one."""
        out = self.model(ids, mask, past)
        refs = []
        for b in range(ids.shape[0]) if row is None else [row]:
            new, keys = mask[b, -ids.shape[1]:].bool(), int(mask[b].sum())
            if not new.any():
                refs.append(None)
                continue
            n = int(new.sum())
            pos = {"position_ids": torch.arange(keys - n, keys)[None]} if self.positions else {}
            ref = self.hf(input_ids=ids[b][new][None], attention_mask=torch.ones(1, keys, dtype=torch.int64),
                          output_attentions=self.maps, use_cache=True, **{self.cache: caches[b]}, **pos)
            caches[b] = getattr(ref, "cache", None) or ref.past_key_values
            refs.append(ref)
        return refs, out

    def diffs(self, b: int, ref, out, ids, mask):
        """Row b's (logits difference, its tolerance, per-layer map differences)."""
        new, keys = mask[b, -ids.shape[1]:].bool(), mask[b].bool()
        theirs, ours = ref.logits[0], out.logits[b][new]
        d = (theirs - ours).abs().max().item()
        tol = TOLERANCE["logits"] * max(1.0, theirs.abs().max().item())
        if not self.maps:
            return d, tol, []
        # transformers returns the attention layers' maps alone; a mixer layer's (0 here) is proven apart
        cfg, maps = self.model.cfg, [0.0] * self.model.cfg.n_layers
        for i, a in zip([i for i in range(cfg.n_layers) if cfg.attends(i)], ref.attentions, strict=True):
            maps[i] = map_diff(a[0], out.attentions[b, i][:, new][..., keys])
        return d, tol, maps

    def check(self, case: str, ids, mask, past=None, caches=None):
        caches = caches if caches is not None else [None] * ids.shape[0]
        kept = copy.deepcopy(caches)  # they grow in place: a second run (locate) needs them as they were
        refs, out = self.run(ids, mask, past, caches)
        self.cases += 1
        for b, ref in enumerate(refs):
            if ref is None:
                continue
            d, tol, maps = self.diffs(b, ref, out, ids, mask)
            self.worst["logits"] = max(self.worst["logits"], d)
            self.worst["attentions"] = max([self.worst["attentions"], *maps])
            failed = ("logits", d, tol) if d > tol else next(
                (("attentions", m, TOLERANCE["attentions"]) for m in maps if m > TOLERANCE["attentions"]), None)
            if failed is not None:
                raise ProofError(f"{self.folder}: the import differs from transformers' {self.hf.config.model_type} "
                                 f"{locate(self, ids, mask, past, kept, b)} ({case}, row {b}: {failed[0]} differ by "
                                 f"{failed[1]:.2e}, tolerance {failed[2]:.1e}); nothing was written")
        return caches, out


def map_diff(theirs: torch.Tensor, ours: torch.Tensor) -> float:
    """The largest difference of one row's maps (heads, queries, keys).  transformers' sliding layers cache only the
    last window's keys: its map then covers posenc's last keys, and posenc's others must be 0."""
    kept = theirs.shape[-1]
    d = (theirs - ours[..., -kept:]).abs().max().item()
    return max(d, ours[..., :-kept].abs().max().item()) if ours.shape[-1] > kept else d


def decoder_layers(hf) -> torch.nn.ModuleList:
    n = hf.config.num_hidden_layers
    return next(m for _, m in hf.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n)


@torch.inference_mode()
def locate(proof: Proof, ids, mask, past, caches, row: int) -> str:
    """Where row `row` parts first: the embedding (layer 0's input), a layer's attention maps, else its output (its
    MLP and norms, the attention having agreed), or the final norm and head when every layer agrees."""
    caught: dict[str, list[torch.Tensor]] = {"hf_in": [], "hf": [], "ours_in": [], "ours": []}

    def keep(where):
        return lambda _m, _a, out: caught[where].append((out[0] if isinstance(out, tuple) else out).clone())

    def keep_input(where):
        return lambda _m, args, kwargs: caught[where].append((args[0] if args else kwargs["hidden_states"]).clone())

    layers = decoder_layers(proof.hf)
    hooks = [layers[0].register_forward_pre_hook(keep_input("hf_in"), with_kwargs=True),
             proof.model.blocks[0].register_forward_pre_hook(keep_input("ours_in"), with_kwargs=True)]
    hooks += [layer.register_forward_hook(keep("hf")) for layer in layers]
    hooks += [block.register_forward_hook(keep("ours")) for block in proof.model.blocks]
    try:
        refs, out = proof.run(ids, mask, past, caches, row=row)
    finally:
        for h in hooks:
            h.remove()
    new = mask[row, -ids.shape[1]:].bool()
    _, _, maps = proof.diffs(row, refs[0], out, ids, mask)

    def diff(theirs, ours):
        a, b = theirs[0], ours[row][new]
        return (a - b).abs().max().item(), TOLERANCE["logits"] * max(1.0, a.abs().max().item())

    if (d := diff(caught["hf_in"][0], caught["ours_in"][0]))[0] > d[1]:
        return f"at the embedding (largest difference {d[0]:.2e})"
    for i, (a, b) in enumerate(zip(caught["hf"], caught["ours"], strict=False)):
        if maps and maps[i] > TOLERANCE["attentions"]:
            return f"at layer {i} attention (largest difference {maps[i]:.2e})"
        if (d := diff(a, b))[0] > d[1]:
            part = "MLP and norms" if maps else "block"
            return f"at layer {i} {part} (largest difference {d[0]:.2e})"
    return "at the final norm and head (every layer agrees)"


def prove(model: Transformer, folder: str | Path, data: dict[str, Any], max_length: int,
          generic: bool = False, override: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the probes; the verdict model.json's source records, or ProofError naming where the two differ.
    override: the RoPE scaling the import replaced the folder's with (transformers' model gets the same)."""
    import transformers  # lazy: an optional dependency of the exporter (the build extra), never of the worker

    folder = Path(folder)
    hf, maps = reference(folder, data, override)
    proof = Proof(model.eval(), hf, maps, folder)
    vocab = min(model.cfg.vocab_size, hf.config.vocab_size)
    lengths = probe_lengths(model, max_length)
    for n in lengths:
        ids, mask = batch(n, vocab, seed=n)
        proof.check(f"left-padded B=3 T={n}", ids, mask)
    prefill = min(9, max(lengths))
    ids, mask = batch(prefill, vocab, seed=1)
    caches, out = proof.check(f"prefill B=3 T={prefill}", ids, mask)
    g = torch.Generator().manual_seed(2)
    for step in range(STEPS):
        if max_positions(model.cfg) and mask.shape[1] + 1 > max_positions(model.cfg):
            break
        ids = torch.randint(0, vocab, (3, 1), generator=g)
        mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.int64)], dim=1)
        caches, out = proof.check(f"decode step {step + 1} past={mask.shape[1] - 1}", ids, mask, out.presents,
                                  caches)
    return {"reference": f"transformers {transformers.__version__} "
                         f"{'eager' if maps else 'sdpa (logits only)'} float32",
            "importer": "generic" if generic else "module", "passed": True, "lengths": lengths,
            "decode_steps": STEPS, "cases": proof.cases, "logits": proof.worst["logits"],
            "attentions": proof.worst["attentions"] if maps else None,
            "tolerance": {"logits": TOLERANCE["logits"], "attentions": TOLERANCE["attentions"]}}
