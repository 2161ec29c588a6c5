"""The merge methods: one module per method or family, each declaring its methods (`registry.Method`): name,
parameters, what they need from the plan, the tensor combination, the dry run's cost and the report's text.
The math they share is `tensor_math`. docs/adding-a-method.md walks through adding one.
"""

from __future__ import annotations

from mergekit_lite.errors import InputError
from mergekit_lite.merge.methods import (
    ema,
    geometric,
    linear,
    lines,
    nearswap,
    passthrough,
    recall,
    slerp,
    task_vectors,
)
from mergekit_lite.merge.methods.registry import Method, Parameter, did_you_mean

# the methods in the order the CLI and the docs list them
REGISTRY: dict[str, Method] = {
    method.name: method
    for module in (linear, slerp, nearswap, task_vectors, geometric, passthrough, recall, lines, ema)
    for method in module.METHODS
}
NAMES = tuple(REGISTRY)
# every parameter by name, as the first method that takes it declares it (the defaults of a parameter a method
# does not take, e.g. RECALL's temperature when recall_lerp computes its weights)
PARAMETERS: dict[str, Parameter] = {
    parameter.name: parameter for method in reversed(REGISTRY.values()) for parameter in reversed(method.parameters)
}
SWEEPABLE = {name: method for name, method in REGISTRY.items() if method.main_coefficient}


def parameters_of(name) -> set[str]:
    """The parameters a method takes; none for a name that is no method (refused where the method is checked)."""
    declared = REGISTRY.get(name) if isinstance(name, str) else None
    return declared.parameter_names if declared else set()


def method(name: str) -> Method:
    """The registered method called `name` (an InputError naming the choices for any other)."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise InputError(
            f"unknown method {name!r}{did_you_mean(str(name), NAMES)} (choose from {', '.join(NAMES)})"
        ) from None
