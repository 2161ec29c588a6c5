"""The variants (a task-vector member's sparsifier, a plan step's action) are enums valued by the strings they were
written as, so plans, provenance files and recorded hashes read the same; the merge code asks the member, never
compares its string."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from mergekit_lite.merge.methods import REGISTRY
from mergekit_lite.merge.methods.task_vectors import SPARSIFIER_PARAMETERS, TaskVectorMethod
from mergekit_lite.merge.methods.tensor_math import TaskVectorRecipe, task_vector_merge
from mergekit_lite.merge.methods.variants import Sparsifier, Variant
from mergekit_lite.merge.plan import StepAction, TensorStep

MERGE_PACKAGE = Path(__file__).resolve().parent.parent / "mergekit_lite" / "merge"
VARIANTS = (Sparsifier, StepAction)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_variant_reads_and_writes_as_its_string(variant):
    for member in variant:
        assert member == member.value and hash(member) == hash(member.value)
        assert str(member) == f"{member}" == f"{member:<1}" == member.value
        assert json.dumps({member: [member]}) == json.dumps({member.value: [member.value]})
        assert variant(member.value) is member


def test_the_string_given_becomes_its_member():
    assert TaskVectorRecipe(sparsifier="magnitude").sparsifier is Sparsifier.MAGNITUDE
    assert TensorStep("w", (1,), torch.float32, "copy").action is StepAction.COPY
    with pytest.raises(ValueError):
        TaskVectorRecipe(sparsifier="magnitudes")


def test_a_recipe_and_its_fields_as_keywords_merge_alike():
    generator = torch.Generator().manual_seed(0)
    base, model = torch.randn(64, generator=generator), torch.randn(64, generator=generator)
    recipe = TaskVectorRecipe(scale=0.5, sparsifier=Sparsifier.MAGNITUDE, densities=[0.5], consensus=True)
    by_recipe = task_vector_merge(base, [model], [1.0], recipe)
    by_keywords = task_vector_merge(
        base, [model], [1.0], scale=0.5, sparsifier="magnitude", densities=[0.5], consensus=True
    )
    assert torch.equal(by_recipe, by_keywords)
    assert torch.equal(
        task_vector_merge(base, [model], [1.0], recipe, scale=1.0),
        task_vector_merge(base, [model], [1.0], sparsifier="magnitude", densities=[0.5], consensus=True),
    )


def test_every_family_member_declares_its_sparsifiers_knobs():
    for method in REGISTRY.values():
        if isinstance(method, TaskVectorMethod) and method.sparsifier is not None:
            assert set(SPARSIFIER_PARAMETERS[method.sparsifier]) <= set(method.parameters), method.name


def _compared_strings(tree: ast.AST, values: set[str]) -> list[int]:
    """Lines that compare a `sparsifier` or an `action` with one of the variants' strings (==, !=, in)."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        named = any(
            (isinstance(operand, ast.Name) and operand.id in ("sparsifier", "action"))
            or (isinstance(operand, ast.Attribute) and operand.attr in ("sparsifier", "action"))
            for operand in operands
        )
        strings = [
            constant.value
            for operand in operands
            for constant in ([operand] if isinstance(operand, ast.Constant) else getattr(operand, "elts", []))
            if isinstance(constant, ast.Constant) and isinstance(constant.value, str)
        ]
        if named and set(strings) & values:
            lines.append(node.lineno)
    return lines


def test_the_merge_code_never_compares_a_variant_with_its_string():
    values = {member.value for variant in VARIANTS for member in variant}
    assert all(issubclass(variant, Variant) for variant in VARIANTS)
    found = {
        str(path.relative_to(MERGE_PACKAGE)): lines
        for path in sorted(MERGE_PACKAGE.rglob("*.py"))
        if (lines := _compared_strings(ast.parse(path.read_text()), values))
    }
    assert not found
    assert _compared_strings(ast.parse('if step.action == "copy": pass'), values)  # what it finds
