"""Maps the top-level passes/ and plugins/ folders under kimi_compile (DESIGN.md §2)."""
from setuptools import find_packages, setup

_ROOTS = {"kimi_compile": "kimi_compile", "kimi_compile.passes": "passes", "kimi_compile.plugins": "plugins"}
packages = []
for pkg, folder in _ROOTS.items():
    packages.append(pkg)
    packages += [f"{pkg}.{sub}" for sub in find_packages(folder)]
packages = sorted(set(packages))

setup(packages=packages, package_dir=_ROOTS)
