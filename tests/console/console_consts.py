"""Names shared by the console tests' fixtures and tests (a uniquely named module: `conftest` is not importable
reliably when several test folders have one)."""
from pathlib import Path

API_KEY = "console-key"
MODEL = "demo"
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
