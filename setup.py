"""Build and install megatron_harts.

The C++ extension ``megatron_harts._C`` is compiled from every ``csrc/*.cpp``
with pybind11.  Dependencies and why each is here:

- numpy: array backbone of tree_data and the planner (no torch below the layout).
- pyarrow: reads Parquet trajectory files (tree_data.readers).
- torch: tensors and autograd for layout, ops and models (CI installs the CPU
  build torch==2.13.0 before this package).
- megatron-core==0.16.1: the model building blocks and parallel state; the last
  release that runs on Python 3.11 (docs/design.md).
- psutil: megatron-core's dist-checkpoint writer imports it (not declared by
  megatron-core); tools/convert_hf_checkpoint.py --format dist needs it.
- extra "gpu": fla-core==0.6.0, KDA Triton kernels; imported lazily on GPU only.
- extra "test": pytest, pytest-xdist (scripts/run_tests.sh runs the suite on two worker processes),
  hypothesis (property tests), transformers>=5.6 (the
  Kimi-Linear oracle of invariant 4; also the weight export to transformers' format),
  tensorboard (the driver's --tensorboard-dir writer, torch.utils.tensorboard; optional
  at run time: the driver names it when missing).
- extra "bench": ortools, the planner baseline (OR-Tools + first-fit-decreasing).
- extra "plot": matplotlib, the figure of tools/plan_report.py --plot.
"""
import glob
import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _extensions():
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    if not sources:
        return [], {}
    from pybind11.setup_helpers import Pybind11Extension, build_ext

    ext = Pybind11Extension(
        "megatron_harts._C",
        sources,
        include_dirs=["csrc"],
        cxx_std=17,
        extra_compile_args=["-O3"],
    )
    return [ext], {"build_ext": build_ext}


ext_modules, cmdclass = _extensions()

setup(
    name="megatron_harts",
    version="0.1.0",
    description="Train hybrid-attention MoE models on agentic-RL rollout trees with Megatron",
    packages=find_packages(include=["megatron_harts", "megatron_harts.*"]),
    python_requires=">=3.11",
    install_requires=[
        "numpy>=1.26",
        "pyarrow>=14",
        "torch>=2.6",
        "megatron-core==0.16.1",
        "psutil>=5.9",
    ],
    extras_require={
        "gpu": ["fla-core==0.6.0"],
        "test": ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6.100", "transformers>=5.6", "tensorboard>=2.15"],
        "bench": ["ortools>=9.10"],
        "plot": ["matplotlib>=3.5"],
        # the verl engine (megatron_harts/integrations/verl.py, docs/verl.md): the verl release it is tested with
        "verl": ["verl==0.9.1", "tensordict>=0.8,<=0.10,!=0.9.0"],
    },
    entry_points={"console_scripts": ["harts-pretrain = megatron_harts.training.pretrain:console_main"],
                  # verl imports every "verl.plugins" entry point at start: this registers the engine
                  "verl.plugins": ["megatron_harts = megatron_harts.integrations.verl"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
