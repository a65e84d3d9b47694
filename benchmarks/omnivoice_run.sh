#!/usr/bin/env bash
# One device call for the OmniVoice figures (H200): put the wheels the device lacks in /work/main/.whl
# (omnivoice-0.2.1, pydub-0.25.1, torchaudio-2.11.0 cp312, soundfile, cffi, pycparser, msgspec), copy this tree to
# /work/main/.wt_omni, then run with carry [".wt_omni", ".whl"]:  cd .wt_omni && bash benchmarks/omnivoice_run.sh
# The reference and pydub are pure Python and are imported from their wheels; the rest is pip-installed.
set -u
W=${WHL_DIR:-$(cd ../.whl && pwd)}
python -m pip install -q --no-deps "$W"/cffi-*.whl "$W"/pycparser-*.whl "$W"/msgspec-*.whl \
  "$W"/torchaudio-2.11.0-*.whl "$W"/soundfile-*.whl 2>&1 | grep -v -i warning | tail -2
export PYTHONPATH="$W/omnivoice-0.2.1-py3-none-any.whl:$W/pydub-0.25.1-py2.py3-none-any.whl${PYTHONPATH:+:$PYTHONPATH}"
python -c "import soundfile, torchaudio, msgspec, omnivoice.models.omnivoice; print('imports ok')" 2>&1 | tail -1
OUT=${OUT:-.} timeout "${BENCH_TIMEOUT:-300}" python -W ignore benchmarks/omnivoice_bench.py 2>&1 \
  | grep -v -E "Writing|it/s" | tail -40
