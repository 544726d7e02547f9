"""``resolve``: a recipe by name or path, its ``extends`` chain and ``--set`` overrides applied, validated against
the schema and the rules across sections; every problem at once, each naming the file and the key."""

from __future__ import annotations

from pathlib import Path

from ..errors import RecipeError
from .extends import apply_overrides, build_target, foreign_build_problems, inherited_build_problems, load_chain, retarget
from .messages import section_problems
from .reading import RECIPES_DIR, recipe_path
from .rules import semantic_problems
from .schema import Recipe


def resolve(name_or_path: str, overrides: list[str] | None = None, recipes_dir: Path = RECIPES_DIR) -> Recipe:
    """Load a recipe by name or path, apply `extends:` and `--set` overrides, validate everything."""
    path = recipe_path(name_or_path, recipes_dir)
    origins: dict = {}
    data = load_chain(path, origins=origins)
    data.setdefault("name", path.stem)
    if overrides:       # a --set of build.target extends the file as a child that names another target does
        data = apply_overrides(retarget(data, build_target(apply_overrides(data, overrides)), origins), overrides)
    problems = section_problems(Recipe, data, (), str(path))
    if problems:
        raise RecipeError(problems)
    recipe = Recipe.model_validate(data)
    problems = semantic_problems(recipe, str(path)) + foreign_build_problems(path, overrides or [],
                                                                              recipe.build.target) \
        + inherited_build_problems(recipe, path, origins, overrides or [])
    if problems:
        raise RecipeError(problems)
    recipe._path = str(path)
    return recipe
