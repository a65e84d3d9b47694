"""Data shipped inside the package: the embedded demo model (an ordinary HF checkpoint folder)."""
from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "demo_llama"
