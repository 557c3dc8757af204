#!/usr/bin/env bash
# What a lent GPU's calls of benchmarks/gpu_session.sh carry, made here (with the repo's
# venv active): .whl, wheels for Python 3.12 of the packages the device's image lacks, at
# this venv's versions; .tok8b, the Llama-3-8B preset's tokenizer (128256 pieces; the
# device's sentencepiece failed to train it, here it takes seconds). Both are ignored by
# git (.git/info/exclude). Then, through the device tool:
#   run(command="bash benchmarks/gpu_session.sh env dispatch offline forward",
#       carry=[".whl", ".tok8b"], timeout_s=560)
set -euo pipefail
cd "$(dirname "$0")/.."
for path in /.whl/ /.tok8b/; do
  grep -qxF "$path" .git/info/exclude 2>/dev/null || echo "$path" >> .git/info/exclude
done
packages="fastapi starlette pydantic pydantic_core annotated-types typing-inspection
  typing_extensions uvicorn httptools llguidance grpcio grpcio-health-checking
  grpcio-reflection protobuf gguf openai jiter distro sniffio jsonschema
  jsonschema-specifications referencing rpds-py lark anyio"
pins=$(for p in $packages; do python -m pip show "$p" 2>/dev/null | awk -v p="$p" \
  '/^Version:/ {print p "==" $2}'; done)
rm -rf .whl
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 -d .whl $pins
mkdir -p .tok8b
python -c "import sys; sys.path.insert(0, 'benchmarks'); import peers; from pathlib import Path
peers._write_tokenizer(Path('.tok8b'), 128256, 128000, 128001)"
du -sh .whl .tok8b
