"""Package layout of the wheel (everything else is in pyproject.toml).

The source keeps four top-level folders: tgi_compat/ (the API), router/, modeling/ and kernels/ (the
engine). Installed as top-level packages, `kernels` would be Hugging Face's `kernels` distribution
to pip and to transformers' import checks, and `router`/`modeling` are just as generic. So the wheel
puts the engine packages under tgi_compat/_engine/, a folder that only `import tgi_compat` adds to
sys.path (tgi_compat/__init__.py); benchmarks/ and tests/ stay out of the wheel.
"""

from setuptools import find_packages, setup

API_PACKAGE = "tgi_compat"
ENGINE_PACKAGES = ("router", "modeling", "kernels")
ENGINE_PREFIX = f"{API_PACKAGE}._engine"  # a plain folder in the wheel, not a package


def packages() -> list[str]:
    engine = find_packages(include=[f"{name}*" for name in ENGINE_PACKAGES])
    return find_packages(include=[f"{API_PACKAGE}*"]) + [f"{ENGINE_PREFIX}.{name}" for name in engine]


if __name__ == "__main__":
    setup(packages=packages(), package_dir={f"{ENGINE_PREFIX}.{name}": name for name in ENGINE_PACKAGES})
