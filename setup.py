"""Package layout (everything else is in pyproject.toml).

``mta`` lives in ``src/mta``, ``mta_cli`` in ``cli/mta_cli``; every package under them is found,
so a new subpackage cannot be left out of the wheel. The shipped recipes have one copy in git,
the repository's top-level ``recipes/``, and the wheel carries them as the data package
``mta.recipes`` (``mta.training.config.catalog.SHIPPED_DIR`` finds them either way).
"""

from setuptools import find_namespace_packages, setup

RECIPES = {
    "mta.recipes": "recipes",
    "mta.recipes.configs": "recipes/configs",
    "mta.recipes.examples": "recipes/examples",
}
CODE = {"mta": "src/mta", "mta_cli": "cli/mta_cli"}


def code_packages(name: str, directory: str) -> list[str]:
    found = find_namespace_packages(directory.rsplit("/", 1)[0], include=[name, f"{name}.*"])
    return [package for package in found if "__pycache__" not in package]


setup(
    packages=[package for name, directory in CODE.items() for package in code_packages(name, directory)]
    + list(RECIPES),
    package_dir={**CODE, **RECIPES},
)
