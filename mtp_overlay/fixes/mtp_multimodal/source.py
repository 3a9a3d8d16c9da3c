"""Reading what a multimodal model's forward hands its language model, from the installed source.

The probe's question is a fact of the code, not of an error message: which keyword arguments the
``self.language_model(...)`` calls pass (``input_ids``, ``loss_mask``), and whether the ids they pass
go through the model's CP/SP slicing. Read with ``ast`` from ``inspect.getsource``; a ``**kwargs``
call is read from the dict literal and item assignments that build it (Megatron-LM main's LLaVAModel).
"""

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

INPUTS = ("input_ids", "loss_mask")


def read_calls(function: "Callable[..., Any]", model_call: str, slicing_call: str
               ) -> "tuple[list[dict[str, str]], set[str]] | None":
    """``(calls, sliced)`` of ``function``'s source: the keyword arguments (name -> source text) of
    every ``model_call(...)`` (e.g. ``"self.language_model"``), and the names that go through
    ``slicing_call(...)``: passed to it, or assigned from its first line on. None when the source
    cannot be read or makes no such call."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]
    found = []
    for node in sorted((node for node in calls if ast.unparse(node.func) == model_call), key=lambda node: node.lineno):
        arguments: "dict[str, str]" = {}
        for keyword in node.keywords:
            if keyword.arg is not None:
                arguments[keyword.arg] = ast.unparse(keyword.value)
            elif isinstance(keyword.value, ast.Name):  # **kwargs: the dict built for it
                arguments.update(dict_items(tree, keyword.value.id))
        found.append(arguments)
    if not found:
        return None
    slicing = [node for node in calls if ast.unparse(node.func) == slicing_call]
    sliced: "set[str]" = set()
    if slicing:
        first = min(node.lineno for node in slicing)
        sliced = {name.id for node in slicing for name in ast.walk(node) if isinstance(name, ast.Name)}
        sliced |= {name.id for node in ast.walk(tree) if isinstance(node, ast.Assign) and node.lineno >= first
                   for target in node.targets for name in ast.walk(target) if isinstance(name, ast.Name)}
    return found, sliced


def dict_items(tree: "Any", name: str) -> "dict[str, str]":
    """key -> value source of the dict ``name`` built in ``tree``: ``name = {...}`` literals and
    ``name["key"] = value`` assignments."""
    import ast

    items = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            if isinstance(target, ast.Name) and target.id == name and isinstance(node.value, ast.Dict):
                items.update({key.value: ast.unparse(value) for key, value in zip(node.value.keys, node.value.values)
                              if isinstance(key, ast.Constant) and isinstance(key.value, str)})
            elif (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) and target.value.id == name
                  and isinstance(target.slice, ast.Constant) and isinstance(target.slice.value, str)):
                items[target.slice.value] = ast.unparse(node.value)
    return items


def missing_inputs(call: "dict[str, str]") -> "list[str]":
    """What a language-model call leaves the MTP block without: ``input_ids`` passed as None or not
    at all, ``loss_mask`` likewise."""
    return [name for name in INPUTS if call.get(name, "None") == "None"]


def verdict_parts(calls: "list[dict[str, str]]", sliced: "set[str]") -> "tuple[list[str], list[str]]":
    """``(missing, unsliced)`` over every language-model call: the inputs some call does not pass,
    and the ids passed that never go through the slicing."""
    missing = sorted({name for call in calls for name in missing_inputs(call)}, key=INPUTS.index)
    unsliced = sorted({call["input_ids"] for call in calls if "input_ids" not in missing_inputs(call)} - sliced)
    return missing, unsliced
