"""model.json's one schema (protos/model.schema.json): what the exporter writes, what the worker reads.

Against real artifacts: the tiny ones of every variant, their fast graphs, and an imported Hugging Face model
(transformers' LLaMA with a chat template, a RoPE scaling override and external weights)."""

import copy
import dataclasses
import json
import shutil
import typing
from pathlib import Path

import jsonschema
import pytest

from export import artifact
from export.errors import ArtifactError
from model.config import ModelConfig
from service import model_json
from service.artifacts import load_artifact
from service.errors import ArtifactRejected
from service.model_json import ModelJson
from tests.serving import start

SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "protos" / "model.schema.json").read_text())
# Schema fields none of this module's artifacts carry, and the export command that writes each (its tests export
# through artifact.write_json, which checks every model.json against the schema)
WRITTEN_ELSEWHERE = {
    "quantization": "python -m export quantize (tests/export/test_quantize.py)",
    "fast.budget": "python -m export quantize of a source with a fast graph (tests/export/test_quantize_fast.py)",
    "fast.smoothing": "python -m export quantize --method dynamic of a source with a fast graph "
                      "(tests/export/test_quantize_fast.py)",
    "fast.half": "python -m export.fuse --half (tests/hf/test_half.py)",
    "source.sha256": "python -m export --checkpoint, rope-scale (tests/export/test_rope_scale.py)",
    "source.path": "python -m export --checkpoint, --from-hf",
    "source.seed": "python -m export --init random",
    "source.artifact": "rope-scale", "source.method": "rope-scale", "source.factor": "rope-scale",
    "layers[].temperature": "python -m export --from-hf of a Llama 4 text model (tests/hf/test_llama4.py)",
    "intervene.maps_file": "a model with mixer layers (tests/hf/test_mixers.py)",
    "intervene.maps_layers": "a model with mixer layers", "intervene.maps_heads": "a model with mixer layers",
    "intervene.maps_profile_file": "a model with mixer layers",
}
pytestmark = pytest.mark.xdist_group("model-json")  # one worker imports the LLaMA once (make test)


def resolve(node):
    while "$ref" in node:
        node = SCHEMA["definitions"][node["$ref"].removeprefix("#/definitions/")]
    return node


def schema_paths(node, path=""):
    node, out = resolve(node), set()
    for key, sub in node.get("properties", {}).items():
        out |= {f"{path}{key}"} | schema_paths(sub, f"{path}{key}.")
    if "items" in node:
        out |= {p.replace(path, path[:-1] + "[].", 1) for p in schema_paths(node["items"], path)}
    return out


def written_paths(value, node=SCHEMA, path=""):
    """Every key path of a model.json (lists as []); an open object's keys only where the schema declares them."""
    node, out = resolve(node), set()
    if isinstance(value, dict):
        props, closed = node.get("properties", {}), node.get("additionalProperties", True) is False
        for key, sub in value.items():
            if key in props or closed:
                out |= {f"{path}{key}"} | written_paths(sub, props.get(key, {}), f"{path}{key}.")
    elif isinstance(value, list):
        for item in value:
            out |= {p.replace(path, path[:-1] + "[].", 1) for p in written_paths(item, node.get("items", {}), path)}
    return out


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A LLaMA saved by transformers with a chat template, imported with a RoPE scaling override and its weights
    in model.onnx.data."""
    from export.hf import import_artifact
    from tests.hf.helpers import save_family

    root = tmp_path_factory.mktemp("imported")
    save_family("llama", root / "hf")
    (root / "hf" / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    import_artifact(root / "hf", root / "llama", validation_max_length=8, external_data=True,
                    rope_scaling={"rope_type": "linear", "factor": 2.0})
    return root / "llama"


@pytest.fixture(scope="module")
def exported(tiny_artifacts, fast_artifacts, imported):
    folders = [*(p for p in sorted(tiny_artifacts[0].iterdir()) if p.is_dir()), *sorted(fast_artifacts.iterdir()),
               imported]
    return {f"{p.parent.name}/{p.name}": json.loads((p / "model.json").read_text()) for p in folders}


def test_the_schema_is_a_draft7_schema_that_every_exported_model_json_meets(exported):
    """Checked with jsonschema, the reference implementation (the exporter and worker compile it with
    fastjsonschema)."""
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    validator = jsonschema.Draft7Validator(SCHEMA)
    for name, meta in exported.items():
        assert not list(validator.iter_errors(meta)), name


def test_every_field_export_writes_is_in_the_schema_and_every_schema_field_is_written(exported):
    written = set().union(*(written_paths(meta) for meta in exported.values()))
    declared = schema_paths(SCHEMA)
    assert sorted(written - declared) == []
    missing = {p for p in declared - written if not any(p == w or p.startswith(w + ".") for w in WRITTEN_ELSEWHERE)}
    assert sorted(missing) == []


def test_config_is_the_model_config(exported):
    """model.json's config is an open object: its keys are ModelConfig's fields, which read it back."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for name, meta in exported.items():
        assert set(meta["config"]) == fields, name
        assert ModelConfig.from_dict(meta["config"]).variant == meta["variant"]


def dataclass_in(hint):
    """The dataclass a field's annotation holds (X, X | None, tuple[X, ...]), or None."""
    if dataclasses.is_dataclass(hint):
        return hint
    return next((c for c in map(dataclass_in, typing.get_args(hint)) if c is not None), None)


def mirror(cls, node, path="model.json"):
    """The dataclass's fields are the schema object's properties; the defaults are the schema's; a required
    property has no default.  Recurses into nested objects."""
    node = resolve(node)
    props, hints = node["properties"], typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert sorted(fields) == sorted(props), path
    for name, f in fields.items():
        sub = resolve(props[name])
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        if name != "whole_prompts":  # required in the worker's object, absent in older artifacts: a rule fills it
            assert has_default == (name not in node.get("required", [])), f"{path}.{name}"
        if "default" in sub:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            inner = dataclass_in(hints[name])
            assert default == (model_json.typed(inner, sub["default"]) if inner else sub["default"]), f"{path}.{name}"
        inner = dataclass_in(hints[name])
        if inner is not None:
            mirror(inner, sub.get("items", sub) if sub.get("type") == "array" else sub, f"{path}.{name}")


def test_the_worker_s_objects_mirror_the_schema():
    mirror(ModelJson, SCHEMA)


def test_the_worker_reads_every_exported_model_json(exported, imported):
    for name, meta in exported.items():
        typed = model_json.parse(meta)
        assert typed.variant == meta["variant"] and typed.sizes.head_dim == meta["sizes"]["head_dim"], name
        assert [s.input for s in typed.state] == [s["input"] for s in meta["state"]], name
    m = load_artifact(imported, threads=1)
    tok = json.loads((imported / "model.json").read_text())["tokenizer"]
    assert m.meta.tokenizer.chat_template.template == tok["chat_template"]["template"]
    assert m.meta.tokenizer.eos == frozenset(tok["eos_token_ids"]) and m.meta.source.kind == "huggingface"
    assert m.meta.source.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def required_only(meta, node=SCHEMA):
    """meta with every property the schema does not require removed, at every level."""
    node = resolve(node)
    if isinstance(meta, list):
        return [required_only(v, node.get("items", {})) for v in meta]
    if not isinstance(meta, dict) or "properties" not in node:
        return meta
    return {k: required_only(v, node["properties"][k]) for k, v in meta.items() if k in node.get("required", [])}


def resign(folder, meta):
    (folder / "model.json").write_text(json.dumps(meta))
    artifact.write_manifest(folder, json.loads((folder / "manifest.json").read_text())["validation"])


def test_an_artifact_with_only_the_required_fields_loads_with_the_defaults(tiny_artifacts, tmp_path):
    """What an older artifact may lack: the worker serves it with the schema's defaults, and whole_prompts follows
    its RoPE scaling as the exporter decides it today (dynamic: a prompt runs whole)."""
    folder = shutil.copytree(tiny_artifacts[0] / "rope", tmp_path / "rope")
    meta = json.loads((folder / "model.json").read_text())
    bare = required_only(meta)
    assert "whole_prompts" not in bare and "tokenizer" not in bare and "n_kv_heads" not in bare["sizes"]
    resign(folder, bare)
    m = load_artifact(folder, threads=1)
    assert m.kv_heads == meta["sizes"]["n_heads"] and m.meta.tokenizer.type == "bytes-utf8" and m.max_positions is None
    assert not m.whole_prompts and m.meta.encoding is None and m.meta.layers == ()
    resign(folder, dict(bare, config={"rope_scaling": "dynamic"}))
    assert load_artifact(folder, threads=1).whole_prompts


@pytest.mark.parametrize(("edit", "reason"), [
    (lambda m: m["sizes"].update(head_dim="8"), "model.json: sizes.head_dim must be integer"),
    (lambda m: m.update(speed="fast"), "model.json must not contain {'speed'} properties"),
    (lambda m: m["state"][1].pop("output"), "model.json: state[1] must contain ['output'] properties"),
    (lambda m: m["inputs"][0].update(shape=[1.5]), "model.json: inputs[0].shape[0] must be integer or string"),
    (lambda m: m.pop("variant"), "model.json must contain ['variant'] properties"),
])
def test_a_model_json_that_does_not_match_is_refused_in_one_line_naming_the_field(tiny_artifacts, tmp_path, edit,
                                                                                    reason):
    """The worker logs it, serves the others, and reports the reason (the load-error path of a damaged artifact);
    the exporter refuses to write it."""
    shutil.copytree(tiny_artifacts[0] / "alibi", tmp_path / "alibi")
    bad = shutil.copytree(tiny_artifacts[0] / "rope", tmp_path / "bad")
    meta = json.loads((bad / "model.json").read_text())
    edit(meta)
    resign(bad, meta)
    with pytest.raises(ArtifactError) as err:
        artifact.write_json(tmp_path / "model.json", meta)
    assert str(err.value) == reason.replace("model.json", str(tmp_path / "model.json"), 1) + \
        " (protos/model.schema.json)" and not (tmp_path / "model.json").exists()
    srv = start(tmp_path)
    try:
        assert sorted(srv.registry.models) == ["alibi"] and srv.rejected == {"bad": reason}
    finally:
        srv.stop(grace=1)
    with pytest.raises(ArtifactRejected, match="^" + reason.replace("[", r"\[").replace("(", r"\(")):
        model_json.parse(copy.deepcopy(meta))



def test_an_external_data_models_intervention_graph_reads_the_same_weights(imported):
    """intervene.onnx of a model whose weights are in model.onnx.data refers to those bytes (nothing stored twice),
    and onnxruntime loads and runs it from there."""
    import numpy as np

    from service.artifacts import load_artifact
    from service.intervention import Intervention, resolve, run

    meta = json.loads((imported / "model.json").read_text())
    entry = meta["intervene"]
    assert entry["shared_weights"] >= 2 * meta["sizes"]["n_layers"]  # at least every layer's projections
    import onnx

    graph = onnx.load(str(imported / "intervene.onnx"), load_external_data=False).graph
    outside = [i for i in graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
    assert len(outside) == entry["shared_weights"]
    assert {e.value for i in outside for e in i.external_data if e.key == "location"} == {"model.onnx.data"}
    inside = sum(len(i.raw_data) for i in graph.initializer if i.data_location != onnx.TensorProto.EXTERNAL)
    assert inside < (imported / "model.onnx.data").stat().st_size / 100  # norms' weights, a few scalars
    model = load_artifact(imported, threads=1)
    out = run(model, [resolve(model, Intervention(shift=3), [5, 6, 7], None)])
    assert out["logits"].shape == (1, 3, meta["sizes"]["vocab_size"]) and np.isfinite(out["logits"]).all()
