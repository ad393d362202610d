"""`python -m export models` (make models, make serve): the order of its steps and that each is the command
`make models` has always run, so the models it writes are the same ones."""

from pathlib import Path

from export.pipeline import ROPE_COPIES, steps
from model.train import DEFAULT_STEPS, build_order
from model.variants import VARIANT_NAMES


def test_the_default_model_and_its_scaled_copies_come_first_then_the_shortest_training():
    plan = steps(Path("ck"), Path("art"), quiet=True)
    models = [m for m, _, _ in plan]
    assert models[:5] == ["rope", "rope", "rope-pi8", "rope-ntk8", "rope-yarn8"]
    trained = [m for m, what, _ in plan if what == "train"]
    assert sorted(trained) == sorted(VARIANT_NAMES) and trained == build_order(list(VARIANT_NAMES))
    budgets = [DEFAULT_STEPS[v] for v in trained[1:]]
    assert budgets == sorted(budgets) and trained[-1] == "none"  # NoPE trains longest: served last
    for variant in VARIANT_NAMES:  # each model is exported right after its training, into its own folder
        i = plan.index((variant, "train", ["train", "--variant", variant, "--out", "ck", "--skip-existing",
                                           "--quiet"]))
        assert plan[i + 1] == (variant, "export", ["export", "--checkpoint", str(Path("ck") / variant), "--out",
                                                   str(Path("art") / variant), "--skip-existing"])
    scaled = [argv for _, what, argv in plan if what == "rope-scale"]
    assert [(a[a.index("--out") + 1], a[a.index("--method") + 1]) for a in scaled] == [
        (str(Path("art") / name), method) for name, method, _ in ROPE_COPIES]
    assert all(a[1] == str(Path("art") / "rope") for a in scaled)


def test_the_order_does_not_depend_on_the_registry_order():
    assert build_order(["none", "alibi", "rope", "learned"]) == ["rope", "alibi", "learned", "none"]
