#!/usr/bin/env bash
# The verl job: install the verl release the engine is tested with (megatron_harts/integrations/verl.py)
# into out/verl-site, a separate target, so the project's venv stays as it is (verl pins an older
# transformers), then run tests/test_verl_engine.py with it on the path.  verl goes in without its GPU
# extras: `--no-deps`, then the modules it imports on the CPU.  Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=${VPY:-.venv/bin/python}
SITE=${VERL_SITE:-out/verl-site}
if [ ! -f "$SITE/.installed-0.9.1" ]; then
  echo "verl job: installing verl 0.9.1 into $SITE"
  PIP=("$VPY" -m pip install -q --disable-pip-version-check --target "$SITE" --no-deps)
  "${PIP[@]}" verl==0.9.1
  "${PIP[@]}" "tensordict<=0.10.0,!=0.9.0,>=0.8.0" "ray==2.60.0" hydra-core==1.3.8 omegaconf \
    antlr4-python3-runtime==4.9.3 peft datasets codetiming accelerate dill pylatexenc cloudpickle orjson msgpack \
    pyvers importlib_metadata zipp multiprocess xxhash requests urllib3 certifi charset_normalizer jsonschema \
    jsonschema-specifications referencing rpds-py attrs uvicorn h11 sniffio "fastapi==0.115.12" "starlette<0.47,>=0.40"
  touch "$SITE/.installed-0.9.1"
fi
PYTHONPATH="$PWD:$(cd "$SITE" && pwd)" "$VPY" -m pytest -p no:cacheprovider -n 0 tests/test_verl_engine.py "$@"
