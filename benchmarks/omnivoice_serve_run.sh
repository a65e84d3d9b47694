#!/usr/bin/env bash
# One device call for served OmniVoice at concurrency (benchmarks/omnivoice_serve_concurrency.py; H100 / H200, torch
# 2.11, transformers 5.17, python 3.12). The device lacks the service wheels (fastapi, uvicorn, msgspec, pyzmq, ...:
# /work/main/.whl) and what the reference package imports to write the checkpoint (omnivoice-0.2.1, pydub, soundfile,
# cffi, pycparser): put them all in .whl/ of this tree, then from the repository root, with carry [".whl"]:
#     bash benchmarks/omnivoice_serve_run.sh           # CONC=1,8,16,32 ROUNDS=3 FRAMES=250, cut at BENCH_TIMEOUT=330 s
# Everything goes to /tmp/site (as device_setup.sh does), except torchaudio: nothing here runs it (the checkpoint
# writer stands in for the reference's import of it; the server loads the audio encoder only for ref_audio).
# Output: $OUT/omnivoice_serve_concurrency.out (TTSCONC / RESULT lines) and the server's log beside it.
set -u
OUTDIR=${OUT:-.}
W=${WHL_DIR:-.whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  $(ls "$W"/*.whl | grep -v /torchaudio-) 2>&1 | grep -v -i warning | tail -2
export PYTHONPATH=/tmp/site:.:tests PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -c "import msgspec, fastapi, uvicorn, zmq, _tiny_omnivoice as t; t.import_reference(); print('imports ok')" \
  2>&1 | tail -1
# SIGINT first: the script's finally stops the server it started
timeout -s INT -k 30 "${BENCH_TIMEOUT:-330}" python3 -W ignore benchmarks/omnivoice_serve_concurrency.py 2>&1 \
  | grep -v -E "Writing|it/s" | tee "$OUTDIR/omnivoice_serve_concurrency.out" | tail -40
